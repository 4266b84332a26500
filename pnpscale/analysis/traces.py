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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from decimal import ROUND_HALF_EVEN, Decimal
from fnmatch import translate
from pathlib import Path
from typing import Any, BinaryIO

from pnpscale.analysis.events import DTYPE_BYTES, Event, Kind, collective_type

_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "concurrent_kernel"})
_RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_CPU_CATS = frozenset({"cpu_op", "user_annotation"})
_NCCL = re.compile(r"nccl", re.IGNORECASE)
_PARAM_COMMS = "record_param_comms"
_NOT_A_LAUNCH = {"wait"}  # record_param_comms of Work.wait(): no collective of its own
_BASE_TAIL = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)\s*}\s*$')
_HEAD_START = 1 << 18
_HEAD_MAX = 1 << 26
_TAIL = 1 << 16
_CHUNK = 1 << 16


class TraceError(ValueError):
    """A trace that cannot be read (missing, not gzip/JSON, no event list)."""


@dataclass(frozen=True)
class TraceInfo:
    """What a trace says about itself.

    Attributes:
        path: the file.
        rank, world_size, backend, nccl_version: from ``distributedInfo`` (``None`` when absent).
        base_ns: ``baseTimeNanoseconds`` when ``ts`` is relative to it, else ``None`` (absolute).
        events_read: events in the trace; events_kept: events returned.
    """

    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    nccl_version: str | None
    base_ns: int | None = None
    events_read: int = 0
    events_kept: int = 0


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

    Only the part of the file before ``traceEvents`` is parsed (Kineto writes ``distributedInfo``
    there); a ``baseTimeNanoseconds`` written after the events is not seen here (see
    :func:`read_trace`).

    Raises:
        TraceError: the file is missing, not gzip/JSON, or holds no ``traceEvents`` list.
    """
    path = Path(path)
    try:
        with _open(path) as raw:
            meta, head, array_top = _read_head(path, raw)
    except TraceError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise TraceError(f"{path}: cannot read trace: {_first_line(exc)}") from exc
    if not array_top and "traceEvents" not in meta and len(head) < _HEAD_MAX:
        raise TraceError(f"{path}: no traceEvents list before the end of the file: not a Kineto trace")
    return _info(path, meta)


def read_trace(path: Path | str, sections: Mapping[str, str] | Sequence[str], keep_all_gpu: bool = False) -> Trace:
    """Stream one Kineto trace and keep the events that section analysis needs (see module doc).

    Args:
        path: ``.json`` or ``.json.gz`` Kineto trace.
        sections: section name -> name pattern (:func:`parse_sections`), or a list of exact names.
        keep_all_gpu: keep every GPU event instead of the two per section occurrence that give
            the same :func:`pnpscale.analysis.events.section_records` result (for checks; uses more memory).

    Returns:
        :class:`Trace`; times in integer ns on the Unix epoch, GPU events carry ``launch_ns``.

    Raises:
        TraceError: unreadable file, invalid JSON, or no ``traceEvents`` list.
    """
    path = Path(path)
    pats = dict(sections) if isinstance(sections, Mapping) else {s: s for s in sections}
    collector = _Collector(pats, keep_all_gpu)
    try:
        with _open(path) as raw:
            meta, head, array_top = _read_head(path, raw)
            stream = _Replay(head, raw)
            import ijson

            prefix = "item" if array_top else "traceEvents.item"
            for ev in ijson.items(stream, prefix, use_float=False):
                collector.add(ev)
    except TraceError:
        raise
    except (OSError, EOFError, ValueError, zlib.error, _json_error()) as exc:
        raise TraceError(f"{path}: cannot read trace: {_first_line(exc)}") from exc
    if not array_top and "traceEvents" not in meta:
        raise TraceError(f"{path}: no traceEvents list before the end of the file: not a Kineto trace")
    base = meta.get("baseTimeNanoseconds")
    if base is None:
        m = _BASE_TAIL.search(bytes(stream.tail))
        base = int(m.group(1)) if m else None
    events = collector.events(int(base) if base is not None else 0)
    info = replace(
        _info(path, meta),
        base_ns=int(base) if base is not None else None,
        events_read=collector.read,
        events_kept=len(events),
    )
    return Trace(info, events)


# --- reading ---------------------------------------------------------------------------------


def _open(path: Path) -> BinaryIO:
    """The file's bytes: decompressed when it starts with the gzip magic number."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # noqa: SIM115
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
            raise TraceError(f"{path}: not a JSON trace (starts with {head.lstrip()[:20]!r})")
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
    """Binary stream: ``head`` then the rest of ``raw``; remembers the last bytes read."""

    def __init__(self, head: bytes, raw: BinaryIO) -> None:
        self._head = memoryview(head)
        self._raw = raw
        self.tail = bytearray()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = _CHUNK if n is None or n < 0 else n
        if len(self._head):
            data, self._head = bytes(self._head[:n]), self._head[n:]
        else:
            data = self._raw.read(n)
        if data:
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


