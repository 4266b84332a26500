"""Plain profiler events and their reduction to per-section records (pure, no torch).

Both the live profiler (:mod:`pnpscale.rank.profiling`) and offline Kineto traces
(:mod:`pnpscale.analysis.offline`) are turned into lists of :class:`Event`; :func:`section_records`
then finds, for one rank, every occurrence of each named section and the collectives inside
it. That is the only place where "what is a section" and "what is a collective" is decided.

Rules:

* A section occurrence is a CPU range event whose name is a section name (a
  ``torch.profiler.record_function``). The k-th occurrence of a name is iteration k.
* CPU backends (gloo): section time is the wall span of that range; collectives are the
  ``gloo:*`` work ranges (on gloo worker threads) that start inside it, typed and timed from the
  ``c10d::`` call that issued each (:func:`_typed_by_c10d`).
* Cost of a collective: the time the rank was blocked on it (:mod:`pnpscale.analysis.overlap`): CPU, the
  calling thread's time in ``c10d::`` calls and waiting for a collective to end, outside compute operators
  (``Kind.OP``: profiled ``cpu_op`` operators); CUDA, collective kernels minus the rank's other GPU events.
  The rest of a collective's time is hidden. In GPU-span mode a section's GPU work that runs past the next
  section's first GPU start is clipped there (:func:`_gpu_clips`).
* CUDA (NCCL): section time is the span of the GPU work launched inside the range (first kernel
  start to last kernel end, kept as ``gpu_span_s``); for pnpscale's own runs (``cpu_start``: every
  section starts with the GPU idle, after a synchronize and a barrier) it runs from the CPU range
  start to the last GPU end (one clock within a process), so a rank late on the CPU before its
  first kernel shows compute, not its peers' wait (:func:`cuda_section_span`). A live CUDA run
  (``require_gpu``) without GPU events, or with a section whose collectives have no kernel at all,
  is refused. Collectives are the
  collective kernels among them (:data:`pnpscale.analysis.kineto.COLLECTIVE_KERNELS`). A kernel
  belongs to the section whose CPU range contains its launch (``launch_ns``, from the runtime event
  with the same correlation id). A collective kernel whose launch is unknown (correlation 0) is
  paired in order with the rank's CPU descriptors that no launched kernel belongs to, else placed
  by its GPU start (both recorded as anomalies).
* Collective type, payload bytes, process group and sequence number: from the collective's own
  shapes/dtype (gloo), from the NCCL kernel's own arguments when the trace carries them, or else
  from the CPU-side descriptor (``nccl:*`` range or ``record_param_comms``) paired with the
  kernel: the k-th descriptor in start order with the k-th kernel in launch order, when there are
  as many and one CPU thread issued them all (or, issued from several threads, when every kernel
  name allows its descriptor's type). The descriptor wins over the kernel name (an all_reduce may
  run in a ``SendRecv`` kernel); a disagreeing name is recorded. Descriptors without a kernel are
  counted (``missing_kernels``) and named when ranks cannot be matched.
* Sections may nest (``parent``); overlapping without nesting is refused. ``ProfilerStep#N``
  numbers are kept (``step``) to match ranks by step (:func:`match_steps`); non-physical events
  mark their record ``bad`` (:func:`drop_bad_iterations`).
* Matching across ranks (:func:`align_collectives`): by (process group, sequence number) when
  every collective of a section occurrence carries both, else by order within each stream
  (NCCL: the kernel's CUDA stream; gloo: one stream per rank).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.kineto import (
    DTYPE_BYTES,
    END_MARKER,
    PARAM_COMMS,
    collective_type,
    is_collective_kernel,
    is_descriptor,
    is_gloo_work,
    is_named_descriptor,
    kernel_collective,
    payload_bytes,
    step_number,
)
from pnpscale.analysis.overlap import (
    C10D_PREFIX,
    Span,
    communicating,
    compute_spans,
    intersect,
    length,
    rank_blocked,
    spans_text,
    subtract,
    union,
)
from pnpscale.core.errors import PnpscaleError


class Kind(StrEnum):
    """Where an event ran."""

    CPU = "cpu"  # an operator or record_function range on a CPU thread
    GPU = "gpu"  # a kernel, memcpy or memset on a GPU stream
    RUNTIME = "runtime"  # a CUDA runtime/driver call (cudaLaunchKernel, ...) on a CPU thread
    OP = "op"  # a profiled operator (cpu_op: aten::*, c10d::*, autograd nodes) on a CPU thread


# the vocabulary lives in pnpscale.analysis.kineto; re-exported here for callers of this module
__all__ = ["DTYPE_BYTES", "collective_type", "payload_bytes"]


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

    @property
    def comm_s(self) -> float:
        """Time blocked on the collectives (their durations where the blocked time is unknown)."""
        return sum(c.duration_s if c.blocked_s is None else c.blocked_s for c in self.collectives)


class SectionError(PnpscaleError, ValueError):
    """Events that cannot be reduced to sections (missing or unequal section counts).

    Attributes:
        counts: section name -> the ranges of that name found, when the counts were the fault, else ``None``.
    """

    counts: dict[str, int] | None = None


def is_nccl_kernel(ev: Event) -> bool:
    """A collective's GPU kernel (see :func:`pnpscale.analysis.kineto.is_collective_kernel`)."""
    return ev.kind is Kind.GPU and is_collective_kernel(ev.name)


