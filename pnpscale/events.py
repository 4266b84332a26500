"""Plain profiler events and their reduction to per-section records (pure, no torch).

Both the live profiler (:mod:`pnpscale.profiling`) and offline Kineto traces
(:mod:`pnpscale.analyze`) are turned into lists of :class:`Event`; :func:`section_records`
then finds, for one rank, every occurrence of each named section and the collectives inside
it. That is the only place where "what is a section" and "what is a collective" is decided.

Rules (see ``../shared/notes/design.md``):

* A section occurrence is a CPU range event whose name is a section name (a
  ``torch.profiler.record_function``). The k-th occurrence of a name is iteration k.
* CPU backends (gloo): section time is the wall span of that range; collectives are the
  ``gloo:*`` work ranges (on gloo worker threads) that start inside it.
* CUDA (NCCL): section time is the span of the GPU work launched inside the range (the
  ``gpu_user_annotation`` span: first kernel start to last kernel end); collectives are the NCCL
  kernels (``ncclDevKernel_*``, ``ncclKernel_*``, matched case-insensitively on ``nccl``) among
  them. A kernel belongs to the section whose CPU range contains its launch (``launch_ns``, from
  the runtime event with the same correlation id), or, when the launch is unknown, its start.
* Payload bytes of a collective: from the collective's own shapes/dtype (gloo), or from the
  k-th collective descriptor (``nccl:*`` range or ``record_param_comms``) inside the CPU range
  for the k-th NCCL kernel.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
    "long int": 8, "Long": 8, "int64": 8, "long long": 8,
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
    """

    seq: int
    name: str
    duration_s: float
    payload_bytes: int | None


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
    gpu = [e for e in evs if e.kind is Kind.GPU]
    cpu_comm = [e for e in evs if e.kind is Kind.CPU and _GLOO_WORK.match(e.name)]
    descriptors = [e for e in evs if e.kind is Kind.CPU and (_NCCL_DESCRIPTOR.match(e.name) or e.name == _PARAM_COMMS)]
    origin = ranges[0].start_ns
    occurrence: dict[str, int] = defaultdict(int)
    out: list[SectionRecord] = []
    for r in ranges:
        it = occurrence[r.name]
        occurrence[r.name] += 1
        inside = lambda e, r=r: r.start_ns <= e.start_ns <= r.end_ns  # noqa: E731
        if gpu:
            launched = [
                e for e in gpu if r.start_ns <= (e.launch_ns if e.launch_ns is not None else e.start_ns) <= r.end_ns
            ]
            if launched:
                span = max(e.end_ns for e in launched) - min(e.start_ns for e in launched)
            else:
                span = 0
            kernels = [e for e in launched if is_nccl_kernel(e)]
            descs = _descriptors_in(descriptors, r)
            colls = []
            for i, k in enumerate(kernels):
                d = descs[i] if len(descs) == len(kernels) else None
                name = (d.collective if d and d.collective else None) or collective_type(k.name) or k.name
                colls.append(Collective(i, name, k.duration_ns * 1e-9, d.payload_bytes if d else None))
            out.append(SectionRecord(it, r.name, (r.start_ns - origin) * 1e-9, span * 1e-9, colls))
        else:
            works = [e for e in cpu_comm if inside(e)]
            colls = [
                Collective(i, e.collective or collective_type(e.name) or e.name, e.duration_ns * 1e-9, e.payload_bytes)
                for i, e in enumerate(works)
            ]
            out.append(SectionRecord(it, r.name, (r.start_ns - origin) * 1e-9, r.duration_ns * 1e-9, colls))
    return out


def _descriptors_in(descriptors: list[Event], r: Event) -> list[Event]:
    """Collective descriptors inside range ``r``: ``nccl:*`` ranges if any, else param comms."""
    inside = [d for d in descriptors if r.start_ns <= d.start_ns <= r.end_ns]
    named = [d for d in inside if _NCCL_DESCRIPTOR.match(d.name)]
    return named if named else [d for d in inside if d.name == _PARAM_COMMS]
