"""pnpscale: does adding GPUs to deepinv's distributed PnP solver keep paying off, and why.

Run ``python -m pnpscale -m gpus=1,2,4 problem=2d``; see README.md. In a notebook,
``pnpscale.load("outputs/")`` returns the tidy table of every run (one row per run x section).

Throughout the docstrings, *the study* is the one pnpscale reproduces and generalises:
"Communication under the hood: transfer vs wait" (deepinv's distributed PnP benchmark on V100s,
4 per node, up to 64 GPUs): its metric definitions (POP), configurations and charts.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def load(path: str, **kwargs: Any) -> Any:
    """The report's tidy table (``summary.parquet``) of every run under ``path``, as a DataFrame.

    One row per point x section (section ``"all"`` = combined), typed ``problem``, ``mode``,
    ``gpus`` columns, times in seconds per measured iteration, LB / CommE / PE, GPU-seconds and the
    scaled cost; failed points appear with their status and NaN metrics. See
    :func:`pnpscale.results.runs.load` and :func:`pnpscale.results.summary.scaled_cost` (imported lazily).
    """
    from pnpscale.results.runs import load as _load
    from pnpscale.results.summary import scaled_cost

    return scaled_cost(_load(path, **kwargs))
