"""Launch overhead per run: how long a sweep point spends outside its measured iterations.

Runs ``python -m pnpscale`` as a user would, on a tiny problem at several rank counts, and prints
from each ``run.json``: launch (elastic spawn until the rank function starts: interpreter, torch
import), init (process group, deepinv import), setup (problem and solver), measure (the profiled
iterations), and the command's whole wall time (Hydra, the parent's imports, teardown included).

    python benchmarks/launch_overhead.py [--gpus 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["scale=small", "problem.image_size=32", "problem.num_operators=4", "problem.patch_size=8",
        "problem.overlap=4", "problem.nc=[4,8,8,8]", "problem.nb=1", "iterations=2", "warmup=1"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2,4")
    a = p.parse_args()
    head = ("gpus", "launch s", "init s", "setup s", "measure s", "wall s", "outside measure")
    print("{:>4s} {:>9s} {:>7s} {:>8s} {:>10s} {:>7s} {:>16s}".format(*head))
    for g in [int(x) for x in a.gpus.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "pnpscale", f"gpus={g}", *TINY, f"output.root={tmp}"],
                           check=True, capture_output=True)  # fmt: skip
            wall = time.perf_counter() - t0
            (run,) = Path(tmp).glob("**/run.json")
            t = json.loads(run.read_text())["timings"]
        outside = 1 - t["measure_s"] / wall
        print(
            f"{g:4d} {t['launch_s']:9.2f} {t['init_s']:7.2f} {t['setup_s']:8.2f} {t['measure_s']:10.3f} {wall:7.2f} "
            f"{outside:16.1%}"
        )


if __name__ == "__main__":
    main()
