"""Shared drawing helpers of the report's charts: pyplot-free figures, the GPU axis, series labels.

Every chart module (:mod:`pnpscale.results.charts`, :mod:`pnpscale.results.compare`,
:mod:`pnpscale.results.projection.output`, ...) draws on a :func:`figure` and labels a sweep's variants as
their own series with :func:`labelled`; none imports another chart module's private helpers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from pnpscale import columns as K

#: Colours of the time kinds, the same in every chart: compute blue (the scaled cost's compute), transfer
#: orange, wait red (the scaled cost's communication), hidden (communication behind compute) grey.
KIND_COLORS = dict(zip(("compute", "transfer", "wait", "hidden"), [sns.color_palette("deep")[i] for i in (0, 1, 3, 7)],
                       strict=True))  # fmt: skip


def figure(nrows: int, ncols: int, figsize: tuple[float, float], **kw: Any) -> tuple[Figure, Any]:
    """A pyplot-free Figure (no backend, no global state) in seaborn's whitegrid style."""
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=figsize)
        axes = fig.subplots(nrows, ncols, **kw)
    return fig, axes


def log2_x(ax: Any, gpus: Iterable[int]) -> None:
    """A log-2 GPU axis with a tick at each GPU count of ``gpus``."""
    ticks = sorted({int(g) for g in gpus})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("GPUs (ranks)")


def series_label(problem: str, variant: object) -> str:
    """``problem`` plus its variant, if any.

    >>> series_label("2d", ""), series_label("2d", "denoiser_collective=all_gather")
    ('2d', '2d denoiser_collective=all_gather')
    """
    return f"{problem} {variant}" if isinstance(variant, str) and variant else str(problem)


def labelled(table: pd.DataFrame) -> pd.DataFrame:
    """The table with each variant folded into ``problem`` (``2d denoiser_collective=all_gather``),
    so that views keyed by (problem, mode) draw one series per variant.

    Idempotent: a row whose ``problem`` already carries its variant is kept as is, so every view
    (charts, projection) may call it on :func:`pnpscale.load`'s table or on the report's view.

    >>> t = pd.DataFrame({"problem": ["2d", "2d"], "variant": ["", "denoiser_collective=all_gather"]})
    >>> labelled(labelled(t))["problem"].tolist()
    ['2d', '2d denoiser_collective=all_gather']
    """
    if K.VARIANT not in table:
        return table
    variant = table[K.VARIANT].fillna("").astype(str)
    if not (variant != "").any():
        return table
    out = table.copy()
    out["problem"] = [
        str(p) if not v or str(p).endswith(f" {v}") else series_label(str(p), v)
        for p, v in zip(out["problem"], variant, strict=True)
    ]
    return out
