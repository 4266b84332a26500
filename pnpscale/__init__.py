"""pnpscale: does adding GPUs to deepinv's distributed PnP solver keep paying off, and why.

Run ``python -m pnpscale -m gpus=1,2,4 problem=2d``; see README.md. In a notebook,
``pnpscale.load("outputs/")`` returns the tidy table of every run (one row per run x section).

Throughout the docstrings, *the study* is the one pnpscale reproduces and generalises:
"Communication under the hood: transfer vs wait" (deepinv's distributed PnP benchmark on V100s,
4 per node, up to 64 GPUs): its metric definitions (POP), configurations and charts.

The package reads as the data flows, one floor per stage, every import running down
(``tests/test_architecture.py``): :mod:`pnpscale.core` (with :mod:`pnpscale.columns` and
:mod:`pnpscale.core.layout`, the ground floor), :mod:`pnpscale.analysis`, :mod:`pnpscale.rank`,
:mod:`pnpscale.cluster`, :mod:`pnpscale.results`, :mod:`pnpscale.sweep`, :mod:`pnpscale.validation`,
and the thin commands (``__main__``, ``analyze``, ``report``, ``validate``, ``project``). The one
exception is this facade: :func:`load` imports the results stage when called.
"""

from __future__ import annotations

import warnings
from typing import Any

from pnpscale.core import __version__

__all__ = ["__version__", "load"]


def load(path: str, **kwargs: Any) -> Any:
    """The report's tidy table (``summary.parquet``) of every run under ``path``, as a DataFrame.

    One row per point x section (section ``"all"`` = combined), typed ``problem``, ``mode``,
    ``gpus`` columns, times in seconds per measured iteration, LB / CommE / PE, GPU-seconds and the
    scaled cost, and the spread over the measured iterations (``section_p10_s`` ... ``lb_p90``, beside
    ``iterations``: :mod:`pnpscale.analysis.spread`); failed points appear with their status and NaN metrics. See
    :func:`pnpscale.results.runs.load` and :func:`pnpscale.results.summary.scaled_cost` (imported lazily). A
    point held by several run folders takes the newest complete one, said by a warning and in
    ``table.attrs["choices"]``.
    """
    from pnpscale.results.runs import load as _load  # deferred: the package root stays light (pandas)
    from pnpscale.results.summary import scaled_cost  # deferred: the package root stays light (pandas)

    with warnings.catch_warnings(record=True) as said:  # said again below at the caller's line, not this one
        runs = _load(path, **kwargs)
    for w in said:
        warnings.warn(w.message, w.category, stacklevel=2)
    table = scaled_cost(runs)
    table.attrs["choices"] = runs.attrs.get("choices", [])  # which folder each point came from, where several
    return table
