"""The offline analysis reads the ranks' traces without pandas, and imports its table stage while they are read.

``python -m pnpscale.analyze`` forks its trace readers before pandas and pyarrow are imported (a third of a second):
the readers start at once and the parent imports the table stage meanwhile. These tests hold the two conditions that
this rests on: importing :mod:`pnpscale.analysis.offline` and reading a rank imports no pandas, and
:func:`~pnpscale.analysis.offline._map_ranks` calls ``meanwhile`` once, after every trace was handed to the
readers and before the first result is taken.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from pnpscale.analysis import offline
from pnpscale.analysis.trace.read import parse_sections, read_header

CASE = Path(__file__).parent / "data" / "trace-contract" / "06_ref_valid_corr"
SECTIONS = "gradient,denoiser"


def test_reading_a_rank_imports_no_pandas() -> None:
    code = f"""
import sys
from pathlib import Path
import pnpscale.analyze
from pnpscale.analysis import offline
from pnpscale.analysis.trace.read import parse_sections, read_header
assert "pandas" not in sys.modules, "importing pnpscale.analysis.offline imported pandas"
path = Path({str(CASE / "r0.json")!r})
t = offline.RankedTrace(0, path, "file name", read_header(path))
records, info, found = offline._rank_records(t, parse_sections({SECTIONS!r}))
assert records, "no section records"
assert "pandas" not in sys.modules, "reading a rank's trace imported pandas"
offline._import_table_stage()
assert "pandas" in sys.modules
print("ok", len(records))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok 6"), out.stdout  # 2 sections x 3 iterations


@pytest.mark.parametrize("jobs", [1, 2])
def test_meanwhile_runs_once_after_the_traces_are_given_out(jobs: int) -> None:
    traces, _ = offline.assign_ranks([read_header(CASE / f"r{r}.json") for r in (0, 1)])
    events: list[str] = []
    readers: list[int] = []
    calls = {"n": 0}

    def meanwhile() -> None:
        calls["n"] += 1
        events.append("meanwhile")
        readers.append(len(multiprocessing.active_children()))

    reading = offline._map_ranks(traces, parse_sections(SECTIONS), jobs, meanwhile=meanwhile)
    assert events == []  # nothing before the first result is asked for
    for records, _info, _found in reading:
        events.append(f"result {len(records)}")
    assert calls["n"] == 1
    assert events == ["meanwhile", "result 6", "result 6"]
    assert readers == [0 if jobs == 1 else 2]  # the readers were forked (and given the traces) before it ran


def test_the_same_analysis_with_one_and_two_jobs() -> None:
    traces, world = offline.assign_ranks([read_header(CASE / f"r{r}.json") for r in (0, 1)])
    one = offline.analyze_traces(traces, parse_sections(SECTIONS), 0, world, jobs=1)
    two = offline.analyze_traces(traces, parse_sections(SECTIONS), 0, world, jobs=2)
    if two.timeline is not None:
        two.timeline.close()
    assert one.ranks.equals(two.ranks)
    assert one.sections.equals(two.sections)
    assert one.collectives.equals(two.collectives)
