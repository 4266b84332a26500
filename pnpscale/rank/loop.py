"""The measured loop of a rank: every iteration's sections under one profiler, with its heartbeat.

:func:`run_iterations` runs ``warmup + iterations`` steps of the solver's sections, each in a
``record_function`` range with its peak memory, the known perturbations of ``inject.*`` (:func:`busy_wait`,
:class:`InjectedFailure`) applied inside, a barrier between steps; :class:`Heartbeat` tells the launcher
where the rank is (which rank the others wait for, and since when: a rank's failure kind).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnpscale.core.config import PROFILE_OPERATORS
from pnpscale.core.errors import PnpscaleError
from pnpscale.rank.group import Group

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec


class Heartbeat:
    """Where this rank is: ``{"rank", "beat", "iteration", "section", "t", "pid"}`` rewritten in place in
    :func:`pnpscale.core.layout.progress_file` at each step (outside the timed sections).

    ``beat`` counts the steps; every rank takes the same steps in the same order, so the rank with
    the lowest ``beat`` is the one the others wait for (:func:`pnpscale.cluster.local.hung_ranks`).
    ``iteration`` is -1 before the first iteration; ``section`` is a solver section or a phase
    (``init``, ``setup``, ``barrier``, ``gather``, ``write``, ``done``). A no-op without a path.
    """

    def __init__(self, path: Path | None, rank: int) -> None:
        self.rank, self.beat = rank, 0
        self.iteration, self.section, self.since = -1, "init", time.monotonic()
        self.fd: int | None = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:
                self.fd = None

    def __call__(self, iteration: int, section: str, advance: bool = True) -> None:
        """Record the step; ``advance=False`` for a step only some ranks take (rank 0 writing)."""
        self.iteration, self.section, self.since = iteration, section, time.monotonic()
        if self.fd is None:
            return
        import json

        self.beat += advance
        data = json.dumps(
            {"rank": self.rank, "beat": self.beat, "iteration": iteration, "section": section, "t": time.time(),
             "pid": os.getpid()}
        ).encode()  # fmt: skip
        try:
            os.pwrite(self.fd, data, 0)
            os.ftruncate(self.fd, len(data))
        except OSError:
            pass



class InjectedFailure(PnpscaleError, RuntimeError):
    """Raised on purpose by ``inject.fail=true`` (tests of failure handling)."""



def device_name(device: Any) -> str:
    """CUDA device name, or the CPU model (``/proc/cpuinfo``), or the machine type."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())



def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)



def _inject(spec: RunSpec, rank: int, section: str, measured: bool, device: Any) -> None:
    inj = spec.inject
    if inj["rank"] != rank or inj["section"] not in (None, section):
        return
    if inj["fail"] and measured:
        raise InjectedFailure(f"rank {rank}: injected failure in section {section!r} (inject.fail=true)")
    if inj["delay_s"] and (inj["section"] == section):
        busy_wait(float(inj["delay_s"]), device)



#: cycles per second of ``torch.cuda._sleep`` per CUDA device index, measured once (:func:`sleep_rate_hz`).
_SLEEP_RATE_HZ: dict[int, float] = {}



def sleep_cycles(seconds: float, rate_hz: float) -> int:
    """Cycles to pass to ``torch.cuda._sleep`` for ``seconds`` at ``rate_hz`` cycles per second.

    >>> sleep_cycles(0.2, 1.5e9)
    300000000
    """
    if seconds < 0 or rate_hz <= 0:
        raise ValueError(f"sleep of {seconds} s at {rate_hz} Hz")
    return round(seconds * rate_hz)



#: seconds the GPU sleeps before the sleep kernel is timed: an idle GPU clocks down, and its clock takes
#: tens of milliseconds to come back up (the first ~10 ms sleeps of an idle H200 run several % slow)
SLEEP_WARMUP_S = 0.2
#: seconds of each timed sleep (CUDA events resolve ~0.5 us: 50 ms reads the rate to 1e-5)
SLEEP_TIMED_S = 0.05


