"""The two passes over a trace file that feed a :class:`~pnpscale.analysis.trace.collect.Collector`.

* :func:`scan_file`, the fast path: a bytes-level pre-filter that decodes only the events sections need
  (Kineto's layout); any doubt raises :class:`~pnpscale.analysis.trace.files.Fallback`;
* :func:`stream_events`, the exact path: every event through ``ijson`` (optionally repairing bare non-finite
  tokens), which names what is wrong (:class:`JsonFailure`: message and byte offset).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from pnpscale.analysis.kineto import (
    CPU_CATS,
    END_MARKER,
    GPU_CATS,
    P2P_CALLS,
    RUNTIME_CATS,
    is_collective_kernel,
    is_descriptor,
    is_gloo_work,
    launch_kind,
    step_number,
)
from pnpscale.analysis.trace.collect import Collector
from pnpscale.analysis.trace.files import (
    TAIL,
    Fallback,
    Replay,
    TraceError,
    first_line,
    json_error,
    ns_text,
    open_trace_file,
    read_head,
    refuse_constant,
    valid_object,
)


class JsonFailure(Exception):
    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message, self.offset = message, offset


def stream_events(
    path: Path, pats: Mapping[str, str], keep_all_gpu: bool, repair: bool
) -> tuple[Collector, dict[str, Any], bool, bytes]:
    """One pass over the file: (collector, metadata before the events, top is an array, last bytes)."""
    collector = Collector(pats, keep_all_gpu, path)
    stream = None
    try:
        with open_trace_file(path) as raw:
            meta, head, array_top = read_head(path, raw)
            stream = Replay(head, raw, repair)
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
    except json_error() as exc:
        raise JsonFailure(first_line(exc), stream.offset if stream is not None else 0) from exc
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise TraceError(f"{path}: cannot read trace: {first_line(exc)}") from exc
    return collector, meta, array_top, bytes(stream.tail)


# --- fast path: decode only the events that are needed ----------------------------------------


_SCAN_CHUNK = 1 << 24
#: timestamps beyond this many ns (about 73 years either side of the epoch) are not times
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
_END_MARKER = b'"' + END_MARKER.encode() + b'"'


@dataclass
class ScanState:
    """What the fast pass carries from event to event: the collector, the JSON decoder, the caches of what a name
    needs (decoded whole or read from the bytes), and whether the file's top level is the event array."""

    collector: Collector
    array_top: bool = False
    decoder: json.JSONDecoder = field(
        default_factory=lambda: json.JSONDecoder(parse_float=Decimal, parse_constant=refuse_constant)
    )
    relevant: dict[bytes, bool] = field(default_factory=dict)  # CPU range name -> decoded whole
    collective: dict[tuple[bytes, bytes], bool] = field(default_factory=dict)  # (cat, name) -> collective kernel
    launches: dict[bytes, int] = field(default_factory=dict)  # runtime call name -> launch_kind


def cpu_needed(state: ScanState, name: str) -> bool:
    """Whether a CPU range is decoded whole: a section, a ``ProfilerStep``, a gloo work range, a descriptor or a
    point-to-point ``c10d::`` call (its peer and tag are in its args)."""
    return (
        name in P2P_CALLS
        or state.collector._section_of(name) is not None
        or step_number(name) is not None
        or is_gloo_work(name)
        or is_descriptor(name)
    )


def unescape(raw: bytes) -> str:
    """A JSON string's content (the bytes between its quotes) as text."""
    return json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode()


def decode_run(state: ScanState, data: bytes, start: int, stop: int, index: int, last: bool) -> int:
    """Decode every event of ``data[start:stop]`` (the file's last ones when ``last``) into the collector.

    Returns the index of the next event. Raises :class:`Fallback` on text that is not a
    comma-separated run of JSON values (or, when ``last``, not followed by the array's end and
    valid JSON).
    """
    collector, decoder, array_top = state.collector, state.decoder, state.array_top
    piece = data[start:stop].decode()
    pos, size = 0, len(piece)
    while True:
        ev, pos = decoder.raw_decode(piece, pos)
        collector.read = index
        index += 1
        if not isinstance(ev, dict):
            raise Fallback("an event that is not an object")  # the exact path names it
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
                raise Fallback("no value after a comma")
            return index
        if not last:
            raise Fallback("text between events")
        rest = piece[pos:].lstrip()
        if rest[:1] != "]":
            raise Fallback("text after the last event")
        trailer = rest[1:].strip()
        if array_top and trailer:
            raise Fallback("text after the array")
        if not array_top and trailer != "}" and not (trailer[:1] == "," and valid_object("{" + trailer[1:])):
            raise Fallback("text after the event array")
        return index


