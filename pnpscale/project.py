"""``python -m pnpscale.project SWEEP_DIR --gpus 128,256,512,1024 [--gpus-per-node 4] [--rate ROUTE=GBps ...]
[--algorithm NODES=ALGO ...] [--pe-min 0.8] [--devices D] [--tolerance 0.1] [--fit-gpus 1,2,4] [--out DIR]``:
project a sweep's scaling curve past the measured GPU counts.

The entry point only; the command is :mod:`pnpscale.results.projection.command`, the model lives in
:mod:`pnpscale.results.projection.model` (and the ``projection_*`` modules it assembles), the files in
:mod:`pnpscale.results.projection.output`. Stop signals: one handler from the first import, one line,
exit 130 (:func:`pnpscale.core.signals.install_command`).
"""

from pnpscale.core import signals


def main() -> int:
    """The ``pnpscale-project`` console command (``python -m pnpscale.project``); returns the exit status."""
    signals.install_command("pnpscale.project")
    from pnpscale.results.projection.command import main as project_main  # deferred: the stop handler first

    return signals.run_command(project_main, lambda: "no projection written (an earlier one is intact)")


if __name__ == "__main__":
    raise SystemExit(main())