def sleep_rate_hz(device: Any, cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Measured rate of ``torch.cuda._sleep`` on ``device`` (cycles per second), once per device.

    The sleep kernel spins on the SM clock, which runs below the maximum clock
    (``clock_rate``) most of the time, so converting with the maximum makes delays longer than
    asked. Measured with CUDA events: a first sleep of ``cycles`` gives a rough rate, then the GPU
    sleeps :data:`SLEEP_WARMUP_S` (its clock comes up from idle), then ``repeats`` sleeps of
    :data:`SLEEP_TIMED_S` each are timed; the median. Call it before the profiler starts, so its
    kernels are not traced.

    Raises:
        RuntimeError: the events measured no time.
    """
    import statistics

    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SLEEP_RATE_HZ:
        return _SLEEP_RATE_HZ[index]

    def timed(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        ms = float(start.elapsed_time(end))
        if ms <= 0:
            raise RuntimeError(f"cuda:{index}: a sleep of {n} cycles measured {ms} ms")
        return n / (ms * 1e-3)

    with torch.cuda.device(index):
        rough = timed(cycles)  # module loaded, a first rate
        torch.cuda._sleep(sleep_cycles(SLEEP_WARMUP_S, rough))  # clocks up
        n = max(cycles, sleep_cycles(SLEEP_TIMED_S, rough))
        rates = [timed(n) for _ in range(repeats)]
    _SLEEP_RATE_HZ[index] = statistics.median(rates)
    return _SLEEP_RATE_HZ[index]



def busy_wait(seconds: float, device: Any) -> None:
    """Keep the rank busy for ``seconds``: a CPU spin, or on CUDA a GPU sleep kernel of
    ``seconds x`` :func:`sleep_rate_hz` cycles (launched asynchronously, like any kernel)."""
    if device.type == "cuda":
        import torch

        torch.cuda._sleep(sleep_cycles(seconds, sleep_rate_hz(device)))
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass



def run_iterations(
    spec: RunSpec, solver: Any, device: Any, group: Group, beat: Heartbeat | None = None
) -> tuple[dict[tuple[int, str], int], Any, list[tuple[str, int | None]], list[str | None], int | None]:
    """Profiled iterations: (peak bytes per (iteration, section), profiler, collective calls in order, their
    process groups, the highest CUDA ``max_memory_reserved`` of a section in bytes: ``None`` on CPU)."""
    from pnpscale.rank.profiling import (  # deferred: torch.profiler only once a rank measures
        CollectiveLog,
        PeakMemory,
        make_profiler,
    )

    total = spec.warmup + spec.iterations
    peak = PeakMemory(device)
    peaks: dict[tuple[int, str], int] = {}
    rank = group.rank
    progress = _progress(total, spec.warmup, rank)
    beat = beat or Heartbeat(None, rank)
    if device.type == "cuda" and spec.inject["rank"] == rank and spec.inject["delay_s"]:
        sleep_rate_hz(device)  # calibrated before the profiler starts
    # an exported trace is read offline, where only input shapes give payload bytes
    shapes = spec.record_shapes or spec.export_traces
    gate = gated_operators(spec.operators, device.type == "cuda", spec.export_traces)
    with make_profiler(cuda=device.type == "cuda", record_shapes=shapes) as prof, CollectiveLog(gate) as log:
        for it in range(total):
            t0 = time.perf_counter()
            measured = it >= spec.warmup
            for name, fn in solver.sections():
                beat(it, name)
                with peak.track() as box:
                    with log.section(name):
                        _inject(spec, rank, name, measured, device)
                        fn()
                        sync(device)
                peaks[(it, name)] = box[0]
            solver.after_step()
            sync(device)
            beat(it, "barrier")
            group.barrier()
            prof.step()
            progress(it + 1, time.perf_counter() - t0)
        log.check_complete(rank)
    return peaks, prof, log.calls, log.groups, peak.reserved_max


def gated_operators(operators: str, cuda: bool, export_traces: bool) -> bool:
    """Whether a rank records operators only around its collectives (:class:`pnpscale.rank.profiling.CollectiveLog`,
    ``gate``) for ``profile.operators`` (one of :data:`pnpscale.core.config.PROFILE_OPERATORS`).

    ``all``: every operator. ``collectives``: only around collectives, on CPU ranks (a CUDA rank's decomposition
    reads its GPU events, and a synchronous NCCL call does not wait for the GPU: every operator is recorded
    there). ``auto``: ``collectives`` on CPU ranks unless the traces are exported (a trace viewer's user expects
    the operators in them).

    >>> [gated_operators("auto", cuda, export) for cuda, export in ((False, False), (False, True), (True, False))]
    [True, False, False]
    >>> gated_operators("collectives", False, True), gated_operators("collectives", True, False)
    (True, False)

    Raises:
        ValueError: ``operators`` is not one of those values.
    """
    if operators not in PROFILE_OPERATORS:
        raise ValueError(f"profile.operators={operators!r}: allowed values: {', '.join(PROFILE_OPERATORS)}")
    if cuda or operators == "all":
        return False
    return operators == "collectives" or not export_traces



def _progress(total: int, warmup: int, rank: int) -> Any:
    """Rank 0 prints one progress line per iteration (done / total) to stdout."""
    if rank != 0:
        return lambda done, seconds: None

    def update(done: int, seconds: float) -> None:
        tag = " (warm-up)" if done <= warmup else ""
        print(f"[pnpscale] iteration {done}/{total}{tag}: {seconds:.3f} s", flush=True)

    return update