def open_event_array(path: Path, raw: Any) -> tuple[dict[str, Any], bool, bytes, bytearray]:
    """Read a file's head up to its event array: (metadata before the events, top is an array, the bytes after
    the array's ``[``, the last :data:`TAIL` bytes read). Raises :class:`Fallback` without an event array."""
    meta, head, array_top = read_head(path, raw)
    if not array_top and "traceEvents" not in meta:
        raise Fallback("no traceEvents key")
    opening = _ARRAY_TOP.match(head) if array_top else _EVENTS_KEY.search(head)
    if opening is None:
        raise Fallback("no event array")
    return meta, array_top, bytes(head[opening.end() :]), bytearray(head[-TAIL:])


def read_cpu_event(state: ScanState, data: bytes, m: re.Match[bytes], s: int, e: int, index: int) -> None:
    """A CPU range located at ``data[s:e]`` (``m``: its :data:`_EVENT` match; ``index``: the index after it):
    decoded whole when needed, a ``cpu_op``'s times read from the bytes, else only its name counted."""
    collector = state.collector
    cpu_cat, cpu_name = m.group(2), m.group(3)
    need = state.relevant.get(cpu_name)
    if need is None:
        need = state.relevant[cpu_name] = cpu_needed(state, unescape(cpu_name))
    if need:
        decode_run(state, data, s, e, index - 1, False)
    elif cpu_cat == b"cpu_op":
        op = _OP_TIMES.match(data, m.end())
        if op is None or op.group(3)[:1] == b"-":
            decode_run(state, data, s, e, index - 1, False)
        else:
            name = unescape(cpu_name)
            collector.range_names[name] += 1
            ots = ns_text(op.group(2))
            at = data.find(b'"External id"', op.end(), e)
            v = _INT_VALUE.match(data, at + 13) if at >= 0 else None
            collector.add_op(name, ots, ots + ns_text(op.group(3)), int(op.group(1)),
                             int(v.group(1)) if v is not None else -1)  # fmt: skip
    else:
        collector.count_range(unescape(cpu_name), cpu_cat.decode())


def read_device_event(state: ScanState, data: bytes, m: re.Match[bytes], s: int, e: int, index: int) -> None:
    """A runtime or device event located at ``data[s:e]`` (``m``: its :data:`_EVENT` match with ``cat, name, tid,
    ts, dur`` read; ``index``: the index after it): its times, correlation and stream read from the bytes;
    decoded whole when they are not in Kineto's layout, and collective kernels always."""
    collector = state.collector
    cat, rawname, tid, ts, dur = m.group(4), m.group(5), m.group(6), m.group(7), m.group(8)
    is_rt = cat in _RUNTIME_B
    if rawname is None or (not is_rt and dur[:1] == b"-"):
        decode_run(state, data, s, e, index - 1, False)
        return
    body = m.end()
    corr = stream = None
    at = data.find(b'"correlation"', body, e)
    if at >= 0:
        v = _INT_VALUE.match(data, at + 13)
        if v is None or data.find(b'"correlation"', at + 13, e) >= 0:
            decode_run(state, data, s, e, index - 1, False)
            return
        corr = int(v.group(1))
    start = int(ts.replace(b".", b"")) if len(ts) > 4 and ts[-4] == 46 else ns_text(ts)
    if is_rt:
        if corr is not None:
            launch = state.launches.get(rawname)
            if launch is None:
                launch = state.launches[rawname] = launch_kind(unescape(rawname))
            at = data.find(b'"External id"', body, e)
            v = _INT_VALUE.match(data, at + 13) if at >= 0 else None
            d = int(dur.replace(b".", b"")) if len(dur) > 4 and dur[-4] == 46 else ns_text(dur)
            collector.add_runtime(corr, start, launch, int(v.group(1)) if v is not None else -1,
                                  int(tid), start + d)  # fmt: skip
        return
    coll = state.collective.get((cat, rawname))
    if coll is None:
        coll = state.collective[cat, rawname] = cat in _KERNEL_B and is_collective_kernel(unescape(rawname))
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
        decode_run(state, data, s, e, index - 1, False)
        return
    d = int(dur.replace(b".", b"")) if len(dur) > 4 and dur[-4] == 46 else ns_text(dur)
    collector.add_gpu_event(
        unescape(rawname),
        start,
        start + d,
        stream if stream is not None else int(tid),
        -1 if corr is None else corr,
        None,
    )