def section_records(
    events: Iterable[Event],
    sections: Sequence[str],
    anomalies: Anomalies | None = None,
    rank: int | None = None,
    require_gpu: bool = False,
    cpu_start: bool = False,
    file_end_ns: int | None = None,
    missing_gpu: Sequence[int] = (),
) -> list[SectionRecord]:
    """Reduce one rank's events to its section occurrences and their collectives.

    Args:
        events: all events of one rank (any order).
        sections: section names, e.g. ``("gradient", "denoiser")``.
        anomalies: where to record what was assumed or repaired (see
            :mod:`pnpscale.analysis.anomalies`); ``rank`` labels those records.
        require_gpu: a live CUDA run: a trace without GPU events is refused instead of being read
            with CPU semantics (zero transfer and wait), and so is a section whose collectives have
            no kernel at all (see :func:`cuda_section_span`).
        cpu_start: CUDA section time from the CPU range start to the last GPU end (pnpscale's runs,
            whose sections start with the GPU idle), else the GPU span (foreign traces, where the GPU
            may still run earlier work when a range starts).
        file_end_ns: given for a file that may be cut short (no Kineto end marker): the latest event start
            in it (ns). Then section names occurring a different number of times keep their first ``m``
            occurrences (``m`` the fewest, at least 1; ``trace_cut_short``), and a range ending after it is
            ``open_end``.
        missing_gpu: starts (ns) of launches whose GPU event is not in the file (cut short): the
            occurrence holding one is ``bad`` (kind ``trace_cut_short``; dropped on every rank).

    Returns:
        Records ordered by start; ``iteration`` counts occurrences per name from 0. Times
        in seconds. When the trace has GPU events, section times are GPU spans, or with ``cpu_start``
        from the CPU range start to the last GPU end (see module doc).
        Each record carries its ``ProfilerStep`` number, its enclosing section (nesting), the
        first non-physical event inside it, and its descriptors without a GPU kernel.

    Raises:
        SectionError: a section name never occurs, names occur a different number of times, or two
            section ranges overlap without one enclosing the other; see also ``require_gpu``.
    """
    anomalies = anomalies if anomalies is not None else Anomalies()
    evs = sorted(events, key=lambda e: (e.start_ns, -e.end_ns))
    ranges = [e for e in evs if e.kind in _RANGE_KINDS and e.name in sections]
    counts = {s: sum(1 for r in ranges if r.name == s) for s in sections}
    if file_end_ns is not None and len(set(counts.values())) > 1 and min(counts.values()) > 0:
        keep = min(counts.values())
        anomalies.add(
            "trace_cut_short",
            rank,
            "section ranges found per name: " + ", ".join(f"{s}={n}" for s, n in counts.items())
            + f", in a file Kineto did not close (no {END_MARKER!r}): cut short? iteration {keep} on dropped",
        )  # fmt: skip
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for e in ranges:
            seen[e.name] += 1
            if seen[e.name] <= keep:
                kept.append(e)
        ranges = kept
        counts = {s: keep for s in sections}
    if not ranges or len(set(counts.values())) != 1:
        cut = ""
        if file_end_ns is not None and any(counts.values()):
            cut = f"; or the file was cut short: Kineto did not close it (no {END_MARKER!r})"
        error = SectionError(
            "section ranges found per name: "
            + ", ".join(f"{s}={n}" for s, n in counts.items())
            + " (expected the same non-zero count for every section)"
            + cut
        )
        error.counts = dict(counts)
        raise error
    parents = _nesting(ranges, counts)
    step_ranges = [
        e for e in evs if e.kind in _RANGE_KINDS and e.name not in sections and step_number(e.name) is not None
    ]
    step_starts = [e.start_ns for e in step_ranges]
    descriptor_events = [e for e in evs if e.kind is Kind.CPU and is_descriptor(e.name)]
    gpu_events = _place_unknown_launches([e for e in evs if e.kind is Kind.GPU], descriptor_events, anomalies, rank)
    gpu = _Window(gpu_events, key=_launch_key)
    if require_gpu and not gpu:
        raise SectionError(
            "a CUDA run whose profiler recorded no GPU event (kernels, memcpy): CUPTI did not trace (another "
            "profiler attached, or CUPTI unavailable); see the Kineto messages in the rank's stderr"
        )
    works = [e for e in evs if e.kind is Kind.CPU and is_gloo_work(e.name)]
    _refuse_unplaceable([*gpu_events, *works], ranges)
    typed, issued = _typed_by_c10d(works, evs, anomalies, rank)
    cpu_comm = _Window(typed)
    descriptors = _Window(descriptor_events)
    busy = _Busy(evs, sections, gpu_events)
    origin = ranges[0].start_ns
    clips = {} if cpu_start or not gpu else _gpu_clips(ranges, parents, gpu, anomalies, rank)
    occurrence: dict[str, int] = defaultdict(int)
    out: list[SectionRecord] = []
    for r, parent in zip(ranges, parents, strict=True):
        it = occurrence[r.name]
        occurrence[r.name] += 1
        i = bisect_right(step_starts, r.start_ns) - 1
        step = step_number(step_ranges[i].name) if i >= 0 and step_ranges[i].end_ns >= r.end_ns else None
        bad = f"{r.name!r} range: {r.bad}" if r.bad else None
        bad_kind = "non_physical_timing"
        missing = 0
        if gpu:
            launched = sorted(gpu.between(r.start_ns, r.end_ns), key=lambda e: (e.start_ns, -e.end_ns))
            kernels = [e for e in launched if is_nccl_kernel(e)]
            descs = _descriptors_in(descriptors.between(r.start_ns, r.end_ns))
            n_descs = len(descs) if require_gpu else 0  # offline: recorded as anomalies below
            section_ns, gpu_span_ns = cuda_section_span(r, launched, n_descs, len(kernels), it, cpu_start)
            window = None
            if id(r) in clips and gpu_span_ns is not None:  # GPU work past the next section's start: clipped
                first = min(e.start_ns for e in launched)
                window = (first, clips[id(r)])
                section_ns = gpu_span_ns = clips[id(r)] - first
            # by issue order: kernels by launch, descriptors by start; trusted when one CPU thread issued
            # them all (its order is the kernels' order), else only where every kernel name agrees
            by_launch = sorted(range(len(kernels)), key=lambda j: (_launch_key(kernels[j]), kernels[j].start_ns))
            paired = len(descs) == len(kernels) and (
                len({d.tid for d in descs}) <= 1
                or all(_compatible(kernels[j], d) for j, d in zip(by_launch, descs, strict=True))
            )
            desc_of = dict(zip(by_launch, descs, strict=True)) if paired else {}
            if len(descs) > len(kernels):
                missing = len(descs) - len(kernels)
                anomalies.add(
                    "collective_without_kernel",
                    rank,
                    f"iteration {it} section {r.name!r}: {len(descs)} descriptor(s) "
                    f"({', '.join(d.name for d in descs)}), {len(kernels)} kernel(s)",
                    missing,
                )
            colls = []
            for i, k in enumerate(kernels):
                d = desc_of.get(i)
                hint = kernel_collective(k.name)
                described = k.collective or (d.collective if d else None)
                if described and hint and hint != described and not _may_run(hint, described):
                    anomalies.add(
                        "kernel_name_disagrees", rank, f"{k.name.split('(')[0]} ran {described} (iteration {it})"
                    )
                name = described or hint or k.name
                payload = k.payload_bytes if k.payload_bytes is not None else (d.payload_bytes if d else None)
                group = k.group if k.group is not None else (d.group if d else None)
                gseq = k.group_seq if k.group_seq is not None else (d.group_seq if d else None)
                start = (k.start_ns - origin) * 1e-9
                colls.append(Collective(i, name, k.duration_ns * 1e-9, payload, k.tid, group, gseq, start))
            hidden_ns = busy.split(colls, kernels, busy.gpu, window, waits=False)
            bad = bad or next((f"{e.name!r}: {e.bad}" for e in launched if e.bad), None)
            lost = bisect_right(missing_gpu, r.end_ns) - bisect_left(missing_gpu, r.start_ns)
            if lost and not bad:
                first_lost = missing_gpu[bisect_left(missing_gpu, r.start_ns)]
                bad = (f"{lost} launch(es) inside it (the first at ts {first_lost / 1000:.3f} us), among the "
                       f"file's last, have no GPU event, in a file Kineto did not close (no {END_MARKER!r}): cut "
                       f"short (or the profiler dropped those GPU records); its GPU work is missing")  # fmt: skip
                bad_kind = "trace_cut_short"
        else:
            gpu_span_ns = None
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
            # from the c10d call on: the calling thread is inside the collective (enqueue, then Work.wait())
            called = [(min(issued.get(id(e), e.start_ns), e.start_ns), e.end_ns) for e in works]
            computing, in_calls = busy.cpu(r, works)
            hidden_ns = busy.split(colls, works, computing, (r.start_ns, r.end_ns), True, called, in_calls)
            bad = bad or next((f"{e.name!r}: {e.bad}" for e in works if e.bad), None)
            section_ns = r.duration_ns
        out.append(
            SectionRecord(
                it,
                r.name,
                (r.start_ns - origin) * 1e-9,
                section_ns * 1e-9,
                colls,
                step,
                parent,
                bad,
                missing,
                None if gpu_span_ns is None else gpu_span_ns * 1e-9,
                hidden_ns * 1e-9,
                bad_kind,
                file_end_ns is not None and r.end_ns > file_end_ns,
            )  # fmt: skip
        )
    return out


