"""Plain profiler events and the per-section records they reduce to (pure, no torch).

Both the live profiler (:mod:`pnpscale.rank.profiling`) and offline Kineto traces
(:mod:`pnpscale.analysis.trace.read`) are turned into lists of :class:`Event`;
:func:`pnpscale.analysis.section.records.section_records` reduces one rank's events to :class:`SectionRecord`
occurrences and the :class:`Collective` records inside them, and :func:`rank_rows` turns those into one
rank's plain table (:mod:`pnpscale.columns`). Also here: :class:`Window` (events in ``[lo, hi]`` by a
key, O(log n)) and :func:`launch_key` (where a GPU event is placed), shared by the section rules.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from pnpscale import columns as K
from pnpscale.core.errors import PnpscaleError


class Kind(StrEnum):
    """Where an event ran."""

    CPU = "cpu"  # an operator or record_function range on a CPU thread
    GPU = "gpu"  # a kernel, memcpy or memset on a GPU stream
    RUNTIME = "runtime"  # a CUDA runtime/driver call (cudaLaunchKernel, ...) on a CPU thread
    OP = "op"  # a profiled operator (cpu_op: aten::*, c10d::*, autograd nodes) on a CPU thread


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
        bad: why the event's timing is not physical (negative or missing ``dur``), else ``None``;
            such an event has ``end_ns == start_ns``.
        peer, tag: of a point-to-point call or its gloo work range: the other rank (``dst`` of a send, ``src`` of
            a receive, its rank in the call's process group) and the tag, when the trace has them (a
            ``c10d::send``/``c10d::recv_`` recorded with ``record_shapes``:
            :func:`pnpscale.analysis.kineto.p2p_peer`), else ``None``.
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
    bad: str | None = None
    peer: int | None = None
    tag: int | None = None

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
        blocked_s: the part of ``duration_s`` during which the rank was blocked on this collective
            (:mod:`pnpscale.analysis.overlap`); ``None``: unknown, taken as blocked throughout.
        hidden_s: the part of ``duration_s`` overlapped by the rank's compute (0 when unknown).
        blocked_spans: the blocked spans as text (``"lo-hi,..."``, ns from the collective's start;
            :func:`pnpscale.analysis.overlap.spans_text`), ``None`` when unknown.
        carried: ``(iteration, section, seq)`` of the entry of the section occurrence that issued it, for the
            part of a collective waited in a later section (:mod:`pnpscale.analysis.section.p2p`), else ``None``.
        peer, tag: of a ``send``/``recv``: the other rank and the tag, when the trace has them (:attr:`Event.peer`).
    """

    seq: int
    name: str
    duration_s: float
    payload_bytes: int | None
    stream: int | None = None
    group: str | None = None
    group_seq: int | None = None
    start_s: float | None = None
    blocked_s: float | None = None
    hidden_s: float = 0.0
    blocked_spans: str | None = None
    carried: tuple[int, str, int] | None = None
    peer: int | None = None
    tag: int | None = None


@dataclass(slots=True)
class SectionRecord:
    """One section occurrence on one rank.

    Attributes:
        iteration: 0-based occurrence index of this section name on the rank.
        section: section name.
        start_s: section start relative to the rank's first section start, seconds.
        section_s: section time in seconds (CPU wall span, or GPU span on CUDA).
        collectives: collectives inside, ordered by start.
        step: ``N`` of the ``ProfilerStep#N`` range enclosing it (or being it), when there is one.
        parent: the requested section whose range encloses this one (nested sections), else ``None``.
        bad: description of a non-physical event inside (see :attr:`Event.bad`), else ``None``.
        missing_kernels: CPU-side collective descriptors inside that have no GPU kernel (CUDA).
        gpu_span_s: on CUDA, first GPU start to last GPU end of the work launched inside (seconds;
            ``None`` without GPU work, and on CPU backends).
        hidden_s: the collectives' time overlapped by the rank's compute, their union (seconds).
        bad_kind: the anomaly kind under which :func:`drop_bad_iterations` records ``bad``.
        open_end: read from a file that may be cut short (no Kineto end marker), and no event of the file
            starts after this range ends: whether it is complete cannot be seen (:func:`drop_cut_iterations`).
        gpu_start_s: on CUDA, the first GPU start of the work launched inside (seconds, same clock and origin as
            ``start_s``; ``None`` without GPU work, and on CPU backends): with ``gpu_span_s`` it places
            ``section_s`` on the rank's clock (it ends at ``gpu_start_s + gpu_span_s``).
    """

    iteration: int
    section: str
    start_s: float
    section_s: float
    collectives: list[Collective] = field(default_factory=list)
    step: int | None = None
    parent: str | None = None
    bad: str | None = None
    missing_kernels: int = 0
    gpu_span_s: float | None = None
    hidden_s: float = 0.0
    bad_kind: str = "non_physical_timing"
    open_end: bool = False
    gpu_start_s: float | None = None

    @property
    def comm_s(self) -> float:
        """Time blocked on the collectives (their durations where the blocked time is unknown)."""
        return sum(c.duration_s if c.blocked_s is None else c.blocked_s for c in self.collectives)


class DecompositionError(PnpscaleError, ValueError):
    """Per-rank tables that cannot be decomposed (missing ranks, unmatched collectives): raised by
    :mod:`pnpscale.analysis.metrics` (defined here, with the other analysis errors, so that a module that only
    catches it needs no pandas)."""


class NoMeasuredIteration(DecompositionError):
    """Every iteration of the tables is a warm-up one: nothing to measure."""


class SectionError(PnpscaleError, ValueError):
    """Events that cannot be reduced to sections (missing or unequal section counts).

    Attributes:
        counts: section name -> the ranges of that name found, when the counts were the fault, else ``None``.
    """

    counts: dict[str, int] | None = None


def launch_key(e: Event) -> int:
    """Where a GPU event is placed: its launch when known, else its start."""
    return e.launch_ns if e.launch_ns is not None else e.start_ns


class Window:
    """Events sorted by a key (default: start) with O(log n) lookup of those in ``[lo, hi]``."""

    def __init__(self, events: list[Event], key: Callable[[Event], int] = lambda e: e.start_ns) -> None:
        self.events = sorted(events, key=lambda e: (key(e), e.start_ns, -e.end_ns))
        self.keys = [key(e) for e in self.events]

    def __bool__(self) -> bool:
        return bool(self.events)

    def between(self, lo: int, hi: int) -> list[Event]:
        return self.events[bisect_left(self.keys, lo) : bisect_right(self.keys, hi)]


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
                K.COMM_S: s.comm_s,
                K.N_COLLECTIVES: len(s.collectives),
                K.PEAK_MEM_BYTES: peaks.get((s.iteration, s.section)),
                K.GPU_SPAN_S: s.gpu_span_s,
                K.HIDDEN_S: s.hidden_s,
                K.GPU_START_S: s.gpu_start_s,
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
                    K.BLOCKED_S: c.duration_s if c.blocked_s is None else c.blocked_s,
                    K.HIDDEN_S: c.hidden_s,
                    K.BLOCKED_SPANS_NS: c.blocked_spans,
                    K.PROCESS_GROUP: c.group,
                }
            )
    return {"ranks": rows, "collectives": colls}
