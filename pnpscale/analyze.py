"""``python -m pnpscale.analyze TRACE_DIR --sections ...``: offline analysis of any job's Kineto traces.

The command only; the analysis lives in :mod:`pnpscale.analysis.offline`.
"""

from pnpscale.analysis.offline import main

if __name__ == "__main__":
    raise SystemExit(main())
