"""Live torch.profiler session and its events as plain :class:`~pnpscale.analysis.events.Event` records.

One profiler session covers every iteration (``prof.step()`` after each), as recommended for
kernels not to be dropped or shifted between sessions; events are read in process from the
Kineto results (no JSON round trip). Section ranges are ``record_function`` ranges; on CUDA each
section ends with ``torch.cuda.synchronize()`` inside its range so that all GPU work of a section
is launched and finished inside it.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler
from torch._C._profiler import RecordScope
from torch.profiler import ProfilerActivity, profile

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event, Kind, SectionRecord
from pnpscale.analysis.kineto import (
    GPU_CATS,
    RUNTIME_CATS,
    SKIP_CATS,
    UNKNOWN_CORRELATIONS,
    collective_type,
    is_descriptor,
    is_gloo_work,
    payload_bytes,
)
from pnpscale.core import layout
from pnpscale.core.errors import PnpscaleError


def make_profiler(cuda: bool, record_shapes: bool = False, autograd_ranges: bool = False) -> profile:
    """A profiler over CPU (and CUDA when ``cuda``) activity.

    ``record_shapes`` records every operator's input shapes (``profile.record_shapes``); payload bytes
    do not need it: :class:`CollectiveLog` records them from the collective calls themselves, which
    costs nothing per operator (see ``benchmarks/README.md``, profiler overhead).

    ``autograd_ranges`` (off by default) also records the ranges of the autograd nodes themselves
    (``MmBackward0``, ``torch::autograd::AccumulateGrad``: ``RecordScope.BACKWARD_FUNCTION``). Without them
    every other scope is recorded: operators (the backward's included), the engine's
    ``autograd::engine::evaluate_function: <node>`` range around each node (same name, same place),
    ``record_function`` sections, c10d's ``gloo:*``/``nccl:*`` ranges, and on CUDA kernels and runtime
    calls; training's profiler overhead on CPU drops to about that of recording no operator at all
    (``benchmarks/README.md``). What the decomposition reads is kept: a node range lies inside its
    ``evaluate_function`` range and encloses the same operators, so the compute spans
    (:func:`pnpscale.analysis.overlap.compute_spans`, :func:`~pnpscale.analysis.overlap.communicating`) are
    the same, but where that ``evaluate_function`` range also issues a collective outside the node (from a
    gradient hook, as DDP's): the node's own time outside its operators (engine bookkeeping, microseconds)
    then counts as waiting, not compute. A trace viewer shows one range less per backward node.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if autograd_ranges:
        return profile(activities=activities, record_shapes=record_shapes)
    return _ScopedProfile(
        _ALL_SCOPES - {RecordScope.BACKWARD_FUNCTION}, activities=activities, record_shapes=record_shapes
    )


_ALL_SCOPES = frozenset(RecordScope.__members__.values())


class _ScopedProfile(profile):
    """``torch.profiler.profile`` whose sessions record only the ``RecordFunction`` scopes given.

    torch's ``_enable_profiler(config, activities, scopes)`` takes the scopes, but ``torch.profiler``
    calls it without (all scopes): while this profiler starts a session, ``torch.autograd.profiler``'s
    reference to it is replaced by one that passes ``scopes``, then restored.
    """

    def __init__(self, scopes: frozenset[RecordScope], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._scopes = set(scopes)

    def start_trace(self) -> None:
        enable = autograd_profiler._enable_profiler
        scopes = self._scopes
        # the binding takes ``scopes`` (its signature in ``_enable_profiler.__doc__``); torch's stub omits it
        autograd_profiler._enable_profiler = lambda config, activities: enable(config, activities, scopes)  # type: ignore[call-arg]
        try:
            super().start_trace()
        finally:
            autograd_profiler._enable_profiler = enable


#: torch.distributed collectives whose calls :class:`CollectiveLog` records: name -> (position, keyword) of
#: the tensor (or list of tensors: their bytes summed) whose bytes are the payload (the one a
#: ``gloo:*``/``nccl:*`` range's first input shape gives with ``record_shapes``: the local input; for
#: the list-form ``reduce_scatter`` ProcessGroupNCCL records the list flattened into one input), ``None``
#: for no tensor (barrier). Every collective the solver issues is one of these: deepinv's
#: ``DistributedContext`` (all_reduce, broadcast, all_gather, the object collectives, which c10d runs
#: as all_gather/broadcast), and ``torch.distributed.nn``'s autograd-aware all_gather, whose backward is
#: a list-form ``reduce_scatter`` on NCCL and ``scatter`` calls on gloo.
COLLECTIVE_CALLS: dict[str, tuple[int, str] | None] = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "input"),
    "reduce_scatter_single": (1, "input"),
    "all_to_all": (1, "input_tensor_list"),
    "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"),
    "scatter": (0, "tensor"),
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
    "isend": (0, "tensor"),
    "irecv": (0, "tensor"),
    "barrier": None,
}


