"""Will a local point fit in this machine's memory? An estimate made before anything starts.

estimate = shared + ranks x (per-rank footprint + the problem's tensors on each CPU rank), compared
with the memory available to this process (``MemAvailable``, lowered by a cgroup v2 limit).

* The footprint is measured by the local launcher itself, once per machine and software versions, on a
  real point started the way it starts its ranks (:func:`pnpscale.cluster.local.rank_footprint`: forked
  from a forkserver, or spawned where there is no forkserver): a tiny 2-rank point
  (:data:`pnpscale.cluster.local.PROBE_OVERRIDES`, about 10 s) whose ranks read their own
  ``/proc/self/smaps_rollup`` (:func:`smaps_rollup`) when they are done. A rank's *private* pages (``Private_Clean +
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

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec

#: Copies of the full signal each CPU rank holds (iterate, gradient, all_reduce buffer, denoised
#: image, measurements and slack for temporaries).
SIGNAL_COPIES = 6
GB = 1e9
def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (``Rss``, ``Pss``, ``Private_Clean``, ``Anonymous``...).

    Raises:
        OSError: no such process, or no ``/proc`` (not Linux).
    """
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key.strip()] = int(parts[0]) * 1024
    return out


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
