"""``python -m pnpscale [-m] key=value ...``: the Hydra app (see README.md and conf/config.yaml)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from pnpscale.sweep.config import ConfigError, register_schema


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from pnpscale.sweep.task import run

    run(cfg)


def main() -> None:
    """Check the command line, then hand over to Hydra.

    Exit codes: 0 every point complete; 1 a point failed, or the report could not be written; 2 a
    refused command line or sweep (nothing started); 128 + signal number for SIGINT (130), SIGTERM
    (143) or SIGHUP (129), after the running point was recorded as failed and the report written.
    """
    from pnpscale.sweep import signals
    from pnpscale.sweep.cli import CommandLineError, check_overrides, check_single_point

    signals.install()
    # a log file that cannot be written (a full disk) must not print a traceback per record: the console
    # still gets every line, and the failure itself is recorded in run.json
    logging.raiseExceptions = False
    try:
        try:
            check_overrides(sys.argv[1:])
            check_single_point(sys.argv[1:])
        except (ConfigError, CommandLineError) as exc:
            for line in str(exc).splitlines():
                print(f"pnpscale: error: {line}", file=sys.stderr)
            raise SystemExit(2) from None
        register_schema()
        _hydra_main()
        signals.check()  # a stop whose exception Python swallowed (a weakref callback) still ends as a stop
    except KeyboardInterrupt as exc:
        stop = signals.as_interrupted(exc)
        print(f"pnpscale: {stop}; the run folder of the point that was running says so", file=sys.stderr)
        raise SystemExit(signals.exit_code(exc)) from None


if __name__ == "__main__":
    main()