def call_payload(value: Any) -> int | None:
    """Bytes of a collective's payload argument: a tensor, or a list/tuple of tensors (summed).

    >>> call_payload(torch.zeros(3, 4)), call_payload([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    (48, 24)
    >>> call_payload(None) is None, call_payload([]) is None
    (True, True)
    """
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return sum(t.numel() * t.element_size() for t in value)
    return None


_record_operators = torch._C._autograd._enable_record_function  # this thread's RecordFunction switch


class UnloggedCollectives(PnpscaleError, RuntimeError):
    """A collective ran without passing through the functions :class:`CollectiveLog` wraps, while operators were
    recorded only around those (``profile.operators=collectives``): its time would have been missed."""


class CollectiveLog:
    """Records every torch.distributed collective call made while it is active: (collective, payload bytes).

    ``with CollectiveLog() as log:`` wraps the functions of :data:`COLLECTIVE_CALLS` in
    ``torch.distributed`` (deepinv and ``torch.distributed.nn`` call them through that module) and in
    ``torch.distributed.distributed_c10d`` (where c10d's own helpers find them: ``all_gather_object``
    runs two ``all_gather``, ``broadcast_object_list`` two ``broadcast``), and restores both on exit.
    A call made inside another recorded call on the same thread (``send`` runs ``isend``) counts once,
    as the innermost: the one that reaches the process group and gets a profiler range. Calls from any
    thread are recorded (the autograd engine runs CUDA backward passes on its own threads).
    ``log.calls`` lists ``(collective, bytes)`` in call order (``collective`` as
    :func:`pnpscale.analysis.kineto.collective_type` names it; bytes ``None`` for barrier).
    :func:`attach_payloads` gives them to the profiler's ``gloo:*``/``nccl:*`` ranges, so that payload
    bytes need no ``record_shapes``.

    **Operators only where the decomposition reads them** (``gate=True``, ``profile.operators=collectives``, CPU
    ranks): inside :meth:`section`, the thread's ``RecordFunction`` is off (torch's thread-local switch,
    ``torch._C._autograd._enable_record_function``; the autograd engine runs a CPU backward on the calling thread
    with the same switch) except during each collective call, and from the first asynchronous one (a call that
    returns a ``Work``: ``async_op=True``, ``isend``/``irecv``) to the end of the section. The section range, the
    ``c10d::`` calls with what runs inside them, and c10d's ``gloo:*`` work ranges are recorded as before. That
    is all the CPU decomposition reads (:mod:`pnpscale.analysis.overlap`): a rank is blocked only while a
    collective is in flight, and in flight only from its ``c10d::`` call on; where every collective in flight was
    issued synchronously the thread is inside the call, computing nothing, so operators elsewhere change no number.
    A synchronous call is made as ``async_op=True`` followed by ``Work.wait()`` and, since gloo's worker closes
    its range just after the waiting thread resumes (``Work::finish`` sets ``completed_`` and runs the range's
    end callback under one lock, after the future the thread waits on was completed), a yield until
    ``Work.is_completed()``: the range is closed before the thread computes again, so no compute goes unseen
    inside it (the thread stays in the call those microseconds, under load up to the worker's scheduling
    delay). What is lost: the compute operators themselves (a trace viewer shows the sections, the collectives
    and nothing between them; ``profile.export_traces`` keeps them unless ``operators=collectives`` is asked).
    A collective that reaches a process group without these functions (``ProcessGroup.allreduce`` called
    directly, a C++ comm hook) would go unseen; :meth:`check_complete` compares each group's sequence number
    with the calls logged and refuses the run.
    """

    def __init__(self, gate: bool = False) -> None:
        self._entries: list[list[Any]] = []  # [collective, bytes, kept, process group name]
        self._saved: list[tuple[Any, str, object]] = []
        self._local = threading.local()
        self._gate = gate
        self._seq: dict[str, int] = {}

    @property
    def gated(self) -> bool:
        """Operators are recorded only around collectives inside :meth:`section` (``gate=True``)."""
        return self._gate

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A ``record_function(name)`` range; with :attr:`gated`, operators inside it only where the decomposition
        reads them (the class's docstring). The thread's ``RecordFunction`` switch is on again on exit."""
        from torch.profiler import record_function

        if not self._gate:
            with record_function(name):
                yield
            return
        local = self._local
        with record_function(name):
            local.gated, local.depth = True, 0
            _record_operators(False)
            try:
                yield
            finally:
                local.gated = False
                _record_operators(True)

    @property
    def calls(self) -> list[tuple[str, int | None]]:
        return [(c, b) for c, b, kept, _ in self._entries if kept]

    @property
    def groups(self) -> list[str | None]:
        """The process group name of each of :attr:`calls` (``ProcessGroup.group_name``: ``"0"`` the default
        group, as Kineto's ``pg_config`` names it), ``None`` where it could not be read."""
        return [g for _, _, kept, g in self._entries if kept]

    def __enter__(self) -> CollectiveLog:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._seq = _sequence_numbers()
        wrapped: dict[int, Any] = {}
        for name, where in COLLECTIVE_CALLS.items():
            for module in (dist, c10d):
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                if id(fn) not in wrapped:
                    wrapped[id(fn)] = self._wrap(fn, collective_type(name) or name, where)
                self._saved.append((module, name, fn))
                setattr(module, name, wrapped[id(fn)])
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()
        if self._gate:
            _record_operators(True)

    def check_complete(self, rank: int | None = None) -> None:
        """Refuse a gated session in which a collective bypassed the log (the class's docstring).

        Per process group: the collectives it ran since the log was entered (``ProcessGroup``'s sequence number,
        which c10d advances by one per collective, barrier and point-to-point call included) against the
        calls logged on it. Nothing to check without ``gate``, or where a backend keeps no sequence number.

        Raises:
            UnloggedCollectives: naming the rank, the group and both counts.
        """
        if not self._gate:
            return
        ran = {g: n - self._seq.get(g, 0) for g, n in _sequence_numbers().items()}
        logged: dict[str | None, int] = {}
        for g in self.groups:
            logged[g] = logged.get(g, 0) + 1
        if None in logged:  # a call whose group could not be named: compare the totals
            ran, logged = {"every group": sum(ran.values())}, {"every group": sum(logged.values())}
        for g, n in ran.items():
            if n != logged.get(g, 0):
                raise UnloggedCollectives(
                    f"rank {rank}: process group {g!r} ran {n} collective(s), {logged.get(g, 0)} through "
                    "torch.distributed's functions: operators were recorded only around those "
                    "(profile.operators=collectives); profile with profile.operators=all"
                )

    def _wrap(self, fn: Any, collective: str, where: tuple[int, str] | None) -> Any:
        entries, local, gate = self._entries, self._local, self._gate
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        at = params.index("group") if "group" in params else None  # the group argument's position
        async_at = params.index("async_op") if "async_op" in params else None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            size = None
            if where is not None:
                size = call_payload(args[where[0]] if len(args) > where[0] else kwargs.get(where[1]))
            group = args[at] if at is not None and len(args) > at else kwargs.get("group")
            entry = [collective, size, True, group_name(group)]
            entries.append(entry)
            made = getattr(local, "made", 0) + 1  # calls recorded on this thread so far
            local.made = made
            try:
                if gate and getattr(local, "gated", False):
                    return _gated_call(fn, args, kwargs, async_at, local)
                return fn(*args, **kwargs)
            finally:
                if local.made > made:  # an inner recorded call ran the collective: count that one
                    entry[2] = False

        return call


def _gated_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], async_at: int | None, local: Any) -> Any:
    """``fn(*args, **kwargs)`` with the thread's operators recorded (:class:`CollectiveLog`, gated): a synchronous
    call as ``async_op=True``, ``wait()`` and a yield until its work (and so its profiler range) is complete; an
    asynchronous one leaves operators recorded until the section ends."""
    import os

    local.depth += 1
    _record_operators(True)
    opened = False
    try:
        if async_at is None:  # no async_op: barrier-like or point-to-point; a Work back means in flight
            out = fn(*args, **kwargs)
            opened = out is not None and hasattr(out, "wait")
            return out
        if len(args) > async_at:
            asked = bool(args[async_at])
        else:
            asked = bool(kwargs.get("async_op", False))
        if asked:
            out = fn(*args, **kwargs)
            opened = out is not None
            return out
        if len(args) > async_at:
            args = (*args[:async_at], True, *args[async_at + 1 :])
        else:
            kwargs = {**kwargs, "async_op": True}
        work = fn(*args, **kwargs)
        if work is not None:  # None: not a member of the group, or inside a coalescing manager
            work.wait()
            while not work.is_completed():
                os.sched_yield()
        return None
    finally:
        local.depth -= 1
        if opened:
            local.gated = False  # recorded until the section ends
        elif local.gated and local.depth == 0:
            _record_operators(False)


