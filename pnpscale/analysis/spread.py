"""How much a run's numbers move from one measured iteration to the next (pure functions).

The report's values are means over the measured iterations; this module keeps, per section (and the
combined section ``all``), the per-iteration quantiles of :data:`pnpscale.columns.SPREAD_METRICS`:
p10, p50 (median) and p90 (:data:`pnpscale.columns.SPREAD_QUANTILES`; linear interpolation between the
sorted values, numpy's default), named by :func:`pnpscale.columns.spread_column` (``section_p10_s``,
``lb_p90``...). Per iteration i and section s (``sections.parquet``, POP's per-iteration values):
``section_s`` = mean_r S_r, ``compute_s`` = C, ``transfer_s`` = T, ``wait_s`` = W, ``lb`` = C / C_max,
``comm_e`` = C_max / mean_r S_r, ``wait_pct_of_compute`` = 100 W / C. For ``all``, per iteration, the
times are summed over the top-level sections and ``lb`` = ΣC / ΣC_max, ``comm_e`` = ΣC_max / ΣS,
``wait_pct_of_compute`` = 100 ΣW / ΣC.

With fewer than :data:`MIN_ITERATIONS` measured iterations the quantiles are still given, but they are
too few to say how much a value moves (the report says so, and the comparison of variants does not
call a difference a gain).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from pnpscale import columns as K

ALL = "all"
#: fewer measured iterations than this: too few to state a spread (p10 / p90 of 4 values are mostly the extremes).
MIN_ITERATIONS = 5
_TIMES = (K.SECTION_S, K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S)


def per_iteration(sections: pd.DataFrame, nested: Mapping[str, str] | None = None) -> pd.DataFrame:
    """One row per measured iteration x section, plus section ``all`` per iteration.

    Args:
        sections: a ``sections`` table (:func:`pnpscale.analysis.metrics.decompose`; seconds per iteration).
        nested: section -> its enclosing section (left out of ``all``, as in
            :func:`pnpscale.analysis.metrics.summarize`).

    Returns:
        ITERATION, SECTION and :data:`pnpscale.columns.SPREAD_METRICS` (plus COMPUTE_MAX_S); ratios NaN where
        their denominator is 0. Warm-up iterations are left out.
    """
    m = sections[~sections[K.WARMUP].astype(bool)]
    m = m[[K.ITERATION, K.SECTION, *_TIMES]].assign(**{K.SECTION: m[K.SECTION].astype(str)})
    top = m[~m[K.SECTION].isin(list(nested or {}))]
    both = top.groupby(K.ITERATION, as_index=False)[list(_TIMES)].sum(min_count=1).assign(**{K.SECTION: ALL})
    out = pd.concat([m, both], ignore_index=True)
    c, cmax, s, w = (out[k].astype("float64") for k in (K.COMPUTE_S, K.COMPUTE_MAX_S, K.SECTION_S, K.WAIT_S))
    with np.errstate(divide="ignore", invalid="ignore"):
        out[K.LB] = np.where(cmax != 0, c / cmax, np.nan)
        out[K.COMM_E] = np.where(s != 0, cmax / s, np.nan)
        out[K.WAIT_PCT_OF_COMPUTE] = np.where(c != 0, 100.0 * w / c, np.nan)
    return out.reset_index(drop=True)


def spread(sections: pd.DataFrame, nested: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Per section (and ``all``): the number of measured iterations and the per-iteration quantiles.

    Returns:
        SECTION, ITERATIONS (measured iterations) and :data:`pnpscale.columns.SPREAD_COLUMNS`; empty (with
        those columns) without a measured iteration.

    >>> sec = pd.DataFrame({"iteration": [0, 1, 2, 3], "section": "s", "warmup": [True, False, False, False],
    ...                     "section_s": [9.0, 1.0, 2.0, 3.0], "compute_s": [9.0, 1.0, 2.0, 3.0],
    ...                     "compute_max_s": [9.0, 1.0, 2.0, 3.0], "transfer_s": 0.0, "wait_s": 0.0})
    >>> row = spread(sec).set_index("section").loc["s"]
    >>> int(row["iterations"]), float(row["section_p10_s"]), float(row["section_p50_s"]), float(row["section_p90_s"])
    (3, 1.2, 2.0, 2.8)
    """
    per = per_iteration(sections, nested)
    cols = [K.SECTION, K.ITERATIONS, *K.SPREAD_COLUMNS]
    if per.empty:
        return pd.DataFrame(columns=cols)
    g = per.groupby(K.SECTION, sort=False)
    out = pd.DataFrame({K.ITERATIONS: g[K.ITERATION].nunique()})
    for metric in K.SPREAD_METRICS:
        for q in K.SPREAD_QUANTILES:
            out[K.spread_column(metric, q)] = g[metric].quantile(q / 100)
    return out.reset_index()[cols]


def too_few(iterations: object) -> bool:
    """True when ``iterations`` measured iterations are too few to state a spread (< :data:`MIN_ITERATIONS`)."""
    return pd.isna(iterations) or int(iterations) < MIN_ITERATIONS  # type: ignore[call-overload]
