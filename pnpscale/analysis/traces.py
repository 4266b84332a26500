"""Kineto (torch.profiler) JSON traces -> plain :class:`~pnpscale.analysis.events.Event` records, streamed.

The offline twin of :mod:`pnpscale.rank.profiling`: a trace of any job (``*.json`` or ``*.json.gz``,
told apart by content, not name) is read event by event with ``ijson`` and only what
:func:`pnpscale.analysis.events.section_records` needs is kept, so traces of hundreds of MB per rank never
sit whole in memory:

* section ranges: CPU ranges (``cpu_op``/``user_annotation``) whose name matches a section pattern,
  renamed to the section name (``gradient``, or ``step`` for ``step=ProfilerStep#*``);
* collectives: ``gloo:*`` ranges (on gloo worker threads), ``nccl:*`` ranges and
  ``record_param_comms`` (payload from ``"In msg nelems"`` x ``"dtype"``, else ``"Input Dims"`` x
  ``"Input type"``; type from ``"Collective name"`` or the name; ``"Process Group Name"`` and
  ``"Seq"``/``"seq"`` when present; an ``nccl:*`` range takes what it lacks from the
  ``record_param_comms`` around it) and NCCL kernels (``ncclDevKernel_*``, ``ncclKernel_*``, with
  the same NCCL arguments when the trace has them);
* the launch time of every GPU event, from the runtime call (``cudaLaunchKernel``...) with the same
  ``"correlation"``;
* of the other GPU events (kernels, memcpy, memset), per section occurrence only the one that starts
  first and the one that ends last among those launched inside it (all a section's GPU span needs),
  plus one GPU event so that a trace with GPU work is still recognised as a CUDA trace.

Timestamps are read exactly (``ijson`` gives decimals) and returned in integer nanoseconds on the
Unix epoch: ``ts`` is relative to ``baseTimeNanoseconds`` when the trace has that key (newer
Kineto), absolute otherwise. Rank and world size come from the ``distributedInfo`` block.
"""

from __future__ import annotations

import gzip
import io
import re
import zlib
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_HALF_EVEN, Decimal
from fnmatch import translate
from pathlib import Path
from typing import Any, BinaryIO, cast

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
    runtime_offset,
)
from pnpscale.analysis.kineto import (
    COLLECTIVE_WORDS,
    CPU_CATS,
    GPU_CATS,
    IGNORED_CATS,
    NOT_A_LAUNCH,
    PARAM_COMMS,
    RUNTIME_CATS,
    UNKNOWN_CORRELATIONS,
    comm_fields,
    int_or_none,
    is_collective_kernel,
    is_descriptor,
    is_gloo_work,
    is_named_descriptor,
    step_number,
    stream_of,
)
from pnpscale.analysis.overlap import C10D_PREFIX, union
from pnpscale.core.errors import PnpscaleError

__all__ = ["TraceError", "NotATraceError", "Trace", "TraceInfo", "comm_fields", "read_header", "read_trace"]

#: top-level keys of a trace besides ``traceEvents`` that pnpscale reads, wherever they sit in the file
_META_KEYS = ("distributedInfo", "deviceProperties", "baseTimeNanoseconds")
#: bare non-finite number tokens Kineto writes (not JSON), as values: after ``:``/``,``/``[``
_NON_FINITE = re.compile(rb"(?<=[:,\[])(\s*)(-?(?:Infinity|inf|NaN|nan))(?=\s*[,\]}])")
_HEAD_START = 1 << 18
_HEAD_MAX = 1 << 26
_TAIL = 1 << 16
_CHUNK = 1 << 16


class TraceError(PnpscaleError, ValueError):
    """A trace that cannot be read (missing, not gzip/JSON, no event list)."""


class NotATraceError(TraceError):
    """A readable JSON file that is not a Kineto trace (no ``traceEvents``): skipped in folders."""


@dataclass(frozen=True)
class TraceInfo:
    """What a trace says about itself.

    Attributes:
        path: the file.
        rank, world_size, backend, nccl_version: from ``distributedInfo`` (``None`` when absent).
        base_ns: ``baseTimeNanoseconds`` when ``ts`` is relative to it, else ``None`` (absolute).
        events_read: events in the trace; events_kept: events returned.
        range_names: the 20 most frequent CPU range names with their counts (to help when a
            section name is not found); user_annotations: the 20 most frequent ``user_annotation``
            (``record_function``) names.
        gpu_events, runtime_events, descriptors: device events, runtime launches (with a correlation)
            and collective descriptors (``record_param_comms``, ``nccl:*``...) in the trace.
        unknown_categories: ``X`` events of categories not read, per category (most frequent first).
    """

    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    nccl_version: str | None
    base_ns: int | None = None
    events_read: int = 0
    events_kept: int = 0
    range_names: tuple[tuple[str, int], ...] = ()
    user_annotations: tuple[tuple[str, int], ...] = ()
    gpu_events: int = 0
    runtime_events: int = 0
    descriptors: int = 0
    unknown_categories: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Trace:
    """One rank's trace: its :class:`TraceInfo` and the kept events (ns, Unix epoch)."""

    info: TraceInfo
    events: list[Event]