def scan_events(
    state: ScanState, data: bytes, found: list[re.Match[bytes]], stops: list[int], index: int, eof: bool
) -> int:
    """Read the events located in ``data`` (``found``: their :data:`_EVENT` matches, ``stops``: where each ends;
    ``eof``: the last one is the file's last) into the collector; returns the index of the next event. An event
    whose span holds another ``"ph"`` key (a first key that is not an event's), the file's last event, and any
    event not in Kineto's layout are decoded whole (:func:`decode_run`)."""
    collector = state.collector
    starts = [m.start() for m in found]
    hidden: set[int] = set()
    if data.count(b'"ph"', starts[0], stops[-1]) != len(found):
        hidden = {s for s, e in zip(starts, stops) if data.count(b'"ph"', s, e) != 1}  # noqa: B905
    n_found = len(found)
    for k, m in enumerate(found):
        s, e = m.start(), stops[k]
        ph, cpu_cat, cat, other = m.group(1), m.group(2), m.group(4), m.group(9)
        if (eof and k == n_found - 1) or ph is None or s in hidden:
            index = decode_run(state, data, s, e, index, eof and k == n_found - 1)
            continue
        index += 1
        if ph != b"X":
            if ph == b"i" and data.find(_END_MARKER, s, e) >= 0:
                collector.end_marker = True
            continue
        if cpu_cat is not None:
            read_cpu_event(state, data, m, s, e, index)
            continue
        if cat is None:
            if other is None or other in _CPU_B or other == b"Trace":  # the profiler's window: read
                decode_run(state, data, s, e, index - 1, False)
            else:
                collector.count_category(unescape(other))
            continue
        read_device_event(state, data, m, s, e, index)
    return index


def scan_file(path: Path, pats: Mapping[str, str], keep_all_gpu: bool) -> tuple[Collector, dict[str, Any], bool, bytes]:
    """:func:`stream_events`'s result, decoding only the events that are needed (Kineto's layout).

    Events are located by their first key (``{"ph": ...``, as Kineto writes them; a chunk where some
    ``"ph"`` key is not an event's first key falls back). Flows and other non-``X`` events, and CPU ranges
    whose name is not needed, are skipped after reading ``ph``, ``cat`` and ``name``; runtime and GPU
    events whose ``ph, cat, name, pid, tid, ts, dur[, args]`` come first are read from the bytes
    (``correlation`` and ``stream`` from their args); everything else (needed CPU ranges, collective
    kernels, any event in another layout) is decoded whole with :mod:`json` (floats as
    :class:`~decimal.Decimal`, as ``ijson`` gives them). Any doubt (a non-finite token, invalid UTF-8,
    JSON that does not decode, text after the array that is not JSON, an unreadable file) raises
    :class:`Fallback`, and the file is read by the exact ``ijson`` path, which also names errors.

    Steps, each a function of its own: :func:`open_event_array` (the head), then per chunk of
    :data:`_SCAN_CHUNK` bytes the events located by :data:`_EVENT`, read by :func:`scan_events`
    (:func:`read_cpu_event`, :func:`read_device_event`, :func:`decode_run`).
    """
    state = ScanState(Collector(pats, keep_all_gpu, path))
    collector = state.collector
    try:
        with open_trace_file(path) as raw:
            meta, state.array_top, pending, tail = open_event_array(path, raw)
            index = 0
            lead = True
            while True:
                chunk = raw.read(_SCAN_CHUNK)
                if chunk:
                    tail += chunk
                    del tail[: max(0, len(tail) - TAIL)]
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
                                decode_run(state, data, 0, len(data), index, True)
                            break
                        index = decode_run(state, data, 0, first, index, False)
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
                index = scan_events(state, data, found, stops, index, eof)
                if eof:
                    break
                pending = data[stops[-1] :]
            collector.read = index
    except (json.JSONDecodeError, UnicodeDecodeError, TraceError, OSError, EOFError, zlib.error, OverflowError) as exc:
        # the exact path reads the file again and names what is wrong
        raise Fallback(first_line(exc)) from exc
    return collector, meta, state.array_top, bytes(tail)
