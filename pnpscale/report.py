"""``python -m pnpscale.report DIR [--out OUT]``: the sweep report of any folder of run folders.

The command only; the report lives in :mod:`pnpscale.results.report`. Stop signals are handled before
its heavy imports (pandas, matplotlib): a Ctrl-C while they load is one line and exit 130.
"""

import sys


def _main() -> int:
    from pnpscale.core import signals

    signals.install()
    try:
        from pnpscale.results.report import main

        return main()
    except KeyboardInterrupt as exc:  # main() handles the stops it sees; this is one before it started
        print(f"pnpscale.report: {signals.as_interrupted(exc)}: report not written", file=sys.stderr)
        return signals.exit_code(exc)


if __name__ == "__main__":
    raise SystemExit(_main())
