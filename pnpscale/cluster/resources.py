"""Will a local point fit in this machine's memory? An estimate made before anything starts.

estimate = shared + ranks x (per-rank footprint + the problem's tensors on each CPU rank), compared
with the memory available to this process (``MemAvailable``, lowered by a cgroup v2 limit).

* The footprint is measured once per machine and software versions, on a real point started the way
  the local launcher starts its ranks (:func:`pnpscale.cluster.local.run_ranks`: forked from a
  forkserver that preloaded torch and deepinv, or spawned where there is no forkserver): a tiny
  2-rank point (:data:`PROBE_OVERRIDES`, :func:`probe_footprint`, about 10 s) whose ranks read their
  own ``/proc/self/smaps_rollup`` when they are done. A rank's *private* pages (``Private_Clean +
  Private_Dirty``: what it alone holds, the copy-on-write pages it touched included) are the per-rank
  footprint; what is counted once is the pages the ranks share (the forkserver's resident memory, or a
  spawned rank's shared libraries) plus what rank 0 holds beyond another rank (it gathers the tables
  and writes the run folder). Kept in ``$XDG_CACHE_HOME/pnpscale/rank_footprint-2.json``
  (:func:`rank_footprint`).
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
#: Ranks of the footprint probe's point (at least 2: a real process group, as in a multi-rank point).
PROBE_RANKS = 2
#: How the footprint is measured; part of the cache key, so a new rule measures again.
PROBE_VERSION = 2


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


#: The point the footprint probe runs: a real 2-rank point, tiny (its tensors are negligible).
PROBE_OVERRIDES = (
    f"gpus={PROBE_RANKS}", "scale=small", "problem=2d", "mode=inference", "problem.image_size=32",
    "problem.num_operators=2", "problem.patch_size=8", "problem.overlap=4", "problem.max_batch_size=4",
    "problem.nc=[4,8,8,8]", "problem.nb=1", "iterations=1", "warmup=1", "dist.backend=gloo",
)  # fmt: skip


def _probe_rank(spec_dict: dict[str, Any], run_dir: str) -> None:
    """One probe rank: the real rank (:func:`pnpscale.rank.worker.rank_main`), then its memory into
    ``run_dir/probe-rank<r>.json``: its private bytes and the bytes it shares with the forkserver."""
    from pnpscale.rank.worker import rank_main

    rank_main(spec_dict, run_dir)
    mine = smaps_rollup()
    private = mine.get("Private_Clean", 0) + mine.get("Private_Dirty", 0)
    parent = os.getppid()
    try:  # forked from a server: its resident pages are what the ranks share
        shared = smaps_rollup(parent)["Rss"] if parent != int(os.environ[PROBE_PID_ENV]) else None
    except (OSError, KeyError):
        shared = None
    out = {"private": private, "shared": mine["Rss"] - private if shared is None else shared}
    Path(run_dir, f"probe-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(out))


PROBE_PID_ENV = "PNPSCALE_PROBE_PID"


def probe_footprint() -> tuple[int, int, str]:
    """Run the probe point (:data:`PROBE_OVERRIDES`) the launcher's way and measure its ranks (see the
    module doc); run it in a fresh process (:func:`rank_footprint` does).

    Returns:
        ``(per_rank, once, start_method)``: a rank's private bytes (rank 1: it does what every rank
        does), and the bytes counted once: the shared pages plus what rank 0 holds beyond a rank's
        (it gathers the tables and writes the run folder).
    """
    import tempfile

    from pnpscale.cluster.local import rank_start_method, run_ranks
    from pnpscale.sweep.cli import compose_config
    from pnpscale.sweep.config import resolve_spec

    spec = resolve_spec(compose_config(list(PROBE_OVERRIDES)), cuda_available=False)
    os.environ[PROBE_PID_ENV] = str(os.getpid())
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(PROBE_RANKS, _probe_rank, (spec.to_dict(), tmp), Path(tmp) / "logs", 1)
        got = [json.loads(Path(tmp, f"probe-rank{r}.json").read_text()) for r in range(PROBE_RANKS)]
    per_rank = max(g["private"] for g in got[1:])
    once = max(g["shared"] for g in got) + max(0, got[0]["private"] - per_rank)
    return per_rank, once, rank_start_method()


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    from pnpscale import layout

    return base / "pnpscale" / layout.RANK_FOOTPRINT


def _versions_key() -> str:
    import platform

    import torch

    from pnpscale.cluster.local import RANK_PRELOAD

    return (
        f"python {platform.python_version()} torch {torch.__version__} {platform.machine()} probe {PROBE_VERSION} "
        f"preload {','.join(RANK_PRELOAD)}"
    )


_PROBE = "from pnpscale.cluster.resources import probe_footprint; print('footprint', *probe_footprint())"


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
        line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("footprint "))
        _, per_text, shared_text, method = line.split()
        per_rank, shared = int(per_text), int(shared_text)
    except (OSError, ValueError, StopIteration, subprocess.TimeoutExpired):
        return None
    try:
        from pnpscale import layout

        layout.write_json(path, {"key": key, "per_rank_bytes": per_rank, "shared_bytes": shared,
                                 "start_method": method, "how": "pnpscale.cluster.resources.probe_footprint: a "
                                 f"{PROBE_RANKS}-rank point's private pages per rank, shared pages and rank 0's "
                                 "extra once (/proc/<pid>/smaps_rollup)"})  # fmt: skip
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
