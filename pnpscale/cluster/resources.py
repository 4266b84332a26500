"""Will a local point fit in this machine's memory? An estimate made before anything starts.

estimate = shared + ranks x (per-rank footprint + the problem's tensors on each CPU rank), compared
with the memory available to this process (``MemAvailable``, lowered by a cgroup v2 limit).

* The footprint is measured by the local launcher itself, once per machine and software versions, on a
  real point started the way it starts its ranks (:func:`pnpscale.cluster.local.rank_footprint`: forked
  from a forkserver, or spawned where there is no forkserver): a tiny 2-rank point
  (:data:`pnpscale.cluster.local.PROBE_OVERRIDES`, about 10 s) whose ranks read their own
  ``/proc/self/smaps_rollup`` (:func:`smaps_rollup`; ``smaps`` where the kernel has no rollup) when they are
  done. A rank's *private* pages (``Private_Clean +
  Private_Dirty``: what it alone holds, the copy-on-write pages it touched included) are the per-rank
  footprint; what is counted once is the pages the ranks share (the forkserver's resident memory, or a
  spawned rank's shared libraries) plus what rank 0 holds beyond another rank (it gathers the tables
  and writes the run folder). Kept in ``$XDG_CACHE_HOME/pnpscale/rank_footprint-2.json``
  (:func:`pnpscale.cluster.local.rank_footprint`).
* The problem's tensors (:func:`problem_bytes`): every rank holds the whole signal several times
  over (iterate, gradient, the all_reduce buffer, the denoised image, its measurements' share),
  :data:`SIGNAL_COPIES` copies, times ``unroll + 1`` when training keeps each unrolled step for
  backpropagation, plus DRUNet's weights. On CUDA the tensors live on the GPUs: only the footprint
  counts against host memory.

It is an estimate for a refusal (one line naming it, the limit and the way out), never a
measurement: run.json holds what was measured.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec

#: Copies of the full signal each CPU rank holds (iterate, gradient, all_reduce buffer, denoised
#: image, measurements and slack for temporaries).
SIGNAL_COPIES = 6
GB = 1e9


def _kb_fields(lines: Any) -> dict[str, int]:
    """``Key:  123 kB`` lines -> ``{"Key": 123 * 1024}``, values of a repeated key summed."""
    out: dict[str, int] = {}
    for line in lines:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = out.get(key.strip(), 0) + int(parts[0]) * 1024
    return out


#: the fields :func:`smaps_rollup` must give (a rank's private pages and its resident set)
SMAPS_FIELDS = ("Rss", "Private_Clean", "Private_Dirty")


def smaps_rollup(pid: int | str = "self", proc: Path = Path("/proc")) -> dict[str, int]:
    """A process's memory counts in bytes (``Rss``, ``Pss``, ``Private_Clean``, ``Private_Dirty``...):
    ``/proc/<pid>/smaps_rollup`` (Linux >= 4.14), else the sum over the mappings of ``/proc/<pid>/smaps``
    (kernels without the rollup: older ones, sandboxes such as gVisor), with ``"source"`` naming the file
    read (``smaps_rollup`` = 1, ``smaps`` = 2).

    Raises:
        OSError: no such process, no ``/proc`` (not Linux), or neither file gives :data:`SMAPS_FIELDS`;
            the message names the files tried.
    """
    tried = []
    for source, name in ((1, "smaps_rollup"), (2, "smaps")):
        path = proc / str(pid) / name
        try:
            with open(path) as f:
                out = _kb_fields(f)
        except OSError as exc:
            tried.append(f"{path}: {exc.strerror or exc}")
            continue
        if all(k in out for k in SMAPS_FIELDS):
            out["source"] = source
            return out
        tried.append(f"{path}: no {'/'.join(k for k in SMAPS_FIELDS if k not in out)}")
    raise OSError(f"no memory counts for process {pid}: " + "; ".join(tried))


def footprint_failure(kept: Any, key: str) -> str | None:
    """The reason a kept footprint file gives for a probe that failed on this machine and these versions
    (``key``), ``None`` when it holds none (so the probe is not run again at every point).

    >>> footprint_failure({"key": "k", "failed": "no smaps"}, "k"), footprint_failure({"key": "o", "failed": "x"}, "k")
    ('no smaps', None)
    """
    if isinstance(kept, dict) and kept.get("key") == key and kept.get("failed"):
        return str(kept["failed"])
    return None


#: set once the skipped host-memory check has been said in this process
_SAID: set[str] = set()


def say_memory_check_skipped(reason: str, path: Path) -> None:
    """One line on stderr, once per process and reason: the host-memory check is skipped, and why."""
    if reason not in _SAID:
        _SAID.add(reason)
        print(f"pnpscale: host-memory check skipped: the rank footprint cannot be measured here ({reason}); "
              f"kept in {path} (delete it to measure again)", file=sys.stderr)  # fmt: skip


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_bytes() -> int | None:
    """Memory this process can still take (bytes): ``MemAvailable``, lowered by a cgroup v2 limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used) if avail is not None else int(limit) - used
    except (OSError, ValueError):
        pass
    return avail


