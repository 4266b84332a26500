"""Kineto traces of a distributed job with a known decomposition (test support, not part of the package).

:func:`simulate` runs a small job of blocking collectives (one at a time per rank, never overlapping the
rank's compute) in global time and writes one trace per rank in the layout torch.profiler writes:

* **CUDA/NCCL**: per section a ``user_annotation`` range on the main thread; each compute kernel launched
  from an ``aten::*`` ``cpu_op`` through ``cudaLaunchKernel`` (``cuda_runtime``, ``correlation``,
  ``External id``) onto the compute stream; each collective as ``record_param_comms`` (``Collective
  name``, ``In msg nelems``, ``Out msg nelems``, ``dtype``, ``Group size``, ``Process Group Name``,
  ``Seq``) around an ``nccl:<op>`` range around its launch, its kernel (``ncclDevKernel_*`` / ``ncclKernel_*``
  / ``ncclDevKernel_Generic``, with the same NCCL args) on the communication stream; a
  ``cudaDeviceSynchronize`` closing each section; optional ``ProfilerStep#N`` ranges;
* **CPU/gloo**: per section the range on the main thread, ``aten::*`` ranges for compute,
  ``record_param_comms`` on the main thread and the ``gloo:<op>`` work range (``Input Dims``, ``Input
  type``) on a gloo worker thread from the rank's arrival to the collective's exit.

With ``Spec.orders`` a CUDA section's collectives run together instead (one process group and stream each,
issued in another order on each rank, kernels whose names do not say their type): matched only by the
descriptors' type and ``(process group, Seq)``. With ``Spec.tails`` the CUDA sections are asynchronous (no
synchronisation at their end) and a last kernel on another stream may run into the next section: the truth
clips the section there, as the analysis must. Every file ends with Kineto's last event (``Record Window End``).

Both carry ``distributedInfo`` (backend, rank, world_size, pg_config, nccl_version), ``deviceProperties``
(CUDA), and ``ts``/``dur`` in microseconds with 3 decimals (or integers), relative to
``baseTimeNanoseconds`` or absolute. Each rank has its own clock (``rank_skew_ns``) and, on CUDA, a GPU
clock behind its CPU's (``gpu_lag_ns``); kernels start after their launch.

The truth (:class:`Truth`) holds each collective's arrivals ``A_rc`` and exit ``X_c`` and each rank's
section time ``S_r`` (CPU: the range; CUDA: first GPU start to last GPU end of the work launched inside,
the GPU span a foreign trace is read with). :func:`expected` turns it into the study's decomposition;
it is kept apart so that other rules (overlapped communication) can be added beside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: c10d name, nccl:* range, kernel names (>= 2.19, < 2.19) per collective type
OPS: dict[str, tuple[str, str, str, str]] = {
    "all_reduce": ("allreduce", "nccl:all_reduce", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                   "ncclKernel_AllReduce_RING_LL_Sum_float"),
    "broadcast": ("broadcast", "nccl:broadcast", "ncclDevKernel_Broadcast_RING_LL",
                  "ncclKernel_Broadcast_RING_LL_Sum_int8_t"),
    "all_gather": ("_allgather_base", "nccl:_all_gather_base", "ncclDevKernel_AllGather_RING_LL",
                   "ncclKernel_AllGather_RING_LL_Sum_int8_t"),
    "reduce_scatter": ("_reduce_scatter_base", "nccl:_reduce_scatter_base",
                       "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "ncclKernel_ReduceScatter_RING_LL_Sum_float"),
    "all_to_all": ("all_to_all", "nccl:all_to_all", "ncclDevKernel_SendRecv",
                   "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t"),
}  # fmt: skip
DTYPES = {"Float": ("float", 4, "f32"), "Half": ("c10::Half", 2, "f16"), "BFloat16": ("c10::BFloat16", 2, "bf16")}
KERNEL_ARGS = "(ncclDevKernelArgsStorage<4096ul>)"
OLD_ARGS = "(ncclDevComm*, unsigned long, ncclWork*)"
GENERIC = "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"
BASE_NS = 1_790_000_000_000_000_000
ABSOLUTE_NS = 1_790_000_000_000_000_000  # the first event of an absolute trace, ns since the epoch
MAIN_TID, GLOO_TID, COMPUTE_STREAM, COMM_STREAM, TAIL_STREAM = 1001, 2002, 7, 20, 8


@dataclass(frozen=True)
class Coll:
    """One collective of the job: type, elements, dtype, and ``transfer_ns`` once the last rank arrived."""

    op: str
    nelems: int
    dtype: str
    transfer_ns: int


@dataclass(frozen=True)
class Spec:
    """A job. Times in ns.

    Attributes:
        backend: ``"nccl"`` or ``"gloo"``. world: ranks. sections: section names, in order.
        plan: ``plan[i][s]``: the collectives of section ``s`` in iteration ``i`` (the same on every rank).
        work: ``work[r][i][s]``: the rank's compute before each collective and after the last
            (``len(plan[i][s]) + 1`` values). kernels: ``kernels[r][i][s][k]``: compute kernels that fill
            segment ``k`` (CUDA; 0 only for an empty segment). gap: ``gap[r][i][s]``: the rank's CPU time
            before the section (entry skew). rank_skew_ns, gpu_lag_ns: per rank.
        names: kernel names ``"dev"`` (NCCL >= 2.19), ``"old"`` (< 2.19) or ``"generic"``.
        time_base: ``"base"`` (``baseTimeNanoseconds``) or ``"absolute"``. integer_ts: integer microseconds.
        steps: ``ProfilerStep#N`` ranges around each iteration, N from ``first_step``.
        memcpy: the first piece of each compute segment is a ``gpu_memcpy`` (``cudaMemcpyAsync``).
        orders: ``orders[r][i][s]``: CUDA only; a permutation of the section's collectives (``()``: issued one
            at a time, blocking, as above). Given, the section's collectives run **together**: after segment
            0's compute the rank issues all of them, in its own order, each in its own process group (``"1"``,
            ``"2"``... by position in the plan, with its own ``Seq``) on that group's stream, whose id the rank
            gives at the group's first use (so ranks that issue in another order number the streams
            differently); the kernels' names do not say their type (``ncclDevKernel_Generic``, or
            ``ncclDevKernel_SendRecv`` / ``ncclKernel_SendRecv_*`` for all_to_all); the compute stream waits
            for all of them, then runs segments 1.. . Only the descriptors' type and ``(group, Seq)`` match
            them across ranks.
        tails: ``tails[r][i][s]``: CUDA only, not with ``orders``; given, the sections are **asynchronous**: no
            ``cudaDeviceSynchronize`` at their end (the CPU runs on while the GPU works, the compute stream's
            work queues across sections), and a section with a tail launches last a kernel of that many ns on
            another stream (``TAIL_STREAM``) after its work, which may run past the next section's first GPU
            start: that section's time is then clipped there (the truth: ``S = next first GPU start - first GPU
            start``; ``Truth.clipped`` counts them per rank). A tail shorter than the next section's first
            compute segment ends before the next section's first collective (the generator's strategy draws
            it so), so the next section's numbers are unchanged by it.
    """

    backend: str
    world: int
    sections: tuple[str, ...]
    plan: tuple[tuple[tuple[Coll, ...], ...], ...]
    work: tuple
    kernels: tuple
    gap: tuple
    rank_skew_ns: tuple[int, ...]
    gpu_lag_ns: tuple[int, ...]
    names: str = "dev"
    time_base: str = "base"
    integer_ts: bool = False
    steps: bool = False
    first_step: int = 1
    memcpy: bool = False
    orders: tuple = ()
    tails: tuple = ()

    def order(self, r: int, i: int, s: int) -> tuple[int, ...]:
        """The issue order of section ``s`` of iteration ``i`` on rank ``r`` (``()``: one at a time)."""
        return tuple(self.orders[r][i][s]) if self.orders else ()

    @property
    def iterations(self) -> int:
        return len(self.plan)

    @property
    def tick(self) -> int:
        """The time quantum: 1000 ns with integer microseconds, else 1 ns."""
        return 1000 if self.integer_ts else 1


@dataclass
class Truth:
    """What the job did, per (iteration, section): ``arrive[c][r]``, ``exit[c]``, ``section[r]`` (ns); the keys
    whose collectives ran together (``together``: no compute while any is in flight)."""

    arrive: dict[tuple[int, str], list[list[int]]] = field(default_factory=dict)
    exit: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    section: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    colls: dict[tuple[int, str], tuple[Coll, ...]] = field(default_factory=dict)
    together: set[tuple[int, str]] = field(default_factory=set)
    clipped: dict[int, int] = field(default_factory=dict)


@dataclass
class Job:
    """A simulated job: one list of events and its top-level keys per rank, and the truth."""

    spec: Spec
    events: dict[int, list[dict]]
    meta: dict[int, dict]
    truth: Truth


def expected(truth: Truth) -> dict[tuple[int, str], tuple[float, float, float]]:
    """The study's decomposition of blocking collectives, per (iteration, section), in ns.

    With ``D_rc = X_c - A_rc`` (the rank's time in collective c: from its arrival to the common exit),
    ``T = sum_c min_r D_rc`` (the last rank to arrive waits for nobody: the collective's own time),
    ``W = mean_r sum_c (D_rc - min_r D_rc)``, ``C = mean_r S_r - T - W``.

    Collectives that ran together (``truth.together``; every rank blocked, no compute, from its first
    arrival to the last exit) follow the rule of overlapped communication: each instant of a rank's union
    of ``[A_rc, X_c)`` belongs to the collective in flight that ends first (``b_rc``); of it, the part in
    ``[X_c - t_c, X_c)`` with ``t_c = min_r D_rc`` is transfer, the rest wait (for collectives one at a
    time this is the rule above).
    """
    out = {}
    for key, sec in truth.section.items():
        n = len(sec)
        d = [[truth.exit[key][c] - a for a in arr] for c, arr in enumerate(truth.arrive[key])]
        if key in truth.together:
            t, w = _together(truth.arrive[key], truth.exit[key], n)
        else:
            t = sum(min(dc) for dc in d)
            w = sum(sum(x - min(dc) for x in dc) for dc in d) / n
        out[key] = (sum(sec) / n - t - w, float(t), w)
    return out


def _together(arrive: list[list[int]], exits: list[int], n: int) -> tuple[float, float]:
    """(T, W) of collectives in flight together, by brute force over the instants where anything changes."""
    t_c = [min(x - a for a in arr) for arr, x in zip(arrive, exits, strict=True)]
    transfer = wait = 0
    for r in range(n):
        cuts = sorted({arr[r] for arr in arrive} | set(exits))
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            flying = [c for c in range(len(exits)) if arrive[c][r] <= lo and exits[c] >= hi]
            if not flying:
                continue
            c = min(flying, key=lambda c: exits[c])  # the generator makes exits distinct
            inside = max(0, hi - max(lo, exits[c] - t_c[c]))
            transfer += inside
            wait += hi - lo - inside
    return transfer / n, wait / n


def _kernel_name(spec: Spec, c: Coll) -> str:
    if spec.names == "generic":
        return GENERIC
    dev, old = OPS[c.op][2], OPS[c.op][3]
    if spec.names == "old":
        return old + OLD_ARGS
    return dev.replace("_f32_", f"_{DTYPES[c.dtype][2]}_") + KERNEL_ARGS


def simulate(spec: Spec) -> Job:
    """Run the job in global time and write each rank's events (see module doc)."""
    u = spec.tick
    cuda = spec.backend == "nccl"
    ev: dict[int, list[dict]] = {r: [] for r in range(spec.world)}
    truth = Truth()
    corr = {r: 1 for r in range(spec.world)}
    ext = {r: 1 for r in range(spec.world)}
    seq = {r: 0 for r in range(spec.world)}
    pg_seq: dict[int, dict[str, int]] = {r: {} for r in range(spec.world)}
    pg_stream: dict[int, dict[str, int]] = {r: {} for r in range(spec.world)}  # given at a group's first use
    stream7 = {r: 0 for r in range(spec.world)}  # asynchronous sections: the compute stream's time, carried over
    spans: dict[int, list[tuple[tuple[int, str], int, int]]] = {r: [] for r in range(spec.world)}
    assert not (spec.tails and spec.orders), "tails and orders do not combine"
    now = 10_000_000  # global time every rank leaves the previous barrier (ns)

    def cpu(r: int, name: str, cat: str, start: int, end: int, tid: int = MAIN_TID, **args: Any) -> None:
        ev[r].append({"ph": "X", "cat": cat, "name": name, "pid": 100 + r, "tid": tid,
                      "ts": start + spec.rank_skew_ns[r], "dur": end - start, "args": args})  # fmt: skip

    def gpu(r: int, name: str, start: int, end: int, stream: int, c: int, cat: str = "kernel", **args: Any) -> None:
        t = start + spec.rank_skew_ns[r] + spec.gpu_lag_ns[r]
        ev[r].append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": t, "dur": end - start,
                      "args": {"External id": c, "device": 0, "stream": stream, "correlation": c, "grid": [1, 1, 1],
                               "block": [128, 1, 1], **args}})  # fmt: skip

    def launch(r: int, at: int, name: str = "cudaLaunchKernel") -> int:
        c = corr[r]
        corr[r] += 1
        cpu(r, name, "cuda_runtime", at, at + 2 * u, correlation=c, cbid=211, **{"External id": ext[r]})
        return c

    def compute(r: int, i: int, s: int, k: int, t: int) -> tuple[list[tuple[int, int]], int]:
        """Launch segment k's compute kernels from ``t``: ((launch, correlation) per kernel, the CPU time after)."""
        seg = []
        for j in range(spec.kernels[r][i][s][k]):
            copy = spec.memcpy and j == 0
            cpu(r, "aten::copy_" if copy else "aten::mul", "cpu_op", t, t + 4 * u, **{"External id": ext[r]})
            seg.append((t + u, launch(r, t + u, "cudaMemcpyAsync" if copy else "cudaLaunchKernel")))
            ext[r] += 1
            t += 5 * u
        return seg, t

    def run(r: int, i: int, s: int, k: int, seg: list[tuple[int, int]], at: int) -> int:
        """Run segment k's kernels on the compute stream from ``at``; returns the stream's time after."""
        w = spec.work[r][i][s][k]
        for j, (t, cid) in enumerate(seg):
            begin = max(at, t + u)
            dur = w // len(seg) + (w % len(seg) if j == len(seg) - 1 else 0)
            if spec.memcpy and j == 0:
                gpu(r, "Memcpy DtoD (Device -> Device)", begin, begin + dur, COMPUTE_STREAM, cid,
                    cat="gpu_memcpy", bytes=4096, **{"memory bandwidth (GB/s)": 512.0})  # fmt: skip
            else:
                gpu(r, "void at::native::vectorized_elementwise_kernel<4>", begin, begin + dur, COMPUTE_STREAM, cid)
            at = begin + dur
        return at

    def together(i: int, s: int, name: str, colls: tuple[Coll, ...], starts: dict[int, int]) -> None:
        """A CUDA section whose collectives run together, issued in each rank's order (see Spec.orders)."""
        key = (i, name)
        entry: dict[int, int] = {}
        issued: dict[int, dict[int, tuple[int, int, str, int, int]]] = {}
        after: dict[int, tuple] = {}
        first: dict[int, int] = {}
        for r in range(spec.world):
            entry[r] = starts[r] + spec.gap[r][i][s]
            seg0, t = compute(r, i, s, 0, entry[r] + u)
            issued[r] = {}
            for c in spec.order(r, i, s):
                pg = str(c + 1)
                sq = pg_seq[r].get(pg, 0)
                pg_seq[r][pg] = sq + 1
                stream = pg_stream[r].setdefault(pg, COMM_STREAM + 1 + len(pg_stream[r]))
                desc: dict[str, Any] = {"Collective name": OPS[colls[c].op][0], "In msg nelems": colls[c].nelems,
                        "Out msg nelems": colls[c].nelems * (spec.world if colls[c].op == "all_gather" else 1),
                        "dtype": colls[c].dtype, "Group size": spec.world, "Process Group Name": pg,
                        "Process Group Description": f"group_{pg}", "Seq": sq, "External id": ext[r]}  # fmt: skip
                cpu(r, "record_param_comms", "cpu_op", t, t + 5 * u, **desc)
                cpu(r, OPS[colls[c].op][1], "user_annotation", t + u, t + 4 * u)
                issued[r][c] = (t + 2 * u, launch(r, t + 2 * u), pg, sq, stream)
                ext[r] += 1
                t += 6 * u
            rest = []
            for k in range(1, len(colls) + 1):
                seg, t = compute(r, i, s, k, t)
                rest.append(seg)
            after[r] = (seg0, rest, t)
        cursor = {r: run(r, i, s, 0, after[r][0], entry[r] + 2 * u) for r in range(spec.world)}
        arrive = [[max(cursor[r], issued[r][c][0] + u) for r in range(spec.world)] for c in range(len(colls))]
        exits: list[int] = []
        for c in range(len(colls)):
            x = max(arrive[c]) + colls[c].transfer_ns
            while x in exits:  # distinct ends: which collective a rank waits for is then never a tie
                x += u
            exits.append(x)
        truth.together.add(key)
        sec_times = []
        for r in range(spec.world):
            seg0 = after[r][0]
            starts_gpu = [arrive[c][r] for c in range(len(colls))]
            starts_gpu += [max(entry[r] + 2 * u, seg0[0][0] + u)] if seg0 else []
            first[r] = min(starts_gpu)
            for c in range(len(colls)):
                at, cid, pg, sq, stream = issued[r][c]
                op = colls[c].op
                kname = (OPS[op][2] + KERNEL_ARGS if spec.names != "old" else OPS[op][3] + OLD_ARGS) \
                    if op == "all_to_all" else GENERIC  # fmt: skip
                gpu(r, kname, arrive[c][r], exits[c], stream, cid, **{
                    "Collective name": OPS[op][0], "In msg nelems": colls[c].nelems, "dtype": colls[c].dtype,
                    "Group size": spec.world, "Process Group Name": pg, "Seq": sq})  # fmt: skip
            at = max(exits)
            for k, seg in enumerate(after[r][1], start=1):
                at = run(r, i, s, k, seg, at)
            t_end = after[r][2]
            sync_end = max(t_end + u, at) + u
            cpu(r, "cudaDeviceSynchronize", "cuda_runtime", t_end, sync_end, correlation=corr[r], cbid=165)
            corr[r] += 1
            sec_times.append(at - first[r])
            cpu(r, name, "user_annotation", entry[r], sync_end + u)
            starts[r] = sync_end + u
        truth.arrive[key], truth.exit[key], truth.section[key] = arrive, exits, sec_times

    for i in range(spec.iterations):
        starts = {r: now for r in range(spec.world)}
        for s, name in enumerate(spec.sections):
            colls = spec.plan[i][s]
            key = (i, name)
            truth.colls[key] = colls
            entry: dict[int, int] = {}
            cursor: dict[int, int] = {}
            first_gpu: dict[int, int] = {}
            launches: dict[int, tuple[list[list[tuple[int, int]]], list[tuple[int, int]], int]] = {}
            if cuda and colls and spec.order(0, i, s):
                together(i, s, name, colls, starts)
                continue
            for r in range(spec.world):
                entry[r] = starts[r] + spec.gap[r][i][s]
                t = entry[r] + u
                plan: list[list[tuple[int, int]]] = []  # per segment: (launch time, correlation) of its kernels
                coll_launch: list[tuple[int, int]] = []
                for k in range(len(colls) + 1):
                    seg = []
                    for j in range(spec.kernels[r][i][s][k] if cuda else 0):
                        copy = spec.memcpy and j == 0
                        cpu(
                            r, "aten::copy_" if copy else "aten::mul", "cpu_op", t, t + 4 * u, **{"External id": ext[r]}
                        )
                        seg.append((t + u, launch(r, t + u, "cudaMemcpyAsync" if copy else "cudaLaunchKernel")))
                        ext[r] += 1
                        t += 5 * u
                    plan.append(seg)
                    if k < len(colls):
                        c = colls[k]
                        desc: dict[str, Any] = {"Collective name": OPS[c.op][0], "In msg nelems": c.nelems,
                                "Out msg nelems": c.nelems * (spec.world if c.op == "all_gather" else 1),
                                "dtype": c.dtype, "Group size": spec.world, "Process Group Name": "0",
                                "Process Group Description": "default_pg", "Seq": seq[r],
                                "External id": ext[r]}  # fmt: skip
                        if cuda:
                            cpu(r, "record_param_comms", "cpu_op", t, t + 5 * u, **desc)
                            cpu(r, OPS[c.op][1], "user_annotation", t + u, t + 4 * u)
                            coll_launch.append((t + 2 * u, launch(r, t + 2 * u)))
                            t += 6 * u
                        seq[r] += 1
                        ext[r] += 1
                launches[r] = (plan, coll_launch, t)
            # the GPU (CUDA) or the CPU (gloo) runs the section's work; collectives synchronise the ranks
            arrive: list[list[int]] = []
            exits: list[int] = []
            for r in range(spec.world):
                cursor[r] = max(entry[r] + 2 * u, stream7[r]) if spec.tails else entry[r] + (2 * u if cuda else 0)
            for k in range(len(colls) + 1):
                for r in range(spec.world):
                    w = spec.work[r][i][s][k]
                    if cuda:
                        seg = launches[r][0][k]
                        for j, (at, cid) in enumerate(seg):
                            begin = max(cursor[r], at + u)
                            dur = w // len(seg) + (w % len(seg) if j == len(seg) - 1 else 0)
                            if spec.memcpy and j == 0:
                                gpu(r, "Memcpy DtoD (Device -> Device)", begin, begin + dur, COMPUTE_STREAM, cid,
                                    cat="gpu_memcpy", bytes=4096, **{"memory bandwidth (GB/s)": 512.0})  # fmt: skip
                            else:
                                gpu(r, "void at::native::vectorized_elementwise_kernel<4>", begin, begin + dur,
                                    COMPUTE_STREAM, cid)  # fmt: skip
                            first_gpu.setdefault(r, begin)
                            cursor[r] = begin + dur
                    else:
                        if w:
                            cpu(r, "aten::mul", "cpu_op", cursor[r], cursor[r] + w)
                        cursor[r] += w
                if k == len(colls):
                    break
                c = colls[k]
                arr = []
                for r in range(spec.world):
                    a = max(cursor[r], launches[r][1][k][0] + u) if cuda else cursor[r]
                    arr.append(a)
                x = max(arr) + c.transfer_ns
                for r in range(spec.world):
                    if cuda:
                        corr_id = launches[r][1][k][1]
                        kdesc: dict[str, Any] = {"Collective name": OPS[c.op][0], "In msg nelems": c.nelems,
                                "dtype": c.dtype, "Group size": spec.world, "Process Group Name": "0",
                                "Seq": seq[r] - len(colls) + k}  # fmt: skip
                        gpu(r, _kernel_name(spec, c), arr[r], x, COMM_STREAM, corr_id, **kdesc)
                        first_gpu.setdefault(r, arr[r])
                    else:
                        size = c.nelems
                        gdesc: dict[str, Any] = {
                            "Collective name": OPS[c.op][0], "In msg nelems": size, "dtype": c.dtype,
                            "Process Group Name": "0", "Seq": seq[r] - len(colls) + k}  # fmt: skip
                        cpu(r, "record_param_comms", "cpu_op", arr[r], arr[r] + u, **gdesc)
                        cpu(r, "gloo:" + c.op, "user_annotation", arr[r], x, tid=GLOO_TID + r,
                            **{"Input Dims": [[size]], "Input type": [DTYPES[c.dtype][0]]})  # fmt: skip
                    cursor[r] = x
                arrive.append(arr)
                exits.append(x)
            sec_times = []
            for r in range(spec.world):
                if spec.tails:
                    t_end = launches[r][2]
                    last = cursor[r]
                    tail = spec.tails[r][i][s]
                    if tail:
                        cpu(r, "aten::mul", "cpu_op", t_end, t_end + 4 * u, **{"External id": ext[r]})
                        cid = launch(r, t_end + u)
                        ext[r] += 1
                        begin = max(cursor[r], t_end + 2 * u)
                        gpu(r, "void at::native::vectorized_elementwise_kernel<4>", begin, begin + tail, TAIL_STREAM,
                            cid)  # fmt: skip
                        last = max(last, begin + tail)
                    end = t_end + 6 * u
                    stream7[r] = cursor[r]
                    spans[r].append((key, first_gpu[r], last))
                    sec_times.append(last - first_gpu[r])
                elif cuda:
                    t_end = launches[r][2]
                    sync_end = max(t_end + u, cursor[r]) + u
                    cpu(r, "cudaDeviceSynchronize", "cuda_runtime", t_end, sync_end, correlation=corr[r], cbid=165)
                    corr[r] += 1
                    end = sync_end + u
                    sec_times.append(cursor[r] - first_gpu[r] if r in first_gpu else 0)
                else:
                    end = cursor[r]
                    sec_times.append(end - entry[r])
                cpu(r, name, "user_annotation", entry[r], end)
                starts[r] = end
            truth.arrive[key], truth.exit[key], truth.section[key] = arrive, exits, sec_times
        # the barrier at the end of the iteration (outside the sections): every rank leaves it together
        done = max(starts.values()) + 3 * u
        for r in range(spec.world):
            if spec.steps:
                cpu(r, f"ProfilerStep#{spec.first_step + i}", "user_annotation", now - u, done - u)
        now = done + 2 * u
    for r in range(spec.world):  # a section's GPU work past the next one's first GPU start is clipped there
        truth.clipped[r] = 0
        for (key, first, last), (_, nfirst, _) in zip(spans[r], spans[r][1:], strict=False):
            if last > nfirst > first:
                truth.section[key][r] = nfirst - first
                truth.clipped[r] += 1
    meta = {}
    for r in range(spec.world):
        d: dict[str, Any] = {"schemaVersion": 1}
        d["distributedInfo"] = {"backend": spec.backend, "rank": r, "world_size": spec.world, "pg_count": 1,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                                               "pg_size": spec.world, "ranks": list(range(spec.world))}]}  # fmt: skip
        if cuda:
            d["distributedInfo"]["nccl_version"] = "2.21.5"
            d["deviceProperties"] = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912}]
        if spec.time_base == "base":
            d["baseTimeNanoseconds"] = BASE_NS
        meta[r] = d
        ev[r].sort(key=lambda e: (e["ts"], -e["dur"]))
        first, last = ev[r][0]["ts"], max(e["ts"] + e["dur"] for e in ev[r])
        # Kineto's span of the profiled window (category Trace, on a "Spans" row)
        ev[r].append({"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                      "tid": "PyTorch Profiler", "ts": first - 1000, "dur": last - first + 2000,
                      "args": {"Op count": 0}})  # fmt: skip
        # Kineto's last event, written when it closes the file (ChromeTraceLogger::finalizeTrace)
        ev[r].append({"ph": "i", "cat": "", "name": "Record Window End", "s": "g", "pid": "", "tid": "",
                      "ts": last + 1000, "args": {}})  # fmt: skip
        ev[r].insert(0, {"ph": "M", "name": "process_name", "pid": 100 + r, "tid": 0, "args": {"name": "python"}})
    return Job(spec, ev, meta, truth)


