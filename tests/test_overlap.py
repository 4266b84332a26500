"""Communication that overlaps computation (pnpscale.analysis.overlap): blocked time, unions, hidden time,
the wait/transfer split within blocked time, S_max efficiencies, types from c10d calls, clipped GPU steps."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event, Kind, rank_rows
from pnpscale.analysis.metrics import check_invariants, decompose, summarize
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.analysis.overlap import (
    LATE_CLOSE_NS,
    attribute,
    communicating,
    compute_spans,
    rank_blocked,
    split_blocked,
    waited,
)
from pnpscale.analysis.section.align import align_collectives
from pnpscale.analysis.section.records import section_records
from pnpscale.analysis.tables import frames
from tests.test_traces import X, kernel, launch, write_trace

MS = 1_000_000  # ns


# --- pure parts --------------------------------------------------------------------------------


def test_compute_spans_are_the_innermost_compute_operator():
    # an autograd node that issues a collective and waits for it inside (communicates) holds a compute child
    ops = [(0, 100, "aten::conv"), (10, 30, "aten::empty"), (200, 400, "autograd::engine::evaluate_function: X"),
           (210, 220, "c10d::allreduce_"), (300, 320, "aten::add")]  # fmt: skip
    flags = communicating(ops)
    assert flags == [False, False, True, True, False]
    spans = compute_spans([(s, e, f) for (s, e, _), f in zip(ops, flags, strict=True)])
    assert spans == [(0, 100), (300, 320)]


def test_waited_keeps_idle_time_up_to_a_collective_end_in_the_same_gap():
    busy = [(0, 10), (20, 30), (40, 50)]
    idle = [(10, 20), (30, 40), (50, 70)]
    # ends at 35 (gap 30-40) and 60 (after the last op): Python gap 10-20 holds no end: not blocked
    assert waited(idle, busy, [35, 60]) == [(30, 35), (50, 60)]


def test_a_wait_ends_when_the_thread_resumes_though_gloo_closes_its_range_late():
    """The minimal job of issue 34: the thread idles in ``Future.wait()`` 50 ms, resumes at 60 ms; gloo's worker
    closes its range at 62 ms, inside the compute that follows: the whole gap is blocked."""
    busy = [(0, 10 * MS), (60 * MS, 80 * MS)]
    assert waited([(10 * MS, 60 * MS)], busy, [62 * MS]) == [(10 * MS, 60 * MS)]
    # closed past LATE_CLOSE_NS after the thread resumed, or in a later compute span: not a wait
    assert waited([(10 * MS, 60 * MS)], busy, [60 * MS + LATE_CLOSE_NS + 1]) == []
    later = [(0, 10 * MS), (60 * MS, 61 * MS), (62 * MS, 80 * MS)]
    assert waited([(10 * MS, 60 * MS)], later, [63 * MS]) == []
    # inside a c10d call: gloo's copies (FSDP's reduce_scatter) are the collective's, not compute
    ops = [(0, 100, "c10d::_reduce_scatter_base_"), (10, 60, "aten::clone"), (20, 30, "aten::copy_")]
    assert communicating(ops) == [True, True, True]
    assert compute_spans([(s, e, f) for (s, e, _), f in zip(ops, communicating(ops), strict=True)]) == []


def test_blocked_pieces_go_to_the_collective_that_ends_first():
    assert attribute([(0, 50), (10, 100)], [(0, 100)]) == [[(0, 50)], [(50, 100)]]


@pytest.mark.parametrize(
    ("activity", "busy", "waits", "blocked", "hidden"),
    [
        ([(0, 100)], [], True, [[(0, 100)]], 0),  # a blocking collective: its whole range
        ([(10, 60)], [(0, 100)], True, [[]], 50),  # hidden behind compute
        ([(10, 60), (20, 70)], [], True, [[(10, 60)], [(60, 70)]], 0),  # two in flight: their union, once
        ([(10, 60)], [(0, 40)], True, [[(40, 60)]], 30),  # compute, then wait() until the end
        # ended 45 ms into compute: the gap was Python
        ([(10 * MS, 90 * MS)], [(0, 40 * MS), (45 * MS, 100 * MS)], True, [[]], 80 * MS),
        # gloo closed the range 15 ms after the thread resumed (issue 34): the gap was the wait
        ([(10 * MS, 60 * MS)], [(0, 40 * MS), (45 * MS, 100 * MS)], True, [[(40 * MS, 45 * MS)]], 45 * MS),
        ([(10, 60)], [(0, 40), (45, 100)], False, [[(40, 45)]], 45),  # GPU: any time without compute kernel
    ],
)
def test_rank_blocked(activity, busy, waits, blocked, hidden):
    assert rank_blocked(activity, busy, waits=waits) == (blocked, hidden)


def _blocking_tables(seed=0, w=4, n_it=3, n_c=3):
    rng = np.random.default_rng(seed)
    rrows, crows = [], []
    for it in range(n_it):
        for sec in ("gradient", "denoiser"):
            for r in range(w):
                d = rng.uniform(0.001, 0.3, n_c)
                rrows.append({K.RANK: r, K.ITERATION: it, K.SECTION: sec, K.WARMUP: False,
                              K.SECTION_S: float(d.sum() + rng.uniform(0.1, 2.0))})  # fmt: skip
                crows += [{K.RANK: r, K.ITERATION: it, K.SECTION: sec, K.SEQ: c, K.COLLECTIVE: "all_reduce",
                           K.DURATION_S: float(d[c]), K.PAYLOAD_BYTES: 8} for c in range(n_c)]  # fmt: skip
    return pd.DataFrame(rrows), pd.DataFrame(crows)


def test_one_blocking_collective_reproduces_the_study_rule_exactly():
    """transfer = sum_c min_r D_rc, wait = mean_r sum_c (D_rc - min_r D_rc): unknown spans (older tables) and
    spans covering the whole range give the study's numbers."""
    ranks, coll = _blocking_tables()
    d = coll.pivot_table(index=[K.ITERATION, K.SECTION, K.SEQ], columns=K.RANK, values=K.DURATION_S)
    dmin = d.min(axis=1)
    study_t = dmin.groupby(level=[0, 1]).sum()
    study_w = d.sub(dmin, axis=0).groupby(level=[0, 1]).sum().mean(axis=1)
    full = coll.assign(**{K.BLOCKED_SPANS_NS: [f"0-{round(x * 1e9)}" for x in coll[K.DURATION_S]]})
    for table in (coll, full):
        out = decompose(ranks, table).set_index([K.ITERATION, K.SECTION])
        t, w = study_t.reindex(out.index), study_w.reindex(out.index)
        assert np.allclose(out[K.TRANSFER_S], t, rtol=0, atol=1e-9 if table is full else 1e-15)
        assert np.allclose(out[K.WAIT_S], w, rtol=0, atol=1e-9 if table is full else 1e-15)
        assert (out[K.COMPUTE_S] + out[K.TRANSFER_S] + out[K.WAIT_S] - out[K.SECTION_S]).abs().max() < 1e-9
        assert (out[K.HIDDEN_S] == 0).all()


