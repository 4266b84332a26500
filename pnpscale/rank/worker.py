"""What every rank runs: set up, measure every iteration under the profiler, hand in its tables.

Entry point :func:`rank_main` is used by both launchers (local ``elastic_launch`` and SLURM
tasks). It expects the torch.distributed environment variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). Rank 0 gathers every
rank's tables and writes the run folder (:func:`pnpscale.rank.commit.write_run`); other ranks write
nothing shared.

The rank's process (:mod:`pnpscale.rank.process`), its process group (:mod:`pnpscale.rank.group`) and its
measured loop (:mod:`pnpscale.rank.loop`) are modules of their own; this one is the rank's main: set up,
measure, build this rank's tables, gather them on rank 0, which commits the run folder.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.errors import record

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import SectionError, rank_rows
from pnpscale.analysis.section import section_records
from pnpscale.core import layout
from pnpscale.core.config import RunSpec
from pnpscale.core.errors import PnpscaleError, failure_kind
from pnpscale.core.record import RankFailureRecord
from pnpscale.rank.commit import write_run
from pnpscale.rank.gpus import nvml_device_count, per_rank_nccl_env
from pnpscale.rank.group import Group, collect_nccl_log, cpu_warning, nccl_debug_env, nccl_log_file
from pnpscale.rank.loop import Heartbeat, device_name, run_iterations, sync
from pnpscale.rank.process import (
    LAUNCH_T0_ENV,
    PARENT_PID_ENV,
    die_with_parent,
    process_info,
    refuse_bad_fork,
    threads_per_rank,
)
from pnpscale.rank.profiling import check_trace_complete, export_trace, profiler_events
from pnpscale.rank.solver import make_solver

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec


@record
def rank_main(
    spec_dict: dict[str, Any],
    run_dir: str,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    heartbeat: bool = False,
) -> None:
    """Run one rank of a measurement (see module doc). Raises whatever the rank hit.

    Args:
        spec_dict: :meth:`pnpscale.core.config.RunSpec.to_dict` of the run.
        run_dir: the run folder (shared by all ranks; only rank 0 writes into it).
        config: the resolved Hydra config, stored in ``run.json``.
        extra: launcher fields added to ``run.json`` by rank 0 (e.g. ``{"slurm": {...}}``).
        heartbeat: write this rank's heartbeat (:class:`pnpscale.rank.loop.Heartbeat`) into the run folder, so that
            its launcher can name a rank that hung (SLURM tasks; the local launcher's ranks always do).
    """
    import torch


    if PARENT_PID_ENV in os.environ:
        die_with_parent(int(os.environ[PARENT_PID_ENV]))
    refuse_bad_fork(int(os.environ.get("RANK", "0")))
    spec = RunSpec(**spec_dict)
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = threads_per_rank(spec.threads_per_rank, local_ws)
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    t_start = time.time()
    rank = int(os.environ.get("RANK", "0"))
    nccl_log = nccl_log_file(Path(run_dir), rank)
    staged = False

    def before_init(backend: str) -> None:
        nonlocal staged
        if backend == "nccl":
            env = nccl_debug_env(nccl_log, os.environ)
            staged = "NCCL_DEBUG_FILE" in env
            os.environ.update(env)
            os.environ.update(per_rank_nccl_env(rank, os.environ, socket.gethostname()))
        warning = cpu_warning(len(os.sched_getaffinity(0)), backend, rank)
        if warning:
            print(warning, file=sys.stderr)

    beats = heartbeat or PARENT_PID_ENV in os.environ
    beat = Heartbeat(layout.progress_file(run_dir, rank) if beats else None, rank)
    beat(-1, "init")

    failure = RankFailureRecord(run_dir, rank)  # its bytes now, while the disk has room
    try:
        group = Group(spec.backend, spec.timeout_s, before_init)
        try:
            _measure_and_report(spec, Path(run_dir), group, threads, t_start, config, extra, beat)
        finally:
            group.close()
            if staged:
                collect_nccl_log(nccl_log, Path(run_dir), rank)
    except BaseException as exc:  # its kind crosses to the launcher as a field, decided here

        waited = time.monotonic() - beat.since
        world = int(os.environ.get("WORLD_SIZE", "1"))
        kind = failure_kind(exc, waited, spec.timeout_s, world)

        failure.write(kind, type(exc).__name__, own=isinstance(exc, PnpscaleError), iteration=beat.iteration,
                      section=beat.section, waited_s=round(waited, 3), failed_at=round(time.time(), 3))  # fmt: skip
        raise
    finally:
        failure.close()



def _measure_and_report(
    spec: RunSpec,
    run_dir: Path,
    group: Group,
    threads: int,
    t_start: float,
    config: dict[str, Any] | None,
    extra: dict[str, Any] | None,
    beat: Heartbeat,
) -> None:
    import torch

    rank, cuda = group.rank, group.backend == "nccl"
    if not cuda and spec.backend == "auto" and torch.cuda.is_available():
        print(f"rank {rank}: warning: CUDA is available but the run uses gloo", file=sys.stderr)
    with group.context(cuda) as ctx:
        if ctx.device != group.device:
            raise RuntimeError(f"rank {rank}: deepinv chose {ctx.device}, the process group {group.device}")
        t_setup0 = time.time()

        beat(-1, "setup")
        solver = make_solver(spec, ctx)
        sync(ctx.device)
        beat(-1, "barrier")
        group.barrier()
        t_measure0 = time.time()
        peaks, prof, calls, groups, reserved = run_iterations(spec, solver, ctx.device, group, beat)
        t_measure1 = time.time()

        if spec.export_traces:
            export_trace(prof, layout.trace_file(run_dir, rank))

        anomalies = Anomalies()
        try:
            events = profiler_events(prof, anomalies, rank, calls, groups)
            sections = section_records(events, spec.sections, anomalies, rank, require_gpu=cuda, cpu_start=cuda)
        except SectionError as exc:
            error = SectionError(f"rank {rank}: {exc}", rank=rank)
            error.counts = exc.counts
            raise error from exc
        check_trace_complete(sections, spec.sections, spec.warmup + spec.iterations, cuda, rank)
        table = {**rank_rows(rank, sections, spec.warmup, peaks), "anomalies": anomalies.records()}
        info = {
            "rank": rank,
            "host": socket.gethostname(),
            "device": device_name(ctx.device),
            "threads": threads,
            "cpus": sorted(os.sched_getaffinity(0)),  # the cores this rank may run on (time_sharing in run.json)
            "gpu": physical_gpu(ctx.device),
            "node_gpus": nvml_device_count() if getattr(ctx.device, "type", None) == "cuda" else None,
            "local_operators": list(solver.physics.local_indexes),
            "local_tiles": len(solver.denoiser.local_indices),
            "num_tiles": solver.num_tiles,
            "solver": solver.summary(),
            "process": process_info(),
            "peak_reserved_bytes": reserved,
        }
        beat(spec.warmup + spec.iterations - 1, "gather")
        gathered = group.gather((table, info))
        if rank == 0:
            assert gathered is not None  # rank 0 holds every rank's tables
            beat(spec.warmup + spec.iterations - 1, "write", advance=False)

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
        beat(spec.warmup + spec.iterations - 1, "barrier")
        group.barrier()
        beat(spec.warmup + spec.iterations - 1, "done")


def physical_gpu(device: Any) -> str | None:
    """Which physical GPU a CUDA ``device`` is (its UUID, else its index among all GPUs through
    ``CUDA_VISIBLE_DEVICES``), so that two ranks on one GPU can be told apart; ``None`` on CPU."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        return str(uuid)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)
