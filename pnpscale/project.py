"""``python -m pnpscale.project SWEEP_DIR --gpus 128,256,512,1024 [--gpus-per-node 4] [--rate ROUTE=GBps ...]
[--algorithm NODES=ALGO ...] [--pe-min 0.8] [--devices D] [--tolerance 0.1] [--fit-gpus 1,2,4] [--out DIR]``:
project a sweep's scaling curve past the measured GPU counts.

The entry point only; the command is :mod:`pnpscale.results.projection.command`, the model lives in
:mod:`pnpscale.results.projection.model` (and the ``projection_*`` modules it assembles), the files in
:mod:`pnpscale.results.projection.output`. Stop signals: one handler from the first import, one line,
exit 130 (:func:`pnpscale.core.signals.install_command`).
"""

from pnpscale.core import signals

if __name__ == "__main__":  # run as the command (an import as a library changes nothing)
    signals.install_command("pnpscale.project")

from pnpscale.results.projection.command import main  # noqa: E402 - after the handler: a stop while it imports

if __name__ == "__main__":
    raise SystemExit(signals.run_command(main, lambda: "no projection written (an earlier one is intact)"))
