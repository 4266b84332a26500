"""Defects found by a fresh user's trial of the README, each kept as a regression test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pnpscale import layout
from pnpscale.core.config import ConfigError


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_empty_output_folder_is_refused(key):
    from pnpscale.sweep.cli import check_overrides

    with pytest.raises(Exception, match=rf"{key}='': must name a folder \(empty would write the run into the current"):
        check_overrides([f"{key}="])


def test_a_single_run_into_a_folder_of_another_spec_is_refused_before_hydra_writes(tmp_path):
    from pnpscale.sweep.cli import check_single_point

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    stored = {
        "status": "complete",
        "problem": "2d",
        "mode": "inference",
        "gpus": 2,
        "scale": "small",
        "fingerprint": "x",
    }
    (run_dir / layout.RUN_JSON).write_text(json.dumps(stored))
    with pytest.raises(ConfigError, match=r"holds a complete run of another spec .* hydra\.run\.dir"):
        check_single_point(["gpus=4", "scale=small", f"hydra.run.dir={run_dir}", f"output.root={tmp_path}"])
    assert sorted(p.name for p in run_dir.iterdir()) == [layout.RUN_JSON]  # no .hydra/ written


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("problem.num_operators=100000", "problem.num_operators=100000: must be <= the number of angles 128"),
        ("problem.params.angles_per_pixel=0", "problem.params.angles_per_pixel=0: must be a number > 0"),
        ("problem.params.angles_per_pixel=abc", "problem.params.angles_per_pixel=abc: must be a number > 0"),
    ],
)
def test_problem_rules_run_before_any_rank_starts(override, message, tmp_path):
    from pnpscale.sweep.cli import compose_config
    from pnpscale.sweep.point import resolve_point

    cfg = compose_config(["problem=ct", "scale=small", override, f"output.root={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        resolve_point(cfg, tmp_path / "run", cuda_devices=0)
    assert str(info.value) == message


def test_json_that_is_not_an_event_list_is_skipped_or_refused_by_name(tmp_path: Path):
    from pnpscale.analysis.traces import NotATraceError, TraceError, read_header, read_trace

    array = tmp_path / "rank1.json"
    array.write_text("[1, 2, 3]")
    with pytest.raises(NotATraceError, match="a JSON array whose items are not event objects: not a trace"):
        read_header(array)
    events = tmp_path / "rank2.json"
    events.write_text('{"traceEvents": [1, 2]}')
    with pytest.raises(TraceError, match=r"rank2\.json: event 0 of traceEvents is int, not an object"):
        read_trace(events, ["gradient"])
