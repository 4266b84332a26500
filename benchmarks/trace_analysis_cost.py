"""Offline trace analysis cost: ``python -m pnpscale.analyze`` vs HTA 0.5, on the same traces.

Writes ``--ranks`` synthetic Kineto traces (gzip JSON, the layout of real NCCL traces: per
iteration a ``gradient`` and a ``denoiser`` section, ``--kernels`` compute kernels each launched by
``cudaLaunchKernel`` with its correlation id, and one ``ncclDevKernel_AllReduce`` whose duration
depends on the rank), then times, each in its own process, with its peak resident memory:

* pnpscale: ``python -m pnpscale.analyze DIR --sections gradient,denoiser`` (streams the traces);
* HTA: ``TraceAnalysis(trace_dir=DIR).get_comm_comp_overlap()`` with the Python given by
  ``--hta-python`` (HolisticTraceAnalysis 0.5 pulls jupyterlab and plotly: keep it in its own
  virtual environment, e.g. ``python -m venv /tmp/hta && /tmp/hta/bin/pip install HolisticTraceAnalysis==0.5.0``).

They answer different questions (HTA: the share of communication time overlapped by compute; pnpscale:
compute / transfer / wait per section), so this compares cost, not numbers.

    python benchmarks/trace_analysis_cost.py --ranks 4 --iterations 20 --kernels 2000 [--hta-python /tmp/hta/bin/python]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HTA_SNIPPET = (
    "import sys; from hta.trace_analysis import TraceAnalysis; "
    "a = TraceAnalysis(trace_dir=sys.argv[1]); print(a.get_comm_comp_overlap())"
)


def write_trace(path: Path, rank: int, world: int, iterations: int, kernels: int) -> int:
    """One rank's trace; returns its event count. Times in µs as Kineto writes them."""
    ev: list[dict] = []
    pid, tid, stream = 1000 + rank, 1000 + rank, 7
    corr = 1
    t = 1_000_000.0
    for it in range(iterations):
        step_start = t
        for name, comm_us in (("gradient", 200.0), ("denoiser", 2000.0)):
            start = t
            gpu_t = t + 5
            for _ in range(kernels):
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                           "ts": t, "dur": 2.0, "args": {"correlation": corr, "External id": corr}})  # fmt: skip
                ev.append({"ph": "X", "cat": "kernel", "name": "void conv_kernel<float>()", "pid": 0, "tid": stream,
                           "ts": gpu_t, "dur": 3.0, "args": {"correlation": corr, "External id": corr,
                                                              "device": 0, "stream": stream}})  # fmt: skip
                corr += 1
                t += 2.5
                gpu_t += 3.5
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid, "ts": t,
                       "dur": 2.0, "args": {"correlation": corr, "External id": corr}})  # fmt: skip
            dur = comm_us * (1 + 0.3 * (world - 1 - rank) / max(1, world - 1))
            ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)",
                       "pid": 0, "tid": stream, "ts": max(gpu_t, t + 3), "dur": dur,
                       "args": {"correlation": corr, "External id": corr, "device": 0, "stream": stream}})  # fmt: skip
            corr += 1
            end = max(gpu_t, t + 3) + dur + 2
            ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": pid, "tid": tid, "ts": start,
                       "dur": end - start})  # fmt: skip
            t = end + 10
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{it}", "pid": pid, "tid": tid,
                   "ts": step_start, "dur": t - step_start})  # fmt: skip
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
           "traceEvents": ev}  # fmt: skip
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return len(ev)


_WRAP = (
    "import resource, subprocess, sys, time; t = time.perf_counter(); "
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode); "
    "sys.stderr.write(p.stderr[-2000:] if p.returncode else '')"
)


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, peak RSS (MiB) and return code of ``cmd``, measured by a fresh wrapper process."""
    proc = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True)
    if proc.stderr:
        print(proc.stderr, file=sys.stderr)
    wall, rss_kib, rc = proc.stdout.split()[-3:]
    return float(wall), int(rss_kib) / 1024, int(rc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--kernels", type=int, default=2000, help="compute kernels per section")
    p.add_argument("--hta-python", default=None, help="a Python with HolisticTraceAnalysis 0.5 installed")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "traces"
        d.mkdir()
        n = sum(write_trace(d / f"rank-{r}.json.gz", r, a.ranks, a.iterations, a.kernels) for r in range(a.ranks))
        size = sum(f.stat().st_size for f in d.iterdir()) / 2**20
        print(f"{a.ranks} ranks x {a.iterations} iterations, {n} events, {size:.1f} MiB gzip")
        print(f"{'tool':42s} {'wall s':>8s} {'peak RSS MiB':>13s}")
        out = Path(tmp) / "analysis"
        cmd = [sys.executable, "-m", "pnpscale.analyze", str(d), "--sections", "gradient,denoiser", "--out", str(out)]
        wall, rss, rc = timed(cmd)
        print(
            f"{'pnpscale.analyze (compute/transfer/wait)':42s} {wall:8.2f} {rss:13.0f}" + ("" if rc == 0 else " FAILED")
        )
        if a.hta_python:
            wall, rss, rc = timed([a.hta_python, "-c", HTA_SNIPPET, str(d)])
            print(f"{'HTA 0.5 get_comm_comp_overlap':42s} {wall:8.2f} {rss:13.0f}" + ("" if rc == 0 else " FAILED"))
        else:
            print("HTA: not run (pass --hta-python)")


if __name__ == "__main__":
    main()
