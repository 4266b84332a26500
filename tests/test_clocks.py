"""Rank clocks checked by causality (pnpscale/analysis/clocks.py): a constant skew changes nothing and is never
flagged; a clock that steps while the trace is recorded is named with its rank and a bound that never exceeds the
step.

No false alarm on unshifted generated traces is the main property of tests/test_trace_properties.py (every
generated job, with skews of up to 5 ms between ranks, must give no anomaly): it runs the same analysis.
"""

from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pnpscale import columns as K
from pnpscale.analysis.clocks import CAUSAL, clock_conflicts, offset_bounds
from tests.test_trace_properties import PROPERTY, analyse, assert_decomposition, results, specs
from tests.tracegen import Job, simulate, write


def _table(starts: dict[int, list[float]], durations: dict[int, list[float]], types: list[str]) -> pd.DataFrame:
    rows = []
    for r, ss in starts.items():
        for i, (s, d, t) in enumerate(zip(ss, durations[r], types, strict=True)):
            rows.append({K.RANK: r, K.ITERATION: i, K.SECTION: "s", K.SEQ: 0, K.COLLECTIVE: t, K.START_S: s,
                         K.DURATION_S: d})  # fmt: skip
    return pd.DataFrame(rows)


def test_a_constant_offset_of_any_size_is_never_a_conflict() -> None:
    """Every rank leaves together at 1.0 s + i; rank 1's clock is 1000 s ahead: the bounds hold it, no conflict."""
    arrive = {0: [0.2, 1.5, 2.1], 1: [0.6, 1.2, 2.7]}
    starts = {0: arrive[0], 1: [a + 1000.0 for a in arrive[1]]}
    durations = {r: [1.0 + i - a for i, a in enumerate(arrive[r])] for r in arrive}
    c = _table(starts, durations, ["all_reduce"] * 3)
    lo, hi, _, _ = offset_bounds(c, 1, 0)
    assert lo <= 1000.0 <= hi
    assert clock_conflicts(c) == []


def test_a_clock_step_is_bounded_from_below_and_never_over() -> None:
    """Rank 1's clock steps by +2 s before iteration 2: the bounds cross by the step less the slack the
    collectives leave it (the rank's arrival to the other's exit), never by more than the step. A step of
    0.5 s hides in that slack: not flagged (the limit the README states)."""
    arrive = {0: [0.2, 1.5, 2.1], 1: [0.6, 1.2, 2.7]}  # every rank leaves at 1.0, 2.0, 3.0
    durations = {r: [1.0 + i - a for i, a in enumerate(arrive[r])] for r in arrive}

    def stepped(step: float) -> pd.DataFrame:
        starts = {0: arrive[0], 1: [a + (step if i == 2 else 0.0) for i, a in enumerate(arrive[1])]}
        return _table(starts, durations, ["all_reduce"] * 3)

    (x,) = clock_conflicts(stepped(2.0))
    assert (x.rank, x.other, x.blamed) == (1, 0, None)  # two ranks cannot tell whose clock stepped
    # o1 - o0 <= min(end on 1 - start on 0) = 2.0 - 1.5 (iteration 1); >= start on 1 - end on 0 = 4.7 - 3.0
    assert (x.upper_at[0], x.lower_at[0]) == (1, 2)
    assert (x.upper_s, x.lower_s) == pytest.approx((0.5, 1.7))
    assert 0 < x.crossing_s <= 2.0
    assert clock_conflicts(stepped(0.5)) == []


def test_the_odd_clock_is_blamed_with_three_ranks_and_only_causal_collectives_count() -> None:
    """Three ranks: the stepped rank is the one in conflict (rank 2), or the reference when every rank conflicts
    with it (rank 0). A broadcast (a root may finish before the others start) bounds nothing."""
    arrive = {0: [0.2, 1.5, 2.1], 1: [0.6, 1.2, 2.7], 2: [0.9, 1.9, 2.0]}
    durations = {r: [1.0 + i - a for i, a in enumerate(arrive[r])] for r in arrive}
    for odd in (2, 0):
        starts = {r: [a + (5.0 if i == 2 and r == odd else 0.0) for i, a in enumerate(arrive[r])] for r in arrive}
        found = clock_conflicts(_table(starts, durations, ["all_gather", "all_to_all", "all_reduce"]))
        assert {x.blamed for x in found} == {odd}
        assert {x.rank for x in found} == ({2} if odd == 2 else {1, 2})
        assert all(0 < x.crossing_s <= 5.0 for x in found)
        assert clock_conflicts(_table(starts, durations, ["all_gather", "all_to_all", "broadcast"])) == []
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"} == CAUSAL


