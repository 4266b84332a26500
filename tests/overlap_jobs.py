"""Small 2-rank gloo jobs whose communication overlaps computation, with their own clock as the truth.

Each job profiles a few iterations with ``torch.profiler`` (one session, ``prof.step()`` per iteration),
exports one Kineto trace per rank, and writes ``truth/rank<r>.json``: per section occurrence, the time
the calling thread was blocked on communication as the job measures it itself

* ``blocked_s``: ``time.perf_counter`` around each collective call (explicit ones, and DDP's through a comm
  hook equal to its default) and each ``Work.wait()``. DDP's reducer would wait for its buckets in C++,
  untimed: the hook of the last bucket waits for every bucket in flight itself (timed), so the reducer
  finds them done (the same point of the backward: its last bucket is ready when the gradients are),

plus the section's wall time ``wall_s``. Only wall-clock spans are used: on a virtual machine whose host is
loaded, a running thread loses time to the host (steal time) that schedstat counts neither as on-CPU nor
as queued, so "wall minus on-CPU minus queued" would count it as blocked (seen: 24 % of a compute-only
section). Run as ``python -m tests.overlap_jobs JOB OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

JOBS = (
    "ddp",
    "ddp_default",
    "hidden",
    "concurrent",
    "imbalanced",
    "fsdp",
    "fsdp2",
    "future_wait",
    "pipeline",
    "pipeline_n",
    "prefetch",
)
ITERATIONS = 4


class Clock:
    """Per section occurrence of the calling thread: wall time and the time inside the collective calls and
    waits it timed (``blocked_s``): what the rank spent in communication by its own clock."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._blocked = 0.0
        self._in_flight: list = []

    def section(self, name: str, iteration: int):
        import contextlib

        from torch.profiler import record_function

        @contextlib.contextmanager
        def cm():
            self._blocked = 0.0
            t0 = time.perf_counter()
            with record_function(name):
                yield
            wall = time.perf_counter() - t0
            self.rows.append({"section": name, "iteration": iteration, "wall_s": wall,
                              "blocked_s": min(self._blocked, wall)})  # fmt: skip

        return cm()

    def _timed(self, fn):
        t = time.perf_counter()
        out = fn()
        self._blocked += time.perf_counter() - t
        return out

    def issue(self, call, *args, **kwargs):
        """Call a collective (``async_op=True``), timing the call: time in it is communication too."""
        return self._timed(lambda: call(*args, async_op=True, **kwargs))

    def wait(self, work) -> None:
        self._timed(work.wait)

    def call(self, fn, *args, **kwargs):
        """A blocking call (``send``, ``recv``...), timed: all of it is communication."""
        return self._timed(lambda: fn(*args, **kwargs))

    def ddp_hook(self, state, bucket):
        """DDP's default all_reduce comm hook (average of the bucket), its collective call timed; the last
        bucket's call also waits (timed) for every bucket in flight, where the reducer would wait untimed."""
        import torch.distributed as dist

        buf = bucket.buffer().div_(dist.get_world_size())
        work = self.issue(dist.all_reduce, buf)
        self._in_flight.append(work)
        if bucket.is_last():
            for w in self._in_flight:
                self.wait(w)
            self._in_flight.clear()
        return work.get_future().then(lambda f: f.value()[0])