def _sequence_numbers() -> dict[str, int]:
    """``group_name -> sequence number`` of every process group of this process that keeps one (``{}`` without
    torch.distributed, or before ``init_process_group``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    from torch.distributed.distributed_c10d import _world

    out: dict[str, int] = {}
    for pg, name in list(_world.pg_names.items()):
        try:
            out[str(name)] = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError, NotImplementedError):
            continue
    return out


def group_name(group: Any) -> str | None:
    """Name of a collective call's process group (``None``: the default group), ``None`` when it has none."""
    import torch.distributed as dist

    try:
        g = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        name = getattr(g, "group_name", None) if g is not None else None
    except (RuntimeError, AttributeError, ValueError):
        return None
    return name if isinstance(name, str) else None


def attach_groups(events: list[Event], calls: list[tuple[str, int | None]], groups: list[str | None]) -> list[Event]:
    """Give each collective CPU range (``gloo:*``, ``nccl:*``) without a group its call's process group.

    Paired as :func:`attach_payloads` pairs (per collective type, the k-th range by start is the k-th call),
    over every range of the type; where the counts of a type differ its ranges keep no group (NA in
    ``collectives.parquet``).

    >>> from pnpscale.analysis.events import Event, Kind
    >>> evs = [Event("gloo:all_reduce", Kind.CPU, 5, 9, collective="all_reduce"),
    ...        Event("gloo:broadcast", Kind.CPU, 1, 3, collective="broadcast")]
    >>> [e.group for e in attach_groups(evs, [("broadcast", 8), ("all_reduce", 4)], ["0", "1"])]
    ['1', '0']
    """
    from dataclasses import replace

    by_type: dict[str, list[int]] = {}
    for i, e in enumerate(events):
        if e.kind is Kind.CPU and e.collective is not None and _is_comm(e.name):
            by_type.setdefault(e.collective, []).append(i)
    named: dict[str, list[str | None]] = {}
    for (coll, _), g in zip(calls, groups, strict=True):
        named.setdefault(coll, []).append(g)
    out = list(events)
    for coll, idx in by_type.items():
        got = named.get(coll, [])
        if len(got) != len(idx):
            continue
        for i, g in zip(sorted(idx, key=lambda j: (events[j].start_ns, j)), got, strict=True):
            if out[i].group is None:
                out[i] = replace(out[i], group=g)
    return out


