"""pnpscale's local launcher: Hydra's basic launcher that validates every sweep point first.

Registered as ``hydra/launcher: pnpscale_basic`` (the default in ``conf/config.yaml``). Before
any point runs, every point's config is composed and checked (:func:`validate_points`); a bad
point stops the sweep with one line per bad point and nothing started. After the points ran
(failed ones included), the sweep report is written when ``report=true``.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from pnpscale.core import layout
from pnpscale.core.config import ConfigError, cuda_surely_absent
from pnpscale.core.errors import Abort, InputError, PnpscaleError
from pnpscale.core.lock import Busy, FolderLock, in_use
from pnpscale.core.signals import acknowledge, as_interrupted, check, received
from pnpscale.sweep.cli import check_hydra_override, file_key_error, resume_command
from pnpscale.sweep.point import NoSpace, check_room, mode_key_problems, resolve_point
from pnpscale.sweep.task import RunFailed, record_failure_or_say, record_not_run, say_unrecorded

log = logging.getLogger("pnpscale")


class SweepConfigError(InputError):
    """One or more sweep points are invalid (one line per problem): exit code 2, nothing started.

    Raised inside Hydra wrapped in :class:`pnpscale.core.errors.Abort` (:func:`refuse`), so that Hydra does
    not print a stack trace; ``python -m pnpscale`` prints the same ``pnpscale: error:`` lines as the
    command-line check.
    """


def refuse(message: str) -> Abort:
    """The :class:`~pnpscale.core.errors.Abort` to raise for a refused sweep (``raise refuse("...")``)."""
    return Abort(SweepConfigError(message))


@dataclass
class PnpscaleBasicLauncherConf:
    _target_: str = "hydra_plugins.pnpscale_plugins.launcher.PnpscaleBasicLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="pnpscale_basic", node=PnpscaleBasicLauncherConf, provider="pnpscale"
)


def _label(overrides: Sequence[str]) -> str:
    return " ".join(o for o in overrides if not o.startswith(("hydra", "output.root"))) or "(defaults)"


def validate_points(
    config_loader: Any, config: DictConfig, job_overrides: Sequence[Sequence[str]], check: Any
) -> list[DictConfig]:
    """Compose every point and run ``check(cfg)`` on each; also refuse two points sharing a folder, and a
    key of one mode set on points that are all of another (:func:`pnpscale.sweep.point.mode_key_problems`;
    a key some points read and others ignore is one warning line).

    Args:
        config_loader: Hydra's config loader (``hydra_context.config_loader``).
        config: the sweep's config.
        job_overrides: one override list per point.
        check: callable raising :class:`pnpscale.core.config.ConfigError` for a bad point.

    Returns:
        the composed config of every point, in order.

    Raises:
        Abort: carrying a SweepConfigError, one line per bad point (exit code 2); nothing was launched.
    """

    composed: list[Any] = []
    seen: dict[Any, str] = {}
    problems: dict[str, list[str]] = {}
    for overrides in job_overrides:
        try:
            cfg = config_loader.load_sweep_config(config, list(overrides))
        except Exception as exc:  # a key a user's YAML sets that the schema lacks: one line, not Hydra's six
            unknown = file_key_error(exc)
            if unknown is None:
                raise
            problems.setdefault(str(unknown), []).append(_label(overrides))
            continue
        try:
            check(cfg)
        except ConfigError as exc:
            problems.setdefault(str(exc), []).append(_label(overrides))
        sub = str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        for key, value in (("hydra.sweep.subdir", sub), ("hydra.job.name", OmegaConf.select(cfg, "hydra.job.name"))):
            try:
                check_hydra_override(key, value)
            except ConfigError as exc:
                problems.setdefault(str(exc), []).append(_label(overrides))
        if sub in seen:
            msg = (
                f"hydra.sweep.subdir={sub}: two points would write the same run folder; add the swept key "
                "to it, e.g. hydra.sweep.subdir='problem=${problem.name}/mode=${mode.name}/gpus=${gpus}/seed=${seed}'"
            )
            problems.setdefault(msg, []).extend([seen[sub], _label(overrides)])
        seen[sub] = _label(overrides)
        composed.append(cfg)

    if len(composed) == len(job_overrides):  # the rules across points need every point's config
        pairs = zip(job_overrides, composed, strict=True)
        refused, warnings = mode_key_problems([(_label(o), c, o) for o, c in pairs])
        for msg, pts in refused.items():  # a key that every point setting it would silently ignore
            problems.setdefault(msg, []).extend(pts)
        for line in warnings:  # read by some points, ignored by others: said once
            log.warning("%s", line)
    if problems:
        lines = [f"{msg} (sweep point{'s' if len(pts) > 1 else ''}: {'; '.join(pts)})" for msg, pts in problems.items()]
        raise refuse("invalid sweep, nothing was started:\n" + "\n".join(lines))
    return composed


def check_local(cfg: DictConfig) -> None:
    """A local point: its values, and no complete run of another spec in its folder (resume). Where this
    machine surely has no CUDA device (:func:`pnpscale.core.config.cuda_surely_absent`), torch is not asked
    (its import takes 10-20 s under load, and a refused sweep waited for it)."""
    from pathlib import Path

    devices = 0 if cuda_surely_absent() else None
    resolve_point(cfg, Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir), cuda_devices=devices)


class PnpscaleBasicLauncher(BasicLauncher):
    """Hydra's basic (sequential, in-process) launcher, plus validation, the sweep report, one line
    for a point whose folder cannot be written, and a stop signal handled at any moment."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.hydra_context is not None and self.config is not None
        composed = validate_points(self.hydra_context.config_loader, self.config, job_overrides, check_local)

        rets: list[JobReturn] = []
        try:
            for idx, overrides in enumerate(job_overrides):
                check()  # a stop signal whose exception was swallowed: no further point
                rets.append(self._run_point(initial_job_idx + idx, overrides))
            check()
        except KeyboardInterrupt as exc:

            stop = as_interrupted(exc)
            acknowledge()  # handled here: the report of what completed may be published
            rest = list(zip(job_overrides, composed, strict=True))[len(rets) :]
            said = record_not_run_points(rest, f"not run: the sweep was {stop} before this point started")
            not_run = [f"{label}{'' if s == layout.STATUS_NOT_RUN else f' ({s})'}" for label, s in said
                       if s not in (layout.STATUS_COMPLETE, layout.STATUS_FAILED, layout.STATUS_RUNNING)]  # fmt: skip
            log.error("%s: %d sweep point(s) not run%s", stop, len(not_run), f": {'; '.join(not_run)}" * bool(not_run))
            done = sum(s == layout.STATUS_COMPLETE for _, s in said)  # ended as the stop came: their folders say
            try:
                finish_sweep(self.config, rets, total=len(job_overrides), not_run=not_run, complete_after=done)
            except ReportFailed:
                pass  # logged; the stop decides the exit code
            finally:
                log.error("to resume (complete points are skipped): %s", sweep_resume_command(self.config))
            raise
        finish_and_end(self.config, rets, sweep_resume_command(self.config), total=len(job_overrides))
        return rets

    def _run_point(self, idx: int, overrides: Sequence[str]) -> JobReturn:
        """Hydra's ``run_job`` for one point; a folder Hydra cannot write (its ``.hydra/``, a full disk)
        fails that point with one line instead of ending the sweep with a traceback."""
        from hydra.core.utils import configure_log, filter_overrides, run_job, setup_globals
        from omegaconf import open_dict

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        setup_globals()
        log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        refused = refuse_busy(overrides, cfg, run_dir)  # before Hydra writes the point's .hydra/ over the holder's
        if refused is not None:
            return refused

        try:
            if layout.run_status(run_dir) != layout.STATUS_COMPLETE:  # a complete one is skipped (resume)
                check_room(run_dir)  # before Hydra writes into it: room for the point's status record
        except NoSpace as exc:
            return self._unwritable(overrides, cfg, run_dir, exc)
        try:
            ret = run_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=cfg,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            )
        except OSError as exc:
            ret = self._unwritable(overrides, cfg, run_dir, exc)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret

    def _unwritable(self, overrides: Sequence[str], cfg: DictConfig, run_dir: Path, exc: OSError) -> JobReturn:
        """:func:`fail_unwritable`: the point fails with one line, the sweep goes on with the next point."""
        return fail_unwritable(overrides, cfg, run_dir, exc)