def _ns(x: Any) -> int:
    """Microseconds (int, Decimal, float or str) -> integer nanoseconds, exactly for decimals."""
    if isinstance(x, int):
        return x * 1000
    if isinstance(x, Decimal):
        return int((x * 1000).to_integral_value(ROUND_HALF_EVEN))
    if isinstance(x, float):
        return round(x * 1000)
    return int((Decimal(str(x)) * 1000).to_integral_value(ROUND_HALF_EVEN))


def _int_or_none(v: Any) -> int | None:
    try:
        return None if v is None or isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        return None


def comm_fields(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Collective type, payload bytes, process group and sequence number from Kineto ``args``.

    Payload: ``"In msg nelems"`` x bytes of ``"dtype"`` when present (``record_param_comms``, NCCL
    kernels), else the first input's ``"Input Dims"`` x ``"Input type"`` (``gloo:*``/``nccl:*``
    ranges). Type: ``"Collective name"``, else from ``name``. Unknown values are ``None``.

    >>> comm_fields("ncclKernel_AllReduce", {"Collective name": "allreduce", "In msg nelems": 10,
    ...             "dtype": "Float", "Process Group Name": "0", "Seq": 3})
    {'collective': 'all_reduce', 'payload_bytes': 40, 'group': '0', 'group_seq': 3}
    >>> comm_fields("gloo:all_reduce", {"Input Dims": [[1, 3, 32, 32]], "Input type": ["float"]})
    {'collective': 'all_reduce', 'payload_bytes': 12288, 'group': None, 'group_seq': None}
    """
    cname = args.get("Collective name")
    coll = (collective_type(str(cname)) or str(cname)) if cname else collective_type(name)
    payload = None
    nelems, dtype = _int_or_none(args.get("In msg nelems")), args.get("dtype")
    if nelems is not None and dtype in DTYPE_BYTES:
        payload = nelems * DTYPE_BYTES[dtype]
    else:
        dims, types = args.get("Input Dims"), args.get("Input type")
        if isinstance(dims, list) and dims and isinstance(types, list) and types:
            first = dims[0]
            size = DTYPE_BYTES.get(types[0]) if isinstance(types[0], str) else None
            if isinstance(first, list) and first and size and all(isinstance(d, int) for d in first):
                n = 1
                for d in first:
                    n *= d
                payload = n * size
    group = args.get("Process Group Name")
    seq = args.get("Seq", args.get("seq"))
    return {
        "collective": coll,
        "payload_bytes": payload,
        "group": None if group is None else str(group),
        "group_seq": _int_or_none(seq),
    }


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
        if e.name == _PARAM_COMMS:
            wrappers.setdefault(e.tid, []).append(e)
    for ws in wrappers.values():
        ws.sort(key=lambda e: e.start_ns)
    starts = {tid: [w.start_ns for w in ws] for tid, ws in wrappers.items()}
    out = []
    for e in events:
        ws = wrappers.get(e.tid)
        if ws and e.name.startswith("nccl:"):
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

    def __init__(self, sections: Mapping[str, str], keep_all_gpu: bool = False) -> None:
        self.keep_all_gpu = keep_all_gpu
        self.exact: dict[str, str] = {}
        globs = []
        for name, pat in sections.items():
            if any(ch in pat for ch in "*?["):
                globs.append((re.compile(translate(pat)), name))
            else:
                self.exact[pat] = name
        self.globs = globs
        self.read = 0
        self.cpu: list[Event] = []  # section ranges and collective CPU ranges
        self.sections: list[Event] = []
        self.nccl: list[tuple] = []  # (name, start, end, stream, corr, fields)
        self.gpu_start, self.gpu_end, self.gpu_corr = array("q"), array("q"), array("q")
        self.gpu_stream, self.gpu_name = array("q"), array("q")
        self.names: dict[str, int] = {}
        self.rt_corr, self.rt_start = array("q"), array("q")

    def _section_of(self, name: str) -> str | None:
        hit = self.exact.get(name)
        if hit is not None:
            return hit
        for rx, sec in self.globs:
            if rx.match(name):
                return sec
        return None

    def add(self, ev: Mapping[str, Any]) -> None:
        self.read += 1
        if ev.get("ph") != "X":
            return
        cat = ev.get("cat")
        if cat in _RUNTIME_CATS:
            corr = _int_or_none((ev.get("args") or {}).get("correlation"))
            if corr is not None:
                self.rt_corr.append(corr)
                self.rt_start.append(_ns(ev["ts"]))
            return
        if cat in _GPU_CATS:
            self._add_gpu(ev)
            return
        if cat not in _CPU_CATS:
            return
        name = ev.get("name")
        if not isinstance(name, str):
            return
        section = self._section_of(name)
        if section is None and not (name.startswith(("gloo:", "nccl:")) or name == _PARAM_COMMS):
            return
        start = _ns(ev["ts"])
        end = start + _ns(ev.get("dur", 0))
        tid = _int_or_none(ev.get("tid")) or 0
        if section is not None:
            self.sections.append(Event(section, Kind.CPU, start, end, tid=tid))
            return
        fields = comm_fields(name, ev.get("args") or {})
        if name == _PARAM_COMMS and fields["collective"] in _NOT_A_LAUNCH:
            return
        self.cpu.append(Event(name, Kind.CPU, start, end, tid=tid, **fields))

    def _add_gpu(self, ev: Mapping[str, Any]) -> None:
        args = ev.get("args") or {}
        name = ev.get("name")
        name = name if isinstance(name, str) else ""
        start = _ns(ev["ts"])
        end = start + _ns(ev.get("dur", 0))
        stream = _int_or_none(args.get("stream"))
        if stream is None:
            stream = _int_or_none(ev.get("tid")) or 0
        corr = _int_or_none(args.get("correlation"))
        corr = -1 if corr is None else corr
        if ev.get("cat") == "kernel" and _NCCL.search(name):
            fields = comm_fields(name, args) if "Collective name" in args or "Seq" in args else {}
            self.nccl.append((name, start, end, stream, corr, fields))
            return
        nid = self.names.setdefault(name, len(self.names))
        self.gpu_start.append(start)
        self.gpu_end.append(end)
        self.gpu_corr.append(corr)
        self.gpu_stream.append(stream)
        self.gpu_name.append(nid)

    def events(self, base_ns: int) -> list[Event]:
        """The kept events, shifted by ``base_ns`` (0 for absolute traces)."""
        import numpy as np

        rt_corr = np.frombuffer(self.rt_corr, dtype=np.int64) if len(self.rt_corr) else np.zeros(0, np.int64)
        rt_start = np.frombuffer(self.rt_start, dtype=np.int64) if len(self.rt_start) else np.zeros(0, np.int64)
        order = np.argsort(rt_corr, kind="stable")
        rt_corr, rt_start = rt_corr[order], rt_start[order]

        def launch_of(corr: np.ndarray) -> np.ndarray:
            if not len(rt_corr):
                return np.full(len(corr), -1, dtype=np.int64)
            idx = np.searchsorted(rt_corr, corr)
            idx_c = np.minimum(idx, len(rt_corr) - 1)
            found = (idx < len(rt_corr)) & (rt_corr[idx_c] == corr) & (corr >= 0)
            return np.where(found, rt_start[idx_c], -1)

        out = [replace(e, start_ns=e.start_ns + base_ns, end_ns=e.end_ns + base_ns) for e in self.sections]
        out += [
            replace(e, start_ns=e.start_ns + base_ns, end_ns=e.end_ns + base_ns) for e in merge_descriptors(self.cpu)
        ]
        if self.nccl:
            launches = launch_of(np.array([n[4] for n in self.nccl], dtype=np.int64))
            for (name, start, end, stream, corr, fields), launch in zip(self.nccl, launches, strict=True):
                out.append(
                    Event(
                        name,
                        Kind.GPU,
                        start + base_ns,
                        end + base_ns,
                        tid=stream,
                        correlation=corr,
                        launch_ns=None if launch < 0 else int(launch) + base_ns,
                        **fields,
                    )
                )
        out += self._gpu_representatives(launch_of, base_ns)
        return out

    def _gpu_representatives(self, launch_of: Any, base_ns: int) -> list[Event]:
        """Per section range, the first-starting and last-ending GPU event launched inside it."""
        import numpy as np

        n = len(self.gpu_start)
        if n == 0:
            return []
        start = np.frombuffer(self.gpu_start, dtype=np.int64)
        end = np.frombuffer(self.gpu_end, dtype=np.int64)
        corr = np.frombuffer(self.gpu_corr, dtype=np.int64)
        launch = launch_of(corr)
        place = np.where(launch >= 0, launch, start)
        order = np.argsort(place, kind="stable")
        placed = place[order]
        keep = set(range(n)) if self.keep_all_gpu else {0}
        for r in [] if self.keep_all_gpu else self.sections:
            lo = int(np.searchsorted(placed, r.start_ns, side="left"))
            hi = int(np.searchsorted(placed, r.end_ns, side="right"))
            if hi > lo:
                idx = order[lo:hi]
                keep.add(int(idx[np.argmin(start[idx])]))
                keep.add(int(idx[np.argmax(end[idx])]))
        names = list(self.names)
        return [
            Event(
                names[self.gpu_name[i]],
                Kind.GPU,
                int(start[i]) + base_ns,
                int(end[i]) + base_ns,
                tid=int(self.gpu_stream[i]),
                correlation=int(corr[i]),
                launch_ns=None if launch[i] < 0 else int(launch[i]) + base_ns,
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