def attach_payloads(
    events: list[Event], calls: list[tuple[str, int | None]], anomalies: Anomalies, rank: int | None = None
) -> list[Event]:
    """Give each collective CPU range (``gloo:*``, ``nccl:*``) without payload the bytes of its call.

    Per collective type, the k-th range by start time is the k-th call of :class:`CollectiveLog`
    (a process group runs its collectives in issue order). Where the counts of a type differ, its
    ranges keep an unknown payload and ``payload_unmatched`` is recorded in ``anomalies``.

    >>> from pnpscale.analysis.events import Event, Kind
    >>> evs = [Event("gloo:all_reduce", Kind.CPU, 5, 9, tid=2, collective="all_reduce"),
    ...        Event("gloo:all_reduce", Kind.CPU, 1, 3, tid=3, collective="all_reduce")]
    >>> [e.payload_bytes for e in attach_payloads(evs, [("all_reduce", 40), ("all_reduce", 80)], Anomalies())]
    [80, 40]
    """
    from dataclasses import replace

    by_type: dict[str, list[int]] = {}
    for i, e in enumerate(events):
        if e.kind is Kind.CPU and e.collective is not None and e.payload_bytes is None and _is_comm(e.name):
            by_type.setdefault(e.collective, []).append(i)
    sizes: dict[str, list[int | None]] = {}
    for coll, size in calls:
        sizes.setdefault(coll, []).append(size)
    out = list(events)
    for coll, idx in by_type.items():
        got = sizes.get(coll, [])
        if len(got) != len(idx):
            anomalies.add(
                "payload_unmatched",
                rank,
                f"{len(idx)} {coll} range(s) in the profile, {len(got)} torch.distributed {coll} call(s): "
                "payload unknown",
            )
            continue
        for i, size in zip(sorted(idx, key=lambda j: (events[j].start_ns, j)), got, strict=True):
            out[i] = replace(events[i], payload_bytes=size)
    return out