#: what a non-physical event's ``bad`` says when its time (or its launch's) is not a time: it cannot be placed
UNPLACEABLE = "negative timestamp"


def _refuse_unplaceable(events: Sequence[Event], ranges: Sequence[Event]) -> None:
    """Refuse a collective range or GPU event whose time (or its launch's) is not a time and that therefore lies in
    no section range: its section would silently lose it (a collective missing from the transfer and wait).

    Raises:
        SectionError: naming the event and why its time is not one.
    """
    spans = [(r.start_ns, r.end_ns) for r in ranges]
    for e in events:
        if not e.bad or UNPLACEABLE not in e.bad:
            continue
        at = _launch_key(e) if e.kind is Kind.GPU else e.start_ns
        if not any(a <= at <= b for a, b in spans):
            raise SectionError(
                f"{e.name.split('(')[0]!r}: {e.bad}: a non-physical timestamp, so it cannot be placed in its section "
                f"(whose numbers would silently lack it)"
            )


#: kinds of events that may be a section or ``ProfilerStep`` range (``record_function`` ranges are
#: ``user_annotation``; some ranges, e.g. ``ProfilerStep#N`` in some versions, are ``cpu_op``).
_RANGE_KINDS = (Kind.CPU, Kind.OP)


#: collectives gloo runs as another algorithm, named after it in its range (FSDP's reduce_scatter)
_GLOO_RUNS_AS = {"reduce_scatter": {"all_reduce"}, "all_gather": {"all_reduce"}}