def parse_sections(spec: str | Sequence[str]) -> dict[str, str]:
    """Section name -> name pattern, from ``"gradient,denoiser"`` or ``"step=ProfilerStep#*"``.

    A bare name matches a range of exactly that name; ``NAME=PATTERN`` renames every range matching
    the shell-style ``PATTERN`` (``*``, ``?``, ``[...]``) to ``NAME``.

    Raises:
        ValueError: empty spec, an empty name or pattern, or a name given twice.

    >>> parse_sections("gradient,denoiser")
    {'gradient': 'gradient', 'denoiser': 'denoiser'}
    >>> parse_sections(["step=ProfilerStep#*"])
    {'step': 'ProfilerStep#*'}
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: dict[str, str] = {}
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, sep, pattern = item.partition("=")
        name, pattern = name.strip(), (pattern.strip() if sep else name.strip())
        if not name or not pattern:
            raise ValueError(f"section {item!r}: expected NAME or NAME=PATTERN")
        if name in out:
            raise ValueError(f"section {name!r} given twice")
        out[name] = pattern
    if not out:
        raise ValueError("no section names given")
    return out


def read_header(path: Path | str) -> TraceInfo:
    """Rank, world size, backend, NCCL version and time base of a trace, without reading its events.

    The part of the file before ``traceEvents`` is parsed (Kineto writes ``distributedInfo``
    there); when ``distributedInfo`` is not there, the file's last 64 KiB are searched for the keys
    written after the events (a gzip file is decompressed to its end for that).

    Raises:
        NotATraceError: a JSON file without ``traceEvents`` (not a Kineto trace).
        TraceError: the file is missing, empty or not gzip/JSON.
    """
    path = Path(path)
    try:
        with _open(path) as raw:
            meta, head, array_top = _read_head(path, raw)
            if not array_top and "distributedInfo" not in meta and "traceEvents" in meta:
                tail = bytearray(head[-_TAIL:])
                while chunk := raw.read(_CHUNK * 16):
                    tail += chunk
                    del tail[: max(0, len(tail) - _TAIL)]
                meta = {**_meta_from_tail(bytes(tail)), **meta}
    except TraceError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise TraceError(f"{path}: cannot read trace: {_first_line(exc)}") from exc
    if not array_top and "traceEvents" not in meta and len(head) < _HEAD_MAX:
        if not _valid_object(head.decode("utf-8", errors="replace")):
            raise TraceError(
                f"{path}: cannot read trace: the file ends at byte {len(head)} inside its JSON object, before any "
                f"traceEvents list: truncated (or not JSON)"
            )
        raise NotATraceError(f"{path}: no traceEvents list before the end of the file: not a Kineto trace")
    if array_top and not _array_of_objects(head):
        raise NotATraceError(f"{path}: a JSON array whose items are not event objects: not a trace")
    return _info(path, meta)


def _array_of_objects(head: bytes) -> bool:
    """Whether a top-level JSON array (Chrome's array trace format) starts with an object, or is empty."""
    body = head.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()[1:].lstrip()
    return not body or body[:1] in (b"{", b"]")


def read_trace(
    path: Path | str,
    sections: Mapping[str, str] | Sequence[str],
    keep_all_gpu: bool = False,
    anomalies: Anomalies | None = None,
    rank: int | None = None,
) -> Trace:
    """Stream one Kineto trace and keep the events that section analysis needs (see module doc).

    What is repaired or dropped is recorded in ``anomalies`` under ``rank``: bare ``inf``/``NaN``
    tokens (read as null), events without ``ts`` (dropped), GPU events whose correlation id has no
    runtime launch in a trace that has runtime events (outside the profiled window: dropped), other
    GPU events with correlation 0 (unknown launch: placed by GPU start), ``X`` events of categories not
    read (``unknown_category``, counted per category), exact duplicates (``duplicate_event``), device
    events starting before their launch (``gpu_before_launch``), compute kernels overlapping on their
    stream (``stream_overlap``), runtime events on another clock than the CPU ranges
    (``runtime_clock_offset``: shifted, see :mod:`pnpscale.analysis.gpu_checks`). Events with a negative
    or missing ``dur``, device events with ``ts <= 0`` or outside the profiler's span, collective kernels
    overlapping their stream's work, and CPU ranges with a negative ``ts`` are kept with ``Event.bad``
    set and ``end == start`` (their iteration is dropped later).

    Args:
        path: ``.json`` or ``.json.gz`` Kineto trace.
        sections: section name -> name pattern (:func:`parse_sections`), or a list of exact names.
        keep_all_gpu: keep every GPU event instead of the two per section occurrence that give
            the same :func:`pnpscale.analysis.events.section_records` result (for checks; uses more memory).
        anomalies, rank: where to record anomalies, and the rank to record them under.

    Returns:
        :class:`Trace`; times in integer ns on the Unix epoch, GPU events carry ``launch_ns``.

    Raises:
        NotATraceError: a JSON file without a ``traceEvents`` list.
        TraceError: unreadable file; invalid JSON (the message names the byte offset, and the token
            when it is a bare non-finite number that could not be repaired; "truncated" when the file
            ends inside its JSON); a section range without ``ts``; a ``ts`` beyond any clock's range;
            section ranges of several processes or collective kernels of several devices in one file.
    """
    path = Path(path)
    pats = dict(sections) if isinstance(sections, Mapping) else {s: s for s in sections}
    anomalies = anomalies if anomalies is not None else Anomalies()
    try:
        try:
            collector, meta, array_top, tail = _scan(path, pats, keep_all_gpu)
        except _Fallback:
            collector, meta, array_top, tail = _stream(path, pats, keep_all_gpu, repair=False)
    except _JsonFailure as failure:
        tokens = _non_finite_tokens(path)
        if not tokens:
            ends = any(m in failure.message for m in ("ncomplete", "premature EOF"))
            cut = " (the file ends there: truncated?)" if ends else ""
            raise TraceError(f"{path}: cannot read trace: invalid JSON at or before byte {failure.offset}: "
                             f"{failure.message}{cut}") from None  # fmt: skip
        try:
            collector, meta, array_top, tail = _stream(path, pats, keep_all_gpu, repair=True)
        except _JsonFailure as again:
            tok, at = tokens[0]
            raise TraceError(
                f"{path}: cannot read trace: invalid JSON at or before byte {again.offset}: {again.message} "
                f"(the file also holds bare non-finite tokens such as {tok!r} at byte {at})"
            ) from None
        tok, at = tokens[0]
        anomalies.add("non_finite_number", rank, f"{path.name}: token {tok!r} at byte {at}", len(tokens))
    if not array_top and "traceEvents" not in meta:
        raise NotATraceError(f"{path}: no traceEvents list before the end of the file: not a Kineto trace")
    meta = {**_meta_from_tail(tail), **meta}
    base = meta.get("baseTimeNanoseconds")
    events = collector.events(int(base) if base is not None else 0, anomalies, rank)
    info = replace(
        _info(path, meta),
        base_ns=int(base) if base is not None else None,
        events_read=collector.read,
        events_kept=len(events),
        range_names=tuple(collector.range_names.most_common(20)),
        user_annotations=tuple(collector.user_annotations.most_common(20)),
        gpu_events=collector.gpu_events,
        runtime_events=len(collector.rt_corr),
        descriptors=sum(1 for e in collector.cpu if is_descriptor(e.name)),
        unknown_categories=tuple(collector.unknown_categories.most_common()),
    )
    return Trace(info, events)


class _JsonFailure(Exception):
    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message, self.offset = message, offset


def _stream(
    path: Path, pats: Mapping[str, str], keep_all_gpu: bool, repair: bool
) -> tuple[_Collector, dict[str, Any], bool, bytes]:
    """One pass over the file: (collector, metadata before the events, top is an array, last bytes)."""
    collector = _Collector(pats, keep_all_gpu, path)
    stream = None
    try:
        with _open(path) as raw:
            meta, head, array_top = _read_head(path, raw)
            stream = _Replay(head, raw, repair)
            import ijson

            prefix = "item" if array_top else "traceEvents.item"
            for n, ev in enumerate(ijson.items(stream, prefix, use_float=False)):
                if not isinstance(ev, dict):
                    raise TraceError(
                        f"{path}: event {n} of {prefix.split('.')[0]} is {type(ev).__name__}, not an object"
                    )
                collector.add(ev)
    except TraceError:
        raise
    except _json_error() as exc:
        raise _JsonFailure(_first_line(exc), stream.offset if stream is not None else 0) from exc
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise TraceError(f"{path}: cannot read trace: {_first_line(exc)}") from exc
    return collector, meta, array_top, bytes(stream.tail)


# --- fast path: decode only the events that are needed ----------------------------------------

_SCAN_CHUNK = 1 << 24
#: timestamps beyond this many ns (about 73 years either side of the epoch) are not times
_NS_RANGE = 1 << 61
_STR = rb'"([^"\\]*(?:\\.[^"\\]*)*)"'
_NUM = rb"(-?\d+(?:\.\d+)?)"


def _alternation(cats: frozenset[str]) -> bytes:
    return b"|".join(re.escape(c).encode() for c in sorted(cats, key=lambda c: (-len(c), c)))


#: an event's start: an object whose first key is ``"ph"`` (with unescaped quotes this never occurs inside a
#: JSON string); then, when they follow in Kineto's order, ``ph, cat, name, pid, tid, ts, dur[, args]``
_EVENT = re.compile(
    rb'\{\s*"ph"\s*:(?:\s*"([^"\\]*)"(?:\s*,\s*"cat"\s*:\s*"(?:('
    + _alternation(CPU_CATS)
    + rb')"\s*,\s*"name"\s*:\s*'
    + _STR
    + rb"|("
    + _alternation(RUNTIME_CATS | GPU_CATS)
    + rb')"'
    + rb'(?:\s*,\s*"name"\s*:\s*'
    + _STR
    + rb'\s*,\s*"pid"\s*:\s*(?:-?\d+|"[^"\\]*")\s*,\s*"tid"\s*:\s*(-?\d+)\s*,\s*"ts"\s*:\s*'
    + _NUM
    + rb'\s*,\s*"dur"\s*:\s*'
    + _NUM
    + rb'\s*(?:,\s*"args"\s*:\s*\{|\}))?|([^"\\]*)"))?)?'
)
_INT_VALUE = re.compile(rb"\s*:\s*(-?\d+)\s*[,}\s]")
#: after a CPU event's ``"name": "..."``: ``pid, tid, ts, dur`` in Kineto's order (a cpu_op operator's times)
_OP_TIMES = re.compile(
    rb'\s*,\s*"pid"\s*:\s*(?:-?\d+|"[^"\\]*")\s*,\s*"tid"\s*:\s*(-?\d+)\s*,\s*"ts"\s*:\s*'
    + _NUM
    + rb'\s*,\s*"dur"\s*:\s*'
    + _NUM
    + rb"(?=\s*[,}])"
)
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_ARRAY_TOP = re.compile(rb"\s*\[")
_ARRAY_END = re.compile(rb"\s*\]\s*")
_CPU_B = frozenset(c.encode() for c in CPU_CATS)
_RUNTIME_B = frozenset(c.encode() for c in RUNTIME_CATS)
_GPU_B = frozenset(c.encode() for c in GPU_CATS)
_KERNEL_B = (b"kernel", b"Kernel")


class _Fallback(Exception):
    """The fast path met a layout it does not read exactly: the file is read again by :func:`_stream`."""


def _refuse_constant(token: str) -> Any:
    raise _Fallback(f"non-finite token {token}")


def _ns_text(t: bytes) -> int:
    """A JSON number literal (``-?digits[.digits]``, microseconds) -> integer ns, exactly (as :func:`_ns`)."""
    i = t.find(b".")
    if i < 0:
        return int(t) * 1000
    frac = t[i + 1 :]
    if len(frac) > 3:
        return _ns(Decimal(t.decode()))
    whole, f = int(t[:i]) * 1000, int(frac.ljust(3, b"0"))
    return whole - f if t[:1] == b"-" else whole + f


def _scan(path: Path, pats: Mapping[str, str], keep_all_gpu: bool) -> tuple[_Collector, dict[str, Any], bool, bytes]:
    """:func:`_stream`'s result, decoding only the events that are needed (Kineto's layout).

    Events are located by their first key (``{"ph": ...``, as Kineto writes them; a chunk where some
    ``"ph"`` key is not an event's first key falls back). Flows and other non-``X`` events, and CPU ranges
    whose name is not needed, are skipped after reading ``ph``, ``cat`` and ``name``; runtime and GPU
    events whose ``ph, cat, name, pid, tid, ts, dur[, args]`` come first are read from the bytes
    (``correlation`` and ``stream`` from their args); everything else (needed CPU ranges, collective
    kernels, any event in another layout) is decoded whole with :mod:`json` (floats as
    :class:`~decimal.Decimal`, as ``ijson`` gives them). Any doubt (a non-finite token, invalid UTF-8,
    JSON that does not decode, text after the array that is not JSON, an unreadable file) raises
    :class:`_Fallback`, and the file is read by the exact ``ijson`` path, which also names errors.
    """
    import json

    collector = _Collector(pats, keep_all_gpu, path)
    decoder = json.JSONDecoder(parse_float=Decimal, parse_constant=_refuse_constant)
    relevant: dict[bytes, bool] = {}
    collective: dict[tuple[bytes, bytes], bool] = {}

    def cpu_needed(name: str) -> bool:
        return (
            collector._section_of(name) is not None
            or step_number(name) is not None
            or is_gloo_work(name)
            or is_descriptor(name)
        )

    def text(raw: bytes) -> str:
        return json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode()

    def decode_run(data: bytes, start: int, stop: int, index: int, last: bool) -> int:
        """Decode every event of ``data[start:stop]`` (the file's last ones when ``last``) into the collector.

        Returns the index of the next event. Raises :class:`_Fallback` on text that is not a
        comma-separated run of JSON values (or, when ``last``, not followed by the array's end and
        valid JSON).
        """
        piece = data[start:stop].decode()
        pos, size = 0, len(piece)
        while True:
            ev, pos = decoder.raw_decode(piece, pos)
            collector.read = index
            index += 1
            if not isinstance(ev, dict):
                raise _Fallback("an event that is not an object")  # the exact path names it
            collector.add(ev)
            collector.read = index
            while pos < size and piece[pos] in " \t\r\n":
                pos += 1
            if pos < size and piece[pos] == ",":
                pos += 1
                while pos < size and piece[pos] in " \t\r\n":
                    pos += 1
                if pos < size:
                    continue
                if last:
                    raise _Fallback("no value after a comma")
                return index
            if not last:
                raise _Fallback("text between events")
            rest = piece[pos:].lstrip()
            if rest[:1] != "]":
                raise _Fallback("text after the last event")
            trailer = rest[1:].strip()
            if array_top and trailer:
                raise _Fallback("text after the array")
            if not array_top and trailer != "}" and not (trailer[:1] == "," and _valid_object("{" + trailer[1:])):
                raise _Fallback("text after the event array")
            return index

    try:
        with _open(path) as raw:
            meta, head, array_top = _read_head(path, raw)
            if not array_top and "traceEvents" not in meta:
                raise _Fallback("no traceEvents key")
            opening = _ARRAY_TOP.match(head) if array_top else _EVENTS_KEY.search(head)
            if opening is None:
                raise _Fallback("no event array")
            pending = bytes(head[opening.end() :])
            tail = bytearray(head[-_TAIL:])
            index = 0
            lead = True
            while True:
                chunk = raw.read(_SCAN_CHUNK)
                if chunk:
                    tail += chunk
                    del tail[: max(0, len(tail) - _TAIL)]
                data = pending + chunk
                eof = not chunk
                found = list(_EVENT.finditer(data))
                starts = [m.start() for m in found]
                if lead:
                    if not starts and not eof:
                        pending = data
                        continue
                    lead = False
                    first = starts[0] if starts else len(data)
                    if data[:first].strip():  # events before the first one that starts with "ph"
                        if not starts:
                            if data.strip()[:1] != b"]":
                                decode_run(data, 0, len(data), index, True)
                            break
                        index = decode_run(data, 0, first, index, False)
                    elif not starts:
                        break  # an empty event array at the end of the file
                if not eof:
                    if len(starts) < 2:
                        pending = data
                        continue
                    stops = starts[1:]
                    del found[-1]
                else:
                    stops = starts[1:] + [len(data)]
                hidden: set[int] = set()
                if data.count(b'"ph"', starts[0], stops[-1]) != len(found):
                    hidden = {s for s, e in zip(starts, stops) if data.count(b'"ph"', s, e) != 1}  # noqa: B905
                n_found = len(found)
                for k, m in enumerate(found):
                    s, e = m.start(), stops[k]
                    ph, cpu_cat, cpu_name, cat, rawname, tid, ts, dur, other = m.groups()
                    if (eof and k == n_found - 1) or ph is None or s in hidden:
                        index = decode_run(data, s, e, index, eof and k == n_found - 1)
                        continue
                    index += 1
                    if ph != b"X":
                        continue
                    if cpu_cat is not None:
                        need = relevant.get(cpu_name)
                        if need is None:
                            need = relevant[cpu_name] = cpu_needed(text(cpu_name))
                        if need:
                            decode_run(data, s, e, index - 1, False)
                        elif cpu_cat == b"cpu_op":
                            op = _OP_TIMES.match(data, m.end())
                            if op is None or op.group(3)[:1] == b"-":
                                decode_run(data, s, e, index - 1, False)
                            else:
                                name = text(cpu_name)
                                collector.range_names[name] += 1
                                ots = _ns_text(op.group(2))
                                collector.add_op(name, ots, ots + _ns_text(op.group(3)), int(op.group(1)))
                        else:
                            collector.count_range(text(cpu_name), cpu_cat.decode())
                        continue
                    if cat is None:
                        if other is None or other in _CPU_B or other == b"Trace":  # the profiler's window: read
                            decode_run(data, s, e, index - 1, False)
                        else:
                            collector.count_category(text(other))
                        continue
                    is_rt = cat in _RUNTIME_B
                    if rawname is None or (not is_rt and dur[:1] == b"-"):
                        decode_run(data, s, e, index - 1, False)
                        continue
                    body = m.end()
                    corr = stream = None
                    at = data.find(b'"correlation"', body, e)
                    if at >= 0:
                        v = _INT_VALUE.match(data, at + 13)
                        if v is None or data.find(b'"correlation"', at + 13, e) >= 0:
                            decode_run(data, s, e, index - 1, False)
                            continue
                        corr = int(v.group(1))
                    start = int(ts.replace(b".", b"")) if len(ts) > 4 and ts[-4] == 46 else _ns_text(ts)
                    if is_rt:
                        if corr is not None:
                            collector.rt_corr.append(corr)
                            collector.rt_start.append(start)
                            if start < 0:
                                collector.rt_unset.append(corr)
                        continue
                    coll = collective.get((cat, rawname))
                    if coll is None:
                        coll = collective[cat, rawname] = cat in _KERNEL_B and is_collective_kernel(text(rawname))
                    at = data.find(b'"stream"', body, e)
                    if at < 0 and data.find(b'queue"', body, e) >= 0:  # XPU: "sycl queue", read by stream_of
                        coll = True
                    elif at >= 0:
                        v = _INT_VALUE.match(data, at + 8)
                        if v is None or data.find(b'"stream"', at + 8, e) >= 0:
                            coll = True
                        else:
                            stream = int(v.group(1))
                    if coll:
                        decode_run(data, s, e, index - 1, False)
                        continue
                    d = int(dur.replace(b".", b"")) if len(dur) > 4 and dur[-4] == 46 else _ns_text(dur)
                    collector.add_gpu_event(
                        text(rawname),
                        start,
                        start + d,
                        stream if stream is not None else int(tid),
                        -1 if corr is None else corr,
                        None,
                    )
                if eof:
                    break
                pending = data[stops[-1] :]
            collector.read = index
    except (json.JSONDecodeError, UnicodeDecodeError, TraceError, OSError, EOFError, zlib.error, OverflowError) as exc:
        # the exact path reads the file again and names what is wrong
        raise _Fallback(_first_line(exc)) from exc
    return collector, meta, array_top, bytes(tail)


def _valid_object(text: str) -> bool:
    import json

    try:
        return isinstance(json.loads(text, parse_constant=_refuse_constant), dict)
    except (ValueError, _Fallback):
        return False


def _non_finite_tokens(path: Path) -> list[tuple[str, int]]:
    """Every bare ``inf``/``NaN``/``Infinity`` value token in the (decompressed) file, with its byte offset."""
    out: list[tuple[str, int]] = []
    done = 0  # offset of carry[0] (the last byte of the previous part, kept for the look-behind)
    carry = b""
    with _open(path) as raw:
        while True:
            chunk = raw.read(1 << 22)
            text = carry + chunk
            cut = len(text) if not chunk else max(text.rfind(b","), text.rfind(b"]"), text.rfind(b"}")) + 1
            for m in _NON_FINITE.finditer(text[:cut]):
                out.append((m.group(2).decode(), done + m.start(2)))
            if not chunk:
                return out
            start = max(cut - 1, 0)
            done += start
            carry = text[start:]


def _meta_from_tail(tail: bytes) -> dict[str, Any]:
    """The top-level keys of :data:`_META_KEYS` written after ``traceEvents`` (found in the file's last bytes)."""
    import json

    text = tail.decode("utf-8", errors="replace")
    out: dict[str, Any] = {}
    dec = json.JSONDecoder()
    for key in _META_KEYS:
        for m in reversed(list(re.finditer(rf'"{key}"\s*:\s*', text))):
            try:
                out[key] = dec.raw_decode(text, m.end())[0]
                break
            except ValueError:
                continue
    return out


# --- reading ---------------------------------------------------------------------------------


def _open(path: Path) -> BinaryIO:
    """The file's bytes: decompressed when it starts with the gzip magic number."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        return cast(BinaryIO, gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb"))  # noqa: SIM115
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror or exc}") from exc


def _read_head(path: Path, raw: BinaryIO) -> tuple[dict[str, Any], bytes, bool]:
    """Top-level keys before ``traceEvents``; the bytes read so far; whether the top is an array."""
    head = b""
    size = _HEAD_START
    while True:
        try:
            chunk = raw.read(size - len(head))
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(f"{path}: cannot read trace: {_first_line(exc)}") from exc
        head += chunk
        start = head.lstrip()[:1]
        if start == b"[":
            return {}, head, True
        if head.strip() and start != b"{":
            raise NotATraceError(f"{path}: not a JSON trace (starts with {head.lstrip()[:20]!r})")
        meta, complete = _parse_head(head)
        if complete or not chunk or len(head) >= _HEAD_MAX:
            if not head.strip():
                raise TraceError(f"{path}: empty file")
            return meta, head, False
        size = min(2 * size, _HEAD_MAX)


def _parse_head(head: bytes) -> tuple[dict[str, Any], bool]:
    """Top-level values of the object in ``head`` up to ``traceEvents`` (True when reached)."""
    import ijson

    meta: dict[str, Any] = {}
    key, builder, depth = None, None, 0
    try:
        for prefix, event, value in ijson.parse(io.BytesIO(head), use_float=False):
            if builder is None:
                if prefix == "" and event == "map_key":
                    if value == "traceEvents":
                        meta["traceEvents"] = True
                        return meta, True
                    key, builder, depth = value, ijson.ObjectBuilder(), 0
                continue
            builder.event(event, value)
            depth += event in ("start_map", "start_array")
            depth -= event in ("end_map", "end_array")
            if depth == 0:
                meta[key] = builder.value  # type: ignore[index]
                builder = None
    except ijson.IncompleteJSONError:
        return meta, False
    except ijson.JSONError as exc:
        raise ValueError(f"invalid JSON: {_first_line(exc)}") from exc
    return meta, True


class _Replay(io.RawIOBase):
    """Binary stream: ``head`` then the rest of ``raw``; remembers the last bytes read and the offset.

    With ``repair``, bare non-finite value tokens (``inf``, ``-inf``, ``NaN``, ``Infinity``) are
    replaced by ``null``; the text is cut after the last ``,``/``]``/``}`` of each chunk so that no
    token is split.
    """

    def __init__(self, head: bytes, raw: BinaryIO, repair: bool = False) -> None:
        self._head = memoryview(head)
        self._raw = raw
        self.tail = bytearray()
        self.offset = 0
        self._repair = repair
        self._carry = b""
        self._prev = b""
        self._out = b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = _CHUNK if n is None or n < 0 else n
        if not self._repair:
            return self._read(n)
        while len(self._out) < n:
            data = self._read(n)
            if not data:
                self._out += self._fix(self._carry)
                self._carry = b""
                break
            text = self._carry + data
            cut = max(text.rfind(b","), text.rfind(b"]"), text.rfind(b"}")) + 1
            self._out += self._fix(text[:cut])
            self._carry = text[cut:]
        out, self._out = self._out[:n], self._out[n:]
        return out

    def _fix(self, text: bytes) -> bytes:
        if not text:
            return text
        fixed = _NON_FINITE.sub(rb"\1null", self._prev + text)[len(self._prev) :]
        self._prev = text[-1:]
        return fixed

    def _read(self, n: int) -> bytes:
        if len(self._head):
            data, self._head = bytes(self._head[:n]), self._head[n:]
        else:
            data = self._raw.read(n)
        if data:
            self.offset += len(data)
            self.tail += data
            if len(self.tail) > 2 * _TAIL:
                del self.tail[: len(self.tail) - _TAIL]
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


def _json_error() -> type[Exception]:
    import ijson

    return ijson.JSONError


def _info(path: Path, meta: Mapping[str, Any]) -> TraceInfo:
    d = meta.get("distributedInfo") or {}
    base = meta.get("baseTimeNanoseconds")

    def as_int(v: Any) -> int | None:
        try:
            return None if v is None else int(v)
        except (TypeError, ValueError):
            return None

    return TraceInfo(
        path=path,
        rank=as_int(d.get("rank")),
        world_size=as_int(d.get("world_size")),
        backend=d.get("backend"),
        nccl_version=d.get("nccl_version"),
        base_ns=as_int(base),
    )


# --- event selection -------------------------------------------------------------------------


def ts_text(ev: Mapping[str, Any]) -> str:
    """An event's ``ts`` as written (for messages)."""
    return str(ev.get("ts"))


