"""``python -m pnpscale.report DIR [--out OUT]``: the sweep report of any folder of run folders.

The command only; the report lives in :mod:`pnpscale.results.report`. Its one stop-signal handler is
installed before any other import (:func:`pnpscale.core.signals.install_command`): a Ctrl-C while pandas
and matplotlib load is one line and exit 130; while the report is written, one line, exit 130, the staging
folder removed by this process and the previous report intact; once the report is published, ignored.
"""

from pnpscale.core import signals

if __name__ == "__main__":  # run as the command (an import as a library changes nothing)
    signals.install_command("pnpscale.report")

import sys  # noqa: E402 - after the handler: a stop while the command imports is one line

from pnpscale.core import layout  # noqa: E402 - light (the core floor): the line can say what is intact


def _not_written() -> str:
    out = layout.report_folder(sys.argv[1:])
    return layout.report_not_written(out) if out is not None else "report not written"


if __name__ == "__main__":
    signals.not_written(_not_written)

from pnpscale.results.report import main  # noqa: E402 - pandas, matplotlib: seconds

if __name__ == "__main__":
    raise SystemExit(signals.run_command(main, _not_written))
