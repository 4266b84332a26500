"""Plain profiler events and their reduction to per-section records (pure, no torch).

Both the live profiler (:mod:`pnpscale.rank.profiling`) and offline Kineto traces
(:mod:`pnpscale.analysis.offline`) are turned into lists of :class:`Event`; :func:`section_records`
then finds, for one rank, every occurrence of each named section and the collectives inside
it. That is the only place where "what is a section" and "what is a collective" is decided.

Rules:

* A section occurrence is a CPU range event whose name is a section name (a
  ``torch.profiler.record_function``). The k-th occurrence of a name is iteration k.
* CPU backends (gloo): section time is the wall span of that range; collectives are the
  ``gloo:*`` work ranges (on gloo worker threads) that start inside it.
* CUDA (NCCL): section time is the span of the GPU work launched inside the range (the
  ``gpu_user_annotation`` span: first kernel start to last kernel end); collectives are the NCCL
  kernels (``ncclDevKernel_*``, ``ncclKernel_*``, matched case-insensitively on ``nccl``) among
  them. A kernel belongs to the section whose CPU range contains its launch (``launch_ns``, from
  the runtime event with the same correlation id), or, when the launch is unknown, its start.
* Payload bytes of a collective: from the collective's own shapes/dtype (gloo), from the NCCL
  kernel's own arguments when the trace carries them, or else from the k-th collective
  descriptor (``nccl:*`` range or ``record_param_comms``) inside the CPU range for the k-th
  NCCL kernel. The same precedence gives the collective type, process group and sequence number.
  Descriptors are paired with kernels only when there are as many and every pair agrees where
  the kernel name tells the type (a ``SendRecv`` kernel serves all_to_all, send, recv, gather,
  scatter; an ``AllReduce`` kernel a barrier); otherwise (e.g. sampled traces) none is used.
* Matching across ranks (:func:`align_collectives`): by (process group, sequence number) when
  every collective of a section occurrence carries both, else by order within each stream
  (NCCL: the kernel's CUDA stream; gloo: one stream per rank).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum


class Kind(StrEnum):
    """Where an event ran."""

    CPU = "cpu"  # an operator or record_function range on a CPU thread
    GPU = "gpu"  # a kernel, memcpy or memset on a GPU stream
    RUNTIME = "runtime"  # a CUDA runtime/driver call (cudaLaunchKernel, ...) on a CPU thread


#: bytes per element for dtype names as they appear in live profiler events (C++ names) and in
#: Kineto JSON (``record_param_comms`` args use ScalarType names).
DTYPE_BYTES: dict[str, int] = {
    "float": 4, "Float": 4, "float32": 4,
    "double": 8, "Double": 8, "float64": 8,
    "c10::Half": 2, "Half": 2, "float16": 2,
    "c10::BFloat16": 2, "BFloat16": 2, "bfloat16": 2,
    "long int": 8, "Long": 8, "int64": 8, "long long": 8, "long": 8,
    "int": 4, "Int": 4, "int32": 4,
    "short int": 2, "Short": 2, "int16": 2,
    "signed char": 1, "Char": 1, "int8": 1,
    "unsigned char": 1, "Byte": 1, "uint8": 1,
    "bool": 1, "Bool": 1,
    "c10::complex<float>": 8, "ComplexFloat": 8,
    "c10::complex<double>": 16, "ComplexDouble": 16,
}  # fmt: skip

_NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)
_GLOO_WORK = re.compile(r"^gloo:")
_NCCL_DESCRIPTOR = re.compile(r"^nccl:")
_PARAM_COMMS = "record_param_comms"


@dataclass(frozen=True, slots=True)
class Event:
    """One profiler event, as plain data.

    Attributes:
        name: operator, range or kernel name.
        kind: :class:`Kind`.
        start_ns, end_ns: timestamps in nanoseconds on one clock per trace (start <= end).
        tid: CPU thread id (CPU, RUNTIME) or GPU stream id (GPU).
        correlation: CUDA correlation id linking a runtime call and the GPU work it launched
            (``-1`` when unknown).
        launch_ns: for GPU events, start of the launching runtime call when known, else ``None``.
        payload_bytes: bytes of the (first) tensor a collective carries, when known.
        collective: collective type read from the event (``"all_reduce"``, ``"broadcast"``...),
            when known.
        group: process group name of a collective (``"Process Group Name"``), when known.
        group_seq: the collective's sequence number within its process group (``"Seq"``), when
            known; the same collective has the same ``(group, group_seq)`` on every rank.
    """

    name: str
    kind: Kind
    start_ns: int
    end_ns: int
    tid: int = 0
    correlation: int = -1
    launch_ns: int | None = None
    payload_bytes: int | None = None
    collective: str | None = None
    group: str | None = None
    group_seq: int | None = None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class Collective:
    """One collective inside a section on one rank.

    Attributes:
        seq: position inside the section (0-based, by start time).
        name: ``all_reduce``, ``broadcast``, ... (or the kernel name when the type is unknown).
        duration_s: seconds (gloo work range, or NCCL kernel duration).
        payload_bytes: bytes of the tensor reduced/broadcast (``None`` when unknown).
        stream: CUDA stream of the NCCL kernel (``None`` for gloo: one stream per rank).
        group, group_seq: process group and sequence number within it, when the trace has them.
        start_s: start of the gloo work range or NCCL kernel, seconds on the same clock and origin as
            :attr:`SectionRecord.start_s` (the rank's arrival at the collective), when known.
    """

    seq: int
    name: str
    duration_s: float
    payload_bytes: int | None
    stream: int | None = None
    group: str | None = None
    group_seq: int | None = None
    start_s: float | None = None


@dataclass(slots=True)
class SectionRecord:
    """One section occurrence on one rank.

    Attributes:
        iteration: 0-based occurrence index of this section name on the rank.
        section: section name.
        start_s: section start relative to the rank's first section start, seconds.
        section_s: section time in seconds (CPU wall span, or GPU span on CUDA).
        collectives: collectives inside, ordered by start.
    """

    iteration: int
    section: str
    start_s: float
    section_s: float
    collectives: list[Collective] = field(default_factory=list)


class SectionError(ValueError):
    """Events that cannot be reduced to sections (missing or unequal section counts)."""


def collective_type(name: str) -> str | None:
    """Collective type from a gloo/nccl range, c10d op or NCCL kernel name.

    >>> collective_type("gloo:all_reduce"), collective_type("nccl:_all_gather_base")
    ('all_reduce', 'all_gather')
    >>> collective_type("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    'all_reduce'
    >>> collective_type("aten::mm") is None
    True
    """
    low = name.lower()
    for key, norm in (
        ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
        ("reducescatter", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
        ("allgather", "all_gather"), ("all_gather", "all_gather"),
        ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
        ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("barrier", "barrier"),
        ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
        ("send", "send"), ("recv", "recv"),
    ):  # fmt: skip
        if key in low:
            return norm
    return None


def payload_bytes(shapes: Sequence[Sequence[int]] | None, dtypes: Sequence[str] | None) -> int | None:
    """Bytes of the first tensor input: ``prod(shape) * itemsize``.

    >>> payload_bytes([[1000, 1000]], ["float"])
    4000000
    >>> payload_bytes([[]], ["float"]) is None, payload_bytes([[3]], ["unknown"]) is None
    (True, True)
    """
    if not shapes or not dtypes or not shapes[0]:
        return None
    size = DTYPE_BYTES.get(dtypes[0])
    if size is None:
        return None
    n = 1
    for d in shapes[0]:
        n *= int(d)
    return n * size


def is_nccl_kernel(ev: Event) -> bool:
    return ev.kind is Kind.GPU and bool(_NCCL_KERNEL.search(ev.name))


def section_records(events: Iterable[Event], sections: Sequence[str]) -> list[SectionRecord]:
    """Reduce one rank's events to its section occurrences and their collectives.

    Args:
        events: all events of one rank (any order).
        sections: section names, e.g. ``("gradient", "denoiser")``.

    Returns:
        Records ordered by start; ``iteration`` counts occurrences per name from 0. Times
        in seconds. When the trace has GPU events, section times are GPU spans (see module doc).

    Raises:
        SectionError: a section name never occurs, or names occur a different number of times.
    """
    evs = sorted(events, key=lambda e: (e.start_ns, -e.end_ns))
    ranges = [e for e in evs if e.kind is Kind.CPU and e.name in sections]
    counts = {s: sum(1 for r in ranges if r.name == s) for s in sections}
    if not ranges or len(set(counts.values())) != 1:
        raise SectionError(
            "section ranges found per name: "
            + ", ".join(f"{s}={n}" for s, n in counts.items())
            + " (expected the same non-zero count for every section)"
        )
    gpu = _Window([e for e in evs if e.kind is Kind.GPU], key=_launch_key)
    cpu_comm = _Window([e for e in evs if e.kind is Kind.CPU and _GLOO_WORK.match(e.name)])
    descriptors = _Window(
        [e for e in evs if e.kind is Kind.CPU and (_NCCL_DESCRIPTOR.match(e.name) or e.name == _PARAM_COMMS)]
    )
    origin = ranges[0].start_ns
    occurrence: dict[str, int] = defaultdict(int)
    out: list[SectionRecord] = []
    for r in ranges:
        it = occurrence[r.name]
        occurrence[r.name] += 1
        if gpu:
            launched = sorted(gpu.between(r.start_ns, r.end_ns), key=lambda e: (e.start_ns, -e.end_ns))
            if launched:
                span = max(e.end_ns for e in launched) - min(e.start_ns for e in launched)
            else:
                span = 0
            kernels = [e for e in launched if is_nccl_kernel(e)]
            descs = _descriptors_in(descriptors.between(r.start_ns, r.end_ns))
            paired = len(descs) == len(kernels) and all(map(_compatible, kernels, descs))
            colls = []
            for i, k in enumerate(kernels):
                d = descs[i] if paired else None
                name = k.collective or (d.collective if d else None) or collective_type(k.name) or k.name
                payload = k.payload_bytes if k.payload_bytes is not None else (d.payload_bytes if d else None)
                group = k.group if k.group is not None else (d.group if d else None)
                gseq = k.group_seq if k.group_seq is not None else (d.group_seq if d else None)
                start = (k.start_ns - origin) * 1e-9
                colls.append(Collective(i, name, k.duration_ns * 1e-9, payload, k.tid, group, gseq, start))
            out.append(SectionRecord(it, r.name, (r.start_ns - origin) * 1e-9, span * 1e-9, colls))
        else:
            works = cpu_comm.between(r.start_ns, r.end_ns)
            colls = [
                Collective(
                    i,
                    e.collective or collective_type(e.name) or e.name,
                    e.duration_ns * 1e-9,
                    e.payload_bytes,
                    None,
                    e.group,
                    e.group_seq,
                    (e.start_ns - origin) * 1e-9,
                )
                for i, e in enumerate(works)
            ]
            out.append(SectionRecord(it, r.name, (r.start_ns - origin) * 1e-9, r.duration_ns * 1e-9, colls))
    return out


_SERVED_BY = {
    "send_recv": {"all_to_all", "send", "recv", "gather", "scatter"},
    "all_reduce": {"barrier"},
}


def _compatible(kernel: Event, descriptor: Event) -> bool:
    """Whether an NCCL kernel can be the launch of a collective descriptor (by their types)."""
    kt = kernel.collective or collective_type(kernel.name)
    dt = descriptor.collective or collective_type(descriptor.name)
    return kt is None or dt is None or kt == dt or dt in _SERVED_BY.get(kt, set())


def _launch_key(e: Event) -> int:
    """Where a GPU event is placed: its launch when known, else its start."""
    return e.launch_ns if e.launch_ns is not None else e.start_ns


class _Window:
    """Events sorted by a key (default: start) with O(log n) lookup of those in ``[lo, hi]``."""

    def __init__(self, events: list[Event], key: Callable[[Event], int] = lambda e: e.start_ns) -> None:
        self.events = sorted(events, key=lambda e: (key(e), e.start_ns, -e.end_ns))
        self.keys = [key(e) for e in self.events]

    def __bool__(self) -> bool:
        return bool(self.events)

    def between(self, lo: int, hi: int) -> list[Event]:
        return self.events[bisect_left(self.keys, lo) : bisect_right(self.keys, hi)]


def _descriptors_in(inside: list[Event]) -> list[Event]:
    """Collective descriptors of a range: ``nccl:*`` ranges if any, else param comms."""
    named = [d for d in inside if _NCCL_DESCRIPTOR.match(d.name)]
    return named if named else [d for d in inside if d.name == _PARAM_COMMS]


def align_collectives(records: Mapping[int, Sequence[SectionRecord]]) -> dict[int, list[SectionRecord]]:
    """Number every rank's collectives so that the same collective has the same ``seq`` everywhere.

    :func:`pnpscale.analysis.metrics.decompose` matches collectives across ranks by ``seq``. Per section
    occurrence (iteration, section), collectives are keyed:

    * by ``(group, group_seq)`` when every collective of that occurrence, on every rank, carries
      both (the trace recorded the process group and its sequence number), else
    * by ``(stream ordinal, position within that stream)``: streams are numbered in increasing
      stream id on each rank (one stream per rank for gloo), positions by start time.

    The new ``seq`` is the key's position in the lowest rank's start order, so a trace with one
    stream and no sequence numbers keeps the order-in-section numbering of
    :func:`section_records` unchanged.

    Args:
        records: rank -> that rank's records (from :func:`section_records`).

    Returns:
        rank -> new records (inputs untouched), collectives sorted by the new ``seq``.

    Raises:
        SectionError: ranks disagree on the section occurrences, or a collective of one rank has
            no counterpart on another (different counts per stream, or unmatched sequence numbers).

    >>> a = [SectionRecord(0, "s", 0.0, 1.0, [Collective(0, "all_reduce", 0.1, 8, 7),
    ...                                        Collective(1, "broadcast", 0.2, 4, 9)])]
    >>> b = [SectionRecord(0, "s", 0.0, 1.0, [Collective(0, "broadcast", 0.3, 4, 9),
    ...                                        Collective(1, "all_reduce", 0.4, 8, 7)])]
    >>> [(c.seq, c.name) for c in align_collectives({0: a, 1: b})[1][0].collectives]
    [(0, 'all_reduce'), (1, 'broadcast')]
    """
    if not records:
        return {}
    ranks = sorted(records)
    index = {r: {(s.iteration, s.section): s for s in records[r]} for r in ranks}
    occurrences = list(index[ranks[0]])
    for r in ranks[1:]:
        if set(index[r]) != set(occurrences):
            missing = sorted(set(occurrences) ^ set(index[r]))[0]
            raise SectionError(
                f"rank {r} and rank {ranks[0]} disagree on section occurrences (e.g. iteration {missing[0]} "
                f"section {missing[1]!r})"
            )
    out: dict[int, list[SectionRecord]] = {r: [] for r in ranks}
    new_seq: dict[int, dict[tuple[int, str], list[Collective]]] = {r: {} for r in ranks}
    for occ in occurrences:
        colls = {r: index[r][occ].collectives for r in ranks}
        by_pg = all(c.group is not None and c.group_seq is not None for r in ranks for c in colls[r])
        keys = {r: _match_keys(colls[r], by_pg) for r in ranks}
        ref = [k for _, k in sorted(zip((c.seq for c in colls[ranks[0]]), keys[ranks[0]], strict=True))]
        if len(set(ref)) != len(ref):
            raise SectionError(f"iteration {occ[0]} section {occ[1]!r}: rank {ranks[0]} repeats a collective key")
        for r in ranks[1:]:
            if sorted(keys[r]) != sorted(ref):
                how = "process group and sequence number" if by_pg else "order within each stream"
                raise SectionError(
                    f"iteration {occ[0]} section {occ[1]!r}: rank {r} ran {len(keys[r])} collective(s), rank "
                    f"{ranks[0]} ran {len(ref)}, and they cannot be matched by {how} "
                    f"(rank {r}: {sorted(keys[r])}; rank {ranks[0]}: {sorted(ref)})"
                )
        position = {k: i for i, k in enumerate(ref)}
        for r in ranks:
            renum = [replace(c, seq=position[k]) for c, k in zip(colls[r], keys[r], strict=True)]
            new_seq[r][occ] = sorted(renum, key=lambda c: c.seq)
    for r in ranks:
        for s in records[r]:
            out[r].append(replace(s, collectives=new_seq[r][(s.iteration, s.section)]))
    return out


def _match_keys(colls: Sequence[Collective], by_pg: bool) -> list[tuple]:
    """Match key of each collective of one rank's section occurrence, aligned with ``colls``."""
    if by_pg:
        return [("pg", str(c.group), int(c.group_seq)) for c in colls]  # type: ignore[arg-type]
    streams = sorted({c.stream for c in colls}, key=lambda s: (s is not None, s or 0))
    ordinal = {s: i for i, s in enumerate(streams)}
    seen: dict[int | None, int] = defaultdict(int)
    keys: list[tuple] = [()] * len(colls)
    for i in sorted(range(len(colls)), key=lambda i: colls[i].seq):
        c = colls[i]
        keys[i] = ("stream", ordinal[c.stream], seen[c.stream])
        seen[c.stream] += 1
    return keys


def rank_rows(
    rank: int,
    records: Sequence[SectionRecord],
    warmup: int,
    peaks: Mapping[tuple[int, str], int | None] | None = None,
) -> dict[str, list[dict]]:
    """One rank's plain table (the ``table`` of :func:`pnpscale.analysis.tables.frames`) from its records.

    Args:
        rank: the rank.
        records: its section records.
        warmup: iterations ``< warmup`` are flagged as warm-up.
        peaks: optional (iteration, section) -> peak memory in bytes (``None`` when unknown).

    Returns:
        ``{"ranks": [row...], "collectives": [row...]}`` with the columns of
        :data:`pnpscale.columns.RANKS_COLUMNS` and :data:`pnpscale.columns.COLLECTIVES_COLUMNS`
        (without MAIN); times in seconds, sizes in bytes.
    """
    from pnpscale import columns as K

    peaks = peaks or {}
    rows, colls = [], []
    for s in records:
        rows.append(
            {
                K.RANK: rank,
                K.ITERATION: s.iteration,
                K.SECTION: s.section,
                K.WARMUP: s.iteration < warmup,
                K.START_S: s.start_s,
                K.SECTION_S: s.section_s,
                K.COMM_S: sum(c.duration_s for c in s.collectives),
                K.N_COLLECTIVES: len(s.collectives),
                K.PEAK_MEM_BYTES: peaks.get((s.iteration, s.section)),
            }
        )
        for c in s.collectives:
            colls.append(
                {
                    K.RANK: rank,
                    K.ITERATION: s.iteration,
                    K.SECTION: s.section,
                    K.SEQ: c.seq,
                    K.COLLECTIVE: c.name,
                    K.START_S: c.start_s,
                    K.DURATION_S: c.duration_s,
                    K.PAYLOAD_BYTES: c.payload_bytes,
                }
            )
    return {"ranks": rows, "collectives": colls}