def _is_comm(name: str) -> bool:
    return is_gloo_work(name) or (is_descriptor(name) and name != "record_param_comms")


def profiler_events(
    prof: profile,
    anomalies: Anomalies | None = None,
    rank: int | None = None,
    calls: list[tuple[str, int | None]] | None = None,
    groups: list[str | None] | None = None,
) -> list[Event]:
    """Convert a finished profiler session's Kineto events to :class:`Event` records.

    The same rules as the offline reader (:func:`pnpscale.analysis.trace.read.read_trace`): a GPU event
    whose correlation id has no runtime launch in the session ran before the profiler started and
    is dropped; correlation 0 means unknown (the event is placed by its GPU start); a negative
    duration marks the event ``bad``. Each is recorded in ``anomalies`` under ``rank``. Payload bytes
    of collective ranges come from their input shapes (``record_shapes``), else from ``calls``
    (:class:`CollectiveLog`, :func:`attach_payloads`); their process group from ``groups`` (aligned with
    ``calls``: :attr:`CollectiveLog.groups`, :func:`attach_groups`).

    Raises:
        RuntimeError: the profiler has no results (it was not run).
    """
    results = getattr(prof.profiler, "kineto_results", None) if prof.profiler else None
    if results is None:
        raise RuntimeError("the profiler has no results: was the profiling context exited?")
    anomalies = anomalies if anomalies is not None else Anomalies()
    raw = list(results.events())
    runtime_start: dict[int, int] = {}
    for e in raw:
        if e.activity_type() in RUNTIME_CATS:
            runtime_start[e.correlation_id()] = e.start_ns()
    out: list[Event] = []
    for e in raw:
        act = e.activity_type()
        if act in SKIP_CATS:
            continue
        start = int(e.start_ns())
        dur = int(e.duration_ns())
        end = start + max(dur, 0)
        bad = f"negative dur {dur} ns" if dur < 0 else None
        name = e.name()
        if act in GPU_CATS or str(e.device_type()) == "DeviceType.CUDA":
            corr = int(e.correlation_id())
            launch = runtime_start.get(corr)
            what = f"{name.split('(')[0]} at {start} ns, correlation {corr}"
            if launch is None and runtime_start and corr not in UNKNOWN_CORRELATIONS:
                anomalies.add("gpu_event_outside_window", rank, what)
                continue
            if launch is None:
                anomalies.add("launch_unknown_by_start", rank, what)
            out.append(
                Event(
                    name,
                    Kind.GPU,
                    start,
                    end,
                    tid=int(e.device_resource_id()),
                    correlation=corr,
                    launch_ns=launch,
                    bad=bad,
                )
            )
        elif act in RUNTIME_CATS:
            out.append(
                Event(name, Kind.RUNTIME, start, end, tid=int(e.start_thread_id()), correlation=int(e.correlation_id()))
            )
        else:
            is_comm = _is_comm(name)
            out.append(
                Event(
                    name,
                    Kind.OP if act == "cpu_op" and not is_comm else Kind.CPU,
                    start,
                    end,
                    tid=int(e.start_thread_id()),
                    payload_bytes=payload_bytes(e.shapes(), e.dtypes()) if is_comm else None,
                    collective=collective_type(name) if is_comm else None,
                    bad=bad,
                )
            )
    if calls is None:
        return out
    out = attach_payloads(out, calls, anomalies, rank)
    return attach_groups(out, calls, groups) if groups is not None else out


