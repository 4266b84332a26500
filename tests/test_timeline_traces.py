"""timeline.json on traces ``analyze`` accepts: its slices add up to the tables, per rank, iteration, section and
kind, and no thread holds slices that overlap without nesting (third-party traces, the set-4 case, a generated
CUDA trace with nested sections)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis import timeline_slices as T
from pnpscale.analysis.offline import main
from pnpscale.core import layout
from tests.trace_event_format import check_trace
from tests.tracegen import Coll, Spec, simulate, write

DATA = Path(__file__).parent / "data"


def analyse(folder: Path, out: Path, *args: str) -> Path:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(folder), *args, "--out", str(out), "--jobs", "1"])
    assert code == 0, err.getvalue()
    return out


def slice_sums(doc: dict) -> pd.DataFrame:
    """Per (rank, iteration, section, kind): the written slices' total, integer ns (Perfetto's reading)."""
    rows = [(e["pid"] - T.PID_BASE, int(e["args"]["iteration"]), str(e["args"]["section"]), e["cat"],
             round(float(e["dur"]) * 1000)) for e in doc["traceEvents"]
            if e["ph"] == "X" and e["cat"] in T.KINDS]  # fmt: skip
    t = pd.DataFrame(rows, columns=[K.RANK, K.ITERATION, K.SECTION, K.KIND, "ns"])
    wide = t.pivot_table(index=[K.RANK, K.ITERATION, K.SECTION], columns=K.KIND, values="ns", aggfunc="sum")
    return wide.reindex(columns=list(T.KINDS)).fillna(0).astype("int64")


def assert_timeline_agrees(out: Path) -> pd.DataFrame:
    """The run folder's timeline.json against its tables: per rank and section occurrence the tiling adds up to
    S_r and its wait + transfer to the time blocked (COMM_S), to the nanosecond; averaged over ranks, compute,
    transfer and wait are sections.parquet's (1e-9 s); the format rules hold (no partial overlap on a thread)."""
    return tables_agree((out / layout.TIMELINE_JSON).read_text(), pd.read_parquet(out / layout.RANKS),
                        pd.read_parquet(out / layout.SECTIONS))


def tables_agree(text: str, ranks: pd.DataFrame, sec: pd.DataFrame) -> pd.DataFrame:
    """:func:`assert_timeline_agrees` on a trace's text and its tables; the per-kind sums (ns)."""
    doc, problems = check_trace(text)
    assert problems == [], problems[:5]
    sums = slice_sums(doc)
    ranks = ranks.copy()
    ranks[K.SECTION] = ranks[K.SECTION].astype(object).astype(str)
    r = ranks.set_index([K.RANK, K.ITERATION, K.SECTION]).reindex(sums.index)
    assert len(sums) == len(ranks)  # every section occurrence placed
    tiling = sums[list(T.TILING)].sum(axis=1)
    assert (tiling - np.rint(r[K.SECTION_S] * 1e9)).abs().max() <= 2  # ns: each boundary rounds once
    comm = sums[T.WAIT] + sums[T.TRANSFER]
    assert (comm - np.rint(r[K.COMM_S] * 1e9)).abs().max() <= 2
    sec = sec.assign(**{K.SECTION: sec[K.SECTION].astype(str)}).set_index([K.ITERATION, K.SECTION])
    mean = sums.groupby([K.ITERATION, K.SECTION])[list(T.TILING)].mean() * 1e-9
    for kind, col in ((T.COMPUTE, K.COMPUTE_S), (T.TRANSFER, K.TRANSFER_S), (T.WAIT, K.WAIT_S)):
        assert np.allclose(mean[kind], sec.loc[mean.index, col], rtol=0, atol=3e-9), kind
    return sums


def test_the_set4_timeline_case_places_gpu_work_at_its_gpu_times(tmp_path):
    """GPU work starting 50 us after the CPU range, the NCCL kernel last: its 10 us transfer is in the slices."""
    shutil.copytree(DATA / "trace-gpu-after-cpu-range", tmp_path / "timeline")
    out = analyse(tmp_path / "timeline", tmp_path / "out", "--sections", "step=ProfilerStep#*")
    sums = assert_timeline_agrees(out)
    assert sums.loc[(0, 0, "step"), T.TRANSFER] == 10_000 and sums.loc[(0, 0, "step"), T.COMPUTE] == 30_000
    doc = json.loads((out / layout.TIMELINE_JSON).read_text())
    (tr,) = [e for e in doc["traceEvents"] if e.get("cat") == T.TRANSFER]
    (step,) = [e for e in doc["traceEvents"] if e.get("cat") == "section"]
    assert tr["ts"] + tr["dur"] == step["ts"] + step["dur"]  # the kernel ends the step, on the GPU


@pytest.mark.parametrize("case", ["nccl_parser_config", "trace_filter", "cpu_only"])
def test_third_party_traces_slices_add_up_to_the_tables(shared_traces, tmp_path, case):
    """HolisticTraceAnalysis' sample traces (NCCL, sampled NCCL pair of 128, gloo)."""
    assert_timeline_agrees(analyse(shared_traces / case, tmp_path / "out", "--sections", "step=ProfilerStep#*",
                                   "--partial"))


