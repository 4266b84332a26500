"""The Kineto vocabulary, in one place: event categories, collective names, kernel names, dtypes, payloads.

Used by the offline reader (:mod:`pnpscale.analysis.trace.read`), the live profiler
(:mod:`pnpscale.rank.profiling`) and the section reduction (:mod:`pnpscale.analysis.section.records`), so the three
never disagree on what a GPU event, a collective or a payload is.

Sources: Kineto's ``ActivityType`` names (``libkineto/include/ActivityType.h``); PyTorch's
``record_param_comms`` arguments (``torch/csrc/distributed/c10d/ParamCommsUtils.hpp``: "Collective
name", "In msg nelems", "dtype", "Process Group Name", "Seq"); NCCL's kernel names
(``src/device/generate.py`` of NCCL 2.19+, ``src/collectives/device/`` before, and
``src/device/symmetric/generate.py``: ``ncclSymDevKernel_*`` in NCCL 2.27, ``ncclSymkDevKernel_*``
from 2.28); RCCL uses NCCL's names plus ``mscclKernel_*``; torch's SymmetricMemory
kernels (``torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu``: ``multimem_all_reduce_kernel``,
``one_shot_all_reduce_kernel``, ``two_shot_all_reduce_kernel``, ``multimem_all_gather_kernel``...). A collective NCCL
runs on the copy engines (no kernel, only ``Memcpy`` GPU events) is not one of these: a live run refuses it by name
(:func:`pnpscale.analysis.section.gpu.cuda_section_span`), an offline analysis names it
(:func:`pnpscale.analysis.section.gpu.copy_engine_note`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Kineto categories (``cat`` in JSON, ``activity_type()`` live) of work that ran on a device stream or
#: queue: CUDA/ROCm/XPU/MTIA/PrivateUse1 kernels all write ``kernel``; 2021's Kineto wrote ``Kernel``,
#: ``Memcpy``, ``Memset`` (pytorch/kineto#109).
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "concurrent_kernel", "Kernel", "Memcpy", "Memset"})
#: runtime/driver calls on a CPU thread; their ``correlation`` links them to the device work they launched
#: (``libkineto/include/ActivityType.h``: ``cuda_runtime``, ``cuda_driver``, ``xpu_runtime``, ``xpu_driver``,
#: ``mtia_runtime``, ``privateuse1_runtime``, ``privateuse1_driver``, ``glow_runtime``; 2021: ``Runtime``).
RUNTIME_CATS = frozenset({
    "cuda_runtime", "cuda_driver", "runtime", "driver", "Runtime",
    "xpu_runtime", "xpu_driver", "mtia_runtime", "privateuse1_runtime", "privateuse1_driver", "glow_runtime",
})  # fmt: skip
#: CPU ranges: operators and ``record_function`` annotations (sections, ``nccl:*``, ``gloo:*``); 2021: ``Operator``.
CPU_CATS = frozenset({"cpu_op", "user_annotation", "Operator"})
#: live activities that are neither (GPU-side copies of annotations, profiler overhead...).
SKIP_CATS = frozenset({"gpu_user_annotation", "overhead", "python_function", "cuda_sync"})
#: the other categories Kineto writes, read by nobody here and never reported as unknown (flows ``ac2g``,
#: instants, counters, annotations on the device side, ``Trace`` spans of the profiler itself).
#: Device-side categories that may carry work (``mtia_ccp_events``, ``collective_comm``, ``hpu_op``...) are
#: not in it: they are counted and named as unknown.
IGNORED_CATS = SKIP_CATS | frozenset({
    "ac2g", "fwdbwd", "Trace", "cpu_instant_event", "external_correlation", "cuda_event", "cuda_profiler_range",
    "xpu_sync", "gpu_user_annotation", "python_function", "Python", "Memory", "memory",
})  # fmt: skip
#: words of a collective in a kernel name not in :data:`COLLECTIVE_KERNELS` (named, never taken as one)
COLLECTIVE_WORDS = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.IGNORECASE)
#: correlation ids that mean "unknown" (ROCm tracers write 0 for every kernel; -1: absent).
UNKNOWN_CORRELATIONS = frozenset({0, -1})
#: runtime calls that put work on the device, each recorded by the profiler as a GPU event with its
#: correlation (kernels, copies, memsets: ``cudaLaunchKernel``, ``cuLaunchKernel``, ``hipExtLaunchKernel``,
#: ``cudaMemcpyAsync``, ``cudaMemsetAsync``, ``cudaGraphLaunch``...); not ``cudaLaunchHostFunc`` (runs on the CPU).
LAUNCH_CALL = re.compile(r"Launch(?!HostFunc)|Memcpy|Memset")
#: the runtime calls among them that launch a kernel (``cudaLaunchKernel``, ``cudaLaunchKernelExC``,
#: ``cuLaunchKernel``, ``hipExtLaunchKernel``, ``cudaGraphLaunch``...): CUPTI records a GPU event for every one, while
#: a copy or memset of 0 bytes has none (3 of the 117 ``cudaMemsetAsync`` of HTA's real NCCL trace)
KERNEL_LAUNCH = re.compile(r"Launch(?!HostFunc)")


def launch_kind(name: str) -> int:
    """What a runtime call puts on the device: 2 a kernel (:data:`KERNEL_LAUNCH`), 1 a copy or memset
    (:data:`LAUNCH_CALL`), 0 nothing.

    >>> launch_kind("cudaLaunchKernel"), launch_kind("cudaMemsetAsync"), launch_kind("cudaLaunchHostFunc")
    (2, 1, 0)
    """
    return 2 if KERNEL_LAUNCH.search(name) else 1 if LAUNCH_CALL.search(name) else 0
#: the last event Kineto writes when it closes a trace file (``ChromeTraceLogger::finalizeTrace``, since 2020):
#: a file without it was not closed by Kineto (cut short and completed by a tool, or written by another tool).
END_MARKER = "Record Window End"

#: the CPU-side collective descriptor PyTorch records around every c10d call.
PARAM_COMMS = "record_param_comms"
#: ``record_param_comms`` of ``Work.wait()``: no collective of its own.
NOT_A_LAUNCH = frozenset({"wait"})
GLOO_PREFIX = "gloo:"
#: the ``c10d::`` operators of point-to-point calls (``send``/``isend``, ``recv``/``irecv``, and each op of
#: ``batch_isend_irecv`` on gloo): ``(tensors, process_group, peer, tag)``; with ``record_shapes`` Kineto writes
#: the peer (``dst`` of a send, ``src`` of a receive, a rank of the call's process group) and the tag as the
#: third and fourth ``"Concrete Inputs"`` (``"Input type"`` ``"Scalar"``). ``c10d::recv_any_source_`` names none.
P2P_CALLS = frozenset({"c10d::send", "c10d::recv_"})
NCCL_PREFIX = "nccl:"
#: ``record_function`` ranges of the device process groups around each collective: ``nccl:<op>``
#: (ProcessGroupNCCL, also RCCL), ``xccl:<op>`` (ProcessGroupXCCL, oneCCL on XPU), ``hccl:<op>`` (HCCL).
DESCRIPTOR_PREFIXES = ("nccl:", "xccl:", "hccl:")
#: ``prof.step()`` ranges: ``ProfilerStep#N``.
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")

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


def collective_type(name: str) -> str | None:
    """Collective type from a gloo/nccl range, c10d op or NCCL kernel name.

    A barrier is a barrier whatever carries it: since torch 2.6 ``dist.barrier()`` on NCCL is an
    all_reduce of one element recorded as ``nccl:all_reduce_barrier`` (PR 140785), typed ``barrier``
    as its call is (``gloo:barrier``, c10d's ``barrier``).

    >>> collective_type("gloo:all_reduce"), collective_type("nccl:_all_gather_base")
    ('all_reduce', 'all_gather')
    >>> collective_type("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    'all_reduce'
    >>> collective_type("nccl:all_reduce_barrier"), collective_type("aten::mm") is None
    ('barrier', True)
    """
    low = name.lower()
    for key, norm in (
        ("barrier", "barrier"),
        ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"),
        ("reducescatter", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
        ("allgather", "all_gather"), ("all_gather", "all_gather"),
        ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
        ("broadcast", "broadcast"), ("sendrecv", "send_recv"),
        ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
        ("send", "send"), ("recv", "recv"),
    ):  # fmt: skip
        if key in low:
            return norm
    return None


# --- collective kernels --------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelFamily:
    """One row of the collective-kernel vocabulary.

    Attributes:
        family: short label (``"nccl>=2.19"``...). pattern: regex matched against the kernel name
        (a leading ``void`` removed). typed: whether the name's collective may be trusted as a hint
        (``False``: a generic kernel that runs any collective; the type comes from the CPU descriptor).
        example: a real name of this family (tested).
    """

    family: str
    pattern: re.Pattern[str]
    typed: bool
    example: str


#: Every collective-kernel name pnpscale recognises. The CPU-side descriptor (``record_param_comms``,
#: ``nccl:*``) always wins over the name: since NCCL 2.12 one launched kernel runs whatever work is
#: queued, so even a typed name is only a hint (an all_reduce can run in a ``SendRecv`` kernel).
COLLECTIVE_KERNELS: tuple[KernelFamily, ...] = (
    KernelFamily("nccl>=2.19 generic", re.compile(r"^ncclDevKernel_Generic(?:_\d+)?\b"), False,
                 "ncclDevKernel_Generic(ncclDevComm*, channelMasks, ncclWork*)"),
    KernelFamily("nccl>=2.19", re.compile(r"^ncclDevKernel_[A-Z][A-Za-z]+"), True,
                 "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
    KernelFamily("nccl<2.19", re.compile(r"^ncclKernel_[A-Z][A-Za-z]+_"), True,
                 "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"),
    KernelFamily("nccl>=2.27 symmetric", re.compile(r"^ncclSymDevKernel_[A-Z][A-Za-z]+"), True,
                 "ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_bf16(ncclSymDevArgs)"),
    KernelFamily("nccl>=2.28 symmetric", re.compile(r"^ncclSymkDevKernel_[A-Z][A-Za-z]+"), True,
                 "ncclSymkDevKernel_ReduceScatter_LL_sum_f32(ncclSymkDevWorkArgs4K)"),
    KernelFamily("rccl msccl", re.compile(r"^mscclKernel_"), False, "mscclKernel_Sum_float_LL128(...)"),
    KernelFamily("torch symmetric memory",
                 re.compile(r"^(?:multimem|one_shot|two_shot)_[a-z_]*?(?:all_reduce|all_gather|reduce_scatter|reduce)"
                            r"[a-z_]*_kernel$"), True,
                 "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)"),
    KernelFamily("oneccl", re.compile(r"^oneccl_[a-z]+"), True, "oneccl_allreduce_base<float, 2, 16, 1, 1, 2>"),
    KernelFamily("hccl", re.compile(r"^hcom_[A-Za-z]+"), True, "hcom_allReduce__123_0_1"),
)  # fmt: skip
_ANY_NCCL = re.compile(r"nccl|oneccl|hccl|^hcom_", re.IGNORECASE)
#: a substring every :data:`COLLECTIVE_KERNELS` name holds (each pattern starts with one): a name without any
#: is in no family, which spares parsing it (:func:`kernel_function`)
_FAMILY_PREFIXES = re.compile(r"ncclDevKernel_|ncclKernel_|ncclSym|mscclKernel_|multimem_|one_shot_|two_shot_|"
                              r"oneccl_|hcom_")  # fmt: skip


def _strip_balanced(text: str, open_: str, close: str) -> str:
    """``text`` without its trailing balanced ``open_ ... close`` group (when it ends with one)."""
    if not text.endswith(close):
        return text
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        if text[i] == close:
            depth += 1
        elif text[i] == open_:
            depth -= 1
            if depth == 0:
                return text[:i].rstrip()
    return text


def kernel_label(name: str) -> str:
    """A kernel name for messages: without its parameter list, never cut at its first ``(``.

    >>> kernel_label("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)")
    'void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>'
    >>> kernel_label("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"), kernel_label("k")
    ('ncclDevKernel_AllReduce_Sum_f32_RING_LL', 'k')
    """
    return _strip_balanced(name.strip(), "(", ")") or name


def kernel_function(name: str) -> str:
    """A kernel's unqualified function name: no ``void``, parameters, template arguments or namespaces.

    >>> kernel_function("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)")
    'multimem_all_reduce_kernel'
    >>> kernel_function("void ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)")
    'ncclKernel_AllReduce_RING_LL_Sum_float'
    """
    base = kernel_label(name)
    base = base[5:] if base.startswith("void ") else base
    base = _strip_balanced(base, "<", ">")
    return base.rsplit("::", 1)[-1].strip() or base


#: distinct kernel names remembered by :func:`kernel_family`, :func:`is_collective_kernel` and
#: :func:`kernel_collective` (a trace repeats a few hundred names thousands of times; a section's records ask about
#: each of its kernels)
_KERNEL_NAMES_CACHED = 1 << 14


@functools.lru_cache(maxsize=_KERNEL_NAMES_CACHED)
def kernel_family(name: str) -> KernelFamily | None:
    """The row of :data:`COLLECTIVE_KERNELS` a GPU kernel name belongs to (matched on its unqualified function
    name, :func:`kernel_function`), else ``None``. Pure: remembered per name.

    >>> kernel_family("void ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)").family
    'nccl<2.19'
    >>> kernel_family("void at::native::elementwise_kernel<128, 4>") is None
    True
    """
    if _FAMILY_PREFIXES.search(name) is None:
        return None
    base = kernel_function(name)
    for fam in COLLECTIVE_KERNELS:
        if fam.pattern.search(base):
            return fam
    return None


@functools.lru_cache(maxsize=_KERNEL_NAMES_CACHED)
def is_collective_kernel(name: str) -> bool:
    """Whether a GPU kernel is a collective's: a :data:`COLLECTIVE_KERNELS` name, or any name with ``nccl``."""
    return kernel_family(name) is not None or bool(_ANY_NCCL.search(name))


@functools.lru_cache(maxsize=_KERNEL_NAMES_CACHED)
def kernel_collective(name: str) -> str | None:
    """The collective a kernel name hints at (``None`` for generic kernels or unknown names).

    >>> kernel_collective("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)") is None
    True
    >>> kernel_collective("ncclSymDevKernel_AllGather_LL(ncclSymDevArgs)")
    'all_gather'
    >>> kernel_collective("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)")
    'all_reduce'
    """
    fam = kernel_family(name)
    if fam is not None and not fam.typed:
        return None
    base = kernel_function(name)
    if fam is not None and fam.family.startswith(("nccl", "hccl", "oneccl")):
        base = base.split("_", 1)[-1]  # after the family prefix (ncclDevKernel_AllReduce...: AllReduce...)
    return collective_type(base)


# --- descriptors and payloads --------------------------------------------------------------------


def is_gloo_work(name: str) -> bool:
    return name.startswith(GLOO_PREFIX)


def is_named_descriptor(name: str) -> bool:
    """A process group's ``nccl:<op>`` / ``xccl:<op>`` / ``hccl:<op>`` range (:data:`DESCRIPTOR_PREFIXES`)."""
    return name.startswith(DESCRIPTOR_PREFIXES)


def is_descriptor(name: str) -> bool:
    """CPU-side collective descriptor: an ``nccl:*``/``xccl:*``/``hccl:*`` range or ``record_param_comms``."""
    return is_named_descriptor(name) or name == PARAM_COMMS


_STREAM_TID = re.compile(r"^\s*stream\s+(\d+)", re.IGNORECASE)


def stream_of(args: Mapping[str, Any], tid: Any) -> int:
    """A device event's stream: ``args.stream`` (CUDA/ROCm), ``args["sycl queue"]`` (XPU), else the ``tid``
    (an integer, or 2021's ``"stream 7"``); 0 when none says.

    >>> stream_of({"stream": 7}, 7), stream_of({"sycl queue": 71}, 7), stream_of({}, "stream 20"), stream_of({}, "x")
    (7, 71, 20, 0)
    """
    for key in ("stream", "sycl queue", "queue"):
        v = int_or_none(args.get(key))
        if v is not None:
            return v
    v = int_or_none(tid)
    if v is not None:
        return v
    m = _STREAM_TID.match(tid) if isinstance(tid, str) else None
    return int(m.group(1)) if m else 0


def step_number(name: str) -> int | None:
    """``N`` of a ``ProfilerStep#N`` range, else ``None``.

    >>> step_number("ProfilerStep#12"), step_number("gradient")
    (12, None)
    """
    m = PROFILER_STEP.match(name)
    return int(m.group(1)) if m else None


def payload_bytes(shapes: Sequence[Sequence[int]] | None, dtypes: Sequence[str] | None) -> int | None:
    """Bytes of the first tensor input: ``prod(shape) * itemsize``.

    >>> payload_bytes([[1000, 1000]], ["float"])
    4000000
    >>> payload_bytes([[]], ["float"]) is None, payload_bytes([[3]], ["unknown"]) is None
    (True, True)
    """
    if not shapes or not dtypes or not shapes[0]:
        return None
    size = DTYPE_BYTES.get(dtypes[0]) if isinstance(dtypes[0], str) else None
    if size is None or not all(isinstance(d, int) for d in shapes[0]):
        return None
    n = 1
    for d in shapes[0]:
        n *= int(d)
    return n * size


def p2p_peer(name: str, args: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(peer, tag) of a point-to-point ``c10d::`` call (:data:`P2P_CALLS`) from Kineto ``args``; ``None`` for each
    one the trace does not hold (recorded without ``record_shapes``, another operator, another layout).

    >>> p2p_peer("c10d::send", {"Concrete Inputs": ["", "", "2", "7"], "Input type": ["TensorList", "", "Scalar",
    ...          "Scalar"]})
    (2, 7)
    >>> p2p_peer("c10d::recv_", {}), p2p_peer("c10d::broadcast_", {"Concrete Inputs": ["", "", "2", "7"]})
    ((None, None), (None, None))
    """
    if name not in P2P_CALLS:
        return None, None
    values, types = args.get("Concrete Inputs"), args.get("Input type")
    if not isinstance(values, list) or len(values) < 4:
        return None, None
    if isinstance(types, list) and len(types) >= 4 and any(t != "Scalar" for t in types[2:4]):
        return None, None  # not the (tensors, group, peer, tag) schema
    peer, tag = (int_or_none(v) if isinstance(v, (int, str)) and str(v).lstrip("-").isdigit() else None
                 for v in values[2:4])  # fmt: skip
    return peer, tag


def int_or_none(v: Any) -> int | None:
    """An integer from a Kineto args value; ``None`` for missing, boolean or non-numeric values."""
    try:
        return None if v is None or isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        return None


def comm_fields(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Collective type, payload bytes, process group and sequence number from Kineto ``args``.

    Payload: ``"In msg nelems"`` x bytes of ``"dtype"`` when present (``record_param_comms``, NCCL
    kernels), else the first input's ``"Input Dims"`` x ``"Input type"`` (``gloo:*``/``nccl:*``
    ranges; :func:`payload_bytes`). Type: ``"Collective name"``, else from ``name``. Unknown values
    are ``None``.

    >>> comm_fields("ncclKernel_AllReduce", {"Collective name": "allreduce", "In msg nelems": 10,
    ...             "dtype": "Float", "Process Group Name": "0", "Seq": 3})
    {'collective': 'all_reduce', 'payload_bytes': 40, 'group': '0', 'group_seq': 3}
    >>> comm_fields("gloo:all_reduce", {"Input Dims": [[1, 3, 32, 32]], "Input type": ["float"]})
    {'collective': 'all_reduce', 'payload_bytes': 12288, 'group': None, 'group_seq': None}
    """
    cname = args.get("Collective name")
    coll = (collective_type(str(cname)) or str(cname)) if cname else collective_type(name)
    payload = None
    nelems, dtype = int_or_none(args.get("In msg nelems")), args.get("dtype")
    if nelems is not None and dtype in DTYPE_BYTES:
        payload = nelems * DTYPE_BYTES[dtype]
    else:
        dims, types = args.get("Input Dims"), args.get("Input type")
        if isinstance(dims, list) and isinstance(types, list):
            first = dims[0] if dims else None
            payload = payload_bytes([first] if isinstance(first, list) else None, types)
    group = args.get("Process Group Name")
    seq = args.get("Seq", args.get("seq"))
    return {
        "collective": coll,
        "payload_bytes": payload,
        "group": None if group is None else str(group),
        "group_seq": int_or_none(seq),
    }
