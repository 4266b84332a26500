"""``python -m pnpscale [-m] key=value ...``: the Hydra app (see README.md and conf/config.yaml)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from pnpscale.sweep.config import ConfigError, register_schema


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from pnpscale.sweep.task import run

    run(cfg)


def main() -> None:
    """Check the command line, then hand over to Hydra."""
    from pnpscale.sweep.cli import CommandLineError, check_overrides, check_single_point

    try:
        check_overrides(sys.argv[1:])
        check_single_point(sys.argv[1:])
    except (ConfigError, CommandLineError) as exc:
        for line in str(exc).splitlines():
            print(f"pnpscale: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    register_schema()
    try:
        _hydra_main()
    except KeyboardInterrupt:
        print("pnpscale: interrupted; the run folder of the point that was running says so", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
