"""From what a pass collected to the kept events: duplicates dropped, the runtime clock aligned, GPU events
checked (:mod:`pnpscale.analysis.gpu_checks`) and reduced to the ones a section needs.

:func:`collected_events` is the second half of :func:`pnpscale.analysis.trace.read.read_trace`; the
anomalies it records are listed there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event, Kind
from pnpscale.analysis.gpu_checks import (
    BEFORE_LAUNCH,
    OUTSIDE_WINDOW,
    STREAM_OVERLAP,
    TS_UNSET,
    WINDOW_SLACK_NS,
    gpu_faults,
    nearest_zero,
    resolution_ns,
    runtime_offset,
)
from pnpscale.analysis.kineto import (
    COLLECTIVE_WORDS,
    PARAM_COMMS,
    UNKNOWN_CORRELATIONS,
    is_gloo_work,
    is_named_descriptor,
    kernel_label,
    step_number,
)
from pnpscale.analysis.overlap import C10D_PREFIX, union
from pnpscale.analysis.trace.collect import Collector, merge_descriptors
from pnpscale.analysis.trace.files import TraceError


def collected_events(
    col: Collector, base_ns: int, anomalies: Anomalies | None = None, rank: int | None = None
) -> list[Event]:
    """The kept events, shifted by ``base_ns`` (0 for absolute traces); anomalies recorded (:func:`read_trace`).

    Raises:
        TraceError: section ranges of more than one process, or collective kernels of more than one
            device, in the file (one trace per rank is expected).
    """
    import numpy as np

    anomalies = anomalies if anomalies is not None else Anomalies()
    if len(col.section_pids) > 1:
        pids = ", ".join(f"pid {p} ({n} ranges)" for p, n in sorted(col.section_pids.items()))
        raise TraceError(f"{col.path}: section ranges of {len(col.section_pids)} processes in one file ({pids}): "
                         f"pnpscale reads one trace per rank; split the file by process")  # fmt: skip
    devices = Counter(n[7] for n in col.nccl)
    if len(devices) > 1:
        devs = ", ".join(f"device {d} ({n} kernels)" for d, n in sorted(devices.items()))
        raise TraceError(f"{col.path}: collective kernels of {len(devices)} devices in one file ({devs}): more "
                         f"than one rank in one trace; pnpscale reads one trace per rank")  # fmt: skip
    if col.no_ts:
        anomalies.add("event_without_ts", rank, col.no_ts[0], len(col.no_ts))
    if col.unknown_categories:
        cats = ", ".join(f"{c!r} ({n})" for c, n in col.unknown_categories.most_common())
        anomalies.add("unknown_category", rank, cats, sum(col.unknown_categories.values()))
    _dedupe(col, anomalies, rank)
    _drop_open_step(col, anomalies, rank)
    rt_corr = np.frombuffer(col.rt_corr, dtype=np.int64) if len(col.rt_corr) else np.zeros(0, np.int64)
    rt_start = np.frombuffer(col.rt_start, dtype=np.int64) if len(col.rt_start) else np.zeros(0, np.int64)
    order = np.argsort(rt_corr, kind="stable")
    rt_corr, rt_start = rt_corr[order], rt_start[order].copy()
    unknown = np.array(sorted(UNKNOWN_CORRELATIONS), dtype=np.int64)

    def launch_of(corr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(launch start or -1, outside the window): a correlation without runtime event is outside
        the profiled window when the trace has runtime events; 0/-1 mean unknown."""
        if not len(rt_corr):
            return np.full(len(corr), -1, dtype=np.int64), np.zeros(len(corr), dtype=bool)
        idx = np.searchsorted(rt_corr, corr)
        idx_c = np.minimum(idx, len(rt_corr) - 1)
        known = ~np.isin(corr, unknown)
        found = (idx < len(rt_corr)) & (rt_corr[idx_c] == corr) & known
        return np.where(found, rt_start[idx_c], -1), known & ~found

    rt_start += _clock_offset(col, launch_of, anomalies, rank)
    col.missing_gpu, col.copies_without_gpu = _launches_without_gpu_event(col, rt_corr, rt_start, order, base_ns)

    def shift(e: Event) -> Event:
        if not base_ns:  # absolute timestamps (no baseTimeNanoseconds): nothing to move
            return e
        return replace(e, start_ns=e.start_ns + base_ns, end_ns=e.end_ns + base_ns)

    out = [shift(e) for e in col.sections]
    out += [shift(e) for e in merge_descriptors(col.cpu)]
    out += _ops(col, base_ns)
    outside: list[tuple[int, str]] = []  # (GPU start, text): GPU events whose correlation matches no launch
    faults = _faults(col, launch_of)
    nccl_faults = faults[len(col.gpu_start) :]
    if col.nccl:
        launches, away = launch_of(np.array([n[4] for n in col.nccl], dtype=np.int64))
        for (name, start, end, stream, corr, fields, bad, _), launch, gone, fault in zip(
            col.nccl, launches, away, nccl_faults, strict=True
        ):
            if gone:
                outside.append((start, f"{kernel_label(name)} at ts {start} ns, correlation {corr}"))
                continue
            bad = bad or fault
            out.append(
                Event(
                    name,
                    Kind.GPU,
                    start + base_ns,
                    (start if bad else end) + base_ns,
                    tid=stream,
                    correlation=corr,
                    launch_ns=None if launch < 0 else int(launch) + base_ns,
                    bad=bad,
                    **fields,
                )
            )
    for e in col.bad_gpu:
        launch, gone = launch_of(np.array([e.correlation], dtype=np.int64))
        if not gone[0]:
            out.append(shift(replace(e, launch_ns=None if launch[0] < 0 else int(launch[0]) + base_ns)))
        else:
            outside.append((e.start_ns, f"{kernel_label(e.name)} at ts {e.start_ns} ns, correlation {e.correlation}"))
    out += _gpu_representatives(col, launch_of, base_ns, outside, anomalies, rank, faults[: len(col.gpu_start)])
    lead = int(col.before_launch[0]) if col.before_launch_count else 0
    col.orphan_gpu = _unmatched_gpu_events(outside, rt_start, lead, base_ns, anomalies, rank)
    if col.overlap_count:
        anomalies.add("stream_overlap", rank, col.overlaps[0], col.overlap_count)
    if col.names:
        counts = np.bincount(np.frombuffer(col.gpu_name, dtype=np.int64), minlength=len(col.names))
        hits = [(name, int(counts[i])) for name, i in col.names.items() if COLLECTIVE_WORDS.search(name)]
        if hits:
            text = ", ".join(f"{kernel_label(n)!r} ({c})" for n, c in hits[:5])
            anomalies.add("collective_kernel_unrecognised", rank, text, sum(c for _, c in hits))
    if col.before_launch_count:
        lead, example = col.before_launch
        anomalies.add("gpu_before_launch", rank, f"up to {lead / 1000:g} us before its launch: {example}",
                      col.before_launch_count)  # fmt: skip
    return out