def step_clock(job: Job, rank: int, iteration: int, step_ns: int) -> dict[int, list[dict]]:
    """The job's events with ``rank``'s clock stepped forward by ``step_ns`` from ``iteration`` on (between two
    iterations, where every rank waits in the barrier the generator keeps outside the sections): its CPU events
    from that iteration's first range on, and the GPU events whose launch was."""
    evs = copy.deepcopy(job.events)
    spec = job.spec
    mine = [e for e in evs[rank] if e.get("ph") == "X"]
    firsts = sorted(e["ts"] for e in mine if e["name"] == spec.sections[0] and e.get("cat") == "user_annotation")
    at = firsts[iteration]
    if spec.steps:
        at = min(at, *(e["ts"] for e in mine if e["name"] == f"ProfilerStep#{spec.first_step + iteration}"))
    moved: set[int] = set()
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    for e in mine:
        if e.get("cat") not in gpu and e.get("cat") != "Trace" and e["ts"] >= at:
            e["ts"] += step_ns
            if e.get("cat") == "cuda_runtime":
                moved.add(e["args"]["correlation"])
    for e in mine:
        if e.get("cat") in gpu and e["args"].get("correlation") in moved:
            e["ts"] += step_ns
        if e.get("cat") == "Trace":
            e["dur"] += step_ns
    return evs


def _causal_on_both_sides(job: Job, iteration: int) -> bool:
    colls = job.truth.colls
    before = any(c.op in CAUSAL for (i, _), cs in colls.items() if i < iteration for c in cs)
    after = any(c.op in CAUSAL for (i, _), cs in colls.items() if i >= iteration for c in cs)
    return before and after


def test_a_rank_clock_stepped_between_iterations_is_named_with_its_rank_and_a_bound_under_the_step() -> None:
    """Generated jobs (CPU/gloo and CUDA/NCCL) with one rank's clock stepped forward by a known amount between two
    iterations: the numbers stay the generator's (no duration changed), and when causal collectives lie on both
    sides of the step ``rank_clocks_inconsistent`` names the stepped rank (with 3 ranks or more) and a bound that
    never exceeds the step; with no causal collective on one side nothing can be proved, and nothing is said."""
    named: list[int] = []

    @settings(PROPERTY, max_examples=8)
    @given(spec=specs(max_world=4, max_iterations=3), data=st.data())
    def prop(spec, data) -> None:
        if spec.world < 2 or spec.iterations < 2:
            return
        job = simulate(spec)
        rank = data.draw(st.integers(0, spec.world - 1))
        iteration = data.draw(st.integers(1, spec.iterations - 1))
        step_ns = data.draw(st.integers(2, 50)) * 1_000_000  # 2..50 ms: beyond any generated collective's slack
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "job"
            write(job, folder, events=step_clock(job, rank, iteration, step_ns))
            code, err, out = analyse(folder, spec.sections)
            assert code == 0, err
            table, anomalies = results(out)
        if not any(c for it in spec.plan for sec in it for c in sec):
            return  # no collective: nothing to bound (the main property covers the job)
        assert_decomposition(job, table)
        found = [a for a in anomalies if a["kind"] == "rank_clocks_inconsistent"]
        assert {a["kind"] for a in anomalies} <= {"rank_clocks_inconsistent"}, anomalies
        if not _causal_on_both_sides(job, iteration):
            assert found == []
            return
        assert found, anomalies
        for a in found:
            bound_us = float(re.search(r"stepped by at least ([0-9.e+]+) us", a["example"]).group(1))
            assert 0 < bound_us * 1000 <= step_ns * (1 + 1e-6), a["example"]
            assert f"rank {rank}" in a["example"]
            if spec.world >= 3:
                assert a["rank"] == rank
        named.append(len(found))

    prop()
    assert named, "no generated job had causal collectives on both sides of the step"


