"""Which GPU a rank uses: one per rank, bound before its first CUDA call (pure rules and ``os.environ``; no torch).

The local launcher shares its machine's GPUs out (:data:`NODE_GPUS_ENV`), a SLURM task reads its node's
(``CUDA_VISIBLE_DEVICES``, else :func:`nvml_device_count`); each rank takes entry ``local_rank mod n``
(:func:`gpu_binding`, :func:`bind_gpu`) and its process group checks that the binding took
(:func:`check_binding`).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

#: set by the local launcher: the GPUs of this machine its ranks share out, one per local rank
#: (``CUDA_VISIBLE_DEVICES`` entries, comma-separated; empty: no GPU)
NODE_GPUS_ENV = "PNPSCALE_NODE_GPUS"


#: set in a rank bound to one GPU by :func:`bind_gpu`: the ``CUDA_VISIBLE_DEVICES`` it was given
GPU_BINDING_ENV = "PNPSCALE_GPU_BINDING"


#: set (to ``1``) in the launcher's environment for ranks sharing one GPU on NCCL before 2.30: each rank
#: then gets its own NCCL host id (:func:`per_rank_nccl_env`)
NCCL_HOSTID_PER_RANK_ENV = "PNPSCALE_NCCL_HOSTID_PER_RANK"


def per_rank_nccl_env(rank: int, environ: Any, host: str) -> dict[str, str]:
    """NCCL settings that let ranks of one host share a GPU on NCCL < 2.30, when :data:`NCCL_HOSTID_PER_RANK_ENV`
    is ``1`` (a structure check only: the ranks time-slice the GPU); else nothing.

    NCCL refuses two ranks whose host hash and bus id both match ("Duplicate GPU detected", ``init.cc``); the
    host hash is the hash of ``NCCL_HOSTID`` when set (``getHostHash``). One host id per rank makes NCCL see one
    host per rank, which it connects through its network transport: the socket transport on the loopback
    interface (``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``). Values the user set are kept.

    >>> per_rank_nccl_env(1, {"PNPSCALE_NCCL_HOSTID_PER_RANK": "1"}, "n1")
    {'NCCL_HOSTID': 'n1-pnpscale-rank1', 'NCCL_SOCKET_IFNAME': 'lo', 'NCCL_IB_DISABLE': '1'}
    >>> per_rank_nccl_env(1, {}, "n1")
    {}
    """
    if str(environ.get(NCCL_HOSTID_PER_RANK_ENV, "")) != "1":
        return {}
    wanted = {"NCCL_HOSTID": f"{host}-pnpscale-rank{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    return {k: v for k, v in wanted.items() if k not in environ}


def gpu_binding(local_rank: int, visible: str | None, count: int | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` that binds local rank ``local_rank`` to one GPU, ``None`` to leave it.

    Args:
        local_rank: the rank's index on its node (``LOCAL_RANK``, ``SLURM_LOCALID``).
        visible: the node's ``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-<uuid>`` or MIG names; ``None``: unset).
        count: the node's GPU count, used when ``visible`` is unset (``None``: unknown).

    Returns:
        entry ``local_rank % n`` of the node's GPUs (so ranks sharing one GPU for a structure check
        get the same one), or ``None``: no GPU, or exactly one visible already (bound outside, e.g.
        SLURM's per-task binding).

    >>> gpu_binding(1, "0,1,2,3"), gpu_binding(3, "GPU-a,GPU-b"), gpu_binding(3, None, 2), gpu_binding(1, "0", 1)
    ('1', 'GPU-b', '1', None)
    >>> gpu_binding(0, ""), gpu_binding(0, None, 0), gpu_binding(0, None)
    (None, None, None)
    """
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        gpus = [str(i) for i in range(count or 0)]
    if len(gpus) <= 1 and (visible is not None or not gpus):
        return None
    return gpus[local_rank % len(gpus)]


def bind_gpu(local_rank: int, visible: str | None, count: int | None = None) -> str | None:
    """Bind this process to its GPU (:func:`gpu_binding`) by setting ``CUDA_VISIBLE_DEVICES``; call it
    before the process's first CUDA call (CUDA reads the variable once, at its initialisation:
    :class:`pnpscale.rank.group.Group` checks that the binding took). Returns the binding, or ``None``
    (nothing changed)."""
    binding = gpu_binding(local_rank, visible, count)
    if binding is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = binding
        os.environ[GPU_BINDING_ENV] = binding
    return binding


def nvml_device_count() -> int | None:
    """GPUs on this node by NVML (``libnvidia-ml``), without initialising CUDA; ``None`` without NVML."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None
    return int(count.value) if ok else None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def nvml_free_bytes(visible: str | None) -> list[int] | None:
    """Free memory (bytes) of each GPU this process may use, by NVML (``nvmlDeviceGetMemoryInfo``: what
    ``torch.cuda.mem_get_info`` reports, without creating a CUDA context in the caller, which would hold
    about half a GiB of the GPU while the ranks run): the GPUs of ``visible`` (``CUDA_VISIBLE_DEVICES``: indices
    or ``GPU-<uuid>``), every GPU when ``None``. ``None`` without NVML, or for MIG names (unknown here)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError):
        return None
    try:
        if visible is None:
            count = ctypes.c_uint(0)
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return None
            wanted: list[str] = [str(i) for i in range(count.value)]
        else:
            wanted = [g.strip() for g in visible.split(",") if g.strip()]
        out = []
        for g in wanted:
            handle = ctypes.c_void_p()
            if g.isdigit():
                rc = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(g)), ctypes.byref(handle))
            elif g.startswith("GPU-"):
                rc = nvml.nvmlDeviceGetHandleByUUID(g.encode(), ctypes.byref(handle))
            else:
                return None
            mem = _NvmlMemory()
            if rc != 0 or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
                return None
            out.append(int(mem.free))
        return out
    except AttributeError:
        return None
    finally:
        nvml.nvmlShutdown()


def check_binding(binding: str | None, visible: int, rank: int) -> None:
    """Refuse a rank bound to one GPU (:func:`bind_gpu`) that sees several: CUDA had been initialised in
    the process before the binding, so it opens a context on every GPU (or fails on GPUs in
    exclusive-process mode).

    >>> check_binding("2", 1, 0), check_binding(None, 4, 0)
    (None, None)

    Raises:
        RuntimeError: ``binding`` is set and ``visible > 1``.
    """
    if binding is not None and visible > 1:
        raise RuntimeError(
            f"rank {rank}: bound to GPU {binding} (CUDA_VISIBLE_DEVICES) but sees {visible} GPUs: CUDA was "
            "initialised in this process before the binding (something called torch.cuda first)"
        )
