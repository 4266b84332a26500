"""What one pass over a trace keeps: :class:`Collector` gathers the needed events as they stream by.

Section ranges, collective ranges and descriptors, ``ProfilerStep`` ranges, runtime launches (correlation,
start), GPU events (compact arrays), ``cpu_op`` operators (for blocked time; the peer and tag of point-to-point
``c10d::`` calls, :func:`~pnpscale.analysis.kineto.p2p_peer`) and the counts behind the messages (range
names, unknown categories). :mod:`pnpscale.analysis.trace.select` turns what it holds
into :class:`~pnpscale.analysis.events.Event` records.
"""

from __future__ import annotations

import re
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fnmatch import translate
from pathlib import Path
from typing import Any

from pnpscale.analysis.events import Event, Kind
from pnpscale.analysis.kineto import (
    CPU_CATS,
    END_MARKER,
    GPU_CATS,
    IGNORED_CATS,
    NOT_A_LAUNCH,
    P2P_CALLS,
    PARAM_COMMS,
    RUNTIME_CATS,
    comm_fields,
    int_or_none,
    is_collective_kernel,
    is_descriptor,
    is_gloo_work,
    is_named_descriptor,
    launch_kind,
    p2p_peer,
    step_number,
    stream_of,
)
from pnpscale.analysis.trace.files import NS_RANGE, TraceError, to_ns, ts_text


def merge_descriptors(events: Sequence[Event]) -> list[Event]:
    """Fill each ``nccl:*`` range's unknown fields from the ``record_param_comms`` enclosing it.

    PyTorch records a collective as ``record_param_comms`` (with ``"Seq"``, ``"Process Group
    Name"``, sizes) around an ``nccl:<op>`` range (with input shapes) on the same thread. Known
    fields of the ``nccl:*`` range are kept; the other events are returned unchanged, in order.

    >>> rpc = Event("record_param_comms", Kind.CPU, 0, 10, tid=1, group="0", group_seq=4, payload_bytes=8)
    >>> ar = Event("nccl:all_reduce", Kind.CPU, 2, 8, tid=1, collective="all_reduce", payload_bytes=16)
    >>> m = merge_descriptors([rpc, ar])[1]
    >>> (m.group, m.group_seq, m.payload_bytes)
    ('0', 4, 16)
    """
    import bisect

    wrappers: dict[int, list[Event]] = {}
    for e in events:
        if e.name == PARAM_COMMS:
            wrappers.setdefault(e.tid, []).append(e)
    for group in wrappers.values():
        group.sort(key=lambda e: e.start_ns)
    starts = {tid: [w.start_ns for w in group] for tid, group in wrappers.items()}
    out = []
    for e in events:
        ws = wrappers.get(e.tid)
        if ws and is_named_descriptor(e.name):
            i = bisect.bisect_right(starts[e.tid], e.start_ns) - 1
            w = ws[i] if i >= 0 else None
            if w is not None and w.end_ns >= e.end_ns:
                e = replace(
                    e,
                    collective=e.collective or w.collective,
                    payload_bytes=e.payload_bytes if e.payload_bytes is not None else w.payload_bytes,
                    group=e.group if e.group is not None else w.group,
                    group_seq=e.group_seq if e.group_seq is not None else w.group_seq,
                )
        out.append(e)
    return out