# --- writing -------------------------------------------------------------------------------------------

_NUM = re.compile(r'"\\u0000(-?[0-9.]+)"')


def us_text(ns: int, integer: bool = False) -> str:
    """Integer ns -> Kineto's microseconds: ``12.345`` (or ``12`` with integer ts, when exact).

    >>> us_text(12345), us_text(-1500), us_text(7000, integer=True)
    ('12.345', '-1.500', '7')
    """
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if integer and ns % 1000 == 0:
        return f"{sign}{ns // 1000}"
    return f"{sign}{ns // 1000}.{ns % 1000:03d}"


def trace_text(job: Job, rank: int, meta_after: bool = False, events: Sequence[dict] | None = None) -> str:
    """The JSON text of one rank's trace, numbers of ``ts``/``dur`` written exactly (see :func:`us_text`).

    ``ts`` is relative to ``baseTimeNanoseconds`` when the spec says so, else absolute (ns since the epoch).
    """
    spec = job.spec
    origin = BASE_NS if spec.time_base == "base" else 0
    shift = 0 if spec.time_base == "base" else ABSOLUTE_NS - BASE_NS
    out = []
    for e in job.events[rank] if events is None else events:
        e = dict(e)
        for key in ("ts", "dur"):
            if isinstance(e.get(key), int):
                v = e[key] + (shift + BASE_NS - origin if key == "ts" else 0)
                e[key] = "\u0000" + us_text(v, spec.integer_ts)
        out.append(e)
    meta = job.meta[rank]
    body = "[\n  " + ",\n  ".join(json.dumps(e) for e in out) + "\n]"  # one event per line, as Kineto writes
    head = json.dumps(meta)[1:-1]
    text = (
        ("{" + '"traceEvents":' + body + "," + head + "}")
        if meta_after
        else ("{" + head + ',"traceEvents":' + body + "}")
    )
    return _NUM.sub(r"\1", text)


def write(
    job: Job,
    folder: Path,
    meta_after: bool = False,
    events: dict[int, list[dict]] | None = None,
    edit: Callable[[int, str], str] | None = None,
) -> list[Path]:
    """One ``rank<r>.json`` per rank in ``folder`` (``events`` in place of the job's; ``edit(rank, text)``
    changes the text before it is written)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in job.events:
        p = folder / f"rank{r}.json"
        text = trace_text(job, r, meta_after, None if events is None else events[r])
        p.write_text(edit(r, text) if edit else text)
        paths.append(p)
    return paths
