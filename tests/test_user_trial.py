"""Defects found by a fresh user's trial of the README, each kept as a regression test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pnpscale.core import layout
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
    from pnpscale.analysis.trace.read import NotATraceError, TraceError, read_header, read_trace

    array = tmp_path / "rank1.json"
    array.write_text("[1, 2, 3]")
    with pytest.raises(NotATraceError, match="a JSON array whose items are not event objects: not a trace"):
        read_header(array)
    events = tmp_path / "rank2.json"
    events.write_text('{"traceEvents": [1, 2]}')
    with pytest.raises(TraceError, match=r"rank2\.json: event 0 of traceEvents is int, not an object"):
        read_trace(events, ["gradient"])


def _two_points(sweep: Path) -> Path:
    """A 1- and a 2-rank point of 2d inference (tables written by the real writer); the 2-rank folder."""
    from tests.test_report import fake_run

    p = lambda g: sweep / layout.point_subdir("2d", "inference", g)  # noqa: E731
    fake_run(p(1), "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]})
    fake_run(p(2), "2d", "inference", {"gradient": [(0.6, 0.2)] * 2, "denoiser": [(1.6, 0.1)] * 2})
    return p(2)


def _edit_json(run_dir: Path, change) -> None:
    doc = json.loads((run_dir / layout.RUN_JSON).read_text())
    change(doc)
    (run_dir / layout.RUN_JSON).write_text(json.dumps(doc))


def _move(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)
    return dst


#: label -> (how the 2-rank point is damaged, returning its folder; the point's label then; the reason)
MISLABELLED = {
    "renamed to gpus=4": (lambda d: _move(d, d.parent / "gpus=4"), "problem=2d mode=inference gpus=4",
                          "gpus is 2, but its folder says gpus=4 (moved or renamed?)"),
    "moved under problem=3d": (lambda d: _move(d, d.parents[2] / layout.point_subdir("3d", "inference", 2)),
                               "problem=3d mode=inference gpus=2",
                               "problem is '2d', but its folder says problem=3d (moved or renamed?)"),
    "moved under a variant": (lambda d: _move(d, d.parents[2] / layout.point_subdir(
        "2d", "inference", 2, "denoiser_collective=all_gather")),
        "problem=2d mode=inference denoiser_collective=all_gather gpus=2",
        "spec.denoiser_collective is 'all_reduce', but its folder says denoiser_collective=all_gather "
        "(moved or renamed?)"),
    "run.json's mode edited": (lambda d: _edit_json(d, lambda r: r.update(mode="training")) or d,
                               "problem=2d mode=inference gpus=2",
                               "mode is 'training', but its folder says mode=inference (moved or renamed?)"),
    "run.json's spec.gpus edited": (lambda d: _edit_json(d, lambda r: r["spec"].update(gpus=8)) or d,
                                    "problem=2d mode=inference gpus=2", "spec.gpus is 8, but gpus is 2"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(MISLABELLED))
def test_a_run_folder_whose_record_disagrees_with_its_folder_is_unreadable(tmp_path, capsys, label):
    """A run folder moved into another point's place (or a record edited) was reported under the folder's
    labels (a 2-rank 2d run as ``3d``, or as ``gpus=4``: GPU-seconds 2x): refused for load and the report."""
    import pnpscale
    from pnpscale.results.report import main

    sweep = tmp_path / "sweep"
    damage, point, reason = MISLABELLED[label]
    moved = damage(_two_points(sweep))
    error = f"unreadable: {moved / layout.RUN_JSON}: {reason}"
    table = pnpscale.load(sweep)
    bad = table[table["status"] != "complete"]
    assert len(bad) == 1 and bad["status"].iloc[0] == "unreadable" and bad["error"].iloc[0] == error
    assert (table[table["status"] == "complete"]["gpus"] == 1).all()
    from pnpscale.results.runs import build_table

    lines: list[str] = []
    build_table(sweep, echo=lines.append)  # what the report prints, by the report's own reader
    assert f"{point}: {error}" in lines, lines
    if label == "moved under problem=3d":  # the whole report once: written, exit 1 under --strict
        capsys.readouterr()
        assert main([str(sweep), "--strict"]) == 1
        assert f"{point}: {error}" in capsys.readouterr().out


@pytest.mark.parametrize("name", [layout.RANKS, layout.COLLECTIVES, layout.SECTIONS])
def test_a_missing_table_is_named_missing_not_by_its_path_twice(tmp_path, name):
    import pnpscale

    run_dir = _two_points(tmp_path / "sweep")
    (run_dir / name).unlink()
    row = pnpscale.load(tmp_path / "sweep").query("gpus == 2").iloc[0]
    assert (row["status"], row["error"]) == ("unreadable", f"unreadable: {run_dir / name}: missing (no such file)")


def test_resume_runs_again_a_complete_point_whose_folder_is_unreadable(tmp_path):
    """``resume=true`` skipped a complete run whose ``ranks.parquet`` was truncated: the report then called the
    point unreadable on every resume, and the sweep exited 0. Only a readable complete run is skipped."""
    from pnpscale.core.config import resolve_spec
    from pnpscale.results.runs import unreadable_reason
    from pnpscale.sweep.cli import compose_config
    from pnpscale.sweep.point import complete_run

    run_dir = _two_points(tmp_path / "sweep")
    cfg = compose_config(["gpus=2", "scale=small", f"output.root={tmp_path}"])
    mine = resolve_spec(cfg, cuda_available=False)
    _edit_json(run_dir, lambda r: r.update(fingerprint=mine.fingerprint()))  # this point's run, as resume sees it
    assert unreadable_reason(run_dir) is None
    assert complete_run(run_dir, cfg)["fingerprint"] == mine.fingerprint()  # readable: skipped
    ranks = run_dir / layout.RANKS
    ranks.write_bytes(ranks.read_bytes()[:300])  # truncated
    assert unreadable_reason(run_dir).startswith(f"{ranks}: ")
    assert complete_run(run_dir, cfg) is None  # run again


@pytest.mark.parametrize("above", ["problem=3d", "gpus=8"])
def test_a_folder_above_the_sweep_named_like_a_point_part_changes_no_label(tmp_path, above):
    """pyarrow's hive partitioning takes the first ``key=`` part of the path: a 2d sweep kept under
    ``results/problem=3d/`` was reported as a complete ``3d`` point (under ``gpus=8/``: every point unreadable,
    "ranks [0, 1], expected 0..7"). The point is the run folder's own parts, checked against its record."""
    import pnpscale

    _two_points(tmp_path / above / "sweep")
    table = pnpscale.load(tmp_path).query("section == 'all'")
    assert table["status"].tolist() == ["complete", "complete"], table["error"].tolist()
    assert table["problem"].tolist() == ["2d", "2d"] and table["gpus"].tolist() == [1, 2]
    assert table["gpu_seconds"].tolist() == pytest.approx([4.0, 4.4])  # 1 x (1 + 3); 2 x (0.6 + 1.6)