def test_split_within_blocked_time():
    # rank 0 arrives first and computes until 0.3 s into the collective; rank 1 arrives last (D = 0.1 s)
    c = pd.DataFrame({K.ITERATION: 0, K.SECTION: "s", K.SEQ: 0, K.RANK: [0, 1], K.DURATION_S: [0.5, 0.1],
                      K.BLOCKED_SPANS_NS: ["300000000-500000000", None]})  # fmt: skip
    out = split_blocked(c)
    # rank 0: blocked 0.2 s, of which the last 0.1 s (after rank 1 entered) is transfer, 0.1 s wait
    assert out.loc[0].tolist() == pytest.approx([0.2, 0.1, 0.1])
    assert out.loc[1].tolist() == pytest.approx([0.1, 0.0, 0.1])


# --- section records from events ---------------------------------------------------------------


def _gloo_rank(works, ops, section=(0, 100 * MS), tid=1):
    evs = [Event("s", Kind.CPU, *section, tid=tid)]
    evs += [Event(f"gloo:{name}", Kind.CPU, a, b, tid=90 + i, collective=name) for i, (name, a, b) in enumerate(works)]
    evs += [Event(name, Kind.OP, a, b, tid=tid) for name, a, b in ops]
    return evs


def test_concurrent_collectives_count_once_and_hidden_is_reported():
    # two all_reduces in flight together (two gloo worker threads), the thread computes until 50 ms then waits
    works = [("all_reduce", 10 * MS, 80 * MS), ("all_reduce", 12 * MS, 90 * MS)]
    ops = [("c10d::allreduce_", 5 * MS, 6 * MS), ("c10d::allreduce_", 7 * MS, 8 * MS), ("aten::mm", 9 * MS, 50 * MS)]
    (rec,) = section_records(_gloo_rank(works, ops), ["s"])
    # blocked: inside the two c10d calls (5-6, 7-8 ms), then waiting from 50 ms to the last end (90 ms)
    assert [c.blocked_s for c in rec.collectives] == pytest.approx([0.032, 0.010])  # 5-6, 7-8, 50-80; 80-90
    assert rec.comm_s == pytest.approx(0.042)  # the union minus compute, never the sum of 75 + 83 ms
    assert rec.hidden_s == pytest.approx(0.043)  # 5-90 ms in flight (from the first call), 42 ms blocked
    assert [c.hidden_s for c in rec.collectives] == pytest.approx([0.043, 0.042])  # its range minus 42 ms