def drunet_weight_bytes(nc: list[int], nb: int, channels: int, dims: int) -> int:
    """Bytes (float32) of DRUNet's weights: per level ``nb`` residual blocks of two 3^dims convolutions on
    the way down and up, a 2^dims down- and up-sampling convolution between levels, head and tail.

    >>> drunet_weight_bytes([64, 128, 256, 512], 4, 3, 2) // 10**6  # deepinv's DRUNet: 32.6 M parameters
    130
    """
    k, s = 3**dims, 2**dims
    params = 2 * k * channels * nc[0]  # head and tail
    for i, c in enumerate(nc):
        blocks = 2 * nb if i < len(nc) - 1 else nb  # down and up path; the bottom level once
        params += blocks * 2 * k * c * c
        if i < len(nc) - 1:
            params += 2 * s * c * nc[i + 1]
    return 4 * params


def problem_bytes(spec: RunSpec) -> int:
    """Bytes of the problem's tensors on one CPU rank (see the module doc for the rule)."""
    from pnpscale.rank.problems import make_problem  # deferred: torch only once the config is valid

    signal = make_problem(spec).signal_bytes()
    sizes = spec.sizes
    steps = int(sizes.get("unroll") or 0) + 1 if spec.mode == "training" else 1
    channels = signal // (4 * int(sizes["image_size"]) ** spec.dims) or 1
    weights = drunet_weight_bytes(list(sizes["nc"]), int(sizes["nb"]), channels, spec.dims)
    return SIGNAL_COPIES * signal * steps + weights


def memory_refusal(gpus: int, footprint: tuple[int, int], per_rank_data: int, available: int) -> str | None:
    """The refusal text when ``gpus`` ranks do not fit in ``available`` bytes, else ``None``.

    Args:
        gpus: ranks on this machine.
        footprint: ``(per_rank, shared)`` bytes (:func:`pnpscale.cluster.local.rank_footprint`).
        per_rank_data: the problem's tensors on each rank (0 on CUDA), bytes.
        available: :func:`available_bytes`.

    >>> print(memory_refusal(64, (390 * 10**6, 330 * 10**6), 10**6, 20 * 10**9))  # doctest: +NORMALIZE_WHITESPACE
    needs about 25.4 GB of memory here (64 ranks x (0.39 GB per rank + 0.00 GB of problem tensors) + 0.33 GB
    shared), 20.0 GB is available: use cluster=slurm, or gpus<=50 here
    >>> memory_refusal(16, (390 * 10**6, 330 * 10**6), 10**6, 20 * 10**9) is None
    True
    """
    own, shared = footprint
    per = own + per_rank_data
    need = shared + gpus * per
    if need <= available:
        return None
    fits = max(0, available - shared) // per
    way = f"use cluster=slurm, or gpus<={fits} here" if fits >= 1 else "use cluster=slurm, or a smaller scale/problem"
    return (
        f"needs about {need / GB:.1f} GB of memory here ({gpus} ranks x ({own / GB:.2f} GB per rank + "
        f"{per_rank_data / GB:.2f} GB of problem tensors) + {shared / GB:.2f} GB shared), "
        f"{available / GB:.1f} GB is available: {way}"
    )


