"""Test helpers: run the CLI in a subprocess, find run folders, tiny problem overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces" / "hta"

#: A problem small enough for a multi-rank run in a few seconds on 2 CPU cores.
TINY_2D = [
    "scale=small",
    "problem.image_size=32",
    "problem.num_operators=4",
    "problem.patch_size=8",
    "problem.overlap=4",
    "problem.max_batch_size=4",
    "problem.nc=[4,8,8,8]",
    "problem.nb=1",
    "iterations=2",
    "warmup=1",
]


#: The 3D volume at a size that runs in seconds (window 8 + 2*4 = 16, a multiple of 8).
TINY_3D = [
    "problem=3d",
    "scale=small",
    "problem.image_size=16",
    "problem.patch_size=8",
    "problem.overlap=4",
    "problem.nc=[4,8,8,8]",
    "problem.nb=1",
    "iterations=2",
    "warmup=1",
]


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