def test_a_wait_inside_an_autograd_node_is_blocked_time():
    # a synchronous all_reduce issued inside an autograd backward node: the node's own time is waiting
    works = [("all_reduce", 20 * MS, 60 * MS)]
    ops = [("autograd::engine::evaluate_function: AllReduceBackward", 10 * MS, 61 * MS),
           ("c10d::allreduce_", 15 * MS, 16 * MS), ("aten::mul", 11 * MS, 14 * MS)]  # fmt: skip
    (rec,) = section_records(_gloo_rank(works, ops), ["s"])
    # from the c10d call (15 ms) to the end (60 ms), although the autograd node encloses it all
    assert rec.collectives[0].blocked_s == pytest.approx(0.045) and rec.hidden_s == 0


def test_collective_type_from_the_c10d_call():
    """FSDP's reduce_scatter on gloo runs as ``gloo:all_reduce``: the c10d call names what was asked for."""
    works = [("all_reduce", 10 * MS, 20 * MS), ("all_reduce", 30 * MS, 40 * MS)]
    ops = [("c10d::_reduce_scatter_base_", 5 * MS, 6 * MS), ("c10d::allreduce_", 25 * MS, 26 * MS)]
    an = Anomalies()
    (rec,) = section_records(_gloo_rank(works, ops), ["s"], an, rank=0)
    assert [c.name for c in rec.collectives] == ["reduce_scatter", "all_reduce"]
    (a,) = [a for a in an.records() if a["kind"] == "range_name_disagrees"]
    assert a["count"] == 1 and "c10d::_reduce_scatter_base_" in a["example"]


def test_cuda_blocked_is_collective_kernels_minus_compute_kernels(tmp_path):
    evs = [
        X("s", "user_annotation", 0, 50),
        launch(1, 1), kernel("void gemm", 10, 100, 1, stream=7),
        launch(2, 2), kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 60, 80, 2, stream=20),
    ]  # fmt: skip
    path = write_trace(tmp_path / "r0.json", evs, rank=0, world=1)
    from pnpscale.analysis.trace.read import read_trace

    (rec,) = section_records(read_trace(path, ["s"]).events, ["s"])
    # the kernel runs 60-140 us, compute until 110 us: blocked 30 us, hidden 50 us
    assert rec.collectives[0].blocked_s == pytest.approx(30e-6) and rec.hidden_s == pytest.approx(50e-6)


def test_gpu_work_past_the_next_step_is_clipped(tmp_path):
    """An asynchronous GPU pipeline: step k's kernels still run when step k+1's start on the GPU."""
    evs = []
    for k in range(3):
        t = 1000 * k
        evs += [X(f"ProfilerStep#{k}", "user_annotation", t, 100), launch(t + 1, 10 + k),
                kernel("void gemm", t + 500, 1300, 10 + k)]  # fmt: skip
    path = write_trace(tmp_path / "r0.json", evs, rank=0, world=1)
    from pnpscale.analysis.trace.read import read_trace

    an = Anomalies()
    recs = section_records(read_trace(path, {"step": "ProfilerStep#*"}).events, ["step"], an, rank=0)
    # GPU 500-1800, 1500-2800, 2500-3800 us: the first two end 300 us into the next; the last keeps 1300 us
    assert [r.section_s for r in recs] == pytest.approx([1000e-6, 1000e-6, 1300e-6])
    (a,) = [a for a in an.records() if a["kind"] == "gpu_work_past_next_section"]
    assert a["count"] == 2 and "0.300 ms" in a["example"]