def refuse_busy(
    overrides: Sequence[str], cfg: DictConfig, run_dir: Path, cuda_devices: int | None = None
) -> JobReturn | None:
    """A point whose run folder another live process holds (:func:`pnpscale.core.lock.in_use`): refused with one
    line naming the holder, nothing written into the folder (its ``run.json``, ``.hydra/`` and tables stay the
    holder's); ``None`` when the folder is free. Both launchers (SLURM: ``cuda_devices=0``), before anything is
    written or submitted for the point.

    Returns:
        the point's ``FAILED`` JobReturn (a :class:`pnpscale.sweep.task.RunFailed` ``refused, <folder> is in use
        by pid N on host H since T``), or ``None``.
    """
    from hydra.core.utils import JobStatus


    busy = in_use(run_dir)
    if busy is None:
        return None
    label = resolve_point(cfg, run_dir, cuda_devices).label  # validated before the sweep started: memoised
    log.error("%s refused: %s", label, busy)
    ret = JobReturn(overrides=list(overrides), working_dir=str(run_dir), status=JobStatus.FAILED)
    ret.return_value = RunFailed(label, run_dir, f"refused, {busy}")
    return ret


def fail_unwritable(
    overrides: Sequence[str], cfg: DictConfig, run_dir: Path, exc: OSError, cuda_devices: int | None = None
) -> JobReturn:
    """A point whose folder cannot be written (a full disk, :func:`pnpscale.sweep.point.check_room`): failed with
    one line, its failure recorded when the disk has room for that
    (:func:`pnpscale.sweep.task.record_failure_or_say`, which says so on stderr otherwise); a complete run
    (skipped on resume) is left complete. Both launchers (local, SLURM: ``cuda_devices=0``, the compute node
    decides ``scale=auto``).

    Returns:
        the point's JobReturn: ``FAILED`` with a :class:`pnpscale.sweep.task.RunFailed`, or ``COMPLETED``
        for a complete run left as it is.
    """
    from hydra.core.utils import JobStatus


    error = f"cannot write its run folder: {exc}"
    if layout.run_status(run_dir) == layout.STATUS_COMPLETE:  # a complete run (skipped, resume): kept
        log.warning("%s: %s; its complete run is left as it is", _label(overrides), error)
        ret = JobReturn(overrides=list(overrides), working_dir=str(run_dir), status=JobStatus.COMPLETED)
        ret.return_value = None
        return ret
    log.error("%s failed: %s", _label(overrides), error)
    lock = FolderLock(run_dir)
    try:
        lock.acquire()
        taken = True
    except (Busy, OSError):
        taken = False  # another process's folder, or not even its lock fits: nothing written
    if taken:
        try:
            point = resolve_point(cfg, run_dir, cuda_devices)  # validated before the sweep: memoised
            record_failure_or_say(run_dir, point.spec, None, error, point.label, lock)
        finally:
            lock.release()
    else:

        say_unrecorded(_label(overrides), run_dir, exc)
    ret = JobReturn(overrides=list(overrides), working_dir=str(run_dir), status=JobStatus.FAILED)
    ret.return_value = RunFailed(_label(overrides), run_dir, error)
    return ret