def _unmatched_gpu_events(
    outside: Sequence[tuple[int, str]], rt_start: Any, lead: int, base_ns: int, anomalies: Anomalies, rank: int | None
) -> list[int]:
    """Record the GPU events whose correlation id matches no runtime launch (``(GPU start ns, text)``, text empty
    after the first of a kind), with the cause their place allows; return the starts (ns, shifted by ``base_ns``,
    sorted) of those recorded while the profiler ran.

    One that starts before the file's first runtime launch (plus ``lead``, ns: how far the trace's GPU clock runs
    ahead of its launches, ``gpu_before_launch``) may have been launched before the profiler started
    (``gpu_event_outside_window``). One that starts after it cannot be: its launch is missing from a file whose
    profiler was recording (``gpu_event_unknown_correlation``); the iteration holding one is dropped by
    :func:`pnpscale.analysis.section.records.section_records` (``orphan_gpu``), since its work cannot be placed.
    """
    if not outside:
        return []
    first = int(rt_start.min()) + max(lead, 0) if len(rt_start) else None
    before = [(t, x) for t, x in outside if first is None or t < first]
    after = [(t, x) for t, x in outside if first is not None and t >= first]
    for kind, group in (("gpu_event_outside_window", before), ("gpu_event_unknown_correlation", after)):
        if group:
            text = next((x for _, x in group if x), f"a GPU event at ts {group[0][0]} ns")
            if kind == "gpu_event_unknown_correlation" and first is not None:
                text += f" (after the first recorded launch, at ts {first - max(lead, 0)} ns)"
            anomalies.add(kind, rank, text, len(group))
    return sorted(t + base_ns for t, _ in after)