# --- efficiencies ------------------------------------------------------------------------------


def _sections(rows):
    """rows: (iteration, section, [S_r...], [D_r...] or None) -> decompose's table."""
    rr, cc = [], []
    for it, sec, ss, ds in rows:
        for r, s in enumerate(ss):
            rr.append({K.RANK: r, K.ITERATION: it, K.SECTION: sec, K.WARMUP: False, K.SECTION_S: s})
            if ds is not None:
                cc.append({K.RANK: r, K.ITERATION: it, K.SECTION: sec, K.SEQ: 0, K.COLLECTIVE: "all_reduce",
                           K.DURATION_S: ds[r], K.PAYLOAD_BYTES: 8})  # fmt: skip
    cols = [K.RANK, K.ITERATION, K.SECTION, K.SEQ, K.COLLECTIVE, K.DURATION_S, K.PAYLOAD_BYTES]
    return decompose(pd.DataFrame(rr), pd.DataFrame(cc, columns=cols))


def test_a_section_without_collectives_has_comme_1_and_pe_lb():
    # rank 1 works 30 ms longer (the case: LB 0.63, CommE 1.59 before)
    summ = summarize(_sections([(0, "work", [0.05, 0.08], None)]), gpus=2).set_index(K.SECTION)
    assert summ.loc["work", K.COMM_E] == pytest.approx(1.0)
    assert summ.loc["work", K.PE] == pytest.approx(summ.loc["work", K.LB]) == pytest.approx(0.065 / 0.08)


def test_comme_never_exceeds_1_when_ranks_leave_at_different_times():
    # a section followed by compute before its collective's end differs per rank (S_r unequal)
    sections = _sections([(0, "a", [1.0, 1.3], [0.4, 0.1]), (0, "b", [0.5, 0.2], [0.1, 0.1])])
    summ = summarize(sections, gpus=2).set_index(K.SECTION)
    assert (summ[K.COMM_E] <= 1 + 1e-12).all()
    assert summ[K.PE].to_numpy() == pytest.approx((summ[K.LB] * summ[K.COMM_E]).to_numpy())


@pytest.mark.parametrize("gpus", [2, 8, 64])
def test_study_configurations_keep_the_study_comme(gpus):
    """Every section of the study ends in its all_reduce: the ranks leave together (S_r equal), and
    ΣC_max/ΣS_max is the study's ΣC_max/Σ mean_r S_r. Two sections (gradient with idle ranks past 8
    operators, a balanced denoiser), one blocking all_reduce each."""
    rng = np.random.default_rng(gpus)
    rows = []
    for it in range(3):
        work = np.where(np.arange(gpus) < 8, 0.2, 0.0) + rng.uniform(0, 0.01, gpus)
        rows.append((it, "gradient", [float(work.max() + 0.05)] * gpus, list(work.max() + 0.05 - work)))
        dn = 1.0 / gpus + rng.uniform(0, 0.005, gpus)
        rows.append((it, "denoiser", [float(dn.max() + 0.1)] * gpus, list(dn.max() + 0.1 - dn)))
    sections = _sections(rows)
    summ = summarize(sections, gpus=gpus).set_index(K.SECTION)
    study = sections.groupby(K.SECTION)[K.COMPUTE_MAX_S].sum() / sections.groupby(K.SECTION)[K.SECTION_S].sum()
    for sec in ("gradient", "denoiser"):
        assert summ.loc[sec, K.COMM_E] == pytest.approx(study[sec], rel=1e-12)