def nested_cuda_job(steps: bool = True):
    """Two CUDA ranks, two iterations of gradient then denoiser inside ``ProfilerStep#N``; rank 1's GPU lags
    its CPU by 30 us (GPU work starts well after each CPU range) and enters late."""
    plan = ((Coll("broadcast", 8, "Float", 2000), Coll("all_reduce", 4096, "Float", 9000)),
            (Coll("all_reduce", 65536, "Float", 15000),))  # fmt: skip
    work = tuple(tuple(((5000, 4000, 3000), (7000, 2000)) for _ in range(2)) for _ in range(2))
    kernels = tuple(tuple(((1, 2, 1), (2, 1)) for _ in range(2)) for _ in range(2))
    gap = (((0, 0), (0, 0)), ((3000, 1000), (2000, 500)))
    return simulate(Spec("nccl", 2, ("gradient", "denoiser"), (plan, plan), work=work, kernels=kernels, gap=gap,
                         rank_skew_ns=(0, 1234), gpu_lag_ns=(0, 30000), steps=steps))  # fmt: skip


def test_a_generated_cuda_trace_with_nested_sections_nests_on_every_thread(tmp_path):
    job = nested_cuda_job()
    write(job, tmp_path / "job")
    out = analyse(tmp_path / "job", tmp_path / "out", "--sections", "step=ProfilerStep#*,gradient,denoiser")
    sums = assert_timeline_agrees(out)
    assert set(sums.index.get_level_values(K.SECTION)) == {"step", "gradient", "denoiser"}
    doc = json.loads((out / layout.TIMELINE_JSON).read_text())
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    # the step's slices on depth 0, its children's one thread down; no overflow thread was needed
    assert {e["tid"] for e in x if e["cat"] == T.COMPUTE and e["args"]["section"] == "step"} == {T.SLICES_TID}
    assert {e["tid"] for e in x if e["cat"] == T.COMPUTE and e["args"]["section"] != "step"} == {T.SLICES_TID + 1}
    assert max(e["tid"] for e in x) < T.OVERFLOW_TID
    # each child section lies inside its step on the sections thread
    for pid in (1, 2):
        secs = [(e["ts"], e["ts"] + e["dur"], e["args"]) for e in x if e["cat"] == "section" and e["pid"] == pid]
        for a, b, args in secs:
            if args["section"] != "step":
                assert any(a0 <= a and b <= b0 for a0, b0, g in secs if g["section"] == "step")
    # one iteration slice per rank and iteration; a flow per collective across the two ranks
    assert sorted((e["pid"], e["args"]["iteration"]) for e in x if e["cat"] == "iteration") == [
        (1, 0), (1, 1), (2, 0), (2, 1)]
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    colls = pd.read_parquet(out / layout.COLLECTIVES)
    assert len(flows) == 2 * len(colls.drop_duplicates([K.ITERATION, K.SECTION, K.SEQ]))


def test_untangle_moves_only_what_would_overlap_and_the_check_names_it():
    spans = [{"pid": 1, "tid": 2}, {"pid": 1, "tid": 2}, {"pid": 1, "tid": 2}]
    names = {2: "compute / transfer / wait"}
    T._untangle(spans, [0, 2, 8], [10, 5, 12], names)
    assert [s["tid"] for s in spans] == [2, 2, 2 + T.OVERFLOW_TID]
    assert names[2 + T.OVERFLOW_TID] == "compute / transfer / wait (overlapping, 1)"
    ev = [{"ph": "X", "pid": 1, "tid": 2, "name": "a", "ts": 0, "dur": 10},
          {"ph": "X", "pid": 1, "tid": 2, "name": "b", "ts": 8, "dur": 4}]  # fmt: skip
    (line,) = T.nesting_problems(ev)
    assert "pid 1 tid 2: 'b' [8.0, 12.0] us overlaps 'a'" in line


def test_the_live_cuda_rule_cpu_start_to_gpu_end_places_the_same_intervals():
    """pnpscale's own CUDA runs (``cpu_start``: S_r from the CPU range start to the last GPU end, the live
    rule): the same trace's timeline adds up to those tables too, nested sections nesting."""
    import tempfile

    from pnpscale.analysis.offline import analyze_traces, assign_ranks
    from pnpscale.analysis.trace.read import parse_sections, read_header

    job = nested_cuda_job()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write(job, Path(tmp) / "job")
        traces, world = assign_ranks([read_header(p) for p in paths])
        a = analyze_traces(traces, parse_sections("step=ProfilerStep#*,gradient,denoiser"), 0, world,
                           cpu_start=True, jobs=1)  # fmt: skip
    assert (a.ranks[K.SECTION_S] > a.ranks[K.GPU_SPAN_S] + 1e-9).any()  # the CPU lead is in S_r here
    text = json.dumps(T.run_trace(a.ranks, a.collectives), separators=(",", ":"), allow_nan=False)
    tables_agree(text, a.ranks, a.sections)
