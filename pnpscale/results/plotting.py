"""Shared drawing helpers of the report's charts: pyplot-free figures, the GPU axis, series labels.

Every chart module (:mod:`pnpscale.results.charts`, :mod:`pnpscale.results.compare`,
:mod:`pnpscale.results.projection.output`, ...) draws on a :func:`figure` and labels a sweep's variants as
their own series with :func:`pnpscale.results.series.labelled`; none imports another chart module's private helpers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import seaborn as sns
from matplotlib.figure import Figure

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