def _linkless_trace(path: Path, runtime_shift_us: float) -> Path:
    """A CUDA trace as Kineto writes one without ``External id`` and without collective descriptors: per section
    three ``aten::mul`` operators (10 us), each launching a kernel through ``cudaLaunchKernel`` (4 us, from 3 us
    into the operator); the runtime events shifted by ``runtime_shift_us`` (another clock, kineto#1082)."""
    from tests.test_traces import X, kernel, write_trace

    events = []
    corr = 1
    for i in range(2):
        t0 = 100.0 + 50.0 * i
        events.append(X("gradient", "user_annotation", t0, 40.0))
        for k in range(3):
            op = t0 + 2.0 + 12.0 * k
            events.append(X("aten::mul", "cpu_op", op, 10.0))
            events.append(X("cudaLaunchKernel", "cuda_runtime", op + 3.0 + runtime_shift_us, 4.0, correlation=corr,
                            cbid=211))  # fmt: skip
            events.append(kernel("void at::native::vectorized_elementwise_kernel<4>", op + 8.0, 5.0, corr))
            corr += 1
    return write_trace(path, events)


@pytest.mark.parametrize("shift_us", [-5.0, -17.0, 4.5])
def test_runtime_calls_across_their_threads_operators_are_refused_when_nothing_links_them(tmp_path, shift_us):
    """Without a descriptor or ``External id`` the runtime clock's offset cannot be found; but a thread's runtime
    calls nest inside its operators, so a call across an operator's start or end proves the runtime events are on
    another clock (kineto#1082): refused, naming it, instead of placing kernels by launches in the wrong section."""
    from pnpscale.analysis.trace.read import TraceError, read_trace

    with pytest.raises(TraceError, match=r"runtime call\(s\) cross the start or end of a CPU range .*kineto#1082"):
        read_trace(_linkless_trace(tmp_path / "rank0.json", shift_us), ["gradient"])


@pytest.mark.parametrize("shift_us", [0.0, -0.9, 2.0])
def test_runtime_calls_inside_their_operators_are_read(tmp_path, shift_us):
    """No false alarm: calls inside their operators (or crossing by no more than the 1 us slack) are read."""
    from pnpscale.analysis.trace.read import read_trace

    trace = read_trace(_linkless_trace(tmp_path / "rank0.json", shift_us), ["gradient"])
    assert sum(1 for e in trace.events if e.name == "gradient") == 2


def test_a_real_trace_nests_its_runtime_calls_in_its_operators(shared_traces: Path) -> None:
    """HolisticTraceAnalysis' NCCL trace (8740 runtime calls): none crosses an operator of its thread at offset 0;
    shifted 5 us earlier, hundreds do (skipped without the shared traces)."""
    import gzip
    import json

    import numpy as np

    from pnpscale.analysis.trace.select import crossing_calls

    path = shared_traces / "nccl_parser_config" / "nccl_data.json.gz"
    evs = [e for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    rt = [e for e in evs if e.get("cat") == "cuda_runtime"]
    ops = [e for e in evs if e.get("cat") == "cpu_op"]

    def ns(v: float) -> int:
        return int(round(v * 1000))

    def arr(xs):
        return np.array(xs, dtype=np.int64)

    o = (arr([e["tid"] for e in ops]), arr([ns(e["ts"]) for e in ops]), arr([ns(e["ts"] + e["dur"]) for e in ops]))
    for shift_ns, crossing in ((0, False), (-5000, True)):
        r = (arr([e["tid"] for e in rt]), arr([ns(e["ts"]) + shift_ns for e in rt]),
             arr([ns(e["ts"] + e["dur"]) + shift_ns for e in rt]))  # fmt: skip
        n, _, _ = crossing_calls(*r, *o)
        assert (n > 100) == crossing and (n == 0) != crossing, (shift_ns, n)
