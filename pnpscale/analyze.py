"""``python -m pnpscale.analyze TRACE_DIR --sections ...`` (console: ``pnpscale-analyze``): offline analysis of
any job's Kineto traces.

The command only; the analysis lives in :mod:`pnpscale.analysis.offline`. Its one stop-signal handler is
installed before any other import (:func:`pnpscale.core.signals.install_command`): a Ctrl-C is one line
and exit 130 (a staging folder removed by this process), never a ``KeyboardInterrupt`` traceback.
"""

from pnpscale.core import signals


def _not_written() -> str:
    return "no analysis written (the tables of an earlier analysis in that folder are intact)"


def main() -> int:
    """The ``pnpscale-analyze`` console command (``python -m pnpscale.analyze``); returns the exit status."""
    signals.install_command("pnpscale.analyze")
    signals.not_written(_not_written)
    from pnpscale.analysis.offline import main as analyze_main  # deferred: the stop handler before pandas

    return signals.run_command(analyze_main, _not_written)


if __name__ == "__main__":
    raise SystemExit(main())
