"""``python -m pnpscale [-m] key=value ...``: the Hydra app (see README.md and conf/config.yaml)."""

from __future__ import annotations

from pnpscale.core import signals

if __name__ == "__main__":  # one handler from the first import: a stop while Hydra imports is one line
    signals.install_command("pnpscale")

import sys  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from pnpscale.core.config import CONF_DIR, register_schema  # noqa: E402
from pnpscale.core.errors import Abort, PnpscaleError, report_lines  # noqa: E402
from pnpscale.sweep.cli import check_overrides, check_single_point  # noqa: E402
from pnpscale.sweep.task import STOPPED_POINTS, run  # noqa: E402


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")  # conf/, or a wheel's
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode


    try:
        run(cfg)
    except PnpscaleError as exc:
        if HydraConfig.get().mode == RunMode.RUN:  # a single run: one line, not Hydra's three
            raise Abort(exc) from None
        raise  # a sweep point: its launcher records it and ends the sweep with one line


def main() -> None:
    """Check the command line, then hand over to Hydra.

    Exit codes: 0 every point complete; 1 a point failed, or the report could not be written; 2 a
    refused command line or sweep (nothing started); 128 + signal number for SIGINT (130), SIGTERM
    (143) or SIGHUP (129), after the running point was recorded as failed and the report written.
    """

    signals.install()
    import logging

    logging.raiseExceptions = False  # a log file on a full disk loses lines, never prints "--- Logging error ---"
    try:
        try:
            check_overrides(sys.argv[1:])
            check_single_point(sys.argv[1:])
        except PnpscaleError as exc:  # ConfigError, CommandLineError: refused input, nothing started
            for line in report_lines(exc):
                print(line, file=sys.stderr)
            raise SystemExit(exc.exit_code) from None
        register_schema()
        _hydra_main()
        signals.check()  # a stop whose exception Python swallowed (a weakref callback) still ends as a stop
    except Abort as stop:  # a launcher or sweeper refused the sweep (or could not write it), under Hydra
        if not getattr(stop.error, "logged", False):  # a report failure is already its one line in the log
            for line in report_lines(stop.error):
                print(line, file=sys.stderr)
        raise SystemExit(stop.error.exit_code) from None
    except KeyboardInterrupt as exc:

        stop_ = signals.as_interrupted(exc)
        running = (
            f"; the point that was running is recorded as failed in its run folder {STOPPED_POINTS[-1]}"
            if STOPPED_POINTS
            else ""  # stopped between points (or before any ran): nothing was running
        )
        print(f"pnpscale: {stop_}{running}", file=sys.stderr)
        raise SystemExit(signals.exit_code(exc)) from None


if __name__ == "__main__":
    main()
