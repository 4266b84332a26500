"""What every rank runs: set up, measure every iteration under the profiler, hand in its tables.

Entry point :func:`rank_main` is used by both launchers (local ``elastic_launch`` and SLURM
tasks). It expects the torch.distributed environment variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). Rank 0 gathers every
rank's tables and writes the run folder (:func:`pnpscale.sweep.record.write_run`); other ranks write
nothing shared.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from pnpscale import layout

LAUNCH_T0_ENV = "PNPSCALE_LAUNCH_T0"


class InjectedFailure(RuntimeError):
    """Raised on purpose by ``inject.fail=true`` (tests of failure handling)."""


def threads_per_rank(requested: int | None, ranks: int, cpus: int | None = None) -> int:
    """CPU threads of each rank: ``requested``, else this node's CPUs split evenly (>= 1).

    >>> threads_per_rank(None, 4, cpus=2), threads_per_rank(None, 1, cpus=16), threads_per_rank(3, 4, cpus=2)
    (1, 16, 3)
    """
    if requested:
        return int(requested)
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // max(1, ranks))


def choose_backend(requested: str, cuda_devices: int, local_world_size: int) -> str:
    """Process-group backend: ``nccl`` when every local rank has a CUDA device, else ``gloo``.

    Args:
        requested: ``auto``, ``gloo`` or ``nccl``.
        cuda_devices: CUDA devices visible to this process.
        local_world_size: ranks on this node.

    Raises:
        RuntimeError: ``nccl`` requested without enough CUDA devices (deepinv would silently
            fall back to gloo; we refuse).

    >>> choose_backend("auto", 0, 4), choose_backend("auto", 4, 4), choose_backend("gloo", 4, 4)
    ('gloo', 'nccl', 'gloo')
    """
    if requested == "gloo":
        return "gloo"
    enough = cuda_devices >= 1 and (cuda_devices >= local_world_size or cuda_devices == 1)
    if requested == "nccl":
        if not enough:
            raise RuntimeError(
                f"dist.backend=nccl: {cuda_devices} CUDA device(s) visible for {local_world_size} "
                "local rank(s); allowed: gloo, or run where each rank has a GPU"
            )
        return "nccl"
    return "nccl" if enough and cuda_devices >= local_world_size else "gloo"


def nccl_debug_env(run_dir: Path, rank: int, current: Any) -> dict[str, str]:
    """NCCL diagnostics for the transfer analysis, unless the user set them already.

    ``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING`` (topology, ring/tree graphs and the
    algorithm chosen per collective size) and ``NCCL_DEBUG_FILE=<run_dir>/nccl/rank<r>.log``.

    >>> nccl_debug_env(Path("/r"), 3, {})["NCCL_DEBUG_FILE"]
    '/r/nccl/rank3.log'
    >>> nccl_debug_env(Path("/r"), 0, {"NCCL_DEBUG": "WARN"}).get("NCCL_DEBUG") is None
    True
    """
    wanted = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING",
        "NCCL_DEBUG_FILE": str(layout.nccl_log(run_dir, rank)),
    }
    return {k: v for k, v in wanted.items() if k not in current}


class Group:
    """The ranks of a run; a 1-rank run has no process group (deepinv's single-process path).

    With one rank nothing is distributed, so its sections hold no collectives at all: the seed
    page's 1-GPU baseline, with zero transfer and zero wait by construction.
    """

    def __init__(self, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.backend = backend
        if self.world > 1:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
            if dist.get_backend() != backend:
                raise RuntimeError(f"process group backend is {dist.get_backend()}, expected {backend}")
            self.rank = dist.get_rank()
        else:
            self.rank = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def context(self, cuda: bool) -> Iterator[Any]:
        """deepinv's ``DistributedContext`` on this group (single-process when 1 rank)."""
        from deepinv.distributed import DistributedContext

        hidden = {} if self.distributed else {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
        try:
            with DistributedContext(backend=self.backend, cleanup=False, device_mode="gpu" if cuda else "cpu") as ctx:
                yield ctx
        finally:
            os.environ.update(hidden)


@record
def rank_main(
    spec_dict: dict[str, Any], run_dir: str, config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
) -> None:
    """Run one rank of a measurement (see module doc). Raises whatever the rank hit.

    Args:
        spec_dict: :meth:`pnpscale.sweep.config.RunSpec.to_dict` of the run.
        run_dir: the run folder (shared by all ranks; only rank 0 writes into it).
        config: the resolved Hydra config, stored in ``run.json``.
        extra: launcher fields added to ``run.json`` by rank 0 (e.g. ``{"slurm": {...}}``).
    """
    import torch

    from pnpscale.sweep.config import RunSpec

    spec = RunSpec(**spec_dict)
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = threads_per_rank(spec.threads_per_rank, local_ws)
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    t_start = time.time()
    backend = choose_backend(spec.backend, torch.cuda.device_count(), local_ws)
    if backend == "nccl":
        (Path(run_dir) / layout.NCCL_DIR).mkdir(parents=True, exist_ok=True)
        os.environ.update(nccl_debug_env(Path(run_dir), int(os.environ.get("RANK", "0")), os.environ))
    group = Group(backend, spec.timeout_s)
    try:
        _measure_and_report(spec, Path(run_dir), group, threads, t_start, config, extra)
    finally:
        group.close()


def _measure_and_report(
    spec: Any,
    run_dir: Path,
    group: Group,
    threads: int,
    t_start: float,
    config: dict[str, Any] | None,
    extra: dict[str, Any] | None,
) -> None:
    import torch

    rank, cuda = group.rank, group.backend == "nccl"
    if not cuda and spec.backend == "auto" and torch.cuda.is_available():
        print(f"rank {rank}: warning: CUDA is available but the run uses gloo", file=sys.stderr)
    with group.context(cuda) as ctx:
        t_setup0 = time.time()
        from pnpscale.rank.solver import make_solver

        solver = make_solver(spec, ctx)
        _sync(ctx.device)
        group.barrier()
        t_measure0 = time.time()
        peaks, prof = _run_iterations(spec, solver, ctx.device, group)
        t_measure1 = time.time()
        from pnpscale.analysis.events import rank_rows, section_records
        from pnpscale.rank.profiling import export_trace, profiler_events

        if spec.export_traces:
            export_trace(prof, layout.trace_file(run_dir, rank))
        from pnpscale.analysis.anomalies import Anomalies

        anomalies = Anomalies()
        sections = section_records(profiler_events(prof, anomalies, rank), spec.sections, anomalies, rank)
        table = {**rank_rows(rank, sections, spec.warmup, peaks), "anomalies": anomalies.records()}
        info = {
            "rank": rank,
            "host": socket.gethostname(),
            "device": _device_name(ctx.device),
            "threads": threads,
            "local_operators": list(solver.physics.local_indexes),
            "local_tiles": len(solver.denoiser.local_indices),
            "num_tiles": solver.num_tiles,
            "solver": solver.summary(),
        }
        gathered = group.gather((table, info))
        if rank == 0:
            from pnpscale.sweep.record import write_run

            timings = {
                "launch_s": (t_start - float(os.environ[LAUNCH_T0_ENV])) if LAUNCH_T0_ENV in os.environ else None,
                "init_s": t_setup0 - t_start,
                "setup_s": t_measure0 - t_setup0,
                "measure_s": t_measure1 - t_measure0,
            }
            recon = solver.result().cpu() if spec.save_reconstruction else None
            write_run(
                run_dir,
                spec,
                gathered,
                backend=group.backend if group.distributed else "none",
                timings=timings,
                config=config,
                reconstruction=recon,
                extra=extra,
            )
        group.barrier()


def _device_name(device: Any) -> str:
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


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inject(spec: Any, rank: int, section: str, measured: bool, device: Any) -> None:
    inj = spec.inject
    if inj["rank"] != rank or inj["section"] not in (None, section):
        return
    if inj["fail"] and measured:
        raise InjectedFailure(f"rank {rank}: injected failure in section {section!r} (inject.fail=true)")
    if inj["delay_s"] and (inj["section"] == section):
        busy_wait(float(inj["delay_s"]), device)


def busy_wait(seconds: float, device: Any) -> None:
    """Keep the rank busy for ``seconds``: a CPU spin, or a GPU sleep kernel on CUDA."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        rate_hz = getattr(props, "clock_rate", 0) * 1e3 or 1.4e9
        torch.cuda._sleep(int(seconds * rate_hz))
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run_iterations(spec: Any, solver: Any, device: Any, group: Group) -> tuple[dict[tuple[int, str], int], Any]:
    from torch.profiler import record_function

    from pnpscale.rank.profiling import PeakMemory, make_profiler

    total = spec.warmup + spec.iterations
    peak = PeakMemory(device)
    peaks: dict[tuple[int, str], int] = {}
    rank = group.rank
    progress = _progress(total, spec.warmup, rank)
    with make_profiler(cuda=device.type == "cuda", record_shapes=spec.record_shapes) as prof:
        for it in range(total):
            t0 = time.perf_counter()
            measured = it >= spec.warmup
            for name, fn in solver.sections():
                with peak.track() as box:
                    with record_function(name):
                        _inject(spec, rank, name, measured, device)
                        fn()
                        _sync(device)
                peaks[(it, name)] = box[0]
            solver.after_step()
            _sync(device)
            group.barrier()
            prof.step()
            progress(it + 1, time.perf_counter() - t0)
    return peaks, prof


def _progress(total: int, warmup: int, rank: int) -> Any:
    """Rank 0 prints one progress line per iteration (done / total) to stdout."""
    if rank != 0:
        return lambda done, seconds: None

    def update(done: int, seconds: float) -> None:
        tag = " (warm-up)" if done <= warmup else ""
        print(f"[pnpscale] iteration {done}/{total}{tag}: {seconds:.3f} s", flush=True)

    return update
