"""The Hydra task: validate one sweep point, launch its ranks, record the outcome.

``python -m pnpscale`` (see :mod:`pnpscale.__main__`) calls :func:`run` once per point.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from pnpscale import layout
from pnpscale.sweep.config import ConfigError, RunSpec, resolve_spec

log = logging.getLogger("pnpscale")


class RunFailed(RuntimeError, CompactHydraException):
    """A sweep point that did not complete; its folder holds ``run.json`` with the error.

    Hydra prints it as one line (no traceback): the rank's error and the run folder.
    """


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_spec(cfg: DictConfig, cuda_devices: int) -> RunSpec:
    """Resolve and check one point for a local launch on a machine with ``cuda_devices`` GPUs.

    Raises:
        ConfigError: invalid value, or more GPUs requested than this machine has (CUDA).
    """
    spec = resolve_spec(cfg, cuda_available=cuda_devices > 0)
    from pnpscale.sweep.cli import writable_dir

    if not writable_dir(Path(str(cfg.output.root))):
        raise ConfigError("output.root", cfg.output.root, "must be a folder this user can create and write")
    if cfg.cluster.name == "local" and cuda_devices and spec.backend != "gloo" and spec.gpus > cuda_devices:
        raise ConfigError(
            "gpus",
            spec.gpus,
            f"this machine has {cuda_devices} CUDA device(s): allowed 1..{cuda_devices} locally "
            "(or cluster=slurm, or dist.backend=gloo for CPU ranks)",
        )
    return spec


def existing_run(run_dir: Path, spec: RunSpec, resume: bool) -> dict[str, Any] | None:
    """The complete run already in ``run_dir`` to keep (``resume=true``, same spec), else ``None``.

    Raises:
        ConfigError: ``resume=true`` and the folder holds a complete run of a *different* spec
            (never overwritten silently; ``resume=false`` replaces it).
    """
    if not resume or layout.run_status(run_dir) != layout.STATUS_COMPLETE:
        return None
    done = layout.read_json(run_dir / layout.RUN_JSON)
    if done.get("fingerprint") == spec.fingerprint():
        return done
    raise ConfigError(
        "resume",
        True,
        f"{run_dir} holds a complete run of another spec (fingerprint {done.get('fingerprint')}, this point "
        f"{spec.fingerprint()}): use another hydra.sweep.dir, or resume=false to replace it",
    )


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Measure one point and write its run folder.

    Args:
        cfg: composed config of one point.
        run_dir: the run folder; default: Hydra's job output folder.

    Returns:
        ``run.json`` of the point.

    Raises:
        ConfigError: invalid config (nothing started).
        RunFailed: a rank failed; the folder holds ``run.json`` with status ``failed``.
    """
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    spec = make_spec(cfg, cuda_device_count())
    config = OmegaConf.to_container(cfg, resolve=True)
    on_slurm = cfg.cluster.name != "local"
    if on_slurm:
        from pnpscale.cluster.slurm import in_slurm_task

        if not in_slurm_task():
            raise ConfigError(
                "cluster",
                cfg.cluster.name,
                "runs every point as a SLURM job through the pnpscale SLURM launcher: keep hydra.mode=MULTIRUN "
                "(set by cluster=slurm) and use cluster=slurm for the whole sweep",
            )
    if spec.scale_requested == "auto":
        log.info("scale=auto -> %s (%s)", spec.scale, "CUDA available" if spec.scale == "paper" else "no CUDA")
    elif spec.scale == "paper" and not on_slurm and cuda_device_count() == 0:
        log.warning(
            "scale=paper on CPU ranks: the seed page's sizes (%s^%d image, DRUNet %s) take a very long time per "
            "iteration without GPUs; scale=small is the CPU preset",
            spec.sizes["image_size"],
            2 if spec.problem == "2d" else 3,
            spec.sizes["nc"],
        )
    # On SLURM the launcher skipped complete points before submitting; a rank must never skip alone.
    if not on_slurm:
        done = existing_run(run_dir, spec, bool(cfg.resume))
        if done is not None:
            log.info("skipping %s: complete run already in %s (resume=true)", _point(spec), run_dir)
            return done
    log.info("%s: %d rank(s), run folder %s", _point(spec), spec.gpus, run_dir)
    if not on_slurm and cuda_device_count() == 0:
        import os

        from pnpscale.rank.worker import threads_per_rank

        cpus, threads = len(os.sched_getaffinity(0)), threads_per_rank(spec.threads_per_rank, spec.gpus)
        if spec.gpus * threads > cpus:
            log.warning(
                "%d rank(s) x %d thread(s) on %d CPU(s): ranks share cores, so compute and wait include that "
                "contention (it is measured, not corrected)",
                spec.gpus,
                threads,
                cpus,
            )
    from pnpscale.cluster.local import launch_local
    from pnpscale.sweep.record import run_json_base, write_failure

    layout.write_json(run_dir / layout.RUN_JSON, run_json_base(spec, config))
    try:
        if on_slurm:  # this process is task 0 of the point's SLURM job: rank 0
            from pnpscale.cluster.slurm import run_rank

            run_rank(spec, run_dir, config)
        else:
            launch_local(spec, run_dir, config)
    except KeyboardInterrupt:
        write_failure(run_dir, spec, config, "interrupted (Ctrl-C): the ranks were stopped")
        raise
    except Exception as exc:
        if _is_signal(exc):  # torch elastic turns the Ctrl-C it received into an exception
            write_failure(run_dir, spec, config, f"interrupted ({exc}): the ranks were stopped")
            raise KeyboardInterrupt from None  # stops the whole sweep, not only this point
        write_failure(run_dir, spec, config, exc)
        log.error("%s failed: %s", _point(spec), exc)
        raise RunFailed(f"{_point(spec)} failed: {exc} (run folder: {run_dir})") from None
    result = layout.read_json(run_dir / layout.RUN_JSON)
    log.info("%s: %s", _point(spec), summary_line(result))
    return result


def _is_signal(exc: BaseException) -> bool:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(exc, SignalException)


def _point(spec: RunSpec) -> str:
    return f"problem={spec.problem} mode={spec.mode} gpus={spec.gpus}"


def summary_line(run_json: dict[str, Any]) -> str:
    """One line of headline figures from a complete ``run.json``."""
    m = run_json.get("metrics") or {}

    def pct(v: Any) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    gs = m.get("gpu_seconds_per_iteration")
    return (
        f"LB {pct(m.get('lb'))}, CommE {pct(m.get('comm_e'))}, PE {pct(m.get('pe'))}, "
        f"{'n/a' if gs is None else f'{gs:.4g}'} GPU-s per iteration ({m.get('iterations')} measured)"
    )