@pytest.mark.parametrize(
    ("options", "code", "message"),
    [
        (["--rank", "nosuch.json=0"], 2, "--rank names no given trace: nosuch.json"),
        (["--rank", "rank0.json=5"], 2, "--rank rank0.json=5: outside the world size 2"),
        (["--warmup", "9"], 2, "--warmup 9: no measured iteration (all rows are warm-up): lower --warmup"),
        ([], 0, None),
    ],
)
def test_an_analyze_option_the_traces_refuse_exits_2(tmp_path, capsys, options, code, message):
    """``--rank`` naming no trace or a rank outside the world, and a ``--warmup`` leaving no measured
    iteration, are the user's input: exit 2 (they exited 1, the code of a trace that cannot be analysed)."""
    from pnpscale.analysis.offline import main
    from tests.test_analyze import SECTIONS, two_rank_job

    job = two_rank_job(tmp_path / "job")
    assert main([str(job), "--sections", SECTIONS, *options]) == code
    err = capsys.readouterr().err
    assert (message is None and err == "") or err == f"pnpscale.analyze: error: {message}\n", err


def test_analyze_of_a_run_folder_without_traces_is_refused_by_name(tmp_path, capsys):
    """A run folder without ``traces/`` (``profile.export_traces=false``, or the folder deleted) was read as
    trace files: its own ``timeline.json`` (Chrome trace format) then asked for ``--rank timeline.json=R``."""
    from pnpscale.analysis.offline import main
    from tests.test_report import fake_run

    run_dir = tmp_path / "run"
    fake_run(run_dir, "2d", "inference", {"gradient": [(1.0, 0.0)]})
    (run_dir / layout.TIMELINE_JSON).write_text('{"traceEvents": []}')
    assert main([str(run_dir), "--sections", "gradient"]) == 2
    assert capsys.readouterr().err == (
        f"pnpscale.analyze: error: {run_dir}: a run folder without traces/ (its ranks' Kineto traces are kept "
        "with profile.export_traces=true); its tables are the analysis\n"
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nodes": 5}, "nodes is 5: must be in 1..gpus=2"),  # withheld the whole report (a ValueError)
        ({"nodes": 2}, "nodes is 2, but hosts lists 1 host(s): ['h']"),  # tree bytes on one host, silently
        ({"world_size": 7}, "world_size is 7: must equal gpus=2"),
    ],
)
def test_a_record_whose_world_disagrees_with_its_gpus_is_refused(tmp_path, fields, message):
    from pnpscale.core.record import RecordError, read_record

    run_dir = _two_points(tmp_path / "sweep")
    _edit_json(run_dir, lambda r: r.update(fields))
    with pytest.raises(RecordError) as info:
        read_record(run_dir)
    assert str(info.value) == f"{run_dir / layout.RUN_JSON}: {message}"