def _launches_without_gpu_event(
    col: Collector, rt_corr: Any, rt_start: Any, order: Any, base_ns: int
) -> tuple[list[int], list[int]]:
    """Starts (ns, shifted by ``base_ns``, sorted) of the launches (:data:`~pnpscale.analysis.kineto.LAUNCH_CALL`)
    whose GPU event is not in a file that holds GPU events: the work they launched is missing, and
    :func:`pnpscale.analysis.section.records.section_records` drops the iteration holding one (conservation: every
    launch inside a section has its GPU event).

    Kernel launches (:data:`~pnpscale.analysis.kineto.KERNEL_LAUNCH`: CUPTI records a GPU event for every one)
    always; copies and memsets (which have none when of 0 bytes) only in a file Kineto did not close (no end
    marker) whose latest launch is one of them: Kineto writes the GPU events after the CPU's, in time order, so a
    cut loses the last launches' work (``trace_cut_short``). In a closed file the profiler dropped the GPU records
    (``iteration_incomplete``). Empty for a file without
    GPU events (refused by :func:`pnpscale.analysis.offline`) and for one with GPU events of unknown launch
    (correlation 0, ROCm: no launch can be vouched for).

    Returns:
        (those starts, the starts of the other copies and memsets without a GPU event: a 0-byte one has none, a
        dropped record would shorten its section's GPU span, so the section is named: ``copy_without_gpu_event``).
    """
    import numpy as np

    if not len(rt_corr) or not col.gpu_events:
        return [], []
    kinds = np.frombuffer(col.rt_launch, dtype=np.int8)[order]
    launch = kinds > 0
    # every GPU event's correlation, repeats kept (np.isin takes them as they are; a np.unique here cost 30 ms)
    seen = np.concatenate([np.frombuffer(col.gpu_corr, dtype=np.int64) if len(col.gpu_corr) else
                           np.zeros(0, np.int64), np.array([n[4] for n in col.nccl], dtype=np.int64),
                           np.array([e.correlation for e in col.bad_gpu], dtype=np.int64)])  # fmt: skip
    unknown = np.array(sorted(UNKNOWN_CORRELATIONS), dtype=np.int64)
    if np.isin(seen, unknown).any():  # GPU events of unknown launch (correlation 0, ROCm): no launch can be vouched for
        return [], []
    known = ~np.isin(rt_corr, unknown)
    gone = launch & known & ~np.isin(rt_corr, seen)
    if not gone.any():
        return [], []
    latest = int(np.argmax(np.where(launch & known, rt_start, np.iinfo(np.int64).min)))
    copies = np.zeros_like(gone)
    if col.end_marker or not gone[latest]:  # not a cut's GPU tail: only kernels, which always have a GPU event
        copies = gone & (kinds == 1)
        gone &= kinds == 2
    return sorted((rt_start[gone] + base_ns).tolist()), sorted((rt_start[copies] + base_ns).tolist())


