"""The Hydra task: one sweep point resolved, run by its cluster backend, recorded.

``python -m pnpscale`` (see :mod:`pnpscale.__main__`) calls :func:`run` once per point. The task
knows only the :class:`~pnpscale.cluster.base.Cluster` interface (chosen by ``cluster=``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import DictConfig

from pnpscale.cluster import cluster_backend
from pnpscale.cluster.resources import cuda_device_count
from pnpscale.core import layout
from pnpscale.core.config import plain
from pnpscale.core.errors import PnpscaleError
from pnpscale.core.lock import Busy, FolderLock
from pnpscale.core.record import (
    RecordError,
    now_iso,
    read_record,
    release_space,
    reserve_space,
    start_record,
    write_failure,
    write_record,
)
from pnpscale.core.signals import deferred, stop_behind
from pnpscale.sweep.cli import resume_command
from pnpscale.sweep.point import Point, complete_run, resolve_point

log = logging.getLogger("pnpscale")

#: The run folders of points a stop signal ended while they ran (each recorded as failed): the command's
#: last line names them, and says nothing of a running point when the stop came between points.
STOPPED_POINTS: list[Path] = []


class RunFailed(PnpscaleError, RuntimeError, CompactHydraException):
    """A sweep point that did not complete; its folder holds ``run.json`` with the error.

    Hydra prints it as one line (no traceback): the point, the rank's error and the run folder.

    Attributes:
        label: the point (``problem=2d mode=inference gpus=4``).
        run_dir: its run folder.
        error: the error alone (first line of what the rank raised, or the scheduler's account).
    """

    def __init__(self, label: str, run_dir: Path | str, error: str) -> None:
        self.label, self.run_dir, self.error = label, str(run_dir), error
        super().__init__(f"{label} failed: {error} (run folder: {run_dir})")


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Measure one point and write its run folder.

    The run folder is locked for as long as the point runs (:class:`pnpscale.core.lock.FolderLock`);
    its ``run.json`` says ``running`` with this process's pid and host, and some disk space is set
    aside to record a failure even on a full disk (:func:`pnpscale.core.record.reserve_space`).

    Args:
        cfg: composed config of one point.
        run_dir: the run folder; default: Hydra's job output folder.

    Returns:
        ``run.json`` of the point (as a dict).

    Raises:
        ConfigError: invalid config (nothing started).
        RunFailed: a rank failed (the folder holds ``run.json`` with status ``failed``), or another
            live process holds the run folder (its run.json and tables untouched).
        Interrupted: SIGINT / SIGTERM / SIGHUP (a ``KeyboardInterrupt``); the point is recorded as
            failed (``interrupted (SIGINT)``, ``terminated (SIGTERM)``) and every rank is stopped.
    """

    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    backend = cluster_backend(cfg.cluster)
    backend.enter(cfg)
    point = resolve_point(cfg, run_dir)
    lock = FolderLock(point.run_dir)
    try:
        lock.acquire()
    except Busy as exc:
        log.error("%s refused: %s", point.label, exc)
        raise RunFailed(point.label, point.run_dir, f"refused, {exc}") from None
    try:
        if lock.previous is not None:
            log.warning("%s: took over the lock of %s: that process is gone", point.label, lock.previous.text())
        return _run_locked(cfg, point, backend, lock)
    finally:
        lock.release()


def _run_locked(cfg: DictConfig, point: Point, backend: Any, lock: Any = None) -> dict[str, Any]:
    import os
    import socket


    spec = point.spec
    # the resume rule again, now that the folder is locked: another process may have completed it
    done = complete_run(point.run_dir, cfg, point.resume) if backend.resumes_in_task else None
    if done is not None:
        log.info("skipping %s: complete run already in %s (resume=true)", point.label, point.run_dir)
        return done
    _log_choices(point, backend)  # what this point's run chose: never said of a point it skips
    if point.resume and backend.resumes_in_task and layout.run_status(point.run_dir) == layout.STATUS_COMPLETE:
        # the same spec (else refused), but damaged
        from pnpscale.results.runs import unreadable_reason  # deferred: pandas only on resume

        log.warning("%s: the complete run in %s is unreadable (%s): running it again", point.label,
                    point.run_dir, unreadable_reason(point.run_dir))  # fmt: skip
    record_file = point.run_dir / layout.RUN_JSON
    if record_file.exists() and layout.run_status(point.run_dir) is None:  # cut short or edited: no status to read
        log.warning("%s: the run.json in %s is unreadable (%s): running it again", point.label, point.run_dir,
                    layout.json_problem(record_file))  # fmt: skip
    if layout.run_status(point.run_dir) == layout.STATUS_RUNNING:  # its lock was free: that process is gone
        log.warning("%s: the earlier run in %s never recorded its end: failed (process gone); running it again",
                    point.label, point.run_dir)  # fmt: skip
    config: dict[str, Any] | None = None
    try:  # from here on, any stop or failure is recorded in run.json
        config = plain(cfg)
        log.info("%s: %d rank(s), run folder %s", point.label, spec.gpus, point.run_dir)
        with deferred():
            reserve_space(point.run_dir)
            write_record(point.run_dir, start_record(spec, config).set(pid=os.getpid(), host=socket.gethostname()))
        backend.run(spec, point.run_dir, config)
    except BaseException as exc:
        stop = stop_behind(exc)
        if stop is not None:
            _record_failure(point, config, f"{stop}: the ranks were stopped", lock)
            STOPPED_POINTS.append(point.run_dir)
            _log_single_run_resume(point)
            raise stop from None  # stops the whole sweep, not only this point
        if not isinstance(exc, Exception):
            raise
        _record_failure(point, config, exc, lock)
        log.error("%s failed: %s", point.label, exc)
        raise RunFailed(point.label, point.run_dir, str(exc).splitlines()[0] if str(exc) else repr(exc)) from None
    finally:
        release_space(point.run_dir)
    result = read_record(point.run_dir).to_dict()
    log.info("%s: %s", point.label, summary_line(result))
    return result


def _record_failure(point: Point, config: dict[str, Any] | None, error: BaseException | str, lock: Any = None) -> None:
    """``run.json`` says ``failed`` with ``error``; a disk too full even for that gets one line on stderr
    (:func:`record_failure_or_say`), never an exception (the stop or the failure decides what happens next)."""
    record_failure_or_say(point.run_dir, point.spec, config, error, point.label, lock)


def record_failure_or_say(
    run_dir: Path,
    spec: Any,
    config: dict[str, Any] | None,
    error: BaseException | str,
    label: str,
    lock: Any = None,
    **extra: Any,
) -> bool:
    """Record a failed point (:func:`pnpscale.core.record.write_failure`, which frees the space reserved for it
    and falls back to a short record, then to overwriting ``run.json`` in place); on a disk still too full, the
    lock file's holder name is given up for its block (:meth:`pnpscale.core.lock.FolderLock.forget_holder`)
    and it is tried once more. If even that fails, one line on stderr names the point, the folder and the
    cause: ``pnpscale: error: <point>: no status record could be written in <folder> (ENOSPC: No space left
    on device); the point failed``.

    ``extra``: more fields of the record (a launcher's own block, e.g. its scheduler's account of the job).

    Returns:
        whether a record was written.
    """

    try:
        write_failure(run_dir, spec, config, error, **extra)
        return True
    except OSError as exc:
        full = exc
    if lock is not None and lock.forget_holder():
        try:
            write_failure(run_dir, spec, config, error, **extra)
            return True
        except OSError as exc:
            full = exc
    say_unrecorded(label, run_dir, full)
    return False


def say_unrecorded(label: str, run_dir: Path, full: OSError) -> None:
    """One line on stderr (and the log): the point's folder could not hold its status record, and why."""
    import errno
    import sys

    cause = errno.errorcode.get(full.errno or 0, type(full).__name__)
    line = (f"{label}: no status record could be written in {run_dir} ({cause}: {full.strerror or full}); "
            "the point failed")  # fmt: skip
    print(f"pnpscale: error: {line}", file=sys.stderr, flush=True)
    log.error("%s", line)


def record_not_run(cfg: DictConfig, run_dir: Path, reason: str, cuda_devices: int | None = None) -> str:
    """Record in ``run_dir`` that the sweep asked for this point but never ran it (``run.json``: status
    ``not_run``, ``error`` = ``reason``), so that the report and ``pnpscale.load`` list it; resume runs it.

    Never overwrites a complete run (a point skipped or finished as the stop came: it stays complete), nor
    the record of the point this process was running when stopped (it says ``interrupted``), nor a folder
    in use by another process. An earlier record of another status is replaced, its error kept in the text.

    ``cuda_devices``: as for :func:`pnpscale.sweep.point.resolve_point` (0 for a launcher whose compute
    node decides ``scale=auto``).

    Returns:
        what the folder now says: ``not_run``, ``complete``, ``failed`` (this process's interrupted point),
        or why nothing was recorded (``in use by ...``, ``not recorded (OSError: ...)``).
    """
    import os


    try:
        earlier = read_record(run_dir)
    except RecordError:
        earlier = None
    if earlier is not None and (earlier.status == layout.STATUS_COMPLETE or earlier.pid == os.getpid()):
        return earlier.status
    lock = FolderLock(run_dir)
    try:
        with deferred():
            lock.acquire()
            try:
                text = reason
                if earlier is not None and earlier.status != layout.STATUS_NOT_RUN:
                    before = (earlier.error or "").splitlines()[0] if earlier.error else ""
                    text += f" (the folder's earlier run, {earlier.started_at}: {earlier.status}" + (
                        f": {before})" if before else ")"
                    )
                record = start_record(resolve_point(cfg, run_dir, cuda_devices).spec, _without_hydra(cfg))
                write_record(run_dir, record.set(status=layout.STATUS_NOT_RUN, error=text, started_at=None,
                                                 finished_at=now_iso()))  # fmt: skip
            finally:
                lock.release()
    except Busy as exc:
        return f"not recorded: {exc}"
    except (OSError, PnpscaleError) as exc:
        return f"not recorded ({type(exc).__name__}: {exc})"
    return layout.STATUS_NOT_RUN


def _without_hydra(cfg: Any) -> dict[str, Any]:
    """A launcher's composed point config as the task would record it: resolved, without its ``hydra`` node."""
    from omegaconf import OmegaConf

    out = plain(cfg, resolve=False)
    out.pop("hydra", None)
    for key in out:
        node = cfg[key]
        if OmegaConf.is_config(node):
            try:
                out[key] = OmegaConf.to_container(node, resolve=True)
            except Exception:  # noqa: BLE001 - an interpolation of the Hydra run: kept as written
                pass
    return out


def _log_single_run_resume(point: Point) -> None:
    """A single run (no sweep): log the command that runs it again into the same folder."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.get().mode != RunMode.RUN:
            return  # the launcher logs the sweep's resume command
    except ValueError:  # not under Hydra
        return

    ov = HydraConfig.get().overrides
    log.error(
        "to run it again: %s", resume_command(list(ov.task), list(ov.hydra), point.run_dir.absolute(), "hydra.run.dir")
    )


def _log_choices(point: Point, backend: Any) -> None:
    """Say what ``scale=auto`` chose, and warn about slow or contended CPU runs."""
    spec = point.spec

    if spec.scale_requested == "auto":
        log.info("scale=auto -> %s (%s)", spec.scale, "CUDA available" if spec.scale == "paper" else "no CUDA")
    elif spec.scale == "paper" and backend.name == "local" and cuda_device_count() == 0:
        log.warning(
            "scale=paper on CPU ranks: the study's sizes (side %s, DRUNet %s) take a very long time per iteration "
            "without GPUs; scale=small is the CPU preset",
            spec.sizes["image_size"],
            spec.sizes["nc"],
        )
    contention = backend.cpu_contention(spec) if cuda_device_count() == 0 else None
    if contention is not None and contention[0] > contention[1]:
        log.warning(
            "%d rank(s) need %d thread(s) on %d CPU(s): ranks share cores, so compute and wait include that "
            "contention (it is measured, not corrected)",
            spec.gpus,
            contention[0],
            contention[1],
        )


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