def _double(path: Path, column: str) -> None:
    import pandas as pd

    _edit_json(path.parent, lambda r: r.pop("digests", None))  # a folder without digests: the invariants answer
    table = pd.read_parquet(path)
    table[column] = table[column] * 2
    table.to_parquet(path, index=False)


@pytest.mark.parametrize(
    ("name", "column", "reason"),
    [  # the transfer table's bytes per GPU and rates come from sections.parquet's main_payload_bytes
        (layout.SECTIONS, "main_payload_bytes", "main_payload_bytes = 24576, but the collectives table gives 12288"),
        (layout.COLLECTIVES, "payload_bytes", "main_payload_bytes = 12288, but the collectives table gives 24576"),
    ],
)
def test_main_payload_bytes_that_disagree_with_the_collectives_are_unreadable(tmp_path, name, column, reason):
    """An edited payload was reported as measured: the transfer table doubled the bytes per GPU and the rate."""
    import pnpscale

    run_dir = _two_points(tmp_path / "sweep")
    _double(run_dir / name, column)
    row = pnpscale.load(tmp_path / "sweep").query("gpus == 2").iloc[0]
    assert row["status"] == "unreadable"
    assert row["error"] == f"unreadable: {run_dir / layout.SECTIONS}: iteration 0 section 'gradient': {reason}"


def test_analyze_of_a_folder_without_traces_exits_2_naming_it_and_its_run_folders(tmp_path, capsys):
    """A sweep folder or an empty folder given to ``analyze`` said "no trace files given", exit 1, naming
    nothing; it is the user's input: exit 2, the folder named, and a sweep's run folders pointed at."""
    from pnpscale.analysis.offline import main
    from pnpscale.core import layout
    from tests.test_report import fake_run

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty), "--sections", "gradient"]) == 2
    assert capsys.readouterr().err == (
        f"pnpscale.analyze: error: {empty}: a folder with no trace files (*.json, *.json.gz)\n")
    run = tmp_path / "sweep" / layout.point_subdir("2d", "inference", 1)
    fake_run(run, "2d", "inference", {"gradient": [(1.0, 0.0)]})
    assert main([str(tmp_path / "sweep"), "--sections", "gradient"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sweep'}: a folder with no trace files" in err and f"e.g. {run}" in err, err