def _drop_open_step(col: Collector, anomalies: Anomalies, rank: int | None) -> None:
    """Drop the ``ProfilerStep#N`` Kineto opens at the last ``prof.step()`` and closes when the profiler stops,
    where it is a section range (``--sections step=ProfilerStep#*``) and holds nothing while the step before it
    holds work: "holds" meaning an operator, runtime call, collective or other section range starts inside it.
    Kept, it would be an iteration of a few microseconds that lowers every mean (or, beside ``gradient,denoiser``,
    one ``step`` too many, refused). Only the rank's last step is looked at; one that holds work, or a trace whose
    steps all hold nothing (nothing tells the open one apart), is left to the section checks. Recorded as
    ``empty_iteration``.
    """
    import numpy as np

    steps = sorted(
        (e for e in col.cpu if step_number(e.name) is not None and e.bad is None), key=lambda e: (e.start_ns, -e.end_ns)
    )
    if len(steps) < 2:
        return
    last, before = steps[-1], steps[-2]

    def place(e: Event) -> tuple[int, int, int]:
        return e.start_ns, e.end_ns, e.tid

    if not any(place(s) == place(last) for s in col.sections):
        return  # the step is not a section: the sections inside steps decide the iterations
    times = [np.frombuffer(a, dtype=np.int64) for a in (col.op_start, col.rt_start) if len(a)]

    def holds_work(step: Event) -> bool:
        lo, hi = step.start_ns, step.end_ns
        if any(lo <= s.start_ns <= hi for s in col.sections if place(s) != place(step)):
            return True
        if any(lo <= e.start_ns <= hi for e in col.cpu if step_number(e.name) is None):
            return True
        return any(bool(((t >= lo) & (t <= hi)).any()) for t in times)

    if holds_work(last) or not holds_work(before):
        return
    where = f"{col.path.name}: " if col.path is not None else ""
    anomalies.add(
        "empty_iteration",
        rank,
        f"{where}the last step, {last.name} ({(last.end_ns - last.start_ns) / 1000:g} us), holds no operator, "
        f"collective or other section (the step Kineto opens at the last prof.step() and closes when the profiler "
        f"stops): dropped",
    )
    col.cpu = [e for e in col.cpu if e is not last]
    col.sections = [s for s in col.sections if place(s) != place(last)]


def _ops(col: Collector, base_ns: int) -> list[Event]:
    """The operators that matter to blocked time: ``c10d::`` calls, and those overlapping a gloo work range
    or a ``c10d::`` call (:mod:`pnpscale.analysis.overlap`); the rest cannot change it."""
    import numpy as np

    if not len(col.op_start):
        return []
    start = np.frombuffer(col.op_start, dtype=np.int64)
    end = np.frombuffer(col.op_end, dtype=np.int64)
    names = list(col.op_names)
    c10d = np.array([n.startswith(C10D_PREFIX) for n in names], dtype=bool)[np.frombuffer(col.op_name, np.int64)]
    spans = [(e.start_ns, e.end_ns) for e in col.cpu if is_gloo_work(e.name)]
    spans += list(zip(start[c10d].tolist(), end[c10d].tolist(), strict=True))
    merged = union(spans)
    keep = c10d.copy()
    if merged:
        lo = np.array([a for a, _ in merged], dtype=np.int64)
        hi = np.array([b for _, b in merged], dtype=np.int64)
        i = np.searchsorted(hi, start, side="right")
        inside = i < len(hi)
        keep |= inside & (lo[np.minimum(i, len(lo) - 1)] < end)
    p2p = col.op_p2p
    return [
        Event(
            names[col.op_name[i]],
            Kind.OP,
            int(start[i]) + base_ns,
            int(end[i]) + base_ns,
            tid=col.op_tid[i],
            peer=p2p[i][0] if i in p2p else None,
            tag=p2p[i][1] if i in p2p else None,
        )
        for i in np.flatnonzero(keep).tolist()
    ]


def _dedupe(col: Collector, anomalies: Anomalies, rank: int | None) -> None:
    """Drop exact duplicates (same name, times, thread or stream, correlation) of the kept events."""
    dups: list[str] = []

    def unique(items: list, key: Any, label: Any) -> list:
        seen: set = set()
        out = []
        for it in items:
            k = key(it)
            if k in seen:
                dups.append(label(it))
                continue
            seen.add(k)
            out.append(it)
        return out

    def ev_key(e: Event) -> tuple:
        return (e.name, e.start_ns, e.end_ns, e.tid, e.bad)

    def ev_label(e: Event) -> str:
        return f"{e.name!r} at ts {e.start_ns} ns (thread {e.tid})"

    col.sections = unique(col.sections, ev_key, ev_label)
    col.cpu = unique(col.cpu, ev_key, ev_label)
    col.nccl = unique(
        col.nccl,
        lambda n: (n[0], n[1], n[2], n[3], n[4]),
        lambda n: f"{kernel_label(n[0])!r} at ts {n[1]} ns (stream {n[3]}, correlation {n[4]})",
    )
    if dups:
        anomalies.add("duplicate_event", rank, dups[0], len(dups))