def record_not_run_points(
    points: Sequence[tuple[Sequence[str], DictConfig]], reason: str, cuda_devices: int | None = None
) -> list[tuple[str, str]]:
    """Record every point of ``points`` (overrides, composed config) that did not run as ``not_run`` in its
    folder (:func:`pnpscale.sweep.task.record_not_run`): the point a stop interrupted keeps its
    ``interrupted`` record, a complete one stays complete. Both launchers (SLURM: ``cuda_devices=0``).

    Returns:
        per point, in sweep order: its label (``problem=2d mode=inference gpus=4``) and what its folder now
        says (``not_run``, ``complete``, ``failed``, or why nothing could be recorded).
    """

    out = []
    for overrides, cfg in points:
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        try:
            label = resolve_point(cfg, run_dir, cuda_devices).label  # validated before the sweep started: memoised
        except Exception:  # noqa: BLE001 - the folder changed since: the overrides name it
            label = _label(overrides)
        out.append((label, record_not_run(cfg, run_dir, reason, cuda_devices)))
    return out


def sweep_resume_command(config: DictConfig) -> str:
    """The command that resumes this sweep (:func:`pnpscale.sweep.cli.resume_command`)."""

    ov = config.hydra.overrides
    return resume_command(list(ov.task), list(ov.hydra), Path(str(config.hydra.sweep.dir)).absolute())


