"""pnpscale's local launcher: Hydra's basic launcher that validates every sweep point first.

Registered as ``hydra/launcher: pnpscale_basic`` (the default in ``conf/config.yaml``). Before
any point runs, every point's config is composed and checked (:func:`validate_points`); a bad
point stops the sweep with one line per bad point and nothing started. After the points ran
(failed ones included), the sweep report is written when ``report=true``.
"""

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("pnpscale")


class SweepConfigError(SystemExit):
    """One or more sweep points are invalid: printed one line per problem, exit code 2.

    A ``SystemExit`` (not an ``Exception``) so that Hydra does not wrap it: the sweep stops before
    anything started, with the same ``pnpscale: error:`` lines and exit code as the command-line check.
    """

    def __init__(self, message: str) -> None:
        for line in message.splitlines():
            print(f"pnpscale: error: {line}", file=sys.stderr)
        super().__init__(2)


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
        check: callable raising :class:`pnpscale.sweep.config.ConfigError` for a bad point.

    Returns:
        the composed config of every point, in order.

    Raises:
        SweepConfigError: one line per bad point (exit code 2); nothing was launched.
    """
    from pnpscale.sweep.config import ConfigError

    composed, seen = [], {}
    problems: dict[str, list[str]] = {}
    for overrides in job_overrides:
        cfg = config_loader.load_sweep_config(config, list(overrides))
        try:
            check(cfg)
        except ConfigError as exc:
            problems.setdefault(str(exc), []).append(_label(overrides))
        sub = str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
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
        _remove_empty_sweep_dir(config)
        raise SweepConfigError("invalid sweep, nothing was started:\n" + "\n".join(lines))
    return composed


def _remove_empty_sweep_dir(config: DictConfig) -> None:
    """Drop the sweep folder Hydra made before launching, when it holds only its multirun.yaml."""
    from pathlib import Path

    sweep_dir = Path(str(config.hydra.sweep.dir))
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {"multirun.yaml"}:
        for p in sweep_dir.iterdir():
            p.unlink()
        sweep_dir.rmdir()


def check_local(cfg: DictConfig) -> None:
    """A local point: its values, and no complete run of another spec in its folder (resume)."""
    from pathlib import Path

    from pnpscale.sweep.point import resolve_point

    resolve_point(cfg, Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir))


class PnpscaleBasicLauncher(BasicLauncher):
    """Hydra's basic (sequential, in-process) launcher, plus validation and the sweep report."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.hydra_context is not None and self.config is not None
        validate_points(self.hydra_context.config_loader, self.config, job_overrides, check_local)
        try:
            rets = super().launch(job_overrides, initial_job_idx)
        except KeyboardInterrupt:
            log.error("interrupted: the remaining sweep points were not run; re-run with hydra.sweep.dir=%s to resume",
                      self.config.hydra.sweep.dir)  # fmt: skip
            finish_sweep(self.config, [])
            raise
        finish_sweep(self.config, rets)
        return rets


def finish_sweep(config: DictConfig, rets: Sequence[JobReturn]) -> None:
    """After every point ran: summary of failures, then the sweep report (``report=true``)."""
    from hydra.core.utils import JobStatus

    failed = [r for r in rets if r.status == JobStatus.FAILED]
    if failed:
        rest = "the others are complete" if len(failed) < len(rets) else "none completed"
        log.warning("%d of %d sweep point(s) failed; %s", len(failed), len(rets), rest)
    if config.get("report", False):
        from pnpscale.results.report import write_report

        sweep_dir = str(config.hydra.sweep.dir)
        try:
            out = write_report(sweep_dir, echo=log.info)
            log.info("report: %s", out)
        except Exception as exc:  # noqa: BLE001 - a report failure must not hide the runs
            log.error("report failed: %s", exc)