def _clock_offset(col: Collector, launch_of: Any, anomalies: Anomalies, rank: int | None) -> int:
    """The offset (ns) that puts the runtime clock on the CPU ranges' clock (:func:`runtime_offset`), 0 if none."""
    import numpy as np

    if not len(col.rt_corr):
        return 0
    if not col.nccl:
        return _clock_offset_from_operators(col, anomalies, rank)
    launches, _ = launch_of(np.array([n[4] for n in col.nccl], dtype=np.int64))
    known = [int(x) for x in launches if x >= 0]
    descs = [e for e in col.cpu if is_named_descriptor(e.name)] or [e for e in col.cpu if e.name == PARAM_COMMS]
    fit = runtime_offset(known, [(d.start_ns, d.end_ns) for d in descs])
    if fit is None:
        return _clock_offset_from_operators(col, anomalies, rank)
    off = nearest_zero(*fit)
    first = min(known)
    d0 = min(descs, key=lambda d: d.start_ns)
    anomalies.add(
        "runtime_clock_offset",
        rank,
        f"the first collective launch (ts {first} ns) lies outside its {d0.name!r} "
        f"[{d0.start_ns}, {d0.end_ns}] ns; "
        f"every launch fits its descriptor with an offset of {fit[0]}..{fit[1]} ns: runtime events shifted by "
        f"{off:+d} ns ({len(known)} collectives)",
        len(col.rt_corr),
    )
    return off


def _clock_offset_from_operators(col: Collector, anomalies: Anomalies, rank: int | None) -> int:
    """The runtime clock's offset found from the operators that issued the runtime calls (the ``cpu_op`` with the
    call's ``External id``, which Kineto links them by): the offsets ``[lo, hi]`` (ns) that put every linked
    call's start inside its operator; applied (the one nearest 0) only when they exclude 0, else 0 (the clocks
    agree, no call is linked, or no offset fits every pair). Recorded as ``runtime_clock_offset``."""
    import numpy as np

    if not len(col.rt_ext) or not len(col.op_ext):
        _refuse_crossing_calls(col, rank)
        return 0
    op_ext = np.frombuffer(col.op_ext, dtype=np.int64)
    linked = np.flatnonzero(op_ext >= 0)
    if not len(linked):
        _refuse_crossing_calls(col, rank)
        return 0
    by_ext = linked[np.argsort(op_ext[linked], kind="stable")]
    keys = op_ext[by_ext]
    rt_ext = np.frombuffer(col.rt_ext, dtype=np.int64)
    rt_start = np.frombuffer(col.rt_start, dtype=np.int64)
    j = np.minimum(np.searchsorted(keys, rt_ext), len(keys) - 1)
    hit = (rt_ext >= 0) & (keys[j] == rt_ext)
    if not hit.any():
        _refuse_crossing_calls(col, rank)
        return 0
    op = by_ext[j[hit]]
    start = np.frombuffer(col.op_start, dtype=np.int64)[op]
    end = np.frombuffer(col.op_end, dtype=np.int64)[op]
    calls = rt_start[hit]
    lo, hi = int(np.max(start - calls)), int(np.min(end - calls))
    if lo > hi or lo <= 0 <= hi:
        return 0
    off = nearest_zero(lo, hi)
    anomalies.add(
        "runtime_clock_offset",
        rank,
        f"runtime calls lie outside the operators that issued them (External id; e.g. one at ts {int(calls[0])} ns, "
        f"its operator [{int(start[0])}, {int(end[0])}] ns); every call fits its operator with an offset of "
        f"{lo}..{hi} ns: runtime events shifted by {off:+d} ns ({int(hit.sum())} calls)",
        len(col.rt_corr),
    )
    return off


#: how far (ns) a runtime call must reach over a range's start or end to count as crossing it: a trace in whole
#: microseconds rounds ts and dur apart (a start by up to 0.5 us, an end by up to 1 us); other traces keep ns
CROSSING_SLACK_NS = 1000
CROSSING_SLACK_FINE_NS = 100