def sweep_summary(total: int, complete: int, failed: int, not_run: Sequence[str] = ()) -> str:
    """The sweep's summary line: every point it asked for, complete, failed or not run (named).

    >>> sweep_summary(4, 1, 1, ["gpus=4", "gpus=8"])
    '4 sweep point(s): 1 complete, 1 failed, 2 not run (gpus=4; gpus=8)'
    >>> sweep_summary(2, 1, 1)
    '2 sweep point(s): 1 complete, 1 failed'
    """
    parts = [f"{complete} complete", f"{failed} failed"]
    if not_run:
        parts.append(f"{len(not_run)} not run ({'; '.join(not_run)})")
    unaccounted = total - complete - failed - len(not_run)
    if unaccounted > 0:  # the point a stop interrupted (recorded failed in its folder)
        parts.append(f"{unaccounted} interrupted")
    return f"{total} sweep point(s): " + ", ".join(parts)


class ReportFailed(PnpscaleError, RuntimeError, CompactHydraException):
    """The sweep report could not be written (the points' run folders are intact); one line, exit 1.

    Attributes:
        logged: ``True``: its line is already in the sweep's log (the command prints it no second time).
    """

    logged = True


def finish_and_end(
    config: DictConfig, rets: Sequence[JobReturn], resume: str, total: int | None = None, not_run: Sequence[str] = ()
) -> None:
    """:func:`finish_sweep`, then :func:`end_if_failed`, whatever the report did: a report that could not be
    written (a full disk) is its one logged line, and the failed points' line with the resume command still
    ends the sweep; no Hydra hint either way (both are raised as :class:`~pnpscale.core.errors.Abort`).

    Raises:
        Abort: carrying :class:`SweepFailed` when a point failed or was not run, else :class:`ReportFailed`
            when only the report failed (exit 1 both).
    """
    try:
        finish_sweep(config, rets, total=total, not_run=not_run)
    except ReportFailed as exc:
        end_if_failed(config, rets, resume, not_run=not_run)
        raise Abort(exc) from None
    end_if_failed(config, rets, resume, not_run=not_run)


