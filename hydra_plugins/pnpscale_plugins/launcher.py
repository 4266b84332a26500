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

from pnpscale.core.errors import Abort, InputError, PnpscaleError

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
    """Compose every point and run ``check(cfg)`` on each; also refuse two points sharing a folder.

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
    from pnpscale.core.config import ConfigError
    from pnpscale.sweep.cli import check_hydra_override

    composed: list[Any] = []
    seen: dict[Any, str] = {}
    problems: dict[str, list[str]] = {}
    for overrides in job_overrides:
        cfg = config_loader.load_sweep_config(config, list(overrides))
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
    if problems:
        lines = [f"{msg} (sweep point{'s' if len(pts) > 1 else ''}: {'; '.join(pts)})" for msg, pts in problems.items()]
        raise refuse("invalid sweep, nothing was started:\n" + "\n".join(lines))
    return composed


def check_local(cfg: DictConfig) -> None:
    """A local point: its values, and no complete run of another spec in its folder (resume)."""
    from pathlib import Path

    from pnpscale.sweep.point import resolve_point

    resolve_point(cfg, Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir))


class PnpscaleBasicLauncher(BasicLauncher):
    """Hydra's basic (sequential, in-process) launcher, plus validation, the sweep report, one line
    for a point whose folder cannot be written, and a stop signal handled at any moment."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.hydra_context is not None and self.config is not None
        validate_points(self.hydra_context.config_loader, self.config, job_overrides, check_local)
        from pnpscale.core.signals import check

        rets: list[JobReturn] = []
        try:
            for idx, overrides in enumerate(job_overrides):
                check()  # a stop signal whose exception was swallowed: no further point
                rets.append(self._run_point(initial_job_idx + idx, overrides))
            check()
        except KeyboardInterrupt as exc:
            from pnpscale.core.signals import acknowledge, as_interrupted

            stop = as_interrupted(exc)
            acknowledge()  # handled here: the report of what completed may be published
            log.error("%s: the remaining sweep points were not run", stop)
            try:
                finish_sweep(self.config, rets)
            except ReportFailed:
                pass  # logged; the stop decides the exit code
            finally:
                log.error("to resume (complete points are skipped): %s", sweep_resume_command(self.config))
            raise
        finish_sweep(self.config, rets)
        end_if_failed(self.config, rets, sweep_resume_command(self.config))
        return rets

    def _run_point(self, idx: int, overrides: Sequence[str]) -> JobReturn:
        """Hydra's ``run_job`` for one point; a folder Hydra cannot write (its ``.hydra/``, a full disk)
        fails that point with one line instead of ending the sweep with a traceback."""
        from hydra.core.utils import JobStatus, configure_log, filter_overrides, run_job, setup_globals
        from omegaconf import open_dict

        from pnpscale.sweep.task import RunFailed

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        setup_globals()
        log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        from pnpscale.core.lock import in_use

        busy = in_use(run_dir)  # before Hydra writes the point's .hydra/ over the holder's
        if busy is not None:
            from pnpscale.sweep.point import resolve_point

            label = resolve_point(cfg, run_dir).label  # validated before the sweep started: memoised
            log.error("%s refused: %s", label, busy)
            ret = JobReturn(overrides=list(overrides), working_dir=str(run_dir), status=JobStatus.FAILED)
            ret.return_value = RunFailed(label, run_dir, f"refused, {busy}")
            return ret
        try:
            ret = run_job(
                hydra_context=self.hydra_context,
                task_function=self.task_function,
                config=cfg,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            )
        except OSError as exc:
            error = f"cannot write its run folder: {exc}"
            log.error("%s failed: %s", _label(overrides), error)
            ret = JobReturn(overrides=list(overrides), working_dir=str(run_dir), status=JobStatus.FAILED)
            ret.return_value = RunFailed(_label(overrides), run_dir, error)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret


def sweep_resume_command(config: DictConfig) -> str:
    """The command that resumes this sweep (:func:`pnpscale.sweep.cli.resume_command`)."""
    from pnpscale.sweep.cli import resume_command

    ov = config.hydra.overrides
    return resume_command(list(ov.task), list(ov.hydra), Path(str(config.hydra.sweep.dir)).absolute())


class ReportFailed(PnpscaleError, RuntimeError, CompactHydraException):
    """The sweep report could not be written (the points' run folders are intact); one line, exit 1."""


def finish_sweep(config: DictConfig, rets: Sequence[JobReturn]) -> None:
    """After every point ran: summary of failures, then the sweep report (``report=true``).

    The report is staged and renamed (:func:`pnpscale.results.report.write_report`): if it fails,
    or a signal arrives while it is written, the previous report is left as it was.

    Raises:
        ReportFailed: the report could not be written (logged first, one line).
    """
    from hydra.core.utils import JobStatus

    failed = [r for r in rets if r.status == JobStatus.FAILED]
    if failed:
        rest = "the others are complete" if len(failed) < len(rets) else "none completed"
        log.warning("%d of %d sweep point(s) failed; %s", len(failed), len(rets), rest)
    if config.get("report", False):
        from pnpscale.results.report import write_report
        from pnpscale.results.runs import NoRunsError

        sweep_dir = str(config.hydra.sweep.dir)
        log.info("writing the report of %s", sweep_dir)
        try:
            out = write_report(sweep_dir, echo=log.info)
            log.info("report: %s", out)
        except NoRunsError as exc:
            log.warning("no report: %s", exc)
        except Exception as exc:  # noqa: BLE001 - any report failure: one line, exit 1, runs intact
            from pnpscale.core.signals import received

            stop = received()
            if stop is not None:  # a Ctrl-C a library turned into another error: a stop, not a failure
                raise stop from None
            msg = f"report not written ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); " \
                  f"the run folders are intact: python -m pnpscale.report {sweep_dir}"  # fmt: skip
            log.error(msg)
            raise ReportFailed(msg) from None


class SweepFailed(PnpscaleError, RuntimeError):
    """Some sweep points failed (each recorded in its run folder's ``run.json``): the sweep's last line, exit 1."""


#: The most failed points the last line names one by one (beyond it: their count and where they are).
NAMED_FAILURES = 8


def end_if_failed(config: DictConfig, rets: Sequence[JobReturn], resume: str) -> None:
    """End a sweep that had failed points with one line naming every one of them (or, beyond
    :data:`NAMED_FAILURES`, their count), where their records are, and the command that runs them again.

    Raised as :class:`~pnpscale.core.errors.Abort`, so Hydra prints neither its "Error executing job"
    line nor its ``HYDRA_FULL_ERROR`` hint (it would name only the first failed point).

    Raises:
        Abort: carrying a :class:`SweepFailed` (exit 1) when any point failed.
    """
    from hydra.core.utils import JobStatus

    failed = [r for r in rets if r.status == JobStatus.FAILED]
    if not failed:
        return
    labels = [getattr(r._return_value, "label", None) or _label(r.overrides or []) for r in failed]
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    named = "; ".join(labels) if len(labels) <= NAMED_FAILURES else f"see {sweep_dir}/*/run.json"
    raise Abort(
        SweepFailed(
            f"{len(failed)} of {len(rets)} sweep point(s) failed ({named}); each run.json under {sweep_dir} "
            f"says why; to re-run only the failed points: {resume}"
        )
    )