def crossing_calls(
    call_tid: Any,
    call_start: Any,
    call_end: Any,
    op_tid: Any,
    op_start: Any,
    op_end: Any,
    slack_ns: int = CROSSING_SLACK_NS,
) -> tuple[int, int, int]:
    """Runtime calls that cross the start or end of a CPU range (operator, ``record_function`` range) of their
    own thread by more than ``slack_ns``: ``(count, index of the first, the boundary it crosses in ns)``,
    ``(0, -1, 0)`` when none. A thread's calls nest: a runtime call (a leaf, made while the thread's ranges are
    open) lies inside a range or between two, never across a boundary, unless the runtime events are on another
    clock than the ranges (kineto#1082). Arrays of int64 ns; threads -1 (unknown) are skipped.

    >>> import numpy as np
    >>> a = lambda *x: np.array(x, dtype=np.int64)
    >>> crossing_calls(a(1, 1), a(1_000, 8_000), a(3_000, 12_000), a(1), a(0), a(10_000))  # [8, 12] us crosses 10
    (1, 1, 10000)
    >>> crossing_calls(a(1), a(1_000), a(3_000), a(1), a(0), a(10_000))
    (0, -1, 0)
    """
    import numpy as np

    count, first, boundary = 0, -1, 0
    for tid in np.intersect1d(np.unique(call_tid[call_tid >= 0]), np.unique(op_tid)).tolist():
        bounds = np.sort(np.concatenate([op_start[op_tid == tid], op_end[op_tid == tid]]))
        idx = np.flatnonzero(call_tid == tid)
        lo = np.searchsorted(bounds, call_start[idx] + slack_ns, side="right")
        hi = np.searchsorted(bounds, call_end[idx] - slack_ns, side="left")
        crossing = idx[lo < hi]
        if len(crossing):
            count += len(crossing)
            i = int(crossing[0])
            if first < 0 or call_start[i] < call_start[first]:
                first = i
                boundary = int(bounds[np.searchsorted(bounds, call_start[i] + slack_ns, side="right")])
    return count, first, boundary


def _refuse_crossing_calls(col: Collector, rank: int | None) -> None:
    """Refuse a trace whose runtime calls cross its CPU ranges (``cpu_op`` operators and section ranges:
    :func:`crossing_calls`, by more than 1 us in a trace of whole microseconds, 0.1 us otherwise) when nothing links
    a call to what issued it (no collective descriptor fits, no ``External id``): the runtime clock differs from the CPU
    ranges' and its offset cannot be found, so launches, and the kernels placed by them, would fall into the
    wrong section.

    Raises:
        TraceError: naming the file, rank, the count and the first crossing call.
    """
    import numpy as np

    ranges = [e for e in col.sections if e.bad is None]
    if not len(col.rt_tid) or not (len(col.op_tid) or ranges):
        return
    tid = np.frombuffer(col.rt_tid, dtype=np.int64)
    start = np.frombuffer(col.rt_start, dtype=np.int64)
    end = np.frombuffer(col.rt_end, dtype=np.int64)
    ops = [
        np.concatenate([np.frombuffer(a, dtype=np.int64) if len(a) else np.zeros(0, np.int64),
                        np.array([getattr(e, f) for e in ranges], dtype=np.int64)])
        for a, f in ((col.op_tid, "tid"), (col.op_start, "start_ns"), (col.op_end, "end_ns"))
    ]  # fmt: skip
    whole_us = all(not (x % 1000).any() for x in (start, end, ops[1], ops[2]))
    slack = CROSSING_SLACK_NS if whole_us else CROSSING_SLACK_FINE_NS
    n, i, at = crossing_calls(tid, start, end, ops[0], ops[1], ops[2], slack_ns=slack)
    if not n:
        return
    who = "" if rank is None else f" (rank {rank})"
    raise TraceError(
        f"{col.path}{who}: {n} runtime call(s) cross the start or end of a CPU range of their own thread (e.g. the "
        f"call of correlation {col.rt_corr[i]} on thread {tid[i]}, [{start[i]}, {end[i]}] ns, across a range "
        f"boundary at {at} ns): the runtime events are on another clock than the CPU ranges (kineto#1082), and the "
        f"trace links no call to what issued it (no collective descriptor that fits, no 'External id'), so the "
        f"offset cannot be found and launches would fall into the wrong sections"
    )