def check_memory(spec: RunSpec, cuda_devices: int, footprint: tuple[int, int] | None) -> str | None:
    """:func:`memory_refusal` for a local point on this machine; ``None`` when it fits or cannot be estimated.

    Args:
        spec: the point.
        cuda_devices: CUDA devices here (0: the problem's tensors live on the CPU ranks).
        footprint: ``(per_rank, shared)`` bytes of a rank as the launcher starts it
            (:func:`pnpscale.cluster.local.rank_footprint`), ``None`` when unknown.
    """
    available = available_bytes()
    if footprint is None or available is None:
        return None
    data = 0 if cuda_devices and spec.backend != "gloo" else problem_bytes(spec)
    return memory_refusal(spec.gpus, footprint, data, available)


#: Bytes a rank holds on its GPU before any tensor of the problem: the CUDA context, cuBLAS/cuDNN workspaces and
#: NCCL's buffers (about 0.5 GiB for a context with lazy module loading; NCCL's channels a few hundred MiB more):
#: a round figure, the low end, so that the estimate stays a lower bound.
CUDA_RANK_OVERHEAD_BYTES = 512 * 2**20


def ranks_per_gpu(gpus: int, devices: int) -> int:
    """The most local ranks bound to one GPU when ``gpus`` ranks share ``devices`` GPUs (rank ``r`` on GPU
    ``r mod devices``, :func:`pnpscale.rank.gpus.gpu_binding`).

    >>> ranks_per_gpu(2, 1), ranks_per_gpu(4, 4), ranks_per_gpu(5, 4)
    (2, 1, 2)
    """
    return -(-gpus // max(1, devices))


def gpu_memory_refusal(gpus: int, devices: int, per_rank: int, free: Sequence[int]) -> str | None:
    """The refusal text when the ranks bound to one GPU need more than its free memory, else ``None``.

    Args:
        gpus: local ranks.
        devices: GPUs they share (:func:`ranks_per_gpu`).
        per_rank: a lower bound of one rank's GPU memory (:func:`gpu_bytes_per_rank`), bytes.
        free: each GPU's free bytes (:func:`pnpscale.rank.gpus.nvml_free_bytes`); the least is compared.

    >>> print(gpu_memory_refusal(1, 1, 150 * 10**9, [140 * 10**9]))  # doctest: +NORMALIZE_WHITESPACE
    needs at least 150.0 GB on each GPU (1 rank(s) per GPU x 150.0 GB: the problem's tensors and the CUDA
    context; activations not counted), the GPU with the least free memory has 140.0 GB: use more GPUs, or a
    smaller scale/problem
    >>> gpu_memory_refusal(2, 1, 10 * 10**9, [140 * 10**9]) is None
    True
    """
    if not free:
        return None
    per_gpu = ranks_per_gpu(gpus, devices)
    need, least = per_gpu * per_rank, min(free)
    if need <= least:
        return None
    return (
        f"needs at least {need / GB:.1f} GB on each GPU ({per_gpu} rank(s) per GPU x {per_rank / GB:.1f} GB: the "
        f"problem's tensors and the CUDA context; activations not counted), the GPU with the least free memory "
        f"has {least / GB:.1f} GB: use more GPUs, or a smaller scale/problem"
    )


def gpu_bytes_per_rank(spec: RunSpec) -> int:
    """A lower bound of one CUDA rank's GPU memory: the problem's tensors (:func:`problem_bytes`, every rank
    holds the whole signal several times over) plus :data:`CUDA_RANK_OVERHEAD_BYTES`; the denoiser's
    activations (which depend on the batch of tiles) are not counted, so a refusal is certain, a pass is not."""
    return problem_bytes(spec) + CUDA_RANK_OVERHEAD_BYTES


def check_gpu_memory(spec: RunSpec, cuda_devices: int, free: Sequence[int] | None) -> str | None:
    """:func:`gpu_memory_refusal` for a local CUDA point, before any rank starts; ``None`` when it fits, when
    the ranks are CPU ranks (no CUDA device, or ``dist.backend=gloo``) or the free memory is unknown.

    Args:
        spec: the point.
        cuda_devices: CUDA devices here.
        free: each usable GPU's free bytes, ``None`` when unknown.
    """
    if not cuda_devices or spec.backend == "gloo" or not free:
        return None
    return gpu_memory_refusal(spec.gpus, cuda_devices, gpu_bytes_per_rank(spec), free)