def _ns(x: Any) -> int:
    """Microseconds (int, Decimal, float or str) -> integer nanoseconds, exactly for decimals."""
    if isinstance(x, int):
        return x * 1000
    if isinstance(x, Decimal):
        return int((x * 1000).to_integral_value(ROUND_HALF_EVEN))
    if isinstance(x, float):
        return round(x * 1000)
    return int((Decimal(str(x)) * 1000).to_integral_value(ROUND_HALF_EVEN))


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


class _Collector:
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
        # other cpu_op operators (compute or c10d calls), for the time a thread is blocked on its collectives
        self.op_start, self.op_end, self.op_tid, self.op_name = array("q"), array("q"), array("q"), array("q")
        self.op_names: dict[str, int] = {}
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
        start = _ns(ts)
        if not -_NS_RANGE <= start <= _NS_RANGE:
            raise TraceError(f"{self.path}: event #{self.read - 1} {ev.get('name')!r}: ts {ts} us is out of any "
                             f"clock's range (a timestamp in the wrong unit, or corrupt)")  # fmt: skip
        dur = ev.get("dur")
        if dur is None or isinstance(dur, bool):
            return start, start, f"no dur (ts {ts} us)"
        d = _ns(dur)
        if d < 0:
            return start, start, f"negative dur {dur} us (ts {ts} us)"
        return start, start + d, None

    def _no_ts(self, ev: Mapping[str, Any]) -> None:
        self.no_ts.append(f"event #{self.read - 1} {ev.get('name')!r} ({ev.get('cat')})")

    def add(self, ev: Mapping[str, Any]) -> None:
        self.read += 1
        if ev.get("ph") != "X":
            return
        cat = ev.get("cat")
        if cat in RUNTIME_CATS:
            corr = int_or_none((ev.get("args") or {}).get("correlation"))
            if corr is not None:
                times = self._times(ev)
                if times is None:
                    self._no_ts(ev)
                    return
                self.rt_corr.append(corr)
                self.rt_start.append(times[0])
                if times[0] < 0:
                    self.rt_unset.append(corr)
            return
        if cat in GPU_CATS:
            self._add_gpu(ev)
            return
        if cat not in CPU_CATS:
            if cat == "Trace" and str(ev.get("name", "")).startswith("PyTorch Profiler"):
                times = self._times(ev)
                if times is not None and times[2] is None:
                    self.window = (times[0], times[1])
            elif isinstance(cat, str):
                self.count_category(cat)
            return
        name = ev.get("name")
        if not isinstance(name, str):
            return
        self.count_range(name, str(cat))
        section = self._section_of(name)
        step = step_number(name) is not None
        if section is None and not step and not (is_gloo_work(name) or is_descriptor(name)):
            if cat == "cpu_op":
                times = self._times(ev)
                if times is not None and times[2] is None:
                    self.add_op(name, times[0], times[1], int_or_none(ev.get("tid")) or 0)
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

    def add_op(self, name: str, start: int, end: int, tid: int) -> None:
        """A ``cpu_op`` operator that is neither a section nor a collective range (times in ns)."""
        self.op_start.append(start)
        self.op_end.append(end)
        self.op_tid.append(tid)
        self.op_name.append(self.op_names.setdefault(name, len(self.op_names)))

    def _ops(self, base_ns: int) -> list[Event]:
        """The operators that matter to blocked time: ``c10d::`` calls, and those overlapping a gloo work range
        or a ``c10d::`` call (:mod:`pnpscale.analysis.overlap`); the rest cannot change it."""
        import numpy as np

        if not len(self.op_start):
            return []
        start = np.frombuffer(self.op_start, dtype=np.int64)
        end = np.frombuffer(self.op_end, dtype=np.int64)
        names = list(self.op_names)
        c10d = np.array([n.startswith(C10D_PREFIX) for n in names], dtype=bool)[np.frombuffer(self.op_name, np.int64)]
        spans = [(e.start_ns, e.end_ns) for e in self.cpu if is_gloo_work(e.name)]
        spans += list(zip(start[c10d].tolist(), end[c10d].tolist(), strict=True))
        merged = union(spans)
        keep = c10d.copy()
        if merged:
            lo = np.array([a for a, _ in merged], dtype=np.int64)
            hi = np.array([b for _, b in merged], dtype=np.int64)
            i = np.searchsorted(hi, start, side="right")
            inside = i < len(hi)
            keep |= inside & (lo[np.minimum(i, len(lo) - 1)] < end)
        return [
            Event(names[self.op_name[i]], Kind.OP, int(start[i]) + base_ns, int(end[i]) + base_ns, tid=self.op_tid[i])
            for i in np.flatnonzero(keep).tolist()
        ]

    def _add_gpu(self, ev: Mapping[str, Any]) -> None:
        args = ev.get("args") or {}
        name = ev.get("name")
        name = name if isinstance(name, str) else ""
        times = self._times(ev)
        if times is None:
            self._no_ts(ev)
            return
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
        nid = self.names.setdefault(name, len(self.names))
        self.gpu_start.append(start)
        self.gpu_end.append(end)
        self.gpu_corr.append(corr)
        self.gpu_stream.append(stream)
        self.gpu_name.append(nid)

    @property
    def gpu_events(self) -> int:
        return len(self.gpu_start) + len(self.nccl) + len(self.bad_gpu)

    def _dedupe(self, anomalies: Anomalies, rank: int | None) -> None:
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

        self.sections = unique(self.sections, ev_key, ev_label)
        self.cpu = unique(self.cpu, ev_key, ev_label)
        self.nccl = unique(
            self.nccl,
            lambda n: (n[0], n[1], n[2], n[3], n[4]),
            lambda n: f"{n[0].split('(')[0]!r} at ts {n[1]} ns (stream {n[3]}, correlation {n[4]})",
        )
        if dups:
            anomalies.add("duplicate_event", rank, dups[0], len(dups))

    def _clock_offset(self, launch_of: Any, anomalies: Anomalies, rank: int | None) -> int:
        """The offset (ns) that puts the runtime clock on the CPU ranges' clock (:func:`runtime_offset`), 0 if none."""
        import numpy as np

        if not self.nccl or not len(self.rt_corr):
            return 0
        launches, _ = launch_of(np.array([n[4] for n in self.nccl], dtype=np.int64))
        known = [int(x) for x in launches if x >= 0]
        descs = [e for e in self.cpu if is_named_descriptor(e.name)] or [e for e in self.cpu if e.name == PARAM_COMMS]
        fit = runtime_offset(known, [(d.start_ns, d.end_ns) for d in descs])
        if fit is None:
            return 0
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
            len(self.rt_corr),
        )
        return off

    def events(self, base_ns: int, anomalies: Anomalies | None = None, rank: int | None = None) -> list[Event]:
        """The kept events, shifted by ``base_ns`` (0 for absolute traces); anomalies recorded (:func:`read_trace`).

        Raises:
            TraceError: section ranges of more than one process, or collective kernels of more than one
                device, in the file (one trace per rank is expected).
        """
        import numpy as np

        anomalies = anomalies if anomalies is not None else Anomalies()
        if len(self.section_pids) > 1:
            pids = ", ".join(f"pid {p} ({n} ranges)" for p, n in sorted(self.section_pids.items()))
            raise TraceError(f"{self.path}: section ranges of {len(self.section_pids)} processes in one file ({pids}): "
                             f"pnpscale reads one trace per rank; split the file by process")  # fmt: skip
        devices = Counter(n[7] for n in self.nccl)
        if len(devices) > 1:
            devs = ", ".join(f"device {d} ({n} kernels)" for d, n in sorted(devices.items()))
            raise TraceError(f"{self.path}: collective kernels of {len(devices)} devices in one file ({devs}): more "
                             f"than one rank in one trace; pnpscale reads one trace per rank")  # fmt: skip
        if self.no_ts:
            anomalies.add("event_without_ts", rank, self.no_ts[0], len(self.no_ts))
        if self.unknown_categories:
            cats = ", ".join(f"{c!r} ({n})" for c, n in self.unknown_categories.most_common())
            anomalies.add("unknown_category", rank, cats, sum(self.unknown_categories.values()))
        self._dedupe(anomalies, rank)
        rt_corr = np.frombuffer(self.rt_corr, dtype=np.int64) if len(self.rt_corr) else np.zeros(0, np.int64)
        rt_start = np.frombuffer(self.rt_start, dtype=np.int64) if len(self.rt_start) else np.zeros(0, np.int64)
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

        rt_start += self._clock_offset(launch_of, anomalies, rank)

        def shift(e: Event) -> Event:
            return replace(e, start_ns=e.start_ns + base_ns, end_ns=e.end_ns + base_ns)

        out = [shift(e) for e in self.sections]
        out += [shift(e) for e in merge_descriptors(self.cpu)]
        out += self._ops(base_ns)
        outside: list[str] = []
        faults = self._faults(launch_of)
        nccl_faults = faults[len(self.gpu_start) :]
        if self.nccl:
            launches, away = launch_of(np.array([n[4] for n in self.nccl], dtype=np.int64))
            for (name, start, end, stream, corr, fields, bad, _), launch, gone, fault in zip(
                self.nccl, launches, away, nccl_faults, strict=True
            ):
                if gone:
                    outside.append(f"{name.split('(')[0]} at ts {start} ns, correlation {corr}")
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
        for e in self.bad_gpu:
            launch, gone = launch_of(np.array([e.correlation], dtype=np.int64))
            if not gone[0]:
                out.append(shift(replace(e, launch_ns=None if launch[0] < 0 else int(launch[0]) + base_ns)))
        out += self._gpu_representatives(launch_of, base_ns, outside, anomalies, rank, faults[: len(self.gpu_start)])
        if outside:
            anomalies.add("gpu_event_outside_window", rank, outside[0], len(outside))
        if self.overlap_count:
            anomalies.add("stream_overlap", rank, self.overlaps[0], self.overlap_count)
        if self.names:
            counts = np.bincount(np.frombuffer(self.gpu_name, dtype=np.int64), minlength=len(self.names))
            hits = [(name, int(counts[i])) for name, i in self.names.items() if COLLECTIVE_WORDS.search(name)]
            if hits:
                text = ", ".join(f"{n.split('(')[0]!r} ({c})" for n, c in hits[:5])
                anomalies.add("collective_kernel_unrecognised", rank, text, sum(c for _, c in hits))
        if self.before_launch_count:
            lead, example = self.before_launch
            anomalies.add("gpu_before_launch", rank, f"up to {lead / 1000:g} us before its launch: {example}",
                          self.before_launch_count)  # fmt: skip
        return out

    def _faults(self, launch_of: Any) -> list[str | None]:
        """Why each device event (the other GPU events, then the collective kernels) is not physical
        (:func:`pnpscale.analysis.gpu_checks.gpu_faults`), else ``None``."""
        import numpy as np

        n = len(self.gpu_start)
        names = list(self.names)
        start = np.concatenate([np.frombuffer(self.gpu_start, dtype=np.int64) if n else np.zeros(0, np.int64),
                                np.array([x[1] for x in self.nccl], dtype=np.int64)])  # fmt: skip
        end = np.concatenate([np.frombuffer(self.gpu_end, dtype=np.int64) if n else np.zeros(0, np.int64),
                              np.array([x[2] for x in self.nccl], dtype=np.int64)])  # fmt: skip
        stream = np.concatenate([np.frombuffer(self.gpu_stream, dtype=np.int64) if n else np.zeros(0, np.int64),
                                 np.array([x[3] for x in self.nccl], dtype=np.int64)])  # fmt: skip
        corr = np.concatenate([np.frombuffer(self.gpu_corr, dtype=np.int64) if n else np.zeros(0, np.int64),
                               np.array([x[4] for x in self.nccl], dtype=np.int64)])  # fmt: skip
        launch, away = launch_of(corr)
        keep = ~away
        codes = np.zeros(len(start), dtype=np.int8)
        other = np.full(len(start), -1, dtype=np.int64)
        idx = np.flatnonzero(keep)
        c, o = gpu_faults(start[idx], end[idx], stream[idx], corr[idx], launch[idx], self.window)
        codes[idx] = c
        other[idx] = np.where(o >= 0, idx[np.maximum(o, 0)], -1)
        launch_unset = np.isin(corr, np.array(self.rt_unset, dtype=np.int64)) & keep if self.rt_unset else None

        def name(i: int) -> str:
            return (names[self.gpu_name[i]] if i < n else self.nccl[i - n][0]).split("(")[0]

        out: list[str | None] = [None] * len(start)
        before = np.flatnonzero(codes == BEFORE_LAUNCH)  # a GPU clock ahead of the CPU's: placement by launch holds
        if len(before):
            i = int(before[np.argmax(launch[before] - start[before])])
            self.before_launch = [int(launch[i] - start[i]), f"{name(i)!r} at ts {start[i] / 1000:g} us, "
                                  f"correlation {corr[i]}"]  # fmt: skip
            self.before_launch_count = len(before)
        over = codes == STREAM_OVERLAP
        index = np.arange(len(start))
        soft = over & (index < n) & (other < n)  # compute kernels may overlap (programmatic dependent launch)
        if soft.any():
            i = int(np.argmax(soft))
            j = int(other[i])
            self.overlaps = [f"{name(i)!r} at ts {start[i] / 1000:g} us starts {(end[j] - start[i]) / 1000:g} us "
                             f"before {name(j)!r} ends on stream {stream[i]}"]  # fmt: skip
            self.overlap_count = int(soft.sum())
        if launch_unset is not None:
            for i in np.flatnonzero(launch_unset).tolist():
                out[i] = f"its launch (correlation {corr[i]}) has a negative timestamp: placement unknown"
        for i in np.flatnonzero((codes == TS_UNSET) | (codes == OUTSIDE_WINDOW) | (over & ~soft)).tolist():
            us = f"ts {start[i] / 1000:g} us"
            if codes[i] == TS_UNSET:
                out[i] = f"at {us}: an unset timestamp (ts <= 0, kineto#109), not a time"
            elif codes[i] == OUTSIDE_WINDOW and self.window is not None:
                w0, w1 = self.window
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
        self,
        launch_of: Any,
        base_ns: int,
        outside: list[str],
        anomalies: Anomalies,
        rank: int | None,
        faults: Sequence[str | None] = (),
    ) -> list[Event]:
        """Per section range, the first-starting and last-ending GPU event launched inside it; and every
        event with a fault (its iteration is then dropped)."""
        import numpy as np

        n = len(self.gpu_start)
        if n == 0:
            return []
        start = np.frombuffer(self.gpu_start, dtype=np.int64)
        end = np.frombuffer(self.gpu_end, dtype=np.int64)
        corr = np.frombuffer(self.gpu_corr, dtype=np.int64)
        launch, away = launch_of(corr)
        names = list(self.names)
        if away.any():
            i = int(np.argmax(away))
            outside.append(f"{names[self.gpu_name[i]]} at ts {int(start[i])} ns, correlation {int(corr[i])}")
            outside.extend([""] * (int(away.sum()) - 1))
        by_start = (launch < 0) & ~away
        if by_start.any():
            i = int(np.argmax(by_start))
            why = (
                "correlation 0 (unknown launch)"
                if int(corr[i]) in UNKNOWN_CORRELATIONS
                else (
                    f"correlation {int(corr[i])}, and the trace holds no runtime event of a known category"
                    + (
                        f" (categories not read: {', '.join(self.unknown_categories)})"
                        if self.unknown_categories
                        else ""
                    )
                )
            )
            anomalies.add(
                "launch_unknown_by_start",
                rank,
                f"{names[self.gpu_name[i]]} at ts {int(start[i])} ns, {why}",
                int(by_start.sum()),
            )
        valid = np.flatnonzero(~away)
        place = np.where(launch >= 0, launch, start)[valid]
        order = valid[np.argsort(place, kind="stable")]
        placed = np.sort(place, kind="stable")
        keep = set(valid.tolist()) if self.keep_all_gpu else ({int(valid[0])} if len(valid) else set())
        comm = union((n[1], n[2]) for n in self.nccl if n[6] is None)
        if comm and not self.keep_all_gpu:  # compute overlapping a collective kernel hides it
            c_lo = np.array([a for a, _ in comm], dtype=np.int64)
            c_hi = np.array([b for _, b in comm], dtype=np.int64)
            j = np.searchsorted(c_hi, start[valid], side="right")
            over = (j < len(c_hi)) & (c_lo[np.minimum(j, len(c_lo) - 1)] < end[valid])
            keep.update(valid[over].tolist())
        for r in [] if self.keep_all_gpu else self.sections:
            lo = int(np.searchsorted(placed, r.start_ns, side="left"))
            hi = int(np.searchsorted(placed, r.end_ns, side="right"))
            if hi > lo:
                idx = order[lo:hi]
                keep.add(int(idx[np.argmin(start[idx])]))
                keep.add(int(idx[np.argmax(end[idx])]))
        bad = {i: f for i, f in enumerate(faults) if f is not None}
        keep |= set(bad)
        return [
            Event(
                names[self.gpu_name[i]],
                Kind.GPU,
                int(start[i]) + base_ns,
                int(start[i] if i in bad else end[i]) + base_ns,
                tid=int(self.gpu_stream[i]),
                correlation=int(corr[i]),
                launch_ns=None if launch[i] < 0 else int(launch[i]) + base_ns,
                bad=bad.get(i),
            )
            for i in sorted(keep)
        ]


def iter_trace_files(paths: Sequence[Path | str]) -> Iterator[Path]:
    """Trace files named by ``paths``: files as given, folders' ``*.json``/``*.json.gz`` (not recursive).

    Raises:
        TraceError: a path does not exist.
    """
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
        elif p.is_file():
            yield p
        else:
            raise TraceError(f"{p}: no such file or folder")
