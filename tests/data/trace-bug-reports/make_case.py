"""The eight wild-trace cases of set 3 (public bug reports rebuilt as 2-rank Kineto traces), as a function.

A copy of the case generator the cases were handed over with (its README is beside this file):
``build(case)`` returns ``{rank: trace document}``; ``python make_case.py CASE OUTDIR`` writes
``rank0.json``, ``rank1.json``. Layout: 3 iterations, sections ``gradient`` and ``denoiser``, one NCCL
all_reduce per section (``record_param_comms`` + ``nccl:all_reduce`` + the kernel on stream 20).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CASES = ("ref", "ts0", "ts0neg", "oldcats", "xpu", "mtia", "nokernels", "skew", "overlap")
B = 1_790_000_000_000_000_000
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def X(n: str, c: str, ts: int, dur: int, pid: int = 42, tid: int = 42, **a: Any) -> dict:
    return {"ph": "X", "cat": c, "name": n, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": a}


def K(n: str, ts: int, dur: int, corr: int, s: int = 7, **a: Any) -> dict:
    return X(n, "kernel", ts, dur, 0, s, device=0, stream=s, correlation=corr, **a)


def rank(r: int, rt: str = "cuda_runtime") -> list[dict]:
    ev, seq = [], 0
    for it in range(3):
        t, c = 1000 + 1000 * it, 100 * (it + 1)
        for sec, t0, dur, kts, kdur, dts, nts, ndur in (
            ("gradient", t, 150, t + 20, 40 + 10 * r, t + 53, t + 62 + 10 * r, 38 - 10 * r),
            ("denoiser", t + 200, 300, t + 300, 150, t + 440, t + 455, 25),
        ):
            ar = {"Collective name": "allreduce", "In msg nelems": 3072, "dtype": "Float", "Process Group Name": "0",
                  "Seq": seq}  # fmt: skip
            ev += [X(sec, "user_annotation", t0, dur), X("cudaLaunchKernel", rt, t0 + 10, 2.5, correlation=c),
                   K("void compute_kernel", kts, kdur, c), X("record_param_comms", "cpu_op", dts, 5, **ar),
                   X("nccl:all_reduce", "user_annotation", dts + 1, 3),
                   X("cudaLaunchKernel", rt, dts + 2, 2.5, correlation=c + 1),
                   K(NCCL, nts, ndur, c + 1, s=20, **ar)]  # fmt: skip
            c, seq = c + 2, seq + 1
    return ev


def build(case: str) -> dict[int, dict]:
    """``{rank: trace document}`` of one case (see the README beside this file)."""
    if case not in CASES:
        raise ValueError(f"case {case!r}: one of {', '.join(CASES)}")
    docs = {
        r: {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": r, "world_size": 2},
            "baseTimeNanoseconds": B, "traceEvents": rank(r, "mtia_runtime" if case == "mtia" else "cuda_runtime")}
        for r in (0, 1)
    }  # fmt: skip
    evs = {r: docs[r]["traceEvents"] for r in (0, 1)}

    def kern(r: int) -> list[dict]:
        return [e for e in evs[r] if e["cat"] == "kernel"]

    if case in ("ts0", "ts0neg"):  # kineto#109: rank 1, iteration 1, gradient compute kernel at ts 0, dur 0
        k = kern(1)[4]
        k["ts"], k["dur"] = (0 if case == "ts0" else -B // 1000), 0
    if case == "oldcats":  # kineto#109 excerpt: "Kernel"/"Runtime" categories, tid "stream 7"
        for r in (0, 1):
            for e in evs[r]:
                if e["cat"] == "kernel":
                    e["cat"], e["tid"] = "Kernel", f"stream {e['tid']}"
                if e["cat"] == "cuda_runtime":
                    e["cat"] = "Runtime"
    if case == "xpu":  # torch-xpu-ops#5384/#5284
        for r in (0, 1):
            for e in evs[r]:
                if e["cat"] == "cuda_runtime":
                    e["cat"], e["name"] = "xpu_runtime", "urEnqueueKernelLaunch"
                if e["name"] == "nccl:all_reduce":
                    e["name"] = "xccl:all_reduce"
                if e["cat"] == "kernel":
                    e["args"] = {"correlation": e["args"]["correlation"], "device": 0, "sycl queue": 64 + e["tid"]}
                    if e["name"] == NCCL:
                        e["name"] = "oneccl_allreduce_base<float, 2, 16, 1, 1, 2>"
    if case == "mtia":  # HTA#364: runtime category mtia_runtime, GPU 1 ms behind the CPU
        for r in (0, 1):
            for e in kern(r):
                e["ts"] += 1000
    if case == "nokernels":  # kineto#996: every GPU record dropped
        for r in (0, 1):
            evs[r][:] = [e for e in evs[r] if e["cat"] != "kernel"]
    if case == "skew":  # kineto#1082: runtime (hip*) events on another clock, -11 us
        for r in (0, 1):
            for e in evs[r]:
                if e["cat"] == "cuda_runtime":
                    e["ts"] -= 11
    if case == "overlap":  # kineto#990: rank 1's NCCL kernel on the compute stream, starting 10 us early
        for r in (0, 1):
            for i, k in enumerate(kern(r)):
                if k["name"] == NCCL:
                    k["tid"] = k["args"]["stream"] = 7
                if r == 1 and k["name"] == NCCL and i % 4 == 1:
                    k["ts"] -= 12
                    k["dur"] += 12
    return docs


def write(case: str, out: Path) -> list[Path]:
    """Write ``rank0.json``, ``rank1.json`` of ``case`` into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r, doc in build(case).items():
        paths.append(out / f"rank{r}.json")
        paths[-1].write_text(json.dumps(doc, indent=1))
    return paths


if __name__ == "__main__":
    write(sys.argv[1], Path(sys.argv[2]))