def _typed_by_c10d(
    works: list[Event], evs: Sequence[Event], anomalies: Anomalies, rank: int | None
) -> tuple[list[Event], dict[int, int]]:
    """Collective types of gloo work ranges from the ``c10d::`` calls that issued them, and when each was issued.

    The gloo range is named after the algorithm that ran (FSDP's ``reduce_scatter`` runs as
    ``gloo:all_reduce``); the ``c10d::`` operator on the calling thread names the collective that was
    asked for. A process group runs its work in issue order: the work ranges, by start, are paired in order
    with the calls, each with the first call not yet paired that started before it and asked for the
    collective the range ran (or one gloo runs as it: :data:`_GLOO_RUNS_AS`); calls passed over have no gloo
    work range (another backend's). A work range with no call (issued before the profiler started) keeps its
    own name. Each disagreement is recorded (``range_name_disagrees``).

    Returns:
        (the work ranges, typed; ``id(range) -> start of its c10d call`` (ns) for the paired ones: the calling
        thread is inside the collective from that moment).
    """
    calls = sorted(
        (e for e in evs if e.kind is Kind.OP and e.name.startswith(C10D_PREFIX) and collective_type(e.name)),
        key=lambda e: (e.start_ns, e.tid),
    )
    if not calls:
        return works, {}
    out = []
    issued: dict[int, int] = {}
    differ: list[str] = []
    k = 0
    for w in sorted(works, key=lambda e: (e.start_ns, e.tid)):
        ran = w.collective or collective_type(w.name)
        while k < len(calls) and calls[k].start_ns <= w.start_ns:
            call = calls[k]
            k += 1
            asked = collective_type(call.name)
            if asked != ran and ran not in _GLOO_RUNS_AS.get(asked or "", ()):
                continue  # a call without a gloo work range (another backend's, or not recorded)
            if asked and asked != ran:
                differ.append(f"{w.name} issued by {call.name}")
                w = replace(w, collective=asked)
            issued[id(w)] = call.start_ns
            break
        out.append(w)
    if differ:
        anomalies.add("range_name_disagrees", rank, f"{differ[0]} (type taken from the c10d call)", len(differ))
    return out, issued


def _gpu_clips(
    ranges: Sequence[Event], parents: Sequence[str | None], gpu: _Window, anomalies: Anomalies, rank: int | None
) -> dict[int, int]:
    """Where a section's GPU work runs past the start of the next section's GPU work (asynchronous GPU
    pipelines: step k's kernels still run when step k+1's start): ``id(range) -> clip (ns)``, the next
    section's first GPU start, so that no GPU time is counted in two sections. The next section is the next
    range with the same enclosing section that starts after this one ends. Recorded as
    ``gpu_work_past_next_section`` (the sections and the overlap)."""
    spans: dict[int, tuple[int, int]] = {}
    for r in ranges:
        launched = gpu.between(r.start_ns, r.end_ns)
        if launched:
            spans[id(r)] = (min(e.start_ns for e in launched), max(e.end_ns for e in launched))
    order = sorted(range(len(ranges)), key=lambda i: ranges[i].start_ns)
    index: dict[int, int] = {}
    occurrence: dict[str, int] = defaultdict(int)
    for i in order:
        index[i] = occurrence[ranges[i].name]
        occurrence[ranges[i].name] += 1
    clips: dict[int, int] = {}
    examples: list[str] = []
    for pos, i in enumerate(order):
        r = ranges[i]
        nxt = next((j for j in order[pos + 1 :] if parents[j] == parents[i] and ranges[j].start_ns >= r.end_ns), None)
        if nxt is None or id(r) not in spans or id(ranges[nxt]) not in spans:
            continue
        first, last = spans[id(r)]
        nfirst = spans[id(ranges[nxt])][0]
        if last > nfirst > first:
            clips[id(r)] = nfirst
            examples.append(
                f"{r.name!r} iteration {index[i]}: its GPU work ends {(last - nfirst) / 1e6:.3f} ms after "
                f"{ranges[nxt].name!r} iteration {index[nxt]} starts on the GPU"
            )
    if examples:
        anomalies.add("gpu_work_past_next_section", rank, f"{examples[0]}: clipped to its own section", len(examples))
    return clips


