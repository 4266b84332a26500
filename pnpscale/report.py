"""``python -m pnpscale.report DIR [--out OUT]``: the sweep report of any folder of run folders.

The command only; the report lives in :mod:`pnpscale.results.report`. Stop signals are handled before
its heavy imports (pandas, matplotlib): a Ctrl-C while they load is one line and exit 130.
"""

import sys

from pnpscale.core import layout, signals


def main() -> int:
    """The ``pnpscale-report`` console command (``python -m pnpscale.report``); returns the exit code."""

    signals.install()
    try:
        from pnpscale.results.report import main as report_main  # deferred: a stop during the heavy imports is caught

        return report_main()
    except KeyboardInterrupt as exc:  # main() handles the stops it sees; this is one before it started

        out = layout.report_folder(sys.argv[1:])
        said = layout.report_not_written(out) if out is not None else "report not written"
        print(f"pnpscale.report: {signals.as_interrupted(exc)}: {said}", file=sys.stderr)
        return signals.exit_code(exc)


if __name__ == "__main__":
    raise SystemExit(main())
