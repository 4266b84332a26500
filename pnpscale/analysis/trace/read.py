"""Kineto (torch.profiler) JSON traces -> plain :class:`~pnpscale.analysis.events.Event` records, streamed.

The offline twin of :mod:`pnpscale.rank.profiling`: a trace of any job (``*.json`` or ``*.json.gz``,
told apart by content, not name) is read event by event with ``ijson`` and only what
:func:`pnpscale.analysis.section.records.section_records` needs is kept, so traces of hundreds of MB per rank never
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

The reading is split by stage (this module is the facade): :mod:`~pnpscale.analysis.trace.files` (the
file's bytes), :mod:`~pnpscale.analysis.trace.scan` (the fast and the exact pass),
:mod:`~pnpscale.analysis.trace.collect` (what a pass keeps), :mod:`~pnpscale.analysis.trace.select` (checks,
and the kept events).

Timestamps are read exactly (``ijson`` gives decimals) and returned in integer nanoseconds on the
Unix epoch: ``ts`` is relative to ``baseTimeNanoseconds`` when the trace has that key (newer
Kineto), absolute otherwise. Rank and world size come from the ``distributedInfo`` block.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event
from pnpscale.analysis.kineto import comm_fields, is_descriptor
from pnpscale.analysis.trace.files import (
    CHUNK,
    HEAD_MAX,
    TAIL,
    Fallback,
    NotATraceError,
    TraceError,
    closes_json,
    first_line,
    meta_from_tail,
    non_finite_tokens,
    open_trace_file,
    read_head,
    valid_object,
)
from pnpscale.analysis.trace.scan import JsonFailure, scan_file, stream_events
from pnpscale.analysis.trace.select import collected_events

__all__ = ["TraceError", "NotATraceError", "Trace", "TraceInfo", "comm_fields", "read_header", "read_trace"]


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
        end_marker: the file ends with Kineto's last event (``Record Window End``): Kineto closed it, so it
            was not cut short. profiler_span: the file holds Kineto's ``PyTorch Profiler (N)`` span (category
            ``Trace``), which Kineto writes after the activities (``processCpuTrace`` ends with it; its
            in-memory logger replays it after every activity): the activities were all written. kineto_header:
            the file starts as Kineto starts one (``schemaVersion``, written before the events by
            ``ChromeTraceLogger::handleTraceStart``). last_ns: the latest start among the events whose times
            were read (ns, the events' clock), ``None`` when none.
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
    end_marker: bool = False
    last_ns: int | None = None
    profiler_span: bool = False
    kineto_header: bool = False


@dataclass(frozen=True)
class Trace:
    """One rank's trace: its :class:`TraceInfo`, the kept events (ns, Unix epoch), the starts (ns, sorted) of the
    launches whose GPU event is not in the file (``missing_gpu``: the work is missing) and of the GPU events whose
    correlation matches no launch though the profiler was recording (``orphan_gpu``: the launch is missing), and of
    the copies and memsets without a GPU event in a closed file (``copies_without_gpu``: 0 bytes, or a dropped
    record)."""

    info: TraceInfo
    events: list[Event]
    missing_gpu: tuple[int, ...] = ()
    orphan_gpu: tuple[int, ...] = ()
    copies_without_gpu: tuple[int, ...] = ()


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
        with open_trace_file(path) as raw:
            meta, head, array_top = read_head(path, raw)
            if not array_top and "distributedInfo" not in meta and "traceEvents" in meta:
                tail = bytearray(head[-TAIL:])
                while chunk := raw.read(CHUNK * 16):
                    tail += chunk
                    del tail[: max(0, len(tail) - TAIL)]
                meta = {**meta_from_tail(bytes(tail)), **meta}
    except TraceError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise TraceError(f"{path}: cannot read trace: {first_line(exc)}") from exc
    if not array_top and "traceEvents" not in meta and len(head) < HEAD_MAX:
        if not valid_object(head.decode("utf-8", errors="replace")):
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
    (``runtime_clock_offset``: shifted, see :mod:`pnpscale.analysis.gpu_checks`), the last ``ProfilerStep`` of a
    step section holding nothing (``empty_iteration``: dropped, the step Kineto opens at the last
    ``prof.step()``). Events with a negative
    or missing ``dur``, device events with ``ts <= 0`` or outside the profiler's span, collective kernels
    overlapping their stream's work, and CPU ranges with a negative ``ts`` are kept with ``Event.bad``
    set and ``end == start`` (their iteration is dropped later). A file without Kineto's last event (``Record
    Window End``: :attr:`TraceInfo.end_marker`) may have been cut short: :attr:`Trace.missing_gpu` then lists
    its last launches whose GPU event is missing (see :mod:`pnpscale.analysis.trace.select`).

    Args:
        path: ``.json`` or ``.json.gz`` Kineto trace.
        sections: section name -> name pattern (:func:`parse_sections`), or a list of exact names.
        keep_all_gpu: keep every GPU event instead of the two per section occurrence that give
            the same :func:`pnpscale.analysis.section.records.section_records` result (for checks; uses more memory).
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
            collector, meta, array_top, tail = scan_file(path, pats, keep_all_gpu)
        except Fallback:
            collector, meta, array_top, tail = stream_events(path, pats, keep_all_gpu, repair=False)
    except JsonFailure as failure:
        tokens = non_finite_tokens(path)
        if not tokens:
            ends = any(m in failure.message for m in ("ncomplete", "premature EOF"))
            cut = " (the file ends there: truncated?)" if ends else ""
            if not ends and not closes_json(path):  # cut inside a token (a number's decimals): the same cause
                cut = " (the file does not end with '}' or ']': truncated?)"
            raise TraceError(f"{path}: cannot read trace: invalid JSON at or before byte {failure.offset}: "
                             f"{failure.message}{cut}") from None  # fmt: skip
        try:
            collector, meta, array_top, tail = stream_events(path, pats, keep_all_gpu, repair=True)
        except JsonFailure as again:
            tok, at = tokens[0]
            raise TraceError(
                f"{path}: cannot read trace: invalid JSON at or before byte {again.offset}: {again.message} "
                f"(the file also holds bare non-finite tokens such as {tok!r} at byte {at})"
            ) from None
        tok, at = tokens[0]
        anomalies.add("non_finite_number", rank, f"{path.name}: token {tok!r} at byte {at}", len(tokens))
    if not array_top and "traceEvents" not in meta:
        raise NotATraceError(f"{path}: no traceEvents list before the end of the file: not a Kineto trace")
    meta = {**meta_from_tail(tail), **meta}
    base = meta.get("baseTimeNanoseconds")
    events = collected_events(collector, int(base) if base is not None else 0, anomalies, rank)
    regrouped = renumbered_group(meta)
    if regrouped is not None and any(e.peer is not None for e in events):
        dropped = sum(1 for e in events if e.peer is not None)
        anomalies.add("p2p_peer_ambiguous", rank, f"{path.name}: {regrouped}", dropped)
        events = [replace(e, peer=None) if e.peer is not None else e for e in events]
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
        end_marker=collector.end_marker,
        profiler_span=collector.profiler_span,
        kineto_header="schemaVersion" in meta,
        last_ns=collector.last_start + (int(base) if base is not None else 0)
        if collector.last_start > -(1 << 62)
        else None,
    )
    return Trace(info, events, tuple(collector.missing_gpu), tuple(collector.orphan_gpu),
                 tuple(collector.copies_without_gpu))


def renumbered_group(meta: Mapping[str, Any]) -> str | None:
    """The first process group of ``distributedInfo.pg_config`` whose ranks are not ``0..n-1`` in order (its rank
    ``i`` is not global rank ``i``), as text; ``None`` when every listed group numbers its ranks as the job does
    (the default group, or a group of the first ranks), or none is listed.

    A point-to-point call's peer in the trace is its rank in the call's process group (:func:`~pnpscale.analysis.
    kineto.p2p_peer`), read as a global rank: right only where no listed group renumbers ranks.

    >>> renumbered_group({"distributedInfo": {"pg_config": [{"pg_name": "0", "ranks": [0, 1, 2]}]}}) is None
    True
    >>> renumbered_group({"distributedInfo": {"pg_config": [{"pg_name": "0", "ranks": [0, 1, 2, 3]},
    ...                                                     {"pg_name": "1", "ranks": [2, 3]}]}})
    "process group '1' holds ranks [2, 3]"
    """
    d = meta.get("distributedInfo")
    groups = d.get("pg_config") if isinstance(d, Mapping) else None
    if not isinstance(groups, list):
        return None
    for g in groups:
        if not isinstance(g, Mapping):
            continue
        ranks = g.get("ranks")
        default = g.get("pg_desc") == "default_pg"
        if isinstance(ranks, list) and ranks == list(range(len(ranks))):
            continue
        if not isinstance(ranks, list) and default:
            continue  # the default group numbers ranks as the job does
        return f"process group {str(g.get('pg_name'))!r} holds ranks {ranks}"
    return None


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
