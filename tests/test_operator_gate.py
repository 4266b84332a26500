"""Operators recorded only around collectives (``profile.operators=collectives``, CPU ranks): what a gated
session records on real gloo ranks, a bypassing collective refused, and the decomposition of a trace unchanged
when the operators the gate leaves out are dropped from it (property test over generated sections)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pnpscale.analysis.events import Event, Kind
from pnpscale.analysis.section.records import section_records
from pnpscale.core.config import resolve_spec
from pnpscale.rank.loop import gated_operators
from pnpscale.sweep.cli import compose_config
from tests.helpers import free_port

US = 1_000  # ns


# --- which runs are gated ------------------------------------------------------------------------


def test_auto_gates_cpu_ranks_unless_traces_are_exported():
    spec = resolve_spec(compose_config(["scale=tiny"]), cuda_available=False)
    assert spec.operators == "auto" and gated_operators(spec.operators, cuda=False, export_traces=False)
    assert not gated_operators("auto", cuda=False, export_traces=True)
    assert not gated_operators("collectives", cuda=True, export_traces=False)  # CUDA: every operator
    assert gated_operators("collectives", cuda=False, export_traces=True)
    assert not gated_operators("all", cuda=False, export_traces=False)
    with pytest.raises(ValueError, match="profile.operators='some'.*auto, collectives, all"):
        gated_operators("some", cuda=False, export_traces=False)


def test_a_bad_operators_value_is_refused_with_the_allowed_ones():
    from pnpscale.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"profile\.operators=every.*auto, collectives, all"):
        resolve_spec(compose_config(["scale=tiny", "profile.operators=every"]), cuda_available=False)


# --- a gated session on two gloo ranks -----------------------------------------------------------


def _gated_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn

    from pnpscale.rank.profiling import CollectiveLog, UnloggedCollectives, make_profiler, profiler_events

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.randn(32, 32, requires_grad=True)
    t = torch.ones(256)
    with make_profiler(cuda=False) as prof, CollectiveLog(gate=True) as log:
        with log.section("sync"):
            torch.mm(x, x)  # before any collective: not recorded
            dist.all_reduce(t)  # a synchronous call: recorded, and its range closed before it returns
            torch.sin(x)
            dist.all_gather_object([None] * world, rank)  # two all_gathers inside one call
        with log.section("async"):
            torch.cos(x)
            work = dist.all_reduce(t, async_op=True)
            torch.tan(x)  # in flight: recorded from the issue on
            work.wait()
            torch.exp(x)
        torch.sqrt(x.detach().abs())  # outside sections: recorded as before
        with log.section("backward"):
            y = dnn.all_reduce(x * 2).sum()  # an autograd-aware collective
            y.backward()  # its backward all_reduce runs on this thread, recorded; the backward's compute not
        prof.step()
        log.check_complete(rank)
    events = [(e.name, e.start_ns, e.end_ns, e.tid) for e in profiler_events(prof) if e.kind in (Kind.OP, Kind.CPU)]
    with make_profiler(cuda=False) as again:  # the thread's switch is on again: a plain session records all
        torch.mm(x, x)
    plain = [e.name for e in profiler_events(again)]
    refused = ""
    with make_profiler(cuda=False), CollectiveLog(gate=True) as log:
        with log.section("bypass"):
            dist.distributed_c10d._get_default_group().allreduce([t]).wait()  # not through torch.distributed's API
        try:
            log.check_complete(rank)
        except UnloggedCollectives as e:
            refused = str(e)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"events": events, "plain": plain, "refused": refused}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gated_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("gate")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_gated_rank, args=(2, free_port(), str(d)), nprocs=2, start_method="fork")
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]


def _within(events, section):
    (lo, hi) = [(a, b) for n, a, b, _ in events if n == section][0]
    return [n for n, a, b, _ in events if lo <= a and b <= hi and n != section]


@pytest.mark.slow  # the first profiler session of a process starts Kineto (seconds)
def test_a_gated_session_records_collectives_sections_and_what_runs_in_flight(gated_ranks):
    for rank in gated_ranks:
        ev = rank["events"]
        sync = _within(ev, "sync")
        assert "aten::mm" not in sync and "aten::sin" not in sync
        assert sync.count("c10d::allreduce_") == 1 and sync.count("gloo:all_reduce") == 1
        assert sync.count("c10d::allgather_") == 2 and sync.count("gloo:all_gather") == 2
        asyn = _within(ev, "async")
        assert "aten::cos" not in asyn and {"c10d::allreduce_", "aten::tan", "aten::exp"} <= set(asyn)
        assert "aten::sqrt" in [n for n, *_ in ev]
        bwd = _within(ev, "backward")
        assert bwd.count("c10d::allreduce_") == 2 and bwd.count("gloo:all_reduce") == 2  # forward and backward
        assert not {"aten::mul", "aten::sum", "aten::ones_like"} & set(bwd)
        assert "aten::mm" in rank["plain"]
        assert "process group '0' ran 1 collective(s), 0 through torch.distributed's functions" in rank["refused"]
        assert "profile.operators=all" in rank["refused"]


@pytest.mark.slow
def test_a_synchronous_calls_range_closes_inside_its_call(gated_ranks):
    """The yield until ``Work.is_completed()``: each sync gloo range ends before the next recorded event of the
    section thread starts (the second all_gather's c10d call after the first's range, the section's end)."""
    for rank in gated_ranks:
        ev = rank["events"]
        (tid,) = {t for n, *_, t in ev if n == "sync"}
        (lo, hi) = [(a, b) for n, a, b, _ in ev if n == "sync"][0]
        works = sorted((a, b) for n, a, b, _ in ev if n.startswith("gloo:") and lo <= a <= hi)
        calls = sorted(a for n, a, b, t in ev if n.startswith("c10d::") and t == tid and lo <= a <= hi)
        assert len(works) == len(calls) == 3
        for (_, end), nxt in zip(works, [*calls[1:], hi], strict=True):
            assert end <= nxt


# --- the decomposition does not read what the gate leaves out ------------------------------------


@st.composite
def gloo_sections(draw):
    """One rank's section of compute operators and collectives as gloo records them: a synchronous one is its
    ``c10d::`` call (the enqueue), then the thread inside the call without an operator until the work's range
    ends (closed before the call returns); an asynchronous one returns after its call, the thread computes,
    and a later wait (or none: still in flight at the section's end). Returns (events, ops the gate records)."""
    t, tid = 0, 1
    ops, works, kept = [], [], []
    pending: list[int] = []  # ends of async works not waited for
    opened = False
    for k in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["compute", "compute", "sync", "async", "wait"]))
        if kind == "compute":
            d = draw(st.integers(1, 400)) * US
            ops.append(Event("aten::mm", Kind.OP, t, t + d, tid=tid))
            if opened:
                kept.append(ops[-1])
            t += d + draw(st.integers(0, 20)) * US
        elif kind in ("sync", "async"):
            call = draw(st.integers(1, 30)) * US
            c10d = Event("c10d::allreduce_", Kind.OP, t, t + call, tid=tid)
            ops.append(c10d)
            kept.append(c10d)
            lo = t + draw(st.integers(0, call // US)) * US
            end = lo + draw(st.integers(1, 600)) * US
            end = max(end, t + call)
            works.append(Event("gloo:all_reduce", Kind.CPU, lo, end, tid=90 + k, collective="all_reduce"))
            if kind == "sync":
                t = end + draw(st.integers(0, 10)) * US
            else:
                opened = True
                pending.append(works[-1].end_ns)
                t += call + draw(st.integers(0, 10)) * US
        elif pending:  # wait for the oldest in flight
            t = max(t, pending.pop(0)) + draw(st.integers(0, 10)) * US
    section = Event("s", Kind.CPU, 0, t + draw(st.integers(1, 50)) * US, tid=tid)
    return [section, *works, *ops], [section, *works, *kept]


def _decomposition(evs):
    (rec,) = section_records(evs, ["s"])
    return asdict(rec)


@settings(max_examples=300, deadline=None)
@given(gloo_sections())
def test_dropping_the_operators_the_gate_leaves_out_changes_nothing(case):
    full, gated = case
    assert _decomposition(gated) == _decomposition(full)


def test_a_range_closed_after_the_thread_resumed_would_hide_compute_from_the_gate():
    """Why a gated synchronous call yields until its work is complete: where gloo closes the range after the
    thread resumed computing (0.1-19 ms under load), the full trace sees the compute inside the range (hidden),
    a gated one would not: the decomposition differs."""
    s = Event("s", Kind.CPU, 0, 1000 * US, tid=1)
    call = Event("c10d::allreduce_", Kind.OP, 100 * US, 110 * US, tid=1)
    work = Event("gloo:all_reduce", Kind.CPU, 105 * US, 450 * US, tid=90, collective="all_reduce")
    mm = Event("aten::mm", Kind.OP, 400 * US, 900 * US, tid=1)  # resumed at 400 us, the range closed at 450 us
    full, gated = _decomposition([s, work, call, mm]), _decomposition([s, work, call])
    assert full["collectives"][0]["hidden_s"] == pytest.approx(50e-6)
    assert gated["collectives"][0]["hidden_s"] == 0 and full != gated