class _Busy:
    """Where one rank computes, for :mod:`pnpscale.analysis.overlap`: CPU threads' compute operators
    (innermost operator neither a ``c10d::`` call nor enclosing one) and GPU compute events."""

    def __init__(self, evs: Sequence[Event], sections: Sequence[str], gpu_events: Sequence[Event]) -> None:
        per_tid: dict[int, list[Event]] = defaultdict(list)
        self.c10d: dict[int, list[int]] = defaultdict(list)
        self.calls: dict[int, list[Span]] = defaultdict(list)
        for e in evs:
            if e.kind is Kind.OP and e.name not in sections and step_number(e.name) is None:
                per_tid[e.tid].append(e)
                if e.name.startswith(C10D_PREFIX):
                    self.c10d[e.tid].append(e.start_ns)
                    self.calls[e.tid].append((e.start_ns, e.end_ns))
        self.spans: dict[int, list[Span]] = {}
        for tid, ops in per_tid.items():
            flags = communicating([(e.start_ns, e.end_ns, e.name) for e in ops])
            self.spans[tid] = compute_spans([(e.start_ns, e.end_ns, f) for e, f in zip(ops, flags, strict=True)])
        for starts in self.c10d.values():
            starts.sort()
        self.gpu = union(
            (e.start_ns, e.end_ns) for e in gpu_events if not is_collective_kernel(e.name) and e.bad is None
        )

    def cpu(self, section: Event, works: Sequence[Event]) -> tuple[list[Span], list[Span]]:
        """(compute spans, c10d call spans) inside ``section`` on its thread and on every thread that issued a
        collective in it."""
        if not works:
            return [], []
        lo, hi = section.start_ns, section.end_ns
        tids = {section.tid} | {
            t for t, starts in self.c10d.items() if bisect_right(starts, hi) > bisect_left(starts, lo)
        }
        busy = union(s for t in tids for s in intersect(self.spans.get(t, []), [(lo, hi)]))
        return busy, union(s for t in tids for s in intersect(union(self.calls.get(t, [])), [(lo, hi)]))

    @staticmethod
    def split(
        colls: list[Collective],
        evs: Sequence[Event],
        busy: Sequence[Span],
        window: Span | None,
        waits: bool,
        activity: Sequence[Span] | None = None,
        calls: Sequence[Span] = (),
    ) -> int:
        """Fill each collective's blocked and hidden time (``colls`` aligned with their events ``evs``, clipped
        to ``window``); returns the section's hidden time (ns). With ``waits`` (a CPU thread: gloo), the thread
        is blocked only while it waits for a collective to end (:func:`pnpscale.analysis.overlap.waited`).
        ``activity``: each collective's span when not its event's (gloo: from its c10d call to its end);
        ``calls``: the thread's time inside ``c10d::`` calls (blocked)."""
        if not colls:
            return 0
        activity = activity if activity is not None else [(e.start_ns, e.end_ns) for e in evs]
        per, hidden = rank_blocked(activity, busy, window, waits=waits, calls=calls)
        blocked = union(s for spans in per for s in spans)
        for c, e, spans, act in zip(colls, evs, per, activity, strict=True):
            lo, hi = (max(act[0], window[0]), min(act[1], window[1])) if window else act
            c.blocked_s = length(spans) * 1e-9
            c.blocked_spans = spans_text(spans, e.start_ns)
            c.hidden_s = length(subtract([(lo, hi)] if hi > lo else [], blocked)) * 1e-9
        return hidden


def cuda_section_span(
    cpu_range: Event,
    launched: Sequence[Event],
    n_descriptors: int,
    n_nccl_kernels: int,
    iteration: int,
    cpu_start: bool = True,
) -> tuple[int, int | None]:
    """Section time of one CUDA section occurrence, and its GPU span (nanoseconds).

    With ``cpu_start`` (pnpscale's runs, whose sections start with the GPU idle) ``S_r`` runs from
    the CPU range start to the last end of the GPU work launched inside it (Kineto puts CPU and GPU
    events of a process on one clock): a rank that is late on the CPU before its first kernel
    (Python, launches, a host-side wait) shows that delay as its own compute, so load imbalance is
    not hidden as its peers' wait. Without ``cpu_start`` (foreign traces: the GPU may still be
    running earlier work when the range starts) ``S_r`` is the GPU span. Without GPU work, ``S_r``
    is the CPU range with ``cpu_start``, else 0. The GPU span (first GPU start to last GPU end) is
    returned beside it.

    Args:
        cpu_range: the section's ``record_function`` range.
        launched: GPU events launched inside it.
        n_descriptors: collective descriptors (``nccl:*`` / ``record_param_comms``) inside it to
            check against ``n_nccl_kernels`` (0: no check).
        n_nccl_kernels: collective kernels among ``launched``.
        iteration: occurrence index, for messages.
        cpu_start: see above.

    Returns:
        ``(section_ns, gpu_span_ns)``; ``gpu_span_ns`` is ``None`` without GPU work.

    Raises:
        SectionError: collectives were issued (descriptors) but no collective kernel was recorded:
            CUPTI dropped or stopped recording, and the section would read as all compute.

    >>> r = Event("s", Kind.CPU, 100, 400)
    >>> cuda_section_span(r, [Event("k", Kind.GPU, 150, 300), Event("k", Kind.GPU, 310, 390)], 0, 0, 0)
    (290, 240)
    >>> cuda_section_span(r, [Event("k", Kind.GPU, 150, 300), Event("k", Kind.GPU, 310, 390)], 0, 0, 0, False)
    (240, 240)
    """
    if n_descriptors and not n_nccl_kernels:
        copies = [e.name for e in launched if e.name.startswith("Memcpy")]
        why = (
            f"; its GPU work holds {len(copies)} memcpy(s) (e.g. {copies[0]!r}) and no kernel: NCCL >= 2.28 may have "
            "run the collective on the copy engines, which is not timed as a collective"
            if copies
            else ""
        )
        raise SectionError(
            f"iteration {iteration} section {cpu_range.name!r}: {n_descriptors} NCCL collective(s) issued but no "
            "NCCL kernel recorded (CUPTI dropped or stopped recording GPU activity; fewer iterations or a "
            f"smaller problem per run, and see Kineto's messages in the rank's stderr){why}"
        )
    if not launched:
        return (cpu_range.end_ns - cpu_range.start_ns if cpu_start else 0), None
    last = max(e.end_ns for e in launched)
    span = last - min(e.start_ns for e in launched)
    return (last - cpu_range.start_ns if cpu_start else span), span


