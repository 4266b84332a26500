"""The two passes over a trace file that feed a :class:`~pnpscale.analysis.trace.collect.Collector`.

* :func:`scan_file`, the fast path: batches of whole events (cut at Kineto's event starts) decoded by
  ``msgspec`` into typed structs of only the fields the collector reads, then read by columns; the events sections
  need are decoded whole; any doubt raises :class:`~pnpscale.analysis.trace.files.Fallback`;
* :func:`stream_events`, the exact path: every event through ``ijson`` (optionally repairing bare non-finite
  tokens), which names what is wrong (:class:`JsonFailure`: message and byte offset).
"""

from __future__ import annotations

import functools
import json
import operator
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
from isal import igzip, isal_zlib

from pnpscale.analysis.kineto import (
    CPU_CATS,
    END_MARKER,
    GPU_CATS,
    IGNORED_CATS,
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
    NS_RANGE,
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

#: ISA-L's decompression error (not a :class:`zlib.error`)
_ISAL_ERROR = cast(type[Exception], isal_zlib.error)


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


# --- fast path: typed decoding of batches of whole events --------------------------------------


#: decompressed bytes read at a time; a batch is what they hold up to their last event start (2 MB: its text and
#: structs stay in cache beside the other worker's, about 4 % faster per rank than 4 MB on 2 cores)
_SCAN_CHUNK = 1 << 21
#: pending text this long without an event start (``{"ph"`` after a comma) is not Kineto's layout
_BATCH_MAX = 1 << 27
_LEADING_BLANKS = re.compile(rb"[ \t\r\n]*")
_BLANKS = b" \t\r\n"
_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?")
_KERNEL_CATS = ("kernel", "Kernel")


class ArgsFields(msgspec.Struct, gc=False):
    """The ``args`` keys read from every event (:func:`read_batch`); an event that needs others (a section, a
    collective) is decoded whole. A value of another JSON type fails the batch's typed decoding."""

    correlation: int | None = None
    external_id: int | None = msgspec.field(default=None, name="External id")
    stream: int | None = None
    sycl_queue: Any = msgspec.field(default=None, name="sycl queue")
    queue: Any = None


#: the phases (``ph``) of the Trace Event Format; a batch holding an event of another phase, or one without ``ph``,
#: fails its typed decoding (:data:`_TYPED`) and is decoded whole, event by event, as the exact path reads it
PHASES = ("B", "E", "X", "i", "I", "C", "b", "n", "e", "S", "T", "p", "F", "s", "t", "f", "P", "N", "O", "D", "M",
          "V", "v", "R", "c", "(", ")")  # fmt: skip


class EventFields(msgspec.Struct, gc=False, tag_field="ph", tag="X"):
    """The keys of an ``X`` (complete) event read by :func:`read_batch` (the others are skipped by the decoder);
    ``ts`` and ``dur`` as their JSON text (:class:`msgspec.Raw`, empty when absent), converted to exact integer
    ns. The phase is the struct's type (a tagged union, :data:`_TYPED`): the events of other phases are built
    without fields, at a fraction of the cost (flow events are a third of a GPU trace's)."""

    cat: str | None = None
    name: str | None = None
    tid: int | str | None = None
    ts: msgspec.Raw = msgspec.Raw()
    dur: msgspec.Raw = msgspec.Raw()
    args: ArgsFields | None = None


@dataclass
class ScanState:
    """What the fast pass carries from event to event: the collector, the JSON decoder, the caches of what a name
    needs (decoded whole or read from the bytes), and whether the file's top level is the event array."""

    collector: Collector
    array_top: bool = False
    decoder: json.JSONDecoder = field(
        default_factory=lambda: json.JSONDecoder(parse_float=Decimal, parse_constant=refuse_constant)
    )
    relevant: dict[str, bool] = field(default_factory=dict)  # CPU range name -> decoded whole
    collective: dict[str | None, bool] = field(default_factory=dict)  # kernel name -> a collective kernel's
    launches: dict[str, int] = field(default_factory=dict)  # runtime call name -> launch_kind
    needed: set[str] = field(default_factory=set)  # the CPU range names decoded whole
    collective_names: set[str | None] = field(default_factory=set)  # the names of collective kernels


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


class InstantFields(msgspec.Struct, gc=False, tag_field="ph", tag="i"):
    """An ``i`` (instant) event's name: Kineto's last event (:data:`~pnpscale.analysis.kineto.END_MARKER`) is one."""

    name: str | None = None


#: one struct without fields per other phase (its events are skipped: nothing is read from them)
_OTHER_PHASES: tuple[type[msgspec.Struct], ...] = tuple(
    msgspec.defstruct(f"Phase{n}", [], tag_field="ph", tag=ph, gc=False)
    for n, ph in enumerate(PHASES)
    if ph not in ("X", "i")
)
#: a batch's events: :class:`EventFields` for ``X``, :class:`InstantFields` for ``i``, an empty struct otherwise
_ANY_EVENT: Any = functools.reduce(operator.or_, (EventFields, InstantFields, *_OTHER_PHASES))
_TYPED = msgspec.json.Decoder(list.__class_getitem__(_ANY_EVENT))
_RAWS = msgspec.json.Decoder(list[msgspec.Raw])


def us_to_ns(raw: msgspec.Raw) -> int | None:
    """A JSON number's text (microseconds, :class:`msgspec.Raw`) -> integer ns, exactly (the rule of
    :func:`~pnpscale.analysis.trace.files.ns_text`); ``None`` for anything else (absent, null, a string, an
    exponent), which the caller decodes whole."""
    t = bytes(raw)
    if len(t) > 4 and t[-4] == 46:  # Kineto's "{us}.{ns:03}": the digits are the ns
        try:
            return int(t.replace(b".", b""))
        except ValueError:
            return None
    return ns_text(t) if _NUMBER.fullmatch(t) else None


def last_event_start(data: bytes) -> tuple[int, int]:
    """``(comma, start)`` of the last event in ``data`` that starts as Kineto writes it (``, {"ph"``): the
    comma ending the events before it, and its ``{``; ``(-1, -1)`` when there is none after some event. An
    unescaped ``"ph"`` after ``{`` is a key (JSON strings escape their quotes); if it is a nested object's,
    the batch cut there does not decode (unbalanced) and the file falls back."""
    end = len(data)
    while (at := data.rfind(b'"ph"', 0, end)) > 0:
        end = at
        j = at - 1
        while j >= 0 and data[j] in _BLANKS:
            j -= 1
        if j < 0 or data[j] != 123:  # "{"
            continue
        k = j - 1
        while k >= 0 and data[k] in _BLANKS:
            k -= 1
        if k > 0 and data[k] == 44:  # ","
            return k, j
    return -1, -1


def ns_array(texts: list[msgspec.Raw]) -> np.ndarray | None:
    """The ns of every number text in ``texts`` (microseconds as Kineto writes them, ``{us}.{ns:03}``, not
    negative), exactly, as int64; ``None`` when one is in another form (the caller then reads the events one by
    one). A value beyond int64 reads as int64's largest (``numpy.fromstring`` saturates): the caller refuses
    values above :data:`~pnpscale.analysis.trace.files.NS_RANGE`.

    The form is checked on the texts joined by spaces, as arrays (:func:`kineto_column`), then the dots removed
    and the integers parsed by numpy."""
    if not texts:
        return _NO_INTS
    joined = b" ".join(texts)
    if not kineto_column(joined, len(texts)):
        return None
    out = np.fromstring(joined.replace(b".", b""), dtype=np.int64, sep=" ")
    return out if len(out) == len(texts) else None


def kineto_column(joined: bytes, n: int) -> bool:
    """Whether ``joined`` is ``n`` texts of the form ``\\d+\\.\\d{3}`` separated by single spaces (what
    ``re.fullmatch(rb"(?:\\d+\\.\\d{3} )*\\d+\\.\\d{3}", joined)`` says, in a quarter of its time).

    Exactly ``n`` dots and ``n - 1`` spaces, the k-th space 4 bytes after the k-th dot and the text's end 4 after
    the last, every other byte a digit, and each text's first byte before its dot: then text k holds dot k, at
    least one digit before it and three after it, and nothing else.

    >>> kineto_column(b"1.500 1700000000000000.001", 2), kineto_column(b"1.500 1.5", 2)
    (True, False)
    >>> kineto_column(b"1.500 .5000", 2), kineto_column(b"-1.500", 1), kineto_column(b"1..500", 1)
    (False, False, False)
    """
    a = np.frombuffer(joined, np.uint8)
    dots, spaces = np.flatnonzero(a == 46), np.flatnonzero(a == 32)
    if len(dots) != n or len(spaces) != n - 1 or n == 0 or int(dots[-1]) + 4 != len(a):
        return False
    if not np.array_equal(spaces, dots[:-1] + 4):
        return False
    if int(np.count_nonzero((a >= 48) & (a <= 57))) != len(a) - 2 * n + 1:
        return False
    return bool(dots[0] > 0 and (spaces + 1 < dots[1:]).all())


_NO_INTS = np.zeros(0, np.int64)


def int64s(values: list[Any]) -> memoryview:
    """``values`` as the bytes of an int64 array (what :meth:`array.array.frombytes` of a ``"q"`` array takes:
    a fifth of :meth:`~array.array.extend`'s time). Raises :class:`OverflowError` for a value beyond int64."""
    return (np.fromiter(values, np.int64, len(values)) if values else _NO_INTS).data.cast("B")


def as_bytes(a: np.ndarray) -> memoryview:
    """An int64 array's bytes, for :meth:`array.array.frombytes`."""
    return np.ascontiguousarray(a, dtype=np.int64).data.cast("B")


def read_batch(state: ScanState, data: bytes, comma: int, stop: int, index: int) -> int:
    """Read the events of ``data[:comma]`` (whole events separated by commas; ``data[comma:stop]`` is the comma
    and blanks after the last) into the collector; returns the index of the next event.

    One :data:`_TYPED` decoding of the batch gives every event's :class:`EventFields`, read by columns
    (:func:`read_columns`), or one by one (:func:`read_one_by_one`) when some field is not as Kineto writes it.
    A batch whose fields are of other JSON types than :class:`EventFields` says is decoded whole, event by
    event (:func:`decode_run`).

    Raises:
        msgspec.DecodeError: the batch is not a JSON array of objects (the caller falls back).
    """
    batch = b"".join((b"[", memoryview(data)[:comma], b"]"))
    try:
        evs = _TYPED.decode(batch)
    except msgspec.ValidationError:  # a field of another JSON type: exactly as the exact path reads it
        return decode_run(state, data, _LEADING_BLANKS.match(data).end(), stop, index, False)  # type: ignore[union-attr]
    if not read_columns(state, evs, batch, index):
        read_one_by_one(state, evs, batch, index)
    index += len(evs)
    state.collector.read = index
    return index


#: tries, going back from an event's ``ts``, to find the ``{`` that opens it (each passes a nested object)
_OPEN_TRIES = 4


def raw_offset(raw: msgspec.Raw, base: int, size: int) -> int | None:
    """Where a :class:`msgspec.Raw` decoded from a buffer lies in it (msgspec's ``Raw`` of a ``bytes`` input is a
    view of that input): its offset from ``base`` (the buffer's address), ``None`` when it is empty or not inside
    the ``size`` bytes there (a copy)."""
    if not len(raw):
        return None
    at = np.frombuffer(raw, np.uint8).ctypes.data - base
    return at if 0 <= at and at + len(raw) <= size else None


def located_event(state: ScanState, batch: bytes, evs: list[Any], i: int, base: int) -> dict[str, Any] | None:
    """Event ``i`` of ``batch`` (an ``X`` event) decoded whole with :mod:`json` (as :func:`decode_whole` does),
    found without a second decoding of the batch: from the place of its ``ts`` value in the batch
    (:func:`raw_offset`) back to the ``{`` that opens it (an object whose first key is ``"ph"``, as Kineto writes
    events), decoded up to the next such ``{`` after the ``ts`` (:func:`next_object_start`; past it when that one
    is nested in the event). The object found is the event: it opens before its ``ts`` value and ends after it,
    and the only object holding an event's member is the event (the batch's top level is an array). ``None`` when
    that cannot be shown within :data:`_OPEN_TRIES` steps each way (no ``ts``, another key first, nested objects
    in the way): the caller decodes the batch's events."""
    at = raw_offset(evs[i].ts, base, len(batch))
    if at is None:
        return None
    hi = at
    for _ in range(_OPEN_TRIES):
        key = batch.rfind(b'"ph"', 0, hi)
        if key < 0:
            return None
        hi = j = key - 1
        while j >= 0 and batch[j] in _BLANKS:
            j -= 1
        if j < 0 or batch[j] != 123:  # "{"
            continue
        hi = j
        found = _object_at(state, batch, j, at)
        if found is None:
            return None
        end, ev = found
        if end > at:
            return ev if isinstance(ev, dict) else None
    return None


def _object_at(state: ScanState, batch: bytes, start: int, at: int) -> tuple[int, Any] | None:
    """``(end offset, value)`` of the JSON value opening at ``start``, decoded from ``start`` to an object start
    after ``at`` (the next event's, or further when that text ends inside this value); ``None`` when none within
    :data:`_OPEN_TRIES` such starts, or the text is not valid UTF-8."""
    bound = at
    for _ in range(_OPEN_TRIES):
        nxt = next_object_start(batch, bound)
        if nxt is None:
            return None
        try:
            piece = batch[start:nxt].decode()
            value, end = state.decoder.raw_decode(piece)
        except UnicodeDecodeError:
            return None
        except json.JSONDecodeError:
            if nxt >= len(batch) - 1:
                return None
            bound = nxt + 1  # cut inside the value (an object nested after the ts): to the next start
            continue
        if not piece.isascii():
            end = len(piece[:end].encode())
        return start + end, value
    return None


def next_object_start(batch: bytes, at: int) -> int | None:
    """The offset of the first ``{`` after ``at`` that opens an object whose first key is ``"ph"`` (the next
    event, as Kineto writes them, or a nested object), the batch's closing ``]`` when there is none; ``None``
    after :data:`_OPEN_TRIES` ``"ph"`` texts that open no object (string values)."""
    pos = at
    for _ in range(_OPEN_TRIES):
        key = batch.find(b'"ph"', pos)
        if key < 0:
            return len(batch) - 1
        j = key - 1
        while j > at and batch[j] in _BLANKS:
            j -= 1
        if batch[j] == 123:  # "{"
            return j
        pos = key + 4
    return None


class WholeEvents:
    """A batch's events decoded whole with :mod:`json` (:class:`~decimal.Decimal` floats, as ``ijson`` gives
    them), on demand: each found by :func:`located_event`, or, from the first that is not, from one
    :data:`_RAWS` decoding of the batch."""

    def __init__(self, state: ScanState, batch: bytes, evs: list[Any]) -> None:
        self.state, self.batch, self.evs = state, batch, evs
        self.base = np.frombuffer(batch, np.uint8).ctypes.data
        self.raws: list[msgspec.Raw] | None = None

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.raws is None:
            ev = located_event(self.state, self.batch, self.evs, i, self.base)
            if ev is not None:
                return ev
            self.raws = _RAWS.decode(self.batch)
        return cast(dict[str, Any], self.state.decoder.decode(bytes(self.raws[i]).decode()))


def decode_whole(
    state: ScanState, batch: bytes, evs: list[Any], which: list[int], index: int, counted: bool
) -> None:
    """Decode the events ``which`` (indices) of ``batch`` (:class:`WholeEvents`) and give them to
    :meth:`~pnpscale.analysis.trace.collect.Collector.add` in order, as the exact path does (``index``: the
    batch's first event's; ``counted``: CPU range names already counted)."""
    col, whole = state.collector, WholeEvents(state, batch, evs)
    for i in which:
        col.read = index + i
        col.add(whole[i], counted)


def is_span(e: EventFields) -> bool:
    """Whether an ``X`` event is Kineto's ``PyTorch Profiler (N)`` span (category ``Trace``): decoded whole."""
    return e.cat == "Trace" and e.name is not None and e.name.startswith("PyTorch Profiler")


def read_columns(state: ScanState, evs: list[Any], batch: bytes, index: int) -> bool:
    """Read a batch's events as columns; ``False`` (and nothing read) when some event the columns hold is not as
    Kineto writes it (a ``ts``/``dur`` not ``{us}.{ns:03}``, a string ``tid``, no name, a stream from another key
    than ``stream``).

    One loop sorts the events to their columns (with their correlation, ``External id`` and stream: one loop
    costs less than a comprehension per column), then each column is checked and converted as an array.

    Non-``X`` events: only the end marker is noted. Runtime calls with a correlation, GPU events other than
    collective kernels, and ``cpu_op`` operators whose names are not needed go to the collector's arrays (times,
    correlation, ``External id``, stream, thread); CPU range names and categories not read are counted. The
    needed CPU ranges, collective kernels and the profiler's span are decoded whole (:func:`decode_whole`), in
    file order. The result equals :func:`read_one_by_one`'s (arrays and counters in file order).
    """
    col, relevant, needed = state.collector, state.relevant, state.needed
    collective, coll = state.collective, state.collective_names
    rt: list[EventFields] = []
    gpu: list[EventFields] = []
    ops: list[EventFields] = []
    rest: list[EventFields] = []
    rt_corr: list[int] = []
    rt_ext: list[int] = []
    gpu_corr: list[int] = []
    gpu_stream: list[Any] = []
    op_ext: list[int] = []
    cpu_name_list: list[str] = []
    annotations: list[str] = []
    which: list[int] = []
    end = unnamed = queued = p2p = False
    for i, e in enumerate(evs):
        if type(e) is not EventFields:
            if type(e) is InstantFields and e.name == END_MARKER:
                end = True
            continue
        cat, a = e.cat, e.args
        if cat in RUNTIME_CATS:
            if a is not None and a.correlation is not None:
                rt.append(e)
                rt_corr.append(a.correlation)
                rt_ext.append(-1 if a.external_id is None else a.external_id)
        elif cat in GPU_CATS:
            name = e.name
            is_coll = collective.get(name)
            if is_coll is None:
                is_coll = collective[name] = name is not None and is_collective_kernel(name)
                if is_coll:
                    coll.add(name)
            if is_coll and cat in _KERNEL_CATS:
                which.append(i)  # decoded whole
                continue
            unnamed = unnamed or name is None
            gpu.append(e)
            if a is None:
                gpu_corr.append(-1)
                gpu_stream.append(e.tid)
                continue
            gpu_corr.append(-1 if a.correlation is None else a.correlation)
            if a.stream is not None:
                gpu_stream.append(a.stream)
            else:
                queued = queued or a.sycl_queue is not None or a.queue is not None
                gpu_stream.append(e.tid)
        elif cat in CPU_CATS:
            name = e.name
            if name is None:
                continue
            cpu_name_list.append(name)
            need = relevant.get(name)
            if need is None:
                need = relevant[name] = cpu_needed(state, name)
                if need:
                    needed.add(name)
            if need:
                which.append(i)
                p2p = p2p or name in P2P_CALLS
            elif cat == "cpu_op":
                ops.append(e)
                op_ext.append(-1 if a is None or a.external_id is None else a.external_id)
            if cat == "user_annotation":
                annotations.append(name)
        elif cat is not None:
            rest.append(e)
            if is_span(e):
                which.append(i)
    if p2p:
        return False  # decoded whole, yet kept among the operators (Collector.add): in file order, one by one
    # the columns, checked before anything is kept
    rt_start, rt_dur = ns_array([e.ts for e in rt]), ns_array([e.dur for e in rt])
    gpu_start, gpu_dur = ns_array([e.ts for e in gpu]), ns_array([e.dur for e in gpu])
    op_start, op_dur = ns_array([e.ts for e in ops]), ns_array([e.dur for e in ops])
    if rt_start is None or rt_dur is None or gpu_start is None or gpu_dur is None or op_start is None or op_dur is None:
        return False
    cols = (rt_start, rt_dur, gpu_start, gpu_dur, op_start, op_dur)
    if max(int(c.max()) if len(c) else 0 for c in cols) > NS_RANGE:
        return False  # then no sum below overflows int64
    rt_tid = [e.tid for e in rt]
    op_tid = [e.tid for e in ops]
    rt_names = {e.name for e in rt}
    if str in set(map(type, rt_tid)) or str in set(map(type, op_tid)) or None in rt_names:
        return False
    if unnamed or queued:
        return False  # a GPU event without a name (a collective kernel has one), or whose queue stream_of reads
    types = set(map(type, gpu_stream))
    if types - {int}:
        if str in types:
            return False  # stream_of reads "stream 7"
        gpu_stream = [0 if t is None else t for t in gpu_stream]
    rt_tids, gpu_streams = int64s([-1 if t is None else t for t in rt_tid]), int64s(gpu_stream)
    op_tids = int64s([t or 0 for t in op_tid])
    rt_ext_b, rt_corr_b, gpu_corr_b, op_ext_b = int64s(rt_ext), int64s(rt_corr), int64s(gpu_corr), int64s(op_ext)
    # keep them (nothing above changed the collector; an OverflowError above sends the file to the exact path)
    if end:
        col.end_marker = True
    starts = [int(c.max()) for c in (rt_start, gpu_start, op_start) if len(c)]
    if starts:
        col.last_start = max(col.last_start, *starts)
    launches = state.launches
    for name in cast(set[str], rt_names).difference(launches):
        launches[name] = launch_kind(name)
    col.rt_ext.frombytes(rt_ext_b)
    col.rt_tid.frombytes(rt_tids)
    col.rt_end.frombytes(as_bytes(rt_start + rt_dur))
    col.rt_corr.frombytes(rt_corr_b)
    col.rt_start.frombytes(as_bytes(rt_start))
    col.rt_launch.extend([launches[e.name] for e in rt])  # type: ignore[index]
    names = col.names
    col.gpu_start.frombytes(as_bytes(gpu_start))
    col.gpu_end.frombytes(as_bytes(gpu_start + gpu_dur))
    col.gpu_corr.frombytes(gpu_corr_b)
    col.gpu_stream.frombytes(gpu_streams)
    col.gpu_name.frombytes(int64s([names.setdefault(e.name, len(names)) for e in gpu]))  # type: ignore[arg-type]
    op_names = col.op_names
    col.op_ext.frombytes(op_ext_b)
    col.op_start.frombytes(as_bytes(op_start))
    col.op_end.frombytes(as_bytes(op_start + op_dur))
    col.op_tid.frombytes(op_tids)
    col.op_name.frombytes(int64s([op_names.setdefault(e.name, len(op_names)) for e in ops]))  # type: ignore[arg-type]
    col.range_names.update(cpu_name_list)
    col.user_annotations.update(annotations)
    col.unknown_categories.update([e.cat for e in rest if e.cat not in IGNORED_CATS and not is_span(e)])  # type: ignore[misc]
    decode_whole(state, batch, evs, which, index, True)
    return True


def read_one_by_one(state: ScanState, evs: list[Any], batch: bytes, index: int) -> None:
    """Read a batch's events one at a time: what :func:`read_columns` does, and any event whose fields are not
    plain (a missing or negative ``dur``, a ``ts`` not a number or out of range, a string ``tid``, a stream from
    another key, no name) decoded whole, as the exact path reads it (:func:`decode_whole`)."""
    col, whole = state.collector, WholeEvents(state, batch, evs)
    lo, hi = -NS_RANGE, NS_RANGE
    for i, ev in enumerate(evs):
        if type(ev) is not EventFields:
            if type(ev) is InstantFields and ev.name == END_MARKER:
                col.end_marker = True
            continue
        cat, name, a = ev.cat, ev.name, ev.args
        if cat in RUNTIME_CATS:
            if a is None or a.correlation is None:
                continue
            start, dur, tid = us_to_ns(ev.ts), us_to_ns(ev.dur), ev.tid
            if not (
                start is None or dur is None or dur < 0 or not lo <= start <= hi or isinstance(tid, str) or not name
            ):
                launch = state.launches.get(name)
                if launch is None:
                    launch = state.launches[name] = launch_kind(name)
                ext = a.external_id
                col.add_runtime(a.correlation, start, launch, -1 if ext is None else ext, -1 if tid is None else tid,
                                start + dur)  # fmt: skip
                continue
        elif cat in GPU_CATS:
            start, dur, tid = us_to_ns(ev.ts), us_to_ns(ev.dur), ev.tid
            if not (start is None or dur is None or dur < 0 or not lo <= start <= hi or name is None):
                coll = state.collective.get(name)
                if coll is None:
                    coll = state.collective[name] = is_collective_kernel(name)
                coll = coll and cat in _KERNEL_CATS
                stream = 0
                if a is not None and a.stream is not None:
                    stream = a.stream
                elif (a is not None and (a.sycl_queue is not None or a.queue is not None)) or isinstance(tid, str):
                    coll = True  # stream_of reads it
                elif isinstance(tid, int):
                    stream = tid
                if not coll:
                    corr = -1 if a is None or a.correlation is None else a.correlation
                    col.add_gpu_event(name, start, start + dur, stream, corr, None)
                    continue
        elif cat not in CPU_CATS:
            if cat != "Trace":
                if cat is not None:
                    col.count_category(cat)
                continue
        elif name is None:
            continue
        else:
            need = state.relevant.get(name)
            if need is None:
                need = state.relevant[name] = cpu_needed(state, name)
            if not need:
                if cat != "cpu_op":
                    col.count_range(name, cat)
                    continue
                start, dur, tid = us_to_ns(ev.ts), us_to_ns(ev.dur), ev.tid
                if not (start is None or dur is None or dur < 0 or not lo <= start <= hi or isinstance(tid, str)):
                    col.range_names[name] += 1
                    ext = -1 if a is None or a.external_id is None else a.external_id
                    col.add_op(name, start, start + dur, tid or 0, ext)
                    continue
        col.read = index + i
        col.add(whole[i])


_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_ARRAY_TOP = re.compile(rb"\s*\[")


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


def open_fast(path: Path) -> Any:
    """The file's bytes, as :func:`~pnpscale.analysis.trace.files.open_trace_file` gives them (gzip by content),
    gzip decompressed by ISA-L (:mod:`isal.igzip`, the same format in about a third of zlib's time); its
    errors (``isal_zlib.error``, ``EOFError``, ``OSError``) send the file to the exact path, which names them."""
    with open(path, "rb") as f:
        magic = f.read(2)
    return igzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # noqa: SIM115


def scan_file(path: Path, pats: Mapping[str, str], keep_all_gpu: bool) -> tuple[Collector, dict[str, Any], bool, bytes]:
    """:func:`stream_events`'s result, from typed decoding of batches of whole events (Kineto's layout).

    The file is decompressed (:func:`open_fast`) :data:`_SCAN_CHUNK` bytes at a time (memory bounded by a few
    chunks); each chunk's text up to its last event start (:func:`last_event_start`: ``, {"ph"``, as Kineto writes every
    ``X`` event) is one batch, read by :func:`read_batch`; the file's last events and the text after the array
    are decoded with :mod:`json` (:func:`decode_run`, which checks that the array ends and the rest is JSON).
    Any doubt (a non-finite token, invalid UTF-8, a batch that is not a JSON array of objects, text after the
    array that is not JSON, no event start in :data:`_BATCH_MAX` bytes, an integer beyond 64 bits, an
    unreadable file) raises :class:`Fallback`, and the file is read by the exact ``ijson`` path, which also
    names errors.
    """
    state = ScanState(Collector(pats, keep_all_gpu, path))
    collector = state.collector
    try:
        with open_fast(path) as raw:
            meta, state.array_top, pending, tail = open_event_array(path, raw)
            index = 0
            while chunk := raw.read(_SCAN_CHUNK):
                tail += chunk[-TAIL:]
                del tail[: max(0, len(tail) - TAIL)]
                data = pending + chunk
                comma, start = last_event_start(data)
                if comma < 0:
                    if len(data) > _BATCH_MAX:
                        raise Fallback(f"no event start in {len(data)} bytes")
                    pending = data
                    continue
                index = read_batch(state, data, comma, start, index)
                pending = data[start:]
            if pending.strip()[:1] != b"]":  # else an empty event array
                index = decode_run(state, pending, _LEADING_BLANKS.match(pending).end(), len(pending), index, True)  # type: ignore[union-attr]
            collector.read = index
    except (msgspec.DecodeError, json.JSONDecodeError, UnicodeDecodeError, TraceError, OSError, EOFError,
            zlib.error, _ISAL_ERROR, OverflowError) as exc:  # fmt: skip
        # the exact path reads the file again and names what is wrong
        raise Fallback(first_line(exc)) from exc
    return collector, meta, state.array_top, bytes(tail)
