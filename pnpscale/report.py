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
        from pnpscale.core import layout

        out = layout.report_folder(sys.argv[1:])
        said = layout.report_not_written(out) if out is not None else "report not written"
        print(f"pnpscale.report: {signals.as_interrupted(exc)}: {said}", file=sys.stderr)
        return signals.exit_code(exc)


if __name__ == "__main__":
    raise SystemExit(_main())