#: a kernel named after one collective may run others queued with it (NCCL >= 2.12 runs any work
#: in the launched kernel); these are the cases seen in practice, recorded without an anomaly.
_SERVED_BY = {
    "send_recv": {"all_to_all", "send", "recv", "gather", "scatter"},
    "all_reduce": {"barrier"},
}


def _may_run(kernel_type: str, described: str) -> bool:
    return described in _SERVED_BY.get(kernel_type, set())


def _compatible(kernel: Event, descriptor: Event) -> bool:
    """Whether a kernel's name allows it to run the descriptor's collective."""
    kt = kernel.collective or kernel_collective(kernel.name)
    dt = descriptor.collective or collective_type(descriptor.name)
    return kt is None or dt is None or kt == dt or _may_run(kt, dt)


def _nesting(ranges: Sequence[Event], counts: Mapping[str, int]) -> list[str | None]:
    """The enclosing section of each range (``None`` at top level), aligned with ``ranges``.

    Raises:
        SectionError: two ranges overlap without one enclosing the other, or a range encloses one of
            its own name.
    """
    out: list[str | None] = []
    stack: list[Event] = []
    occurrence: dict[str, int] = defaultdict(int)
    index: dict[int, int] = {}
    for pos, r in enumerate(ranges):
        index[pos] = occurrence[r.name]
        occurrence[r.name] += 1
        while stack and stack[-1].end_ns <= r.start_ns:
            stack.pop()
        if stack and r.end_ns > stack[-1].end_ns:
            o = stack[-1]
            raise SectionError(
                f"sections overlap without nesting: {o.name!r} [{o.start_ns} ns, {o.end_ns} ns] and {r.name!r} "
                f"(iteration {index[pos]}) [{r.start_ns} ns, {r.end_ns} ns]: pnpscale cannot split overlapping time"
            )
        if stack and stack[-1].name == r.name:
            raise SectionError(f"section {r.name!r} (iteration {index[pos]}) lies inside another {r.name!r} range")
        out.append(stack[-1].name if stack else None)
        stack.append(r)
    return out


def _place_unknown_launches(
    gpu: list[Event], descriptors: Sequence[Event], anomalies: Anomalies, rank: int | None
) -> list[Event]:
    """Give collective kernels with an unknown launch (correlation 0) one, from the CPU descriptors.

    The kernels of one rank run in the order their collectives were issued, so the k-th kernel
    without a launch is the k-th descriptor (``nccl:*`` range, else ``record_param_comms``) that
    no kernel with a known launch belongs to; it is placed at that descriptor's start. When the
    counts differ, the kernels stay placed by their GPU start time. Both are recorded.
    """
    unknown = [e for e in gpu if e.launch_ns is None and is_collective_kernel(e.name)]
    if not unknown:
        return gpu
    known = sorted(e.launch_ns for e in gpu if e.launch_ns is not None and is_collective_kernel(e.name))
    named: dict[int, list[int]] = defaultdict(list)  # tid -> starts of nccl:* ranges (sorted: events are)
    for d in descriptors:
        if is_named_descriptor(d.name):
            named[d.tid].append(d.start_ns)
    free = []
    for d in descriptors:
        starts = named.get(d.tid, [])
        if d.name == PARAM_COMMS and bisect_right(starts, d.end_ns) > bisect_left(starts, d.start_ns):
            continue  # the nccl:* range inside stands for this collective
        lo, hi = bisect_left(known, d.start_ns), bisect_right(known, d.end_ns)
        if hi == lo:
            free.append(d)
    unknown.sort(key=lambda e: (e.start_ns, e.tid))
    example = f"{unknown[0].name.split('(')[0]} at {unknown[0].start_ns} ns, correlation {unknown[0].correlation}"
    if len(free) != len(unknown):
        anomalies.add("launch_unknown_by_start", rank, f"{example} ({len(unknown)} kernels, {len(free)} descriptors)",
                      len(unknown))  # fmt: skip
        return gpu
    anomalies.add("launch_unknown_paired", rank, example, len(unknown))
    placed = {id(k): replace(k, launch_ns=d.start_ns) for k, d in zip(unknown, free, strict=True)}
    return [placed.get(id(e), e) for e in gpu]


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
    named = [d for d in inside if is_named_descriptor(d.name)]
    return named if named else [d for d in inside if d.name == PARAM_COMMS]


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
                for rr in (r, ranks[0]):
                    rec = index[rr][occ]
                    if rec.missing_kernels:
                        raise SectionError(
                            f"iteration {occ[0]} section {occ[1]!r}: rank {rr} has {rec.missing_kernels} "
                            f"collective(s) on the CPU side (record_param_comms / nccl:*) without a GPU kernel in "
                            f"the trace ({len(rec.collectives)} kernel(s) for them): the profiler dropped kernels "
                            f"(seen with repeated profiler sessions); fix: profile every iteration in one profiler "
                            f"session (prof.step() per iteration)"
                        )
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