class Collector:
    """Keeps the needed events of one trace as they stream by (see module doc)."""

    def __init__(self, sections: Mapping[str, str], keep_all_gpu: bool = False, path: Path | None = None) -> None:
        self.keep_all_gpu = keep_all_gpu
        self.path = path
        self.exact: dict[str, str] = {}
        globs = []
        for name, pat in sections.items():
            if any(ch in pat for ch in "*?["):
                globs.append((re.compile(translate(pat)), name))
            else:
                self.exact[pat] = name
        self.globs = globs
        self.read = 0
        self.cpu: list[Event] = []  # collective CPU ranges and ProfilerStep ranges
        self.sections: list[Event] = []
        self.nccl: list[tuple] = []  # (name, start, end, stream, corr, fields, bad, device)
        self.bad_gpu: list[Event] = []  # other GPU events with a non-physical duration (all kept)
        self.gpu_start, self.gpu_end, self.gpu_corr = array("q"), array("q"), array("q")
        self.gpu_stream, self.gpu_name = array("q"), array("q")
        self.names: dict[str, int] = {}
        self.rt_corr, self.rt_start = array("q"), array("q")
        self.rt_launch = array("b")  # per runtime event: 2 a kernel launch, 1 a copy or memset, 0 (launch_kind)
        self.rt_ext, self.op_ext = array("q"), array("q")  # External id of runtime events and operators (-1: none)
        self.rt_tid, self.rt_end = array("q"), array("q")  # thread (-1: unknown) and end (ns) of runtime events
        self.end_marker = False  # Kineto's last event (END_MARKER) seen: the file was closed by Kineto
        self.profiler_span = False  # Kineto's "PyTorch Profiler (N)" span seen: written after every activity
        self.last_start = -(1 << 62)  # the latest start (ns) of an event whose times were read
        self.missing_gpu: list[int] = []  # set by trace_select: launches whose GPU event is not in the file
        self.copies_without_gpu: list[int] = []  # set by trace_select: copies / memsets without a GPU event
        self.orphan_gpu: list[int] = []  # set by trace_select: GPU events (starts) whose launch is not in the file
        # other cpu_op operators (compute or c10d calls), for the time a thread is blocked on its collectives
        self.op_start, self.op_end, self.op_tid, self.op_name = array("q"), array("q"), array("q"), array("q")
        self.op_names: dict[str, int] = {}
        self.op_p2p: dict[int, tuple[int | None, int | None]] = {}  # op index -> (peer, tag) of a c10d send/recv
        self.range_names: Counter[str] = Counter()
        self.user_annotations: Counter[str] = Counter()
        self.unknown_categories: Counter[str] = Counter()
        self.section_pids: Counter[str] = Counter()
        self.no_ts: list[str] = []
        self.before_launch: list = []  # [largest lead in ns, its event]
        self.before_launch_count = 0
        self.rt_unset: list[int] = []  # correlations of runtime events with a negative ts
        self.window: tuple[int, int] | None = None  # Kineto's "PyTorch Profiler (N)" span: the profiled window
        self.overlaps: list[str] = []  # the first compute kernel overlapping the previous one on its stream
        self.overlap_count = 0

    def _section_of(self, name: str) -> str | None:
        hit = self.exact.get(name)
        if hit is not None:
            return hit
        for rx, sec in self.globs:
            if rx.match(name):
                return sec
        return None

    def count_range(self, name: str, cat: str) -> None:
        """A CPU range seen (for the names listed when a section is not found)."""
        self.range_names[name] += 1
        if cat == "user_annotation":
            self.user_annotations[name] += 1

    def count_category(self, cat: str) -> None:
        """An ``X`` event of a category not read: counted when Kineto does not list it as ignorable."""
        if cat not in IGNORED_CATS:
            self.unknown_categories[cat] += 1

    def _times(self, ev: Mapping[str, Any]) -> tuple[int, int, str | None] | None:
        """(start, end, why the duration is not physical) in ns; ``None`` without ``ts``."""
        ts = ev.get("ts")
        if ts is None or isinstance(ts, bool):
            return None
        start = to_ns(ts)
        if start > self.last_start and -NS_RANGE <= start <= NS_RANGE:
            self.last_start = start
        if not -NS_RANGE <= start <= NS_RANGE:
            raise TraceError(f"{self.path}: event #{self.read - 1} {ev.get('name')!r}: ts {ts} us is out of any "
                             f"clock's range (a timestamp in the wrong unit, or corrupt)")  # fmt: skip
        dur = ev.get("dur")
        if dur is None or isinstance(dur, bool):
            return start, start, f"no dur (ts {ts} us)"
        d = to_ns(dur)
        if d < 0:
            return start, start, f"negative dur {dur} us (ts {ts} us)"
        return start, start + d, None

    def _no_ts(self, ev: Mapping[str, Any]) -> None:
        self.no_ts.append(f"event #{self.read - 1} {ev.get('name')!r} ({ev.get('cat')}): no 'ts' field")

    def add(self, ev: Mapping[str, Any], counted: bool = False) -> None:
        """One event as the JSON decoder gives it (numbers exact: ``int`` or :class:`~decimal.Decimal`);
        ``counted``: a CPU range's name was already counted (:meth:`count_range`) by the caller.

        Raises:
            TraceError: a section range or a device event without ``ts``; a ``ts`` beyond any clock's range.
        """
        self.read += 1
        if ev.get("ph") != "X":
            if ev.get("ph") == "i" and ev.get("name") == END_MARKER:
                self.end_marker = True
            return
        cat = ev.get("cat")
        if cat in RUNTIME_CATS:
            corr = int_or_none((ev.get("args") or {}).get("correlation"))
            if corr is not None:
                times = self._times(ev)
                if times is None:
                    self._no_ts(ev)
                    return
                ext = int_or_none((ev.get("args") or {}).get("External id"))
                tid = int_or_none(ev.get("tid"))
                self.add_runtime(
                    corr, times[0], launch_kind(str(ev.get("name", ""))), -1 if ext is None else ext,
                    -1 if tid is None else tid, times[1],
                )  # fmt: skip
            return
        if cat in GPU_CATS:
            self._add_gpu(ev)
            return
        if cat not in CPU_CATS:
            if cat == "Trace" and str(ev.get("name", "")).startswith("PyTorch Profiler"):
                self.profiler_span = True
                times = self._times(ev)
                if times is not None and times[2] is None:
                    self.window = (times[0], times[1])
            elif isinstance(cat, str):
                self.count_category(cat)
            return
        name = ev.get("name")
        if not isinstance(name, str):
            return
        if not counted:
            self.count_range(name, str(cat))
        section = self._section_of(name)
        step = step_number(name) is not None
        if section is None and not step and not (is_gloo_work(name) or is_descriptor(name)):
            if cat == "cpu_op":
                times = self._times(ev)
                if times is not None and times[2] is None:
                    args = ev.get("args") or {}
                    ext = int_or_none(args.get("External id"))
                    self.add_op(name, times[0], times[1], int_or_none(ev.get("tid")) or 0, -1 if ext is None else ext)
                    if name in P2P_CALLS:  # its peer and tag, exactly as Kineto wrote them (record_shapes)
                        peer, tag = p2p_peer(name, args)
                        if peer is not None or tag is not None:
                            self.op_p2p[len(self.op_start) - 1] = (peer, tag)
            return
        times = self._times(ev)
        if times is None:
            if section is not None:
                raise TraceError(f"{self.path}: event #{self.read - 1} {name!r} (section {section!r}) has no ts")
            self._no_ts(ev)
            return
        start, end, bad = times
        if start < 0 and bad is None:
            bad = f"a negative timestamp (ts {ts_text(ev)} us), not a time"
        tid = int_or_none(ev.get("tid")) or 0
        if step:
            self.cpu.append(Event(name, Kind.CPU, start, end, tid=tid, bad=bad))
        if section is not None:
            self.section_pids[str(ev.get("pid"))] += 1
            self.sections.append(Event(section, Kind.CPU, start, end, tid=tid, bad=bad))
            return
        if step:
            return
        fields = comm_fields(name, ev.get("args") or {})
        if name == PARAM_COMMS and fields["collective"] in NOT_A_LAUNCH:
            return
        self.cpu.append(Event(name, Kind.CPU, start, end, tid=tid, bad=bad, **fields))

    def add_runtime(
        self, corr: int, start: int, launch: int, ext: int = -1, tid: int = -1, end: int | None = None
    ) -> None:
        """A runtime call with a correlation id (start in ns); ``launch``: what it puts on the device
        (:func:`~pnpscale.analysis.kineto.launch_kind`: 2 a kernel, 1 a copy or memset, 0 nothing);
        ``ext``: its ``External id`` (the operator that issued it), -1 when absent; ``tid``: its thread (-1:
        unknown); ``end``: its end in ns (``start`` when unknown or not physical)."""
        self.rt_ext.append(ext)
        self.rt_tid.append(tid)
        self.rt_end.append(start if end is None or end < start else end)
        self.rt_corr.append(corr)
        self.rt_start.append(start)
        self.rt_launch.append(int(launch))
        self.last_start = max(self.last_start, start)
        if start < 0:
            self.rt_unset.append(corr)

    def add_op(self, name: str, start: int, end: int, tid: int, ext: int = -1) -> None:
        """A ``cpu_op`` operator that is neither a section nor a collective range (times in ns; ``ext``: its
        ``External id``, -1 when absent)."""
        self.op_ext.append(ext)
        self.last_start = max(self.last_start, start)
        self.op_start.append(start)
        self.op_end.append(end)
        self.op_tid.append(tid)
        self.op_name.append(self.op_names.setdefault(name, len(self.op_names)))

    def _add_gpu(self, ev: Mapping[str, Any]) -> None:
        args = ev.get("args") or {}
        name = ev.get("name")
        name = name if isinstance(name, str) else ""
        times = self._times(ev)
        if times is None:  # its section would silently lack its work: refused, naming the event and the field
            raise TraceError(f"{self.path}: event #{self.read - 1} {name!r} ({ev.get('cat')}, correlation "
                             f"{args.get('correlation')}) has no 'ts' field: a device event without a start time "
                             f"cannot be placed in its section")  # fmt: skip
        start, end, bad = times
        stream = stream_of(args, ev.get("tid"))
        corr = int_or_none(args.get("correlation"))
        corr = -1 if corr is None else corr
        if ev.get("cat") in ("kernel", "Kernel") and is_collective_kernel(name):
            fields = comm_fields(name, args) if "Collective name" in args or "Seq" in args else {}
            device = args.get("device", ev.get("pid"))
            self.nccl.append((name, start, end, stream, corr, fields, bad, str(device)))
            return
        self.add_gpu_event(name, start, end, stream, corr, bad)

    def add_gpu_event(self, name: str, start: int, end: int, stream: int, corr: int, bad: str | None) -> None:
        """A GPU event that is not a collective kernel (times in ns, ``corr`` -1 when absent)."""
        if bad is not None:
            self.bad_gpu.append(Event(name, Kind.GPU, start, end, tid=stream, correlation=corr, bad=bad))
            return
        self.last_start = max(self.last_start, start)
        nid = self.names.setdefault(name, len(self.names))
        self.gpu_start.append(start)
        self.gpu_end.append(end)
        self.gpu_corr.append(corr)
        self.gpu_stream.append(stream)
        self.gpu_name.append(nid)

    @property
    def gpu_events(self) -> int:
        return len(self.gpu_start) + len(self.nccl) + len(self.bad_gpu)
