"""Four wild-trace cases (tests/data/trace-wild-cases, a copy of ../shared/cases/traces-set4): each gives the
README's right answer or names its cause (issue #33). The traces are generated in the test from the generator."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.core import layout

GENERATOR = Path(__file__).parent / "data" / "trace-wild-cases" / "make_case.py"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("set4")
    argv = sys.argv
    sys.argv = [str(GENERATOR), str(out)]
    try:
        runpy.run_path(str(GENERATOR), run_name="__main__")
    finally:
        sys.argv = argv
    return out


def analyse(cases: Path, case: str, tmp_path: Path, capsys) -> tuple[pd.DataFrame, dict[str, list[dict]], str]:
    out = tmp_path / case
    code = main([str(cases / case), "--sections", "step=ProfilerStep#*", "--out", str(out), "--jobs", "1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    kinds: dict[str, list[dict]] = {}
    for a in json.loads((out / ANALYSIS_JSON).read_text())["anomalies"]:
        kinds.setdefault(a["kind"], []).append(a)
    return pd.read_parquet(out / layout.SECTIONS), kinds, printed


def step_row(table: pd.DataFrame) -> pd.Series:
    (row,) = [r for _, r in table.iterrows() if r[K.SECTION] == "step"]
    return row


def test_timeline_transfer_is_the_nccl_kernel(cases, tmp_path, capsys):
    table, kinds, _ = analyse(cases, "timeline", tmp_path, capsys)
    row = step_row(table)
    assert (row[K.COMPUTE_S], row[K.TRANSFER_S], row[K.WAIT_S]) == pytest.approx((30e-6, 10e-6, 0.0), abs=1e-12)
    assert kinds == {}


def test_symmetric_memory_kernel_is_the_all_reduce_it_is(cases, tmp_path, capsys):
    table, kinds, printed = analyse(cases, "symm", tmp_path, capsys)
    row = step_row(table)
    assert row[K.TRANSFER_S] == pytest.approx(10e-6, abs=1e-12) and row[K.COMPUTE_S] == pytest.approx(0, abs=1e-12)
    assert "collective_kernel_unrecognised" not in kinds and "'void '" not in printed


def test_collectives_issued_in_different_orders_are_matched_by_type(cases, tmp_path, capsys):
    table, kinds, _ = analyse(cases, "order", tmp_path, capsys)
    assert len(table) == 1
    for _, r in table.iterrows():  # per rank: all_to_all 100 us + all_reduce 10 us, wait 0 (not matched by position)
        assert (r[K.TRANSFER_S], r[K.WAIT_S]) == pytest.approx((110e-6, 0.0), abs=1e-12)
    # the SendRecv kernels ran what their descriptors say
    assert all("ran all" in a["example"] for a in kinds.get("kernel_name_disagrees", []))


def test_empty_trailing_step_is_dropped_and_named(cases, tmp_path, capsys):
    table, kinds, _ = analyse(cases, "emptystep", tmp_path, capsys)
    row = step_row(table)  # one iteration: not two whose mean is halved by a 0 s one
    assert row[K.COMPUTE_S] == pytest.approx(60e-6, abs=1e-12)
    (a,) = kinds["empty_iteration"]
    assert re.search(r"ProfilerStep ?#2\b", a["example"]), a  # the step named (when read, or after matching)