def _steps_text(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"#1-3, #5"``."""
    parts: list[tuple[int, int]] = []
    for x in sorted(steps):
        if parts and parts[-1][1] == x - 1:
            parts[-1] = (parts[-1][0], x)
        else:
            parts.append((x, x))
    return ", ".join(f"#{a}" if a == b else f"#{a}-{b}" for a, b in parts)


def match_steps(
    records: Mapping[int, Sequence[SectionRecord]], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Match section occurrences across ranks by ``ProfilerStep#N`` number, not by position.

    When every record of every rank lies in a numbered ``ProfilerStep`` range, only the step numbers
    present on every rank are kept (the others are recorded as ``step_not_on_every_rank``) and
    iterations are renumbered from 0 in step order; otherwise the records are returned unchanged.

    Raises:
        SectionError: the ranks have no step number in common (the message lists each rank's steps).

    >>> a = [SectionRecord(0, "s", 0.0, 1.0, step=2), SectionRecord(1, "s", 1.0, 1.0, step=3)]
    >>> b = [SectionRecord(0, "s", 0.0, 1.0, step=1), SectionRecord(1, "s", 1.0, 1.0, step=2)]
    >>> [(s.iteration, s.step) for s in match_steps({0: a, 1: b})[1]]
    [(0, 2)]
    """
    out = {r: list(recs) for r, recs in records.items()}
    if not out or not all(s.step is not None for recs in out.values() for s in recs):
        return out
    steps: dict[int, list[int]] = {
        r: sorted({int(s.step) for s in recs if s.step is not None}) for r, recs in out.items()
    }
    common = set.intersection(*(set(v) for v in steps.values()))
    if not common:
        raise SectionError(
            "the ranks have no ProfilerStep number in common ("
            + "; ".join(f"rank {r}: {_steps_text(v)}" for r, v in sorted(steps.items()))
            + "): steps are matched by number, never by position"
        )
    for r, v in sorted(steps.items()):
        extra = [x for x in v if x not in common]
        if extra and anomalies is not None:
            anomalies.add(
                "step_not_on_every_rank",
                r,
                f"ProfilerStep {_steps_text(extra)} (steps on every rank: {_steps_text(sorted(common))})",
                len(extra),
            )
    for r, recs in out.items():
        occurrence: dict[str, int] = defaultdict(int)
        kept = []
        for s in recs:
            if s.step in common:
                kept.append(replace(s, iteration=occurrence[s.section]))
                occurrence[s.section] += 1
        out[r] = kept
    return out


def drop_bad_iterations(
    records: Mapping[int, Sequence[SectionRecord]], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Drop, on every rank, each iteration in which some rank has a non-physical event (``bad``).

    Each dropped iteration is recorded as ``non_physical_timing`` on the rank that had the event,
    with the event in the example.

    Raises:
        SectionError: every iteration holds a non-physical event, or is dropped for another ``bad_kind`` (the
            message names the first).
    """
    bad: dict[int, tuple[int, SectionRecord]] = {}
    for r, recs in sorted(records.items()):
        for s in recs:
            if s.bad and s.iteration not in bad:
                bad[s.iteration] = (r, s)
    for it, (r, s) in sorted(bad.items()):
        if anomalies is not None:
            anomalies.add(s.bad_kind, r, f"iteration {it} section {s.section!r}: {s.bad}")
    out = {r: [s for s in recs if s.iteration not in bad] for r, recs in records.items()}
    if bad and not any(out.values()):
        it, (r, s) = min(bad.items())
        raise SectionError(
            f"every iteration holds a non-physical event, e.g. rank {r} iteration {it} section {s.section!r}: {s.bad}"
            if s.bad_kind == "non_physical_timing"
            else f"every iteration is dropped ({s.bad_kind}), e.g. rank {r} iteration {it} section {s.section!r}: "
            f"{s.bad}"
        )
    return out


def drop_cut_iterations(
    records: Mapping[int, Sequence[SectionRecord]], unclosed: Mapping[int, str], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Drop, on every rank, the iterations a file cut short lost (the profiler killed while writing, the file
    completed by a tool).

    A rank whose file Kineto did not close (``unclosed``: rank -> file name) and that holds fewer iterations
    than another rank lost its last ones: iterations from its count on are dropped everywhere, and its last
    one too when that one is ``open_end`` (no event of the file starts after it: it may be cut inside). With
    as many iterations everywhere (or iterations matched by ``ProfilerStep`` number), a CPU rank's last
    iteration (step) that is ``open_end`` and holds fewer collectives than another rank's is dropped (on CUDA a
    cut loses the GPU events, written last: found from the launches by :func:`section_records`).
    Recorded as ``trace_cut_short`` naming the file, rank and iterations. Ranks with fewer iterations whose
    file Kineto closed are left alone (their records cannot be matched: :func:`align_collectives` refuses them).

    Raises:
        SectionError: the cut leaves no iteration (the message names the file and rank).

    >>> a = [SectionRecord(i, "s", float(i), 1.0) for i in range(3)]
    >>> b = [SectionRecord(0, "s", 0.0, 1.0), SectionRecord(1, "s", 1.0, 1.0, open_end=True)]
    >>> out = drop_cut_iterations({0: a, 1: b}, {1: "rank1.json"})
    >>> [s.iteration for s in out[0]], [s.iteration for s in out[1]]
    ([0], [0])
    """
    out = {r: list(recs) for r, recs in records.items()}
    count = {r: 1 + max((s.iteration for s in recs), default=-1) for r, recs in out.items()}
    if not out:
        return out
    if all(s.step is not None for recs in out.values() for s in recs):  # matched by step number: a step is cut
        for r in sorted(unclosed):  # when it holds fewer collectives than the same step on another rank
            steps = {int(s.step) for s in out.get(r, []) if s.step is not None}
            if not steps:
                continue
            last = max(steps)
            if any(s.gpu_span_s is not None for s in out[r]):
                continue  # CUDA: a cut loses the GPU tail, found from the launches (section_records)
            mine = {s.section: len(s.collectives) for s in out[r] if s.step == last and s.open_end}
            other = [(o, s.section, len(s.collectives), mine[s.section]) for o in out if o != r for s in out[o]
                     if s.step == last and s.section in mine and len(s.collectives) > mine[s.section]]  # fmt: skip
            if other:
                o, sec, theirs, n = other[0]
                out[r] = [s for s in out[r] if s.step != last]
                message = (f"{unclosed[r]}: rank {r} holds {n} collective(s) in ProfilerStep#{last} section {sec!r}, "
                           f"rank {o} {theirs}, in a file Kineto did not close (no {END_MARKER!r}): cut short; that "
                           f"step dropped")  # fmt: skip
                if not out[r]:
                    raise SectionError(f"{message}: no step left on rank {r}")
                if anomalies is not None:
                    anomalies.add("trace_cut_short", r, message)
        return out
    most = max(count.values())
    cut: int | None = None
    why: list[tuple[int, str]] = []
    short = [r for r, n in count.items() if n < most]
    if short:
        if not all(r in unclosed for r in short):
            return out
        cut = min(count[r] for r in short)
        for r in short:
            final = [s for s in out[r] if s.iteration == count[r] - 1]
            if any(s.open_end for s in final):
                cut = min(cut, count[r] - 1)
            why.append((r, f"holds {count[r]} iteration(s), rank {max(count, key=lambda k: count[k])} {most}"))
    else:
        last_it = most - 1
        n_colls = {
            r: {s.section: len(s.collectives) for s in recs if s.iteration == last_it} for r, recs in out.items()
        }
        for r in sorted(unclosed):
            if r not in out or not any(s.open_end for s in out[r] if s.iteration == last_it):
                continue
            if any(s.gpu_span_s is not None for s in out[r]):
                continue  # CUDA: a cut loses the GPU tail, found from the launches (section_records)
            fewer = [(sec, n, o) for o in out for sec, n in n_colls[r].items() if n < n_colls[o].get(sec, n)]
            if fewer:
                sec, n, o = fewer[0]
                cut = last_it
                why.append((r, f"holds {n} collective(s) in iteration {last_it} section {sec!r}, rank {o} "
                               f"{n_colls[o][sec]}"))  # fmt: skip
    if cut is None:
        return out
    for r, text in why:
        message = (f"{unclosed[r]}: rank {r} {text}, in a file Kineto did not close (no {END_MARKER!r}): cut "
                   f"short; iterations {cut}..{most - 1} dropped on every rank")  # fmt: skip
        if cut == 0:
            raise SectionError(f"{message}: no iteration left")
        if anomalies is not None:
            anomalies.add("trace_cut_short", r, message, most - cut)
    return {r: [s for s in recs if s.iteration < cut] for r, recs in out.items()}


def nested_sections(records: Mapping[int, Sequence[SectionRecord]]) -> dict[str, str]:
    """Section -> the section enclosing it, for sections nested in another in every occurrence.

    Raises:
        SectionError: a section is nested in some occurrences and not in others, or in different
            sections (the message names rank and iteration).
    """
    seen: dict[str, tuple[str | None, int, int]] = {}
    for r, recs in sorted(records.items()):
        for s in recs:
            first = seen.setdefault(s.section, (s.parent, r, s.iteration))
            if first[0] != s.parent:
                raise SectionError(
                    f"section {s.section!r} is inside {first[0]!r} on rank {first[1]} iteration {first[2]} but inside "
                    f"{s.parent!r} on rank {r} iteration {s.iteration}: the 'all' row cannot be built from "
                    f"non-overlapping time"
                )
    return {name: parent for name, (parent, _, _) in seen.items() if parent is not None}


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
                K.COMM_S: s.comm_s,
                K.N_COLLECTIVES: len(s.collectives),
                K.PEAK_MEM_BYTES: peaks.get((s.iteration, s.section)),
                K.GPU_SPAN_S: s.gpu_span_s,
                K.HIDDEN_S: s.hidden_s,
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
                }
            )
    return {"ranks": rows, "collectives": colls}
