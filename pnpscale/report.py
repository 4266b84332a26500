"""``python -m pnpscale.report DIR [--out OUT]``: the sweep report of any folder of run folders.

The command only; the report lives in :mod:`pnpscale.results.report`.
"""

from pnpscale.results.report import main

if __name__ == "__main__":
    raise SystemExit(main())