def _faults(col: Collector, launch_of: Any) -> list[str | None]:
    """Why each device event (the other GPU events, then the collective kernels) is not physical
    (:func:`pnpscale.analysis.gpu_checks.gpu_faults`), else ``None``."""
    import numpy as np

    n = len(col.gpu_start)
    names = list(col.names)
    start = np.concatenate([np.frombuffer(col.gpu_start, dtype=np.int64) if n else np.zeros(0, np.int64),
                            np.array([x[1] for x in col.nccl], dtype=np.int64)])  # fmt: skip
    end = np.concatenate([np.frombuffer(col.gpu_end, dtype=np.int64) if n else np.zeros(0, np.int64),
                          np.array([x[2] for x in col.nccl], dtype=np.int64)])  # fmt: skip
    stream = np.concatenate([np.frombuffer(col.gpu_stream, dtype=np.int64) if n else np.zeros(0, np.int64),
                             np.array([x[3] for x in col.nccl], dtype=np.int64)])  # fmt: skip
    corr = np.concatenate([np.frombuffer(col.gpu_corr, dtype=np.int64) if n else np.zeros(0, np.int64),
                           np.array([x[4] for x in col.nccl], dtype=np.int64)])  # fmt: skip
    launch, away = launch_of(corr)
    keep = ~away
    codes = np.zeros(len(start), dtype=np.int8)
    other = np.full(len(start), -1, dtype=np.int64)
    idx = np.flatnonzero(keep)
    tolerance = resolution_ns(start[idx], end[idx] - start[idx])  # ts and dur rounded to it: rounding, not a fault
    c, o = gpu_faults(start[idx], end[idx], stream[idx], corr[idx], launch[idx], col.window, tolerance)
    codes[idx] = c
    other[idx] = np.where(o >= 0, idx[np.maximum(o, 0)], -1)
    launch_unset = np.isin(corr, np.array(col.rt_unset, dtype=np.int64)) & keep if col.rt_unset else None

    def name(i: int) -> str:
        return kernel_label(names[col.gpu_name[i]] if i < n else col.nccl[i - n][0])

    out: list[str | None] = [None] * len(start)
    before = np.flatnonzero(codes == BEFORE_LAUNCH)  # a GPU clock ahead of the CPU's: placement by launch holds
    if len(before):
        i = int(before[np.argmax(launch[before] - start[before])])
        col.before_launch = [int(launch[i] - start[i]), f"{name(i)!r} at ts {start[i] / 1000:g} us, "
                              f"correlation {corr[i]}"]  # fmt: skip
        col.before_launch_count = len(before)
    over = codes == STREAM_OVERLAP
    index = np.arange(len(start))
    soft = over & (index < n) & (other < n)  # compute kernels may overlap (programmatic dependent launch)
    if soft.any():
        i = int(np.argmax(soft))
        j = int(other[i])
        col.overlaps = [f"{name(i)!r} at ts {start[i] / 1000:g} us starts {(end[j] - start[i]) / 1000:g} us "
                         f"before {name(j)!r} ends on stream {stream[i]}"]  # fmt: skip
        col.overlap_count = int(soft.sum())
    if launch_unset is not None:
        for i in np.flatnonzero(launch_unset).tolist():
            out[i] = f"its launch (correlation {corr[i]}) has a negative timestamp: placement unknown"
    for i in np.flatnonzero((codes == TS_UNSET) | (codes == OUTSIDE_WINDOW) | (over & ~soft)).tolist():
        us = f"ts {start[i] / 1000:g} us"
        if codes[i] == TS_UNSET:
            out[i] = f"at {us}: an unset timestamp (ts <= 0, kineto#109), not a time"
        elif codes[i] == OUTSIDE_WINDOW and col.window is not None:
            w0, w1 = col.window
            out[i] = (f"at {us}: outside the profiled window ('PyTorch Profiler' span {w0 / 1000:g}.."
                      f"{w1 / 1000:g} us, with {WINDOW_SLACK_NS // 10**9} s either side): a corrupt "
                      f"timestamp")  # fmt: skip
        else:  # a collective kernel's time would be wrong: its iteration is not physical
            j = int(other[i])
            out[i] = (f"at {us} starts {(end[j] - start[i]) / 1000:g} us before {name(j)!r} ends on stream "
                      f"{stream[i]}: a collective cannot overlap work of its own stream (kineto#990: GPU "
                      f"timestamps wrong)")  # fmt: skip
    return out