def test_recorded_run_comme_with_s_max():
    """The recorded run of tests/data/run_v1 (gloo): ranks leave every section in its all_reduce, S_max and
    mean S differ by the ranks' exit jitter only: CommE moves by 1.25 points (0.958 -> 0.946) and stays <= 1."""
    from pathlib import Path

    sec = pd.read_parquet(next(Path(__file__).parent.joinpath("data", "run_v1").glob("**/sections.parquet")))
    if K.SECTION_MAX_S not in sec:
        pytest.skip("recorded run without section_max_s")
    summ = summarize(sec, gpus=int(sec[K.WORLD_SIZE].iloc[0])).set_index(K.SECTION)
    m = sec[~sec[K.WARMUP]]
    study = m[K.COMPUTE_MAX_S].sum() / m[K.SECTION_S].sum()
    assert summ.loc["all", K.COMM_E] <= study <= 1 and study - summ.loc["all", K.COMM_E] < 0.02


# --- offline, end to end on a synthetic gloo trace ---------------------------------------------


def test_offline_gloo_overlap_is_accepted_and_adds_up(tmp_path, capsys):
    """Two ranks, one async all_reduce hidden on rank 0 (computes throughout) and waited for on rank 1."""
    folder = tmp_path / "job"
    folder.mkdir()
    for rank in (0, 1):
        evs = [X("s", "user_annotation", 0, 100_000, tid=1), X("c10d::allreduce_", "cpu_op", 100, 50, tid=1),
               X("gloo:all_reduce", "user_annotation", 200, 60_000, tid=9),
               X("gloo:all_reduce", "user_annotation", 300, 70_000, tid=10)]  # fmt: skip
        evs.append(X("c10d::allreduce_", "cpu_op", 250, 40, tid=1))
        if rank == 0:
            evs.append(X("aten::mm", "cpu_op", 400, 99_000, tid=1))  # both collectives hidden
        write_trace(folder / f"rank{rank}.json", evs, rank=rank, world=2, backend="gloo")
    assert main([str(folder), "--sections", "s", "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    sec = pd.read_parquet(tmp_path / "out" / "sections.parquet").iloc[0]
    # rank 1 is blocked from the first c10d call to the last end: 0.1 .. 70.3 ms (the union, once);
    # rank 0 computes from 0.4 ms on, the works end during aten::mm: blocked only inside its two c10d calls
    # (50 + 40 us), the rest of 70.2 ms hidden
    assert sec[K.TRANSFER_S] + sec[K.WAIT_S] == pytest.approx((0.0702 + 0.00009) / 2)
    assert sec[K.HIDDEN_S] == pytest.approx((0.0702 - 0.00009) / 2)
    assert sec[K.COMPUTE_S] == pytest.approx(0.1 - (0.0702 + 0.00009) / 2)
    doc = json.loads((tmp_path / "out" / ANALYSIS_JSON).read_text())
    assert doc["metrics"]["comm_e"] <= 1
    assert doc["metrics"]["sections"]["s"]["hidden_share"] == pytest.approx((0.0702 - 0.00009) / 0.1404)


def test_invariants_hold_on_random_overlapping_ranks():
    rng = np.random.default_rng(3)
    gathered = []
    for rank in range(3):
        evs = []
        for it in range(4):
            t0 = it * 200 * MS
            evs.append(Event("s", Kind.CPU, t0, t0 + 150 * MS, tid=1))
            for k in range(3):
                a = t0 + int(rng.uniform(1, 100)) * MS
                evs.append(Event("gloo:all_reduce", Kind.CPU, a, a + int(rng.uniform(1, 60)) * MS, tid=90 + k,
                                 collective="all_reduce"))  # fmt: skip
                evs.append(Event("c10d::allreduce_", Kind.OP, a - MS, a - MS // 2, tid=1))
            for _ in range(5):
                a = t0 + int(rng.uniform(0, 140)) * MS
                evs.append(Event("aten::mm", Kind.OP, a, a + int(rng.uniform(1, 10)) * MS, tid=1))
        gathered.append(section_records(evs, ["s"], rank=rank))
    aligned = align_collectives(dict(enumerate(gathered)))
    ranks, colls = frames([(rank_rows(r, recs, 0), {}) for r, recs in aligned.items()])
    sections = decompose(ranks, colls)
    check_invariants(ranks, sections)
    assert (ranks[K.COMM_S] + ranks[K.HIDDEN_S] <= ranks[K.SECTION_S] + 1e-9).all()
