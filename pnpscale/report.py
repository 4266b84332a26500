"""``python -m pnpscale.report DIR [--out OUT]`` (console: ``pnpscale-report``): the sweep report of any folder
of run folders.

The command only; the report lives in :mod:`pnpscale.results.report`. Its one stop-signal handler is
installed before the heavy imports (:func:`pnpscale.core.signals.install_command`): a Ctrl-C while pandas
and matplotlib load is one line and exit 130; while the report is written, one line, exit 130, the staging
folder removed by this process and the previous report intact; once the report is published, ignored.
"""

import sys

from pnpscale.core import layout, signals  # light (the core floor): the line can say what is intact


def _not_written() -> str:
    out = layout.report_folder(sys.argv[1:])
    return layout.report_not_written(out) if out is not None else "report not written"


def main() -> int:
    """The ``pnpscale-report`` console command (``python -m pnpscale.report``); returns the exit status."""
    signals.install_command("pnpscale.report")
    signals.not_written(_not_written)
    from pnpscale.results.report import main as report_main  # deferred: the stop handler before pandas, matplotlib

    return signals.run_command(report_main, _not_written)


if __name__ == "__main__":
    raise SystemExit(main())
