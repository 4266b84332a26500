"""The ``ProfilerStep`` torch's profiler opens at the last ``prof.step()`` and closes when it stops (holding
nothing), in a real 2-rank gloo trace (tests/data/trace-open-step, written by its ``make_trace.py`` with torch
2.14): never an iteration of a few microseconds, nor one ``step`` too many beside other sections."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.core import layout

DATA = Path(__file__).parent / "data" / "trace-open-step"


def analyse(folder: Path, sections: str, out: Path, capsys) -> tuple[int, pd.DataFrame | None, list[dict], str]:
    code = main([str(folder), "--sections", sections, "--out", str(out), "--jobs", "1"])
    printed = capsys.readouterr()
    if code != 0:
        return code, None, [], printed.err + printed.out
    anomalies = json.loads((out / ANALYSIS_JSON).read_text())["anomalies"]
    return code, pd.read_parquet(out / layout.SECTIONS), anomalies, printed.out


def steps_in(path: Path) -> list[dict]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])


def test_the_trace_holds_the_open_step():
    """The stored traces show the case: 5 ProfilerStep ranges for 4 iterations, the last holding no event."""
    for rank in (0, 1):
        path = DATA / f"rank{rank}.json.gz"
        steps = steps_in(path)
        assert [s["name"] for s in steps] == [f"ProfilerStep#{k}" for k in range(5)]
        last = steps[-1]
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        inside = [e for e in events if e.get("ph") == "X" and e["name"] != last["name"]
                  and last["ts"] <= e["ts"] <= last["ts"] + last["dur"]]  # fmt: skip
        assert inside == [] and last["dur"] < 1000  # microseconds (its cpu_op and user_annotation twins aside)


def test_a_step_section_drops_the_open_step(tmp_path, capsys):
    """4 iterations in every form; the step form's transfer and wait are the sum of its sections' (every
    collective lies in gradient or denoiser); the dropped step named per rank, with its file."""
    code, parts, anomalies, _ = analyse(DATA, "gradient,denoiser", tmp_path / "parts", capsys)
    assert code == 0 and anomalies == [] and parts is not None
    assert set(parts[K.ITERATION]) == {0, 1, 2, 3}
    for sections in ("step=ProfilerStep#*", "step=ProfilerStep#*,gradient,denoiser"):
        code, table, anomalies, printed = analyse(DATA, sections, tmp_path / str(len(sections)), capsys)
        assert code == 0, printed
        assert table is not None
        step = table[table[K.SECTION] == "step"].set_index(K.ITERATION)
        assert list(step.index) == [0, 1, 2, 3]
        for col in (K.TRANSFER_S, K.WAIT_S):
            want = parts.groupby(K.ITERATION)[col].sum()
            assert step[col].to_numpy() == pytest.approx(want.to_numpy(), rel=1e-9, abs=1e-12), col
        empty = [a for a in anomalies if a["kind"] == "empty_iteration"]
        assert sorted(a["rank"] for a in empty) == [0, 1], anomalies  # one per rank, naming its file and step
        for a in empty:
            assert f"rank{a['rank']}.json.gz: the last step, ProfilerStep#4" in a["example"] and a["count"] == 1


def test_a_last_step_that_holds_work_is_not_dropped(tmp_path, capsys):
    """An operator inside rank 0's last step: that step is work, not the open one. Alone as the section, steps
    are matched across ranks (rank 1 has none there: named, dropped); beside gradient,denoiser it is one step too
    many on rank 0, refused with the counts."""
    folder = tmp_path / "job"
    folder.mkdir()
    shutil.copy(DATA / "rank1.json.gz", folder)
    trace = json.loads(gzip.decompress((DATA / "rank0.json.gz").read_bytes()))
    last = steps_in(DATA / "rank0.json.gz")[-1]
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": last["pid"], "tid": last["tid"],
          "ts": last["ts"] + 1, "dur": 1, "args": {}}  # fmt: skip
    trace["traceEvents"].append(op)
    (folder / "rank0.json.gz").write_bytes(gzip.compress(json.dumps(trace).encode()))
    code, table, anomalies, printed = analyse(folder, "step=ProfilerStep#*", tmp_path / "a", capsys)
    assert code == 0, printed
    assert table is not None and list(table[table[K.SECTION] == "step"][K.ITERATION]) == [0, 1, 2, 3]
    assert "step_not_on_every_rank" in {a["kind"] for a in anomalies}
    code, _, _, printed = analyse(folder, "step=ProfilerStep#*,gradient,denoiser", tmp_path / "b", capsys)
    assert code != 0 and "step=5, gradient=4, denoiser=4" in printed