class IncompleteTrace(PnpscaleError, RuntimeError):
    """The profiler did not record every iteration (see :func:`check_trace_complete`)."""


_TRACE_ADVICE = (
    "the profiler stopped recording (a full CUPTI activity buffer stops the trace at some prof.step()): run fewer "
    "iterations or a smaller problem per run, set record_shapes only where needed, and read Kineto's messages in "
    "this rank's stderr"
)


def check_trace_complete(
    records: Sequence[SectionRecord], sections: Sequence[str], expected: int, cuda: bool, rank: int
) -> None:
    """Refuse a trace that lost iterations: each section must occur ``expected`` times
    (``warmup + iterations``), and on CUDA every occurrence must have GPU work when any has.

    Args:
        records: one rank's section records (:func:`pnpscale.analysis.section.records.section_records`).
        sections: the section names. expected: occurrences per section. cuda: the rank ran on CUDA.
        rank: for messages.

    Raises:
        IncompleteTrace: naming rank, section and the first missing iteration, with advice.
    """
    for name in sections:
        occ = sorted((r for r in records if r.section == name), key=lambda r: r.iteration)
        if len(occ) != expected:
            raise IncompleteTrace(
                f"rank {rank}: section {name!r} recorded {len(occ)} time(s), expected {expected} "
                f"(warmup + iterations): {_TRACE_ADVICE}"
            )
        if cuda and any(r.gpu_span_s is not None for r in occ):
            empty = [r.iteration for r in occ if r.gpu_span_s is None]
            if empty:
                raise IncompleteTrace(
                    f"rank {rank}: section {name!r} has no GPU event from iteration {empty[0]} on "
                    f"({len(empty)} of {expected} occurrence(s) without GPU work): {_TRACE_ADVICE}"
                )


def export_trace(prof: profile, path: Path) -> None:
    """Write the Kineto trace (Chrome/Perfetto/HTA-readable JSON) atomically to ``path``."""

    with layout.atomic_path(path) as tmp:
        prof.export_chrome_trace(str(tmp))


class PeakMemory:
    """Peak memory of this process over a section, in bytes.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, and beside it the
    highest ``max_memory_reserved`` of any section (:attr:`reserved_max`: what the caching allocator
    held, the memory the GPU must have). CPU: the resident-set high-water mark (``VmHWM``), reset
    through ``/proc/self/clear_refs`` (Linux); where it cannot be reset the value is the process's
    peak so far (``ru_maxrss``); :attr:`reserved_max` stays ``None``.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.resettable = self.cuda or _clear_refs()
        self.reserved_max: int | None = None

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _clear_refs()

    def peak_bytes(self) -> int:
        if self.cuda:
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            self.reserved_max = max(self.reserved_max or 0, reserved)
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _vm_hwm_bytes()
        if hwm is not None:
            return hwm
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    @contextmanager
    def track(self) -> Iterator[list[int]]:
        """``with peak.track() as box: ...`` leaves the peak in ``box[0]``."""
        box: list[int] = [0]
        self.reset()
        try:
            yield box
        finally:
            box[0] = self.peak_bytes()


def _clear_refs() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
