"""Launch overhead per run: how long a sweep point spends outside its measured iterations.

Runs one sweep ``python -m pnpscale -m gpus=G1,G2,... iterations=2,3`` as a user would, on a tiny
problem, and prints from each point's ``run.json``: launch (elastic start until the rank function
runs), init (process group, deepinv context), setup (problem and solver), measure (the profiled
iterations), their sum (fixed), and the point's wall time (from its start to the next point's start:
teardown and Hydra's work between points included) minus measure (outside). Ranks are forked by a
forkserver that imported torch and the ranks' other CUDA-free modules once (not deepinv: each rank
imports it; :func:`pnpscale.cluster.local.rank_start_method`) and
lives for the whole sweep: the first point pays for the server's start and imports ("cold"), the later
ones do not ("warm"). Also printed: the sweep's
wall time (Hydra, the parent's imports and teardown included) and its average per point.

    python benchmarks/launch_overhead.py [--gpus 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

TINY = ["scale=small", "problem.image_size=32", "problem.num_operators=4", "problem.patch_size=8",
        "problem.overlap=4", "problem.nc=[4,8,8,8]", "problem.nb=1", "warmup=1"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2,4")
    a = p.parse_args()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pnpscale", "-m", f"gpus={a.gpus}", "iterations=2,3", *TINY, f"output.root={tmp}",
               "hydra.sweep.subdir=g${gpus}_it${iterations}"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        runs = [json.loads(f.read_text()) for f in Path(tmp).glob("**/run.json")]
    runs.sort(key=lambda r: r["started_at"])
    print(f"load average after: {os.getloadavg()}")
    head = ("point", "gpus", "launch s", "init s", "setup s", "measure s", "fixed s", "point wall s", "outside")
    print("{:>5s} {:>4s} {:>9s} {:>7s} {:>8s} {:>10s} {:>8s} {:>12s} {:>8s}".format(*head))
    for i, r in enumerate(runs):
        t = r["timings"]
        fixed = t["launch_s"] + t["init_s"] + t["setup_s"]
        # started_at (before the launch) to the next point's, or to finished_at for the last point
        end = runs[i + 1]["started_at"] if i + 1 < len(runs) else r["finished_at"]
        point = (datetime.fromisoformat(end) - datetime.fromisoformat(r["started_at"])).total_seconds()
        tag = "cold" if i == 0 else "warm"
        print(
            f"{tag:>5s} {r['gpus']:4d} {t['launch_s']:9.2f} {t['init_s']:7.2f} {t['setup_s']:8.2f} "
            f"{t['measure_s']:10.3f} {fixed:8.2f} {point:12.2f} {point - t['measure_s']:8.2f}"
        )
    print(
        f"sweep wall {wall:.1f} s for {len(runs)} points: {wall / len(runs):.2f} s per point (Hydra, teardown included)"
    )


if __name__ == "__main__":
    main()
