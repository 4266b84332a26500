"""Property: traces generated with a known decomposition are analysed to the nanosecond (tests/tracegen.py).

Jobs of 1-8 ranks, CPU/gloo and CUDA/NCCL layouts, random sections, iterations, collectives (types,
payloads, dtypes), stragglers, entry skews, clock offsets between ranks and between a rank's CPU and GPU,
integer or 3-decimal timestamps, relative to ``baseTimeNanoseconds`` or absolute, optional
``ProfilerStep#N`` ranges. The examples are bounded and derandomized so CI is quick and deterministic.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.core import layout
from tests.tracegen import DTYPES, OPS, Coll, Job, Spec, expected, simulate, write

SECTION_NAMES = ("gradient", "denoiser", "forward", "backward", "optimizer")
#: no shrinking unless PNPSCALE_SHRINK=1: a failure on 2 cores would take minutes to shrink
PHASES = tuple(Phase) if os.environ.get("PNPSCALE_SHRINK") == "1" else (Phase.explicit, Phase.generate)
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=PHASES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


@st.composite
def specs(
    draw,
    backend: str | None = None,
    max_world: int = 8,
    max_iterations: int = 3,
    together: bool | None = None,
    asynchronous: bool = False,
) -> Spec:
    """A random job (see :class:`tests.tracegen.Spec`); ``together``: CUDA sections of 2 or more collectives
    run them together, issued in another order on each rank (``None``: drawn per section); ``asynchronous``:
    CUDA sections without a synchronisation at their end, with GPU tails that may run into the next section
    (not with ``together`` sections)."""
    backend = backend or draw(st.sampled_from(["nccl", "gloo"]))
    cuda = backend == "nccl"
    world = draw(st.integers(1, max_world))
    sections = tuple(draw(st.permutations(SECTION_NAMES))[: draw(st.integers(1, 3))])
    iterations = draw(st.integers(1, max_iterations))
    integer = draw(st.booleans())
    u = 1000 if integer else 1

    def dur(lo_us: int, hi_us: int) -> int:
        return draw(st.integers(lo_us * 1000 // u, hi_us * 1000 // u)) * u

    plan = tuple(
        tuple(
            tuple(
                Coll(
                    draw(st.sampled_from(sorted(OPS))),
                    draw(st.integers(1, 1 << 22)),
                    draw(st.sampled_from(sorted(DTYPES))),
                    dur(1, 40),
                )  # fmt: skip
                for _ in range(draw(st.integers(0, 3)))
            )
            for _ in sections
        )
        for _ in range(iterations)
    )
    straggler = draw(st.integers(0, world - 1))
    extra = dur(0, 80)
    work, kernels, gap = [], [], []
    for r in range(world):
        wr, kr, gr = [], [], []
        for i in range(iterations):
            wi, ki, gi = [], [], []
            for s in range(len(sections)):
                # every section starts with compute (>= 1 tick): a zero-length range that starts where the next
                # section starts (integer µs) cannot be placed on either side of it, in any analysis
                segs = [dur(1 if k == 0 else 0, 60) for k in range(len(plan[i][s]) + 1)]
                if r == straggler:
                    segs[draw(st.integers(0, len(segs) - 1))] += extra
                wi.append(tuple(segs))
                ki.append(tuple(0 if w == 0 else draw(st.integers(1, 3)) for w in segs))
                gi.append(dur(0, 20))
            wr.append(tuple(wi))
            kr.append(tuple(ki))
            gr.append(tuple(gi))
        work.append(tuple(wr))
        kernels.append(tuple(kr))
        gap.append(tuple(gr))
    spec = Spec(
        backend=backend,
        world=world,
        sections=sections,
        plan=plan,
        work=tuple(work),
        kernels=tuple(kernels),
        gap=tuple(gap),
        rank_skew_ns=tuple(dur(0, 5_000_000) for _ in range(world)),
        gpu_lag_ns=tuple(dur(0, 2000) if cuda else 0 for _ in range(world)),
        names=draw(st.sampled_from(["dev", "old", "generic"])),
        time_base=draw(st.sampled_from(["base", "absolute"])),
        integer_ts=integer,
        steps=draw(st.booleans()),
        first_step=draw(st.integers(0, 50)),
        memcpy=draw(st.booleans()),
    )
    # drawn last, so that the examples drawn before this existed keep their other values
    orders: tuple = ()
    if cuda and any(len(sec) >= 2 for it in plan for sec in it):
        flags = [[len(sec) >= 2 and (together if together is not None else draw(st.booleans())) for sec in it]
                 for it in plan]  # fmt: skip
        if any(f for it in flags for f in it):
            orders = tuple(
                tuple(
                    tuple(
                        tuple(draw(st.permutations(range(len(sec))))) if flags[i][s] else () for s, sec in enumerate(it)
                    )
                    for i, it in enumerate(plan)
                )
                for _ in range(world)
            )
    tails: tuple = ()
    if cuda and not orders and asynchronous:
        occ = [(i, s) for i in range(iterations) for s in range(len(sections))]
        tails = tuple(
            tuple(
                tuple(
                    # shorter than the next section's first compute segment: it ends before that one's collectives
                    draw(st.integers(0, max(0, spec.work[r][occ[k + 1][0]][occ[k + 1][1]][0] // u - 1))) * u
                    if k + 1 < len(occ)
                    else dur(0, 60)
                    for k in (occ.index((i, s)) for s in range(len(sections)))
                )
                for i in range(iterations)
            )
            for r in range(world)
        )
    return replace(spec, orders=orders, tails=tails)


def analyse(folder: Path, sections: tuple[str, ...]) -> tuple[int, str, Path]:
    """``python -m pnpscale.analyze`` in this process: (exit code, stderr text, output folder)."""
    import contextlib
    import io

    out = folder / "analysis"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(folder), "--sections", ",".join(sections), "--out", str(out), "--jobs", "1"])
    return code, err.getvalue(), out


def results(out: Path) -> tuple[pd.DataFrame, list[dict]]:
    return pd.read_parquet(out / layout.SECTIONS), json.loads((out / ANALYSIS_JSON).read_text())["anomalies"]


def assert_decomposition(job: Job, table: pd.DataFrame, iterations: set[int] | None = None) -> None:
    """Every row of ``table`` equals the generator's C, T, W to a nanosecond's fraction; no row missing."""
    want = expected(job.truth)
    got = {(int(r[K.ITERATION]), str(r[K.SECTION])): r for _, r in table.iterrows()}
    keys = {k for k in want if iterations is None or k[0] in iterations}
    assert set(got) == keys
    for key in keys:
        c, t, w = (v * 1e-9 for v in want[key])
        row = got[key]
        assert (row[K.COMPUTE_S], row[K.TRANSFER_S], row[K.WAIT_S]) == pytest.approx((c, t, w), abs=1e-12), key
        assert row[K.N_COLLECTIVES] == len(job.truth.colls[key]), key


def _analysed(spec: Spec, collectives: bool = False) -> tuple[Job, pd.DataFrame, list[dict], pd.DataFrame | None]:
    """``spec`` simulated, written as traces and analysed (exit 0 required): (job, sections table, anomalies,
    the collectives table when ``collectives``)."""
    job = simulate(spec)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "job"
        write(job, folder)
        code, err, out = analyse(folder, spec.sections)
        assert code == 0, err
        table, anomalies = results(out)
        colls = pd.read_parquet(out / layout.COLLECTIVES) if collectives else None
    return job, table, anomalies, colls


def _no_collectives(spec: Spec) -> bool:
    """Several ranks and not one collective: transfer and wait are unknown (NaN, anomaly ``no_collectives``)."""
    return spec.world > 1 and not any(c for it in spec.plan for sec in it for c in sec)


@PROPERTY
@given(spec=specs())
def test_generated_traces_are_analysed_to_the_nanosecond(spec: Spec) -> None:
    job, table, anomalies, _ = _analysed(spec)
    if _no_collectives(spec):  # transfer and wait unknown: NaN, never 0
        assert [a["kind"] for a in anomalies] == ["no_collectives"]
        assert table[K.TRANSFER_S].isna().all() and table[K.WAIT_S].isna().all()
        table = table.assign(**{K.TRANSFER_S: 0.0, K.WAIT_S: 0.0})
    else:
        assert anomalies == []
    assert_decomposition(job, table)


@settings(PROPERTY, max_examples=8)
@given(spec=specs(backend="nccl", max_world=4, together=True))
def test_collectives_issued_in_another_order_on_each_rank_are_matched_by_type_and_sequence(spec: Spec) -> None:
    """Untyped kernels (``ncclDevKernel_Generic``, ``SendRecv``) of several process groups, in flight together,
    issued in each rank's own order on streams each rank numbers differently: matched by the descriptors'
    (process group, ``Seq``), typed by them, and decomposed to the nanosecond."""
    job, table, anomalies, colls = _analysed(spec, collectives=True)
    assert colls is not None
    if _no_collectives(spec):
        return  # no collective at all: the main property covers it
    assert anomalies == []
    assert_decomposition(job, table)
    for (i, sec), group in colls.groupby([K.ITERATION, K.SECTION]):
        assert group.groupby(K.SEQ)[K.COLLECTIVE].nunique().max() == 1, (i, sec)  # one type per match
        want = sorted([c.op for c in job.truth.colls[(int(i), str(sec))]] * spec.world)
        assert sorted(group[K.COLLECTIVE]) == want, (i, sec)


def test_gpu_work_past_the_next_section_is_clipped_to_a_known_answer() -> None:
    """Asynchronous CUDA sections (no synchronisation at their end) whose last kernel, on another stream, runs
    past the next section's first GPU start (issue 21): each such section is clipped there, named per rank
    (``gpu_work_past_next_section``, as many as the generator clipped), and decomposed to the nanosecond."""
    clipped_in_all: list[int] = []

    @settings(PROPERTY, max_examples=12)
    @given(spec=specs(backend="nccl", max_world=4, together=False, asynchronous=True))
    def prop(spec: Spec) -> None:
        job, table, anomalies, _ = _analysed(spec)
        if _no_collectives(spec):
            anomalies = [a for a in anomalies if a["kind"] != "no_collectives"]
            table = table.assign(**{K.TRANSFER_S: 0.0, K.WAIT_S: 0.0})
        clipped = {a["rank"]: a["count"] for a in anomalies if a["kind"] == "gpu_work_past_next_section"}
        assert {a["kind"] for a in anomalies} <= {"gpu_work_past_next_section"}
        assert clipped == {r: n for r, n in job.truth.clipped.items() if n}
        assert_decomposition(job, table)
        clipped_in_all.append(sum(job.truth.clipped.values()))

    prop()
    assert sum(clipped_in_all) > 0, "no generated job ran GPU work past its next section"
