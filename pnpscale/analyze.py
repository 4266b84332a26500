"""``python -m pnpscale.analyze TRACE_DIR --sections ...``: offline analysis of any job's Kineto traces.

The command only; the analysis lives in :mod:`pnpscale.analysis.offline`. Its one stop-signal handler is
installed before any other import (:func:`pnpscale.core.signals.install_command`): a Ctrl-C is one line
and exit 130 (a staging folder removed by this process), never a ``KeyboardInterrupt`` traceback.
"""

from pnpscale.core import signals

if __name__ == "__main__":  # run as the command (an import as a library changes nothing)
    signals.install_command("pnpscale.analyze")



def _not_written() -> str:
    return "no analysis written (the tables of an earlier analysis in that folder are intact)"


if __name__ == "__main__":
    signals.not_written(_not_written)

from pnpscale.analysis.offline import main  # noqa: E402 - after the handler: a stop while it imports is one line

if __name__ == "__main__":
    raise SystemExit(signals.run_command(main, _not_written))
