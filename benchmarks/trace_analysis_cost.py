"""Offline trace analysis cost: ``python -m pnpscale.analyze`` vs HTA 0.5, side by side on the same traces.

Generates (once, with :mod:`kineto_gen` next to this file) ``--ranks`` synthetic Kineto traces of about
``--target-mb`` MB of JSON each, gzip, of a distributed PnP job on H100s (``gradient``/``denoiser``
sections, NCCL all_reduce kernels with their CPU descriptors, cudnn kernels, runtime launches, flows:
Kineto's layout, about 0.3 KB per event), then runs, alternately for ``--rounds`` rounds, each in its
own process tree:

* pnpscale: ``python -m pnpscale.analyze DIR --sections gradient,denoiser`` (compute / transfer / wait);
* HTA 0.5: ``TraceAnalysis(trace_dir=DIR)`` + ``get_comm_comp_overlap()`` + ``get_temporal_breakdown()``
  with the Python given by ``--hta-python`` (HolisticTraceAnalysis 0.5 pulls jupyterlab and plotly: keep
  it in its own virtual environment, ``python3 -m venv /tmp/hta && /tmp/hta/bin/pip install
  HolisticTraceAnalysis==0.5.0``).

Each run's wall time and peak memory (the largest sum of PSS over the command's process tree, sampled
every 0.2 s from ``/proc/PID/smaps_rollup``) are printed, then the medians and pnpscale's ratios to HTA.
The load average before and after is printed too (the machine may be shared). The tools answer
different questions (HTA: overlap of communication with compute; pnpscale: compute / transfer / wait
per section), so this compares cost, not numbers.

    python benchmarks/trace_analysis_cost.py --traces /tmp/w8 --ranks 8 --target-mb 200 --rounds 3 \\
        --hta-python /tmp/hta/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HTA_SNIPPET = (
    "import sys; from hta.trace_analysis import TraceAnalysis; a = TraceAnalysis(trace_dir=sys.argv[1]); "
    "o = a.get_comm_comp_overlap(visualize=False); b = a.get_temporal_breakdown(visualize=False); "
    "print(o.to_string()); print(b.to_string())"
)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def tree_pss(pid: int) -> int:
    """Sum of PSS (bytes) over ``pid`` and its descendants (Linux ``smaps_rollup``)."""
    todo, total = [pid], 0
    while todo:
        p = todo.pop()
        todo += _children(p)
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
        except OSError:
            pass
    return total


def run(cmd: list[str]) -> tuple[float, int, int, str]:
    """(wall seconds, peak summed PSS in bytes, return code, output tail) of ``cmd``."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_pss(p.pid))
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = p.communicate()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    return wall, peak[0], p.returncode, out[-1500:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", type=Path, required=True, help="trace folder (generated when absent)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--target-mb", type=float, default=200, help="MB of JSON per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hta-python", default=None, help="a Python with HolisticTraceAnalysis 0.5 installed")
    a = p.parse_args()
    if not a.traces.is_dir():
        gen = [sys.executable, str(HERE / "kineto_gen.py"), "--out", str(a.traces), "--ranks", str(a.ranks)]
        subprocess.run([*gen, "--target-mb", str(a.target_mb), "--gz"], check=True)
    files = sorted(f for f in a.traces.iterdir() if f.name.endswith((".json", ".json.gz")))
    disk = sum(f.stat().st_size for f in files)
    print(f"{len(files)} traces in {a.traces}, {disk / 1e6:.0f} MB on disk; {os.cpu_count()} CPUs")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        cmds = {
            "pnpscale": [
                sys.executable,
                "-m",
                "pnpscale.analyze",
                str(a.traces),
                "--sections",
                "gradient,denoiser",
                "--out",
                str(Path(tmp) / "analysis"),
            ],  # fmt: skip
        }
        if a.hta_python:
            cmds["hta"] = [a.hta_python, "-c", HTA_SNIPPET, str(a.traces)]
        res: dict[str, list[tuple[float, int]]] = {k: [] for k in cmds}
        for r in range(a.rounds):
            for label, cmd in cmds.items():
                wall, pss, rc, tail = run(cmd)
                print(f"round {r} {label:9s} wall {wall:7.1f} s  peak PSS {pss / 1e9:6.3f} GB  rc {rc}", flush=True)
                if rc:
                    print(tail)
                    raise SystemExit(f"{label} failed")
                res[label].append((wall, pss))
    print(f"load average after: {os.getloadavg()}")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(m for _, m in v)) for k, v in res.items()}
    for label, (w, m) in med.items():
        line = f"median {label:9s} wall {w:7.1f} s  peak PSS {m / 1e9:6.3f} GB"
        if label != "hta" and "hta" in med:
            line += f"  ({w / med['hta'][0]:.3f}x HTA time, {m / med['hta'][1]:.3f}x HTA memory)"
        print(line)


if __name__ == "__main__":
    main()
