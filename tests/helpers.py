"""Test helpers: run the CLI in a subprocess, find run folders, tiny problem overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces" / "hta"

#: A problem small enough for a multi-rank run in a few seconds on 2 CPU cores: the ``scale=tiny`` preset
#: (32² image, 4 operators, 8 px tiles + 4 overlap, DRUNet widths 4-8-8-8 with one block, 2 measured
#: iterations after 1 warm-up). ``problem.num_operators`` is also given explicitly (the preset's value) so
#: that the run folders carry a variant part (``.../mode=inference/num_operators=4/gpus=N``), which the
#: layout, resume and lock tests read.
TINY_2D = ["scale=tiny", "problem.num_operators=4"]

#: The 3D volume at a size that runs in seconds: ``scale=tiny`` (16³, window 8 + 2*4 = 16, a multiple of 8).
TINY_3D = ["problem=3d", "scale=tiny"]


def run_cli(
    *args: str, root: Path, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m pnpscale ARGS output.root=ROOT`` in a subprocess (cwd ``root``)."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR")
    cmd = [sys.executable, "-m", "pnpscale", *args, f"output.root={root / 'outputs'}"]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_dirs(root: Path) -> list[Path]:
    """Every folder under ``root/outputs`` holding a run.json, sorted."""
    return sorted(p.parent for p in (root / "outputs").glob("**/run.json"))


def read_run(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a test's own process group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """One rank of a test's gloo group (deepinv's ``DistributedContext`` joins it): 1 thread, the
    torch.distributed variables set, a process group when ``world > 1`` (one rank: none, and RANK /
    WORLD_SIZE hidden so deepinv runs undistributed); everything undone on exit."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    hidden = {} if world > 1 else {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE")}
    try:
        yield
    finally:
        os.environ.update(hidden)
        if world > 1:
            dist.destroy_process_group()


def rank_results(rank_fn, tmp_path_factory, worlds=(1, 2, 3, 4, 5)) -> dict:
    """Run ``rank_fn(rank, world, port, out_dir)`` on every world size of ``worlds`` (fork-started gloo
    ranks; each rank saves ``rank<r>.pt`` into ``out_dir``) and load the results: world size -> [rank 0, ...]."""
    import torch
    import torch.multiprocessing as mp

    out = {}
    for world in worlds:
        d = tmp_path_factory.mktemp(f"w{world}")
        mp.start_processes(rank_fn, args=(world, free_port(), str(d)), nprocs=world, start_method="fork")
        out[world] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    return out


def rel_error(a, b) -> float:
    """``|a - b| / |b|`` (Frobenius norms) of two tensors."""
    return float((a - b).norm() / b.norm())