def finish_sweep(
    config: DictConfig,
    rets: Sequence[JobReturn],
    total: int | None = None,
    not_run: Sequence[str] = (),
    complete_after: int = 0,
) -> None:
    """After the points ran: one summary line of every point the sweep asked for (``total``: complete, failed,
    not run, the last named in ``not_run``; ``complete_after``: points without a job return that completed
    as a stop came), then the sweep report (``report=true``).

    The report is staged and renamed (:func:`pnpscale.results.report.write_report`): if it fails,
    or a signal arrives while it is written, the previous report is left as it was.

    Raises:
        ReportFailed: the report could not be written (logged first, one line).
    """
    from hydra.core.utils import JobStatus

    failed = [r for r in rets if r.status == JobStatus.FAILED]
    total = len(rets) if total is None else total
    line = sweep_summary(total, len(rets) - len(failed) + complete_after, len(failed), not_run)
    if failed or not_run or len(rets) < total:
        log.warning("%s", line)
    if config.get("report", False):
        from pnpscale.results.report import write_report  # deferred: matplotlib only for a report
        from pnpscale.results.runs import NoRunsError  # deferred: pandas only when a report is asked for

        sweep_dir = str(config.hydra.sweep.dir)
        log.info("writing the report of %s", sweep_dir)
        rebuild = f"the run folders are intact: python -m pnpscale.report {sweep_dir}"
        lost = layout.report_not_written(Path(sweep_dir) / layout.REPORT_DIR)
        try:
            out = write_report(sweep_dir, echo=log.info)
            log.info("report: %s", out)
        except NoRunsError as exc:
            log.warning("no report: %s", exc)
        except KeyboardInterrupt:  # a stop while the report is written: say what is lost and how to get it
            log.error("%s (stopped while it was written); %s", lost, rebuild)
            raise
        except Exception as exc:  # noqa: BLE001 - any report failure: one line, exit 1, runs intact

            stop = received()
            if stop is not None:  # a Ctrl-C a library turned into another error: a stop, not a failure
                log.error("%s (stopped while it was written); %s", lost, rebuild)
                raise stop from None
            msg = f"report not written ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); " \
                  f"{rebuild}"  # fmt: skip
            log.error(msg)
            raise ReportFailed(msg) from None


class SweepFailed(PnpscaleError, RuntimeError):
    """Some sweep points failed (each recorded in its run folder's ``run.json``): the sweep's last line, exit 1."""


#: The most failed points the last line names one by one (beyond it: their count and where they are).
NAMED_FAILURES = 8


def end_if_failed(config: DictConfig, rets: Sequence[JobReturn], resume: str, not_run: Sequence[str] = ()) -> None:
    """End a sweep that had failed points with one line naming every one of them (or, beyond
    :data:`NAMED_FAILURES`, their count), where their records are, and the command that runs them again;
    ``not_run``: points the sweep asked for that never started without a stop signal (a SLURM job cancelled
    while pending), named too (their ``run.json`` says ``not_run``).

    Raised as :class:`~pnpscale.core.errors.Abort`, so Hydra prints neither its "Error executing job"
    line nor its ``HYDRA_FULL_ERROR`` hint (it would name only the first failed point).

    Raises:
        Abort: carrying a :class:`SweepFailed` (exit 1) when any point failed.
    """
    from hydra.core.utils import JobStatus

    failed = [r for r in rets if r.status == JobStatus.FAILED]
    if not failed and not not_run:
        return
    labels = [getattr(r._return_value, "label", None) or _label(r.overrides or []) for r in failed]
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    named = "; ".join(labels) if len(labels) <= NAMED_FAILURES else f"see {sweep_dir}/*/run.json"
    total = len(rets) + len(not_run)
    said = f"{len(failed)} of {total} sweep point(s) failed ({named})" if failed else ""
    if not_run:
        unnamed = "; ".join(not_run) if len(not_run) <= NAMED_FAILURES else f"see {sweep_dir}/*/run.json"
        said += ("; " if said else "") + f"{len(not_run)} of {total} sweep point(s) not run ({unnamed})"
    raise Abort(
        SweepFailed(
            f"{said}; each run.json under {sweep_dir} says why; to re-run only the "
            f"{'points not complete' if not_run else 'failed points'}: {resume}"
        )
    )
