"""CUDA (NCCL) rules of :func:`pnpscale.analysis.section.records.section_records` (pure, no torch).

Which GPU events are collective kernels (:func:`is_nccl_kernel`), a CUDA section's time
(:func:`cuda_section_span`), GPU work clipped at the next section's start (:func:`gpu_clips`), kernels
with an unknown launch placed from the CPU descriptors (:func:`place_unknown_launches`), a range's
descriptors (:func:`descriptors_in`), and whether a kernel's name allows its descriptor's collective
(:func:`compatible`, :func:`may_run`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event, Kind, SectionError, Window, launch_key
from pnpscale.analysis.kineto import (
    END_MARKER,
    PARAM_COMMS,
    collective_type,
    is_collective_kernel,
    is_named_descriptor,
    kernel_collective,
    kernel_label,
)


def is_nccl_kernel(ev: Event) -> bool:
    """A collective's GPU kernel (see :func:`pnpscale.analysis.kineto.is_collective_kernel`)."""
    return ev.kind is Kind.GPU and is_collective_kernel(ev.name)


def gpu_clips(
    ranges: Sequence[Event], parents: Sequence[str | None], gpu: Window, anomalies: Anomalies, rank: int | None
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
        why = copy_engine_note(launched) or ""
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


def may_run(kernel_type: str, described: str) -> bool:
    return described in _SERVED_BY.get(kernel_type, set())


def compatible(kernel: Event, descriptor: Event) -> bool:
    """Whether a kernel's name allows it to run the descriptor's collective."""
    kt = kernel.collective or kernel_collective(kernel.name)
    dt = descriptor.collective or collective_type(descriptor.name)
    return kt is None or dt is None or kt == dt or may_run(kt, dt)


def place_unknown_launches(
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
    example = f"{kernel_label(unknown[0].name)} at {unknown[0].start_ns} ns, correlation {unknown[0].correlation}"
    if len(free) != len(unknown):
        anomalies.add("launch_unknown_by_start", rank, f"{example} ({len(unknown)} kernels, {len(free)} descriptors)",
                      len(unknown))  # fmt: skip
        return gpu
    anomalies.add("launch_unknown_paired", rank, example, len(unknown))
    placed = {id(k): replace(k, launch_ns=d.start_ns) for k, d in zip(unknown, free, strict=True)}
    return [placed.get(id(e), e) for e in gpu]


def descriptors_in(inside: list[Event]) -> list[Event]:
    """Collective descriptors of a range: ``nccl:*`` ranges if any, else param comms."""
    named = [d for d in inside if is_named_descriptor(d.name)]
    return named if named else [d for d in inside if d.name == PARAM_COMMS]


def pair_descriptors(kernels: Sequence[Event], descs: Sequence[Event]) -> dict[int, Event]:
    """Each collective kernel's CPU descriptor: ``index in kernels -> descriptor`` (empty when they cannot be paired).

    First by correlation: a kernel whose launch (``launch_ns``) lies inside exactly one descriptor range, each
    descriptor holding one kernel's launch, is that descriptor's (a runtime launch is recorded inside the
    ``nccl:*`` / ``record_param_comms`` range of the call that issued it, on its thread); this types kernels of
    collectives issued from several threads in any order. When some kernel's launch is unknown or not inside
    exactly one descriptor, by issue order: the k-th kernel by launch with the k-th descriptor by start, when there
    are as many and one CPU thread issued them all (its order is the kernels' order), or, issued from several
    threads, when every kernel name allows its descriptor's collective (:func:`compatible`).

    >>> ks = [Event("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", Kind.GPU, 500, 600, launch_ns=115),
    ...       Event("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(x)", Kind.GPU, 650, 660, launch_ns=15)]
    >>> ds = [Event("nccl:all_reduce", Kind.CPU, 10, 30, tid=3), Event("nccl:all_to_all", Kind.CPU, 110, 130, tid=2)]
    >>> {i: d.name for i, d in sorted(pair_descriptors(ks, ds).items())}
    {0: 'nccl:all_to_all', 1: 'nccl:all_reduce'}
    """
    if not kernels or not descs:
        return {}
    starts = [d.start_ns for d in descs]
    order = sorted(range(len(descs)), key=lambda j: starts[j])
    by_corr: dict[int, Event] = {}
    used: set[int] = set()
    for i, k in enumerate(kernels):
        if k.launch_ns is None:
            break
        holding = [j for j in order if descs[j].start_ns <= k.launch_ns <= descs[j].end_ns]
        if len(holding) != 1 or holding[0] in used:
            break
        used.add(holding[0])
        by_corr[i] = descs[holding[0]]
    else:
        if len(used) == len(descs):
            return by_corr
    by_launch = sorted(range(len(kernels)), key=lambda j: (launch_key(kernels[j]), kernels[j].start_ns))
    ordered = [descs[j] for j in order]
    paired = len(ordered) == len(kernels) and (
        len({d.tid for d in ordered}) <= 1
        or all(compatible(kernels[j], d) for j, d in zip(by_launch, ordered, strict=True))
    )
    return dict(zip(by_launch, ordered, strict=True)) if paired else {}


def lost_gpu_text(lost: int, first_ns: int, file_end_ns: int | None) -> tuple[str, str]:
    """``(bad, bad_kind)`` of a section occurrence holding ``lost`` launches without their GPU event (the first
    at ``first_ns``), in a file that may be cut short (``file_end_ns`` given: no Kineto end marker) or not."""
    where = f"{lost} launch(es) inside it (the first at ts {first_ns / 1000:.3f} us) have no GPU event"
    if file_end_ns is not None:
        return (f"{where}, in a file Kineto did not close (no {END_MARKER!r}): cut short (or the profiler dropped "
                f"those GPU records); its GPU work is missing", "trace_cut_short")  # fmt: skip
    return (f"{where}, in a file Kineto closed: the profiler dropped those GPU records (a full CUPTI buffer?); its "
            f"GPU work is missing", "iteration_incomplete")  # fmt: skip


def orphan_gpu_text(n: int, first_ns: int) -> tuple[str, str]:
    """``(bad, bad_kind)`` of a section occurrence holding ``n`` GPU events whose correlation matches no launch."""
    return (f"{n} GPU event(s) inside it (the first at ts {first_ns / 1000:.3f} us) have a correlation id that "
            f"matches no runtime launch, though the profiler was recording: their launch is missing, so their "
            f"work cannot be placed", "iteration_incomplete")  # fmt: skip


def copy_engine_note(launched: Sequence[Event], descs: Sequence[Event] | None = None) -> str | None:
    """Why a section's collectives may have no kernel, when its GPU work holds device-to-device copies
    (``Memcpy DtoD``, ``Memcpy PtoP``) -- with ``descs``, only copies launched inside one of these collective
    descriptors (NCCL issues them inside the collective's call; a tensor copy is launched outside): NCCL >= 2.28
    runs some collectives (all_gather) on the copy engines (``cudaMemcpyBatchAsync``, no kernel), which pnpscale
    does not time as a collective; ``None`` without such a copy. The same words live and offline (the live run
    refuses the section, an offline analysis drops its iteration as ``collective_on_copy_engines``).

    >>> copy_engine_note([Event("Memcpy DtoD (Device -> Device)", Kind.GPU, 0, 5)])[:44]
    '; its GPU work holds 1 device-to-device copy'
    >>> copy_engine_note([Event("Memcpy HtoD (Pageable -> Device)", Kind.GPU, 0, 5)]) is None
    True
    """
    copies = [e.name for e in launched if e.name.startswith("Memcpy") and ("DtoD" in e.name or "PtoP" in e.name)
              and (descs is None or (e.launch_ns is not None
                                     and any(d.start_ns <= e.launch_ns <= d.end_ns for d in descs)))]  # fmt: skip
    if not copies:
        return None
    return (
        f"; its GPU work holds {len(copies)} device-to-device copy(ies) (e.g. {copies[0]!r}): NCCL >= 2.28 may have "
        "run the collective on the copy engines (cudaMemcpyBatchAsync, no kernel), which is not timed as a "
        "collective (its transfer would read as compute)"
    )
