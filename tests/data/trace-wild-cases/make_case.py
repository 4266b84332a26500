"""Minimal synthetic Kineto traces for the holdout FAILs (a copy of ../shared/cases/traces-set4, formatted)."""

import json
import os
import sys

out = sys.argv[1]


def rt(corr, ts, tid=1):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": 1,
        "args": {"correlation": corr},
    }


def k(name, corr, ts, dur, stream=7):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr, "stream": stream, "device": 0},
    }


def ua(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def write(d, rank, ws, ev):
    os.makedirs(d, exist_ok=True)
    ev = ev + [
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": "Spans",
            "tid": "PyTorch Profiler",
            "ts": 1000,
            "dur": 10000,
        },
        {"ph": "i", "s": "t", "name": "Record Window End", "pid": "", "tid": "", "ts": 12000},
    ]
    json.dump(
        {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": ws}, "traceEvents": ev},
        open(f"{d}/rank{rank}.json", "w"),
    )


B = 1_000_000
# A: timeline: GPU starts 50 us after the CPU range; the NCCL kernel is the last GPU work.
ev = [
    ua("ProfilerStep#1", B, 100),
    rt(1, B + 10),
    k("void compute_kernel(float*)", 1, B + 50, 30),
    rt(2, B + 20),
    k("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 2, B + 80, 10),
]
write(f"{out}/timeline", 0, 1, ev)
# B: symmetric-memory kernel label
ev = [
    ua("ProfilerStep#1", B, 100),
    rt(1, B + 10),
    k("void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*)", 1, B + 20, 10),
]
write(f"{out}/symm", 0, 1, ev)


# C: two ranks, nccl:* descriptors on two threads, SendRecv kernels, issue order differs between ranks
def rank_c(rank, order):
    ev = [ua("ProfilerStep#1", B, 1000)]
    t = B + 10
    g = B + 100
    corr = 10
    for name, tid, dur in order:
        ev += [
            ua(f"nccl:{name}", t, 20, tid=tid),
            rt(corr, t + 5, tid=tid),
            k("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", corr, g, dur),
        ]
        t += 100
        g += dur + 50
        corr += 1
    return ev


write(f"{out}/order", 0, 2, rank_c(0, [("all_to_all", 2, 100), ("all_reduce", 3, 10)]))
write(f"{out}/order", 1, 2, rank_c(1, [("all_reduce", 3, 10), ("all_to_all", 2, 100)]))
# D: a trailing ProfilerStep without GPU work (the step Kineto opens at the last prof.step())
ev = [
    ua("ProfilerStep#1", B, 100),
    rt(1, B + 10),
    k("void compute_kernel(float*)", 1, B + 20, 60),
    ua("ProfilerStep#2", B + 200, 5),
]
write(f"{out}/emptystep", 0, 1, ev)