class _TimedWork:
    """A ``Work`` whose ``wait()`` the job times (FSDP2 issues its collectives itself)."""

    def __init__(self, work, clock: Clock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        return self._clock._timed(lambda: self._work.wait(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._work, name)


def _time_dist_calls(clock: Clock) -> None:
    """Replace FSDP2's collective entry points in ``torch.distributed`` by versions whose call and ``wait()`` the
    job times (wall clock): FSDP2 reaches them as ``dist.<name>`` at call time."""
    import torch.distributed as dist

    names = (
        "all_gather_single",
        "reduce_scatter_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
    )
    for name in (n for n in names if hasattr(dist, n)):
        fn = getattr(dist, name)

        def timed(*args, _fn=fn, **kwargs):
            out = clock._timed(lambda: _fn(*args, **kwargs))
            return _TimedWork(out, clock) if out is not None else None

        setattr(dist, name, timed)


def _compute(x, seconds: float):
    """Torch compute (matmuls, each a profiled op) for about ``seconds`` of this thread's CPU time."""
    import torch

    t = time.perf_counter()
    y = x
    while time.perf_counter() - t < seconds:
        y = torch.tanh(x @ x)  # the same work every time (feeding y back would shrink it to denormals)
    return y


def _job(rank: int, world: int, port: int, job: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if job == "future_wait" and hasattr(os, "sched_setaffinity"):  # both ranks on one core
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    clock = Clock()
    m = torch.rand(192, 192) / 192
    if job.startswith("ddp"):
        import torchvision

        net = torchvision.models.resnet18(num_classes=10)
        # resnet18's 45 MB of gradients in DDP's buckets: the default 25 MB ones ("ddp_default"), or at most
        # 8 MB ("ddp": 4 all_reduces per backward); no broadcast of BatchNorm's buffers in the forward (DDP
        # runs it in C++, where the job cannot time its wait)
        caps = {"bucket_cap_mb": 8} if job == "ddp" else {}
        model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=False, **caps)
        model.register_comm_hook(None, clock.ddp_hook)  # DDP's default hook, its calls timed by the job
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = torch.rand(4, 3, 32, 32)
        target = torch.randint(0, 10, (4,))
    if job == "fsdp":  # FSDP on CPU: its gradients' reduce_scatter runs as gloo:all_reduce
        from torch.distributed.fsdp import FullyShardedDataParallel

        mlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        sharded = FullyShardedDataParallel(mlp, device_id=torch.device("cpu"))
        batch = torch.rand(8, 256)
    if job == "fsdp2":  # FSDP2 (fully_shard) on CPU: all_gather in forward, reduce_scatter in backward
        from torch.distributed.fsdp import fully_shard

        # 16 MB of weights per layer (1 all_gather, 1 reduce_scatter each) against a batch of 128: gloo's wake-up
        # latency after each collective (the caller resumes up to 2 ms after gloo's thread ends it, more with 4
        # ranks' threads on 2 cores) is counted blocked by the job's clock and as compute by the trace; it was
        # 12-14 points of a 2-rank forward with 1 MB layers, 3-10 points of a 4-rank one with 4 MB layers, and is
        # 0.4-4.5 points with these
        layers = [torch.nn.Linear(2048, 2048) for _ in range(4)]
        net2 = torch.nn.Sequential(*layers)
        for layer in layers:
            fully_shard(layer)
        fully_shard(net2)
        batch2 = torch.rand(128, 2048)
        net2(batch2).sum().backward()  # lazy init outside the profile
        _time_dist_calls(clock)
    payload = torch.ones(1 << 20)  # 4 MB
    big = torch.ones(1 << 22)  # 16 MB: the last rank's blocking all_reduce well above wake-up latencies
    other = torch.ones(1 << 20)
    if job.startswith("ddp"):  # DDP rebuilds its buckets in the second forward (a broadcast, in C++): not profiled
        for _ in range(2):
            torch.nn.functional.cross_entropy(model(data), target).backward()
            opt.zero_grad()
    dist.barrier()
    # pipeline_n: the peers of send/recv are in the trace only with record_shapes (c10d::send's "Concrete Inputs")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=job == "pipeline_n") as prof:
        for it in range(ITERATIONS):
            if job.startswith("ddp"):
                with clock.section("forward", it):
                    loss = torch.nn.functional.cross_entropy(model(data), target)
                with clock.section("backward", it):
                    loss.backward()
                opt.step()
                opt.zero_grad()
            elif job == "hidden":
                with clock.section("overlap", it):
                    work = clock.issue(dist.all_reduce, payload)
                    _compute(m, 0.08)
                    clock.wait(work)
            elif job == "concurrent":
                with clock.section("overlap", it):
                    if rank == 1:
                        _compute(m, 0.06)  # rank 0 waits for rank 1 on both collectives, in flight together
                    w1 = clock.issue(dist.all_reduce, payload)
                    w2 = clock.issue(dist.all_reduce, other)
                    clock.wait(w1)
                    clock.wait(w2)
            elif job == "fsdp2":
                with clock.section("forward", it):
                    loss2 = net2(batch2).sum()
                with clock.section("backward", it):
                    loss2.backward()
            elif job == "fsdp":
                with clock.section("step", it):
                    sharded(batch).sum().backward()
            elif job == "future_wait":  # rank 1 late by 50 ms; both wait on the collective's Future
                with clock.section("sync", it):
                    if rank == 1:
                        time.sleep(0.05)
                    fut = clock.issue(dist.all_reduce, payload).get_future()
                    clock._timed(fut.wait)
            elif job == "pipeline":  # 2 stages: activations forward (send/recv), gradients back (isend/irecv)
                act = torch.empty(1 << 18)  # 1 MB
                with clock.section("forward", it):
                    if rank == 0:
                        act = _compute(m, 0.06).flatten().repeat(6)[: 1 << 18].contiguous()
                        clock.call(dist.send, act, 1)
                    else:
                        clock.call(dist.recv, act, 0)  # waits for stage 0's 60 ms
                        _compute(m, 0.02)
                with clock.section("backward", it):
                    grad = torch.empty(1 << 18)
                    if rank == 1:
                        _compute(m, 0.04)
                        clock.wait(clock._timed(lambda g=grad: dist.isend(g.fill_(1.0), 0)))
                    else:
                        clock.wait(clock._timed(lambda g=grad: dist.irecv(g, 1)))  # waits for stage 1's 40 ms
                        _compute(m, 0.01)
            elif job == "pipeline_n":  # `world` stages, i -> i+1 forward (send/recv), i+1 -> i backward (tag 1)
                act = torch.empty(1 << 18)  # 1 MB
                last = world - 1
                with clock.section("forward", it):
                    if rank == 0:
                        act = _compute(m, 0.06).flatten().repeat(6)[: 1 << 18].contiguous()
                    else:
                        clock.call(dist.recv, act, rank - 1)  # waits for the stages before: 60 ms + 20 ms each
                        _compute(m, 0.02)
                    if rank < last:
                        clock.call(dist.send, act, rank + 1)
                with clock.section("backward", it):
                    grad = torch.empty(1 << 18)
                    if rank == last:
                        _compute(m, 0.04)
                    else:  # waits for the stages after: 40 ms + 10 ms each
                        clock.wait(clock._timed(lambda g=grad: dist.irecv(g, rank + 1, tag=1)))
                        _compute(m, 0.01)
                    if rank > 0:
                        clock.wait(clock._timed(lambda g=grad: dist.isend(g.fill_(1.0), rank - 1, tag=1)))
            elif job == "prefetch":  # an all_reduce issued at the end of one section, waited in the next
                with clock.section("issue", it):  # 60 / 120 ms: a few ms of preemption stay a few points
                    _compute(m, 0.06 + (0.06 if rank == 1 else 0.0))
                    work = clock.issue(dist.all_reduce, payload)
                with clock.section("use", it):
                    _compute(m, 0.04)
                    clock.wait(work)
                    clock.wait(clock.issue(dist.all_reduce, other))
            elif job == "imbalanced":
                with clock.section("work", it):  # no collective: rank 1 works 60 ms longer
                    _compute(m, 0.04 + (0.06 if rank == 1 else 0.0))
                with clock.section("sync", it):  # a blocking all_reduce (16 MB), its wait timed by the job
                    clock.wait(clock.issue(dist.all_reduce, big))
            dist.barrier()
            prof.step()
    Path(out, "traces").mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(out, "traces", f"rank{rank}.json")))
    Path(out, "truth").mkdir(parents=True, exist_ok=True)
    Path(out, "truth", f"rank{rank}.json").write_text(json.dumps(clock.rows))
    dist.destroy_process_group()


def _spin() -> None:
    while True:
        pass


def run(job: str, out: str | Path, world: int = 2, timeout_s: float = 240, load: int = 0) -> Path:
    """Run ``job`` on ``world`` gloo ranks (spawned processes), with ``load`` extra processes spinning on the CPUs
    meanwhile (CPU load: the ranks get preempted); returns ``out``."""
    import multiprocessing
    import socket

    import torch.multiprocessing as mp

    if job not in JOBS:
        raise ValueError(f"job {job!r}: one of {', '.join(JOBS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(load)]
    for p in spinners:
        p.start()
    try:
        ctx = mp.start_processes(
            _job, args=(world, port, job, str(out)), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"job {job} did not finish in {timeout_s} s")
    finally:
        for p in spinners:
            p.kill()
            p.join()
    return Path(out)


def truth(out: str | Path) -> list[dict]:
    """Every rank's truth rows, each with its ``rank``."""
    rows = []
    for p in sorted(Path(out, "truth").glob("rank*.json")):
        rank = int(p.stem.removeprefix("rank"))
        rows += [{**r, "rank": rank} for r in json.loads(p.read_text())]
    return rows


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4]), load=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
