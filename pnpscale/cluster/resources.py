"""Will a local point fit in this machine's memory? An estimate made before anything starts.

estimate = shared + ranks x (per-rank footprint + the problem's tensors on each CPU rank), compared
with the memory available to this process (``MemAvailable``, lowered by a cgroup v2 limit).

* The footprint is measured once per machine and software versions, on a Python process that
  imports torch and deepinv and runs a gloo process group of one (what every rank carries before
  it holds any data): its anonymous memory (``/proc/self/smaps_rollup``: each rank has its own) is
  the per-rank footprint, the rest of its resident memory (libraries, shared by every rank) counts
  once. Kept in ``$XDG_CACHE_HOME/pnpscale/rank_footprint.json`` (:func:`rank_footprint`).
* The problem's tensors (:func:`problem_bytes`): every rank holds the whole signal several times
  over (iterate, gradient, the all_reduce buffer, the denoised image, its measurements' share),
  :data:`SIGNAL_COPIES` copies, times ``unroll + 1`` when training keeps each unrolled step for
  backpropagation, plus DRUNet's weights. On CUDA the tensors live on the GPUs: only the footprint
  counts against host memory.

It is an estimate for a refusal (one line naming it, the limit and the way out), never a
measurement: run.json holds what was measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: Copies of the full signal each CPU rank holds (iterate, gradient, all_reduce buffer, denoised
#: image, measurements and slack for temporaries).
SIGNAL_COPIES = 6
GB = 1e9

_PROBE = """
import tempfile
import torch, deepinv, torch.distributed as dist
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
dist.all_reduce(torch.zeros(1))
dist.destroy_process_group()
kb = {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/smaps_rollup") if ":" in l[:20])
      if v.strip().endswith("kB")}
print(kb["Anonymous"] * 1024, (kb["Rss"] - kb["Anonymous"]) * 1024)
"""


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    from pnpscale import layout

    return base / "pnpscale" / layout.RANK_FOOTPRINT


def _versions_key() -> str:
    import platform

    import torch

    return f"python {platform.python_version()} torch {torch.__version__} {platform.machine()}"


def rank_footprint(measure: bool = True) -> tuple[int, int] | None:
    """``(per_rank, shared)`` bytes: one rank's own memory before it holds any data, and the memory
    every rank shares (counted once); measured once, then kept (see the module doc).

    Returns:
        the kept values for this machine and these versions; measured now (a few seconds, once)
        when absent and ``measure``; ``None`` when they cannot be measured.
    """
    path, key = _cache_file(), _versions_key()
    try:
        kept = json.loads(path.read_text())
        if kept.get("key") == key and int(kept["per_rank_bytes"]) > 0:
            return int(kept["per_rank_bytes"]), int(kept["shared_bytes"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if not measure:
        return None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        per_rank, shared = (int(v) for v in proc.stdout.strip().splitlines()[-1].split())
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
    try:
        from pnpscale import layout

        layout.write_json(path, {"key": key, "per_rank_bytes": per_rank, "shared_bytes": shared,
                                 "how": "smaps_rollup of: " + " ".join(_PROBE.split())})  # fmt: skip
    except OSError:
        pass
    return per_rank, shared


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


def problem_bytes(spec: Any) -> int:
    """Bytes of the problem's tensors on one CPU rank (see the module doc for the rule)."""
    from pnpscale.rank.problems import make_problem

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
        footprint: ``(per_rank, shared)`` bytes (:func:`rank_footprint`).
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


def check_memory(spec: Any, cuda_devices: int) -> str | None:
    """:func:`memory_refusal` for a local point on this machine; ``None`` when it fits or cannot be estimated."""
    footprint, available = rank_footprint(), available_bytes()
    if footprint is None or available is None:
        return None
    data = 0 if cuda_devices and spec.backend != "gloo" else problem_bytes(spec)
    return memory_refusal(spec.gpus, footprint, data, available)