def _gpu_representatives(
    col: Collector,
    launch_of: Any,
    base_ns: int,
    outside: list[tuple[int, str]],
    anomalies: Anomalies,
    rank: int | None,
    faults: Sequence[str | None] = (),
) -> list[Event]:
    """Per section range, the first-starting and last-ending GPU event launched inside it; and every
    event with a fault (its iteration is then dropped)."""
    import numpy as np

    n = len(col.gpu_start)
    if n == 0:
        return []
    start = np.frombuffer(col.gpu_start, dtype=np.int64)
    end = np.frombuffer(col.gpu_end, dtype=np.int64)
    corr = np.frombuffer(col.gpu_corr, dtype=np.int64)
    launch, away = launch_of(corr)
    names = list(col.names)
    if away.any():
        i = int(np.argmax(away))
        text = f"{names[col.gpu_name[i]]} at ts {int(start[i])} ns, correlation {int(corr[i])}"
        outside.append((int(start[i]), text))
        outside.extend((int(t), "") for t in start[away][1:].tolist())
    by_start = (launch < 0) & ~away
    if by_start.any():
        i = int(np.argmax(by_start))
        why = (
            "correlation 0 (unknown launch)"
            if int(corr[i]) in UNKNOWN_CORRELATIONS
            else (
                f"correlation {int(corr[i])}, and the trace holds no runtime event of a known category"
                + (f" (categories not read: {', '.join(col.unknown_categories)})" if col.unknown_categories else "")
            )
        )
        anomalies.add(
            "launch_unknown_by_start",
            rank,
            f"{names[col.gpu_name[i]]} at ts {int(start[i])} ns, {why}",
            int(by_start.sum()),
        )
    valid = np.flatnonzero(~away)
    place = np.where(launch >= 0, launch, start)[valid]
    order = valid[np.argsort(place, kind="stable")]
    placed = np.sort(place, kind="stable")
    keep = set(valid.tolist()) if col.keep_all_gpu else ({int(valid[0])} if len(valid) else set())
    comm = union((n[1], n[2]) for n in col.nccl if n[6] is None)
    if comm and not col.keep_all_gpu:  # compute overlapping a collective kernel hides it
        c_lo = np.array([a for a, _ in comm], dtype=np.int64)
        c_hi = np.array([b for _, b in comm], dtype=np.int64)
        j = np.searchsorted(c_hi, start[valid], side="right")
        over = (j < len(c_hi)) & (c_lo[np.minimum(j, len(c_lo) - 1)] < end[valid])
        keep.update(valid[over].tolist())
    for r in [] if col.keep_all_gpu else col.sections:
        lo = int(np.searchsorted(placed, r.start_ns, side="left"))
        hi = int(np.searchsorted(placed, r.end_ns, side="right"))
        if hi > lo:
            idx = order[lo:hi]
            keep.add(int(idx[np.argmin(start[idx])]))
            keep.add(int(idx[np.argmax(end[idx])]))
    # (most traces have no fault: one count in C spares the pass over every GPU event)
    bad = {i: f for i, f in enumerate(faults) if f is not None} if faults.count(None) < len(faults) else {}
    keep |= set(bad)
    return [
        Event(
            names[col.gpu_name[i]],
            Kind.GPU,
            int(start[i]) + base_ns,
            int(start[i] if i in bad else end[i]) + base_ns,
            tid=int(col.gpu_stream[i]),
            correlation=int(corr[i]),
            launch_ns=None if launch[i] < 0 else int(launch[i]) + base_ns,
            bad=bad.get(i),
        )
        for i in sorted(keep)
    ]
