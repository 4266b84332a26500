"""One rank's events -> its per-section records (pure, no torch): :func:`section_records`.

Both the live profiler (:mod:`pnpscale.rank.profiling`) and offline Kineto traces
(:mod:`pnpscale.analysis.offline`) are turned into lists of :class:`~pnpscale.analysis.events.Event`;
:func:`section_records` then finds, for one rank, every occurrence of each named section and the
collectives inside it. That is the only place where "what is a section" and "what is a collective" is
decided; its parts: :mod:`~pnpscale.analysis.section.gpu` (CUDA: kernels, launches, descriptors, spans),
:mod:`~pnpscale.analysis.section.gloo` (gloo work ranges typed by their ``c10d::`` calls),
:mod:`~pnpscale.analysis.section.busy` (where the rank computes: blocked vs hidden). Across ranks:
:mod:`~pnpscale.analysis.section.align` and :mod:`~pnpscale.analysis.section.iterations`.

Rules:

* A section occurrence is a CPU range event whose name is a section name (a
  ``torch.profiler.record_function``). The k-th occurrence of a name is iteration k.
* CPU backends (gloo): section time is the wall span of that range; collectives are the
  ``gloo:*`` work ranges (on gloo worker threads) whose ``c10d::`` call lies inside it (else whose range starts
  inside it: :func:`placement`), typed and timed from that call
  (:func:`~pnpscale.analysis.section.gloo.typed_by_c10d`). One still in flight when a later section starts is
  also a *carried* entry of that section, blocked where it waits for it (:func:`in_flight`,
  :mod:`~pnpscale.analysis.section.p2p`).
* Cost of a collective: the time the rank was blocked on it (:mod:`pnpscale.analysis.overlap`): CPU, the
  calling thread's time in ``c10d::`` calls and waiting for a collective to end, outside compute operators
  (``Kind.OP``: profiled ``cpu_op`` operators); CUDA, collective kernels minus the rank's other GPU events.
  The rest of a collective's time is hidden. In GPU-span mode a section's GPU work that runs past the next
  section's first GPU start is clipped there (:func:`~pnpscale.analysis.section.gpu.gpu_clips`).
* CUDA (NCCL): section time is the span of the GPU work launched inside the range (first kernel
  start to last kernel end, kept as ``gpu_span_s``); for pnpscale's own runs (``cpu_start``: every
  section starts with the GPU idle, after a synchronize and a barrier) it runs from the CPU range
  start to the last GPU end (one clock within a process), so a rank late on the CPU before its
  first kernel shows compute, not its peers' wait (:func:`~pnpscale.analysis.section.gpu.cuda_section_span`).
  A live CUDA run (``require_gpu``) without GPU events, or with a section whose collectives have no kernel
  at all, is refused. Collectives are the
  collective kernels among them (:data:`pnpscale.analysis.kineto.COLLECTIVE_KERNELS`). A kernel
  belongs to the section whose CPU range contains its launch (``launch_ns``, from the runtime event
  with the same correlation id). A collective kernel whose launch is unknown (correlation 0) is
  paired in order with the rank's CPU descriptors that no launched kernel belongs to, else placed
  by its GPU start (both recorded as anomalies).
* Collective type, payload bytes, process group and sequence number: from the collective's own
  shapes/dtype (gloo), from the NCCL kernel's own arguments when the trace carries them, or else
  from the CPU-side descriptor (``nccl:*`` range or ``record_param_comms``) paired with the
  kernel: the descriptor whose range holds the kernel's launch (correlation), else the k-th descriptor
  in start order with the k-th kernel in launch order, when there are as many and one CPU thread issued
  them all (or, issued from several threads, when every kernel name allows its descriptor's type;
  :func:`~pnpscale.analysis.section.gpu.pair_descriptors`). The descriptor wins over the kernel name (an all_reduce may
  run in a ``SendRecv`` kernel); a disagreeing name is recorded. Descriptors without a kernel are
  counted (``missing_kernels``) and named when ranks cannot be matched.
* Sections may nest (``parent``); overlapping without nesting is refused. ``ProfilerStep#N``
  numbers are kept (``step``) to match ranks by step
  (:func:`~pnpscale.analysis.section.iterations.match_steps`); non-physical events mark their record
  ``bad`` (:func:`~pnpscale.analysis.section.iterations.drop_bad_iterations`).
* Matching across ranks (:func:`~pnpscale.analysis.section.align.align_collectives`): by (process group,
  sequence number, type) when every collective of a section occurrence carries both, else by type and order
  within each stream (NCCL: the kernel's CUDA stream; gloo: one stream per rank), never by position alone.
* Conservation: an occurrence holding a launch without its GPU event (``missing_gpu``), a GPU event without
  its launch (``orphan_gpu``), or collectives without kernels beside device-to-device copies launched inside
  their descriptors (NCCL's copy-engine collectives) is ``bad`` and dropped on every rank, named.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Collective, Event, Kind, SectionError, SectionRecord, Window, launch_key
from pnpscale.analysis.kineto import (
    END_MARKER,
    collective_type,
    is_descriptor,
    is_gloo_work,
    kernel_collective,
    step_number,
)
from pnpscale.analysis.overlap import union
from pnpscale.analysis.section.busy import Busy
from pnpscale.analysis.section.gloo import typed_by_c10d
from pnpscale.analysis.section.gpu import (
    copy_engine_note,
    cuda_section_span,
    descriptors_in,
    gpu_clips,
    is_nccl_kernel,
    lost_gpu_text,
    may_run,
    orphan_gpu_text,
    pair_descriptors,
    place_unknown_launches,
)


def section_records(
    events: Iterable[Event],
    sections: Sequence[str],
    anomalies: Anomalies | None = None,
    rank: int | None = None,
    require_gpu: bool = False,
    cpu_start: bool = False,
    file_end_ns: int | None = None,
    missing_gpu: Sequence[int] = (),
    orphan_gpu: Sequence[int] = (),
    copies_without_gpu: Sequence[int] = (),
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
        missing_gpu: starts (ns, sorted) of launches whose GPU event is not in the file: the occurrence holding
            one is ``bad`` (kind ``trace_cut_short`` in a file that may be cut short, else
            ``iteration_incomplete``; dropped on every rank; :func:`~pnpscale.analysis.section.gpu.lost_gpu_text`).
        orphan_gpu: starts (ns, sorted) of GPU events whose correlation matches no launch, recorded while the
            profiler ran: the occurrence whose time (CPU range to its GPU work's end) holds one is ``bad`` (kind
            ``iteration_incomplete``; :func:`~pnpscale.analysis.section.gpu.orphan_gpu_text`).
        copies_without_gpu: starts (ns, sorted) of copies and memsets without a GPU event in a closed file (a
            0-byte copy has none; a dropped record would end the section's GPU span early): each occurrence holding
            some is named (``copy_without_gpu_event``), its numbers kept.

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
    ranges, counts = section_ranges(evs, sections, anomalies, rank, file_end_ns)
    parents = _nesting(ranges, counts)
    descriptor_events = [e for e in evs if e.kind is Kind.CPU and is_descriptor(e.name)]
    gpu_events = place_unknown_launches([e for e in evs if e.kind is Kind.GPU], descriptor_events, anomalies, rank)
    gpu = Window(gpu_events, key=launch_key)
    if require_gpu and not gpu:
        raise SectionError(
            "a CUDA run whose profiler recorded no GPU event (kernels, memcpy): CUPTI did not trace (another "
            "profiler attached, or CUPTI unavailable); see the Kineto messages in the rank's stderr"
        )
    works = [e for e in evs if e.kind is Kind.CPU and is_gloo_work(e.name)]
    _refuse_unplaceable([*gpu_events, *works], ranges)
    typed, issued = typed_by_c10d(works, evs, anomalies, rank)
    place = placement(typed, issued, ranges)
    cpu_comm = Window(typed, key=lambda e: place[id(e)])
    flying = in_flight(ranges, typed, place)
    owner: dict[int, tuple[int, str, int]] = {}  # id(work) -> (iteration, section, seq) of the entry that issued it
    descriptors = Window(descriptor_events)
    busy = Busy(evs, sections, gpu_events)
    origin = ranges[0].start_ns
    clips = {} if cpu_start or not gpu else gpu_clips(ranges, parents, gpu, anomalies, rank)
    steps = step_of(evs, ranges, sections)
    occurrence: dict[str, int] = defaultdict(int)
    out: list[SectionRecord] = []
    for r, parent, step in zip(ranges, parents, steps, strict=True):
        it = occurrence[r.name]
        occurrence[r.name] += 1
        if gpu:
            part = cuda_part(
                r, it, gpu, descriptors, busy, clips, origin, anomalies, rank, require_gpu, cpu_start, missing_gpu,
                orphan_gpu, file_end_ns,
            )
            copies = bisect_right(copies_without_gpu, r.end_ns) - bisect_left(copies_without_gpu, r.start_ns)
            if copies:
                anomalies.add("copy_without_gpu_event", rank, f"iteration {it} section {r.name!r}: {copies} copy or "
                              "memset launch(es) with no GPU event", copies)  # fmt: skip
        else:
            ancestors = (
                [q for q in ranges if q is not r and q.start_ns <= r.start_ns and q.end_ns >= r.end_ns]
                if parent is not None and flying[id(r)]
                else []
            )  # a collective issued in an enclosing section is that section's, not carried into a nested one
            carried = [
                (w, owner[id(w)])
                for w in flying[id(r)]
                if id(w) in owner and not any(q.start_ns <= place[id(w)] <= q.end_ns for q in ancestors)
            ]
            part = gloo_part(r, cpu_comm, issued, busy, origin, carried)
            for c, w in zip(part.collectives, cpu_comm.between(r.start_ns, r.end_ns), strict=False):
                owner.setdefault(id(w), (it, r.name, c.seq))
        bad = f"{r.name!r} range: {r.bad}" if r.bad else None
        out.append(
            SectionRecord(
                it,
                r.name,
                (r.start_ns - origin) * 1e-9,
                part.section_ns * 1e-9,
                part.collectives,
                step,
                parent,
                bad or part.bad,
                part.missing,
                None if part.gpu_span_ns is None else part.gpu_span_ns * 1e-9,
                part.hidden_ns * 1e-9,
                part.bad_kind if not bad else "non_physical_timing",
                file_end_ns is not None and r.end_ns > file_end_ns,
                None if part.gpu_start_ns is None or part.gpu_span_ns is None else (part.gpu_start_ns - origin) * 1e-9,
            )  # fmt: skip
        )
    return out


def section_ranges(
    evs: Sequence[Event],
    sections: Sequence[str],
    anomalies: Anomalies,
    rank: int | None,
    file_end_ns: int | None,
) -> tuple[list[Event], dict[str, int]]:
    """Step 1 of :func:`section_records`: the section ranges of one rank, and how many there are per name.

    Args:
        evs: the rank's events sorted by ``(start_ns, -end_ns)``.
        sections, anomalies, rank, file_end_ns: as for :func:`section_records`.

    Returns:
        (the ranges in ``evs`` order, ``name -> count``); for a file that may be cut short with names
        occurring a different number of times, each name's first ``m`` ranges (``trace_cut_short``).

    Raises:
        SectionError: a name never occurs or names occur a different number of times (``counts`` attached).
    """
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
        if 0 in counts.values() and not any(e.name.startswith("ProfilerStep#") for e in evs):
            cut += "; the trace holds no ProfilerStep#N range either (torch writes them only when profile() has a "
            cut += "schedule=, e.g. torch.profiler.schedule(wait=0, warmup=0, active=N))"
        error = SectionError(
            "section ranges found per name: "
            + ", ".join(f"{s}={n}" for s, n in counts.items())
            + " (expected the same non-zero count for every section)"
            + cut
        )
        error.counts = dict(counts)
        raise error
    return ranges, counts


def step_of(evs: Sequence[Event], ranges: Sequence[Event], sections: Sequence[str]) -> list[int | None]:
    """Step 2 of :func:`section_records`: the ``N`` of the ``ProfilerStep#N`` range enclosing each section range
    (the latest one starting at or before it, if it also ends at or after it), else ``None``; aligned with
    ``ranges``. ``evs`` sorted by ``(start_ns, -end_ns)``."""
    step_ranges = [
        e for e in evs if e.kind in _RANGE_KINDS and e.name not in sections and step_number(e.name) is not None
    ]
    step_starts = [e.start_ns for e in step_ranges]
    out: list[int | None] = []
    for r in ranges:
        i = bisect_right(step_starts, r.start_ns) - 1
        out.append(step_number(step_ranges[i].name) if i >= 0 and step_ranges[i].end_ns >= r.end_ns else None)
    return out


@dataclass
class Part:
    """What one section occurrence holds, from :func:`cuda_part` or :func:`gloo_part` (times in ns).

    Attributes:
        section_ns: the section's time. collectives: its collectives (``seq`` = position by start).
        hidden_ns: their time overlapped by compute (union). bad, bad_kind: a non-physical event inside and
        the anomaly kind to drop it under. missing: descriptors without a kernel (CUDA). gpu_span_ns: CUDA's
        GPU span, ``None`` without GPU work and on CPU backends. gpu_start_ns: where that span starts.
    """

    section_ns: int
    collectives: list[Collective]
    hidden_ns: int
    bad: str | None = None
    bad_kind: str = "non_physical_timing"
    missing: int = 0
    gpu_span_ns: int | None = None
    gpu_start_ns: int | None = None  # CUDA: the first GPU start of the work launched inside (ns, trace clock)


def cuda_part(
    r: Event,
    it: int,
    gpu: Window,
    descriptors: Window,
    busy: Busy,
    clips: Mapping[int, int],
    origin: int,
    anomalies: Anomalies,
    rank: int | None,
    require_gpu: bool,
    cpu_start: bool,
    missing_gpu: Sequence[int],
    orphan_gpu: Sequence[int] = (),
    file_end_ns: int | None = None,
) -> Part:
    """Step 3 of :func:`section_records` on CUDA: the section range ``r`` (iteration ``it``): its time, its
    collective kernels typed from their descriptors, their blocked and hidden time (module doc)."""
    bad = None
    bad_kind = "non_physical_timing"
    missing = 0
    launched = sorted(gpu.between(r.start_ns, r.end_ns), key=lambda e: (e.start_ns, -e.end_ns))
    kernels = [e for e in launched if is_nccl_kernel(e)]
    descs = descriptors_in(descriptors.between(r.start_ns, r.end_ns))
    n_descs = len(descs) if require_gpu else 0  # offline: recorded as anomalies below
    section_ns, gpu_span_ns = cuda_section_span(r, launched, n_descs, len(kernels), it, cpu_start)
    gpu_start_ns = min(e.start_ns for e in launched) if launched else None  # where the GPU span starts
    window = None
    if id(r) in clips and gpu_span_ns is not None:  # GPU work past the next section's start: clipped
        first = min(e.start_ns for e in launched)
        window = (first, clips[id(r)])
        section_ns = gpu_span_ns = clips[id(r)] - first
    desc_of = pair_descriptors(kernels, descs)  # by correlation (launch inside), else by issue order
    copy_engine = copy_engine_note(launched, descs) if len(descs) > len(kernels) else None
    if copy_engine is not None:  # its transfer would read as compute: dropped, named
        bad = f"{len(descs)} collective(s) issued, {len(kernels)} collective kernel(s){copy_engine}"
        bad_kind = "collective_on_copy_engines"
    elif len(descs) > len(kernels):
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
        if described and hint and hint != described and not may_run(hint, described):
            anomalies.add("kernel_name_disagrees", rank, f"{k.name.split('(')[0]} ran {described} (iteration {it})")
        name = described or hint or k.name
        payload = k.payload_bytes if k.payload_bytes is not None else (d.payload_bytes if d else None)
        group = k.group if k.group is not None else (d.group if d else None)
        gseq = k.group_seq if k.group_seq is not None else (d.group_seq if d else None)
        start = (k.start_ns - origin) * 1e-9
        colls.append(Collective(i, name, k.duration_ns * 1e-9, payload, k.tid, group, gseq, start))
    near = busy.gpu_near([(e.start_ns, e.end_ns) for e in kernels])  # all of busy.gpu that can overlap them
    hidden_ns = busy.split(colls, kernels, near, window, waits=False)
    bad = bad or next((f"{e.name!r}: {e.bad}" for e in launched if e.bad), None)
    lost = bisect_right(missing_gpu, r.end_ns) - bisect_left(missing_gpu, r.start_ns)
    if lost and not bad and not r.bad:
        bad, bad_kind = lost_gpu_text(lost, missing_gpu[bisect_left(missing_gpu, r.start_ns)], file_end_ns)
    end = max([r.end_ns, *(e.end_ns for e in launched)])
    orphans = bisect_right(orphan_gpu, end) - bisect_left(orphan_gpu, r.start_ns)
    if orphans and not bad and not r.bad:
        bad, bad_kind = orphan_gpu_text(orphans, orphan_gpu[bisect_left(orphan_gpu, r.start_ns)])
    return Part(section_ns, colls, hidden_ns, bad, bad_kind, missing, gpu_span_ns, gpu_start_ns)


def placement(works: Sequence[Event], issued: Mapping[int, tuple[int, int]], ranges: Sequence[Event]) -> dict[int, int]:
    """Where each gloo work range is placed (ns): at its ``c10d::`` call when the call lies in a section range (the
    section that issued it, whenever gloo's worker starts it), else at its own start. ``id(work) -> ns``.

    >>> w = Event("gloo:all_reduce", Kind.CPU, 105, 200)
    >>> placement([w], {id(w): (95, 98)}, [Event("a", Kind.CPU, 0, 100)])[id(w)]
    95
    """
    spans = union((r.start_ns, r.end_ns + 1) for r in ranges)
    starts = [lo for lo, _ in spans]
    out = {}
    for w in works:
        call = issued[id(w)][0] if id(w) in issued else None
        i = bisect_right(starts, call) - 1 if call is not None else -1
        out[id(w)] = call if call is not None and i >= 0 and call < spans[i][1] else w.start_ns
    return out


def in_flight(ranges: Sequence[Event], works: Sequence[Event], place: Mapping[int, int]) -> dict[int, list[Event]]:
    """Per section range (``id``), the work ranges placed before it starts that end after it starts: collectives
    issued earlier and still in flight when it begins (ranges sorted by start)."""
    by_place = sorted(works, key=lambda w: place[id(w)])
    out: dict[int, list[Event]] = {}
    open_: list[Event] = []
    k = 0
    for r in ranges:
        while k < len(by_place) and place[id(by_place[k])] < r.start_ns:
            open_.append(by_place[k])
            k += 1
        open_ = [w for w in open_ if w.end_ns > r.start_ns]
        out[id(r)] = list(open_)
    return out


def gloo_part(
    r: Event,
    cpu_comm: Window,
    issued: Mapping[int, tuple[int, int]],
    busy: Busy,
    origin: int,
    carried: Sequence[tuple[Event, tuple[int, str, int]]] = (),
) -> Part:
    """Step 3 of :func:`section_records` on a CPU backend: the section range ``r``: its wall span, the gloo work
    ranges placed inside it (:func:`placement`; typed: :func:`~pnpscale.analysis.section.gloo.typed_by_c10d`;
    ``issued``: each one's c10d call, start and end), their blocked and hidden time (module doc). ``carried``:
    work issued in an earlier section occurrence and still in flight when ``r`` starts, with that entry's
    ``(iteration, section, seq)``: an entry each (after the section's own), blocked where ``r`` waits for it."""
    own = cpu_comm.between(r.start_ns, r.end_ns)
    works = [*own, *(w for w, _ in carried)]
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
            peer=e.peer,
            tag=e.tag,
        )
        for i, e in enumerate(works)
    ]
    for c, (_, ref) in zip(colls[len(own) :], carried, strict=True):
        c.carried = ref
    # from the c10d call on: the calling thread is inside the collective (enqueue, then Work.wait()), at least
    # until the call returns
    called = [
        (min(issued[id(e)][0], e.start_ns), max(issued[id(e)][1], e.end_ns)) if id(e) in issued else
        (e.start_ns, e.end_ns)
        for e in works
    ]  # fmt: skip
    computing, in_calls = busy.cpu(r, works)
    hidden_ns = busy.split(colls, works, computing, (r.start_ns, r.end_ns), True, called, in_calls)
    bad = next((f"{e.name!r}: {e.bad}" for e in works if e.bad), None)
    return Part(r.duration_ns, colls, hidden_ns, bad)


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
        at = launch_key(e) if e.kind is Kind.GPU else e.start_ns
        if not any(a <= at <= b for a, b in spans):
            raise SectionError(
                f"{e.name.split('(')[0]!r}: {e.bad}: a non-physical timestamp, so it cannot be placed in its section "
                f"(whose numbers would silently lack it)"
            )


#: kinds of events that may be a section or ``ProfilerStep`` range (``record_function`` ranges are
#: ``user_annotation``; some ranges, e.g. ``ProfilerStep#N`` in some versions, are ``cpu_op``).
_RANGE_KINDS = (Kind.CPU, Kind.OP)


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
