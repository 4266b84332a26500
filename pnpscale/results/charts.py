"""The study's charts, drawn from the table of :func:`pnpscale.results.summary.scaled_cost`.

Each ``plot_*`` function takes that tidy table (:func:`pnpscale.load`'s, or the report's) and returns a
matplotlib Figure (built without pyplot: no backend or global state is touched, so it works headless and
displays in notebooks); a sweep's variants (``solver.denoiser_collective``, ``problem.num_operators``) are
drawn as their own series, ``2d denoiser_collective=all_gather`` (:func:`pnpscale.results.series.labelled`);
:func:`save` writes it. Missing points (failed or incomplete runs) are drawn as red crosses on the x axis and
break the lines (never silently dropped). Time axes are seconds per measured iteration; GPU counts
are on a log-2 axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.results.plotting import KIND_COLORS, figure, log2_x
from pnpscale.results.series import labelled

ALL = "all"
#: Line styles of problems whose runs do not name one (records older than the problem registry).
FALLBACK_STYLES = ("-", "--", ":", "-.")


def line_styles(table: pd.DataFrame) -> dict[str, str]:
    """Problem (or series, ``2d denoiser_collective=all_gather``) -> matplotlib line style: the problem's
    own (``conf/problem/<name>.yaml``'s ``linestyle``, carried by its runs) unless a series earlier in name
    order has it already (two variants of one problem), else the first of :data:`FALLBACK_STYLES` not yet
    taken (cycling when all are).

    >>> line_styles(pd.DataFrame({"problem": ["3d", "2d", "ct"], "linestyle": [None, None, ":"]}))
    {'2d': '-', '3d': '--', 'ct': ':'}
    >>> line_styles(pd.DataFrame({"problem": ["2d", "2d num_operators=2", "3d"], "linestyle": ["-", "-", "--"]}))
    {'2d': '-', '2d num_operators=2': ':', '3d': '--'}
    """
    own: dict[str, str] = {}
    named = table.dropna(subset=["linestyle"]) if "linestyle" in table else table.iloc[0:0]
    for problem, style in zip(named["problem"], named.get("linestyle", []), strict=False):
        own.setdefault(str(problem), str(style))
    series = sorted({str(p) for p in table["problem"]})
    styles: dict[str, str] = {}
    for problem in series:  # the problems' own styles first, then the rest in name order
        if problem in own and own[problem] not in styles.values():
            styles[problem] = own[problem]
    for problem in series:
        if problem not in styles:
            free = [s for s in FALLBACK_STYLES if s not in styles.values() and s not in own.values()]
            free = free or [s for s in FALLBACK_STYLES if s not in styles.values()]
            styles[problem] = free[0] if free else FALLBACK_STYLES[len(styles) % len(FALLBACK_STYLES)]
    return dict(sorted(styles.items()))


def _panels(table: pd.DataFrame) -> list[tuple[str, str]]:
    return sorted({(p, m) for p, m in zip(table["problem"], table["mode"], strict=True)})


def _mark_missing(ax: Any, table: pd.DataFrame, problem: str | None = None, mode: str | None = None) -> None:
    bad = table[table["status"] != "complete"]
    if problem is not None:
        bad = bad[(bad["problem"] == problem) & (bad["mode"] == mode)]
    gpus = sorted({int(g) for g in bad["gpus"]})
    if gpus:
        ax.plot(
            gpus,
            [0.0] * len(gpus),
            "x",
            color="red",
            ms=10,
            mew=2,
            clip_on=False,
            transform=ax.get_xaxis_transform(),
            label="missing (failed run)",
        )


def _line(ax: Any, grp: pd.DataFrame, y: str, all_gpus: list[int], **kw: Any) -> None:
    """Plot y vs gpus with NaN at every GPU count of the sweep that this group lacks (a gap), and, where the
    table has the spread of ``y`` (:data:`pnpscale.columns.SPREAD_COLUMNS`), a band from its per-iteration
    p10 to p90 in the line's colour (values <= 0 left out: they cannot sit on a log axis)."""
    positive_only = kw.pop("positive", False)
    s = grp.set_index("gpus")[y].reindex(all_gpus)
    (line,) = ax.plot(s.index, s.to_numpy(dtype=float), marker="o", **kw)
    lo, hi = K.spread_column(y, 10), K.spread_column(y, 90)
    if y in K.SPREAD_METRICS and lo in grp and hi in grp:
        band = grp.set_index("gpus")[[lo, hi]].reindex(all_gpus).astype(float)
        positive = band.where(band > 0) if positive_only else band
        ax.fill_between(band.index, positive[lo], positive[hi], color=line.get_color(), alpha=0.18, lw=0)
        ax.vlines(band.index, positive[lo], positive[hi], color=line.get_color(), alpha=0.45, lw=3)  # lone points


def plot_scaled_cost(table: pd.DataFrame) -> Figure:
    """Chart 1: scaled GPU-seconds per GPU count, stacked compute vs communication, ideal = 1.0."""
    table = labelled(table)  # one series per (problem, variant)
    panels = _panels(table)
    fig, axes = figure(1, len(panels), (max(8.0, 5.0 * len(panels)), 4.4), squeeze=False, sharey=True)
    colors = sns.color_palette("deep")
    all_rows = table[table[K.SECTION] == ALL]
    totals = (all_rows["scaled_compute"] + all_rows["scaled_comm"]).to_numpy(float)
    finite = totals[np.isfinite(totals)]
    top = max(1.2, 1.15 * float(finite.max())) if finite.size else 1.2
    for ax, (problem, mode) in zip(axes[0], panels, strict=True):
        sub = table[(table["problem"] == problem) & (table["mode"] == mode) & (table[K.SECTION] == ALL)]
        sub = sub.sort_values("gpus")
        labels = [str(int(g)) for g in sub["gpus"]]
        x = np.arange(len(sub))
        comp, comm = sub["scaled_compute"].to_numpy(float), sub["scaled_comm"].to_numpy(float)
        ax.bar(x, comp, color=colors[0], label="compute")
        ax.bar(x, comm, bottom=comp, color=colors[3], label="communication (transfer + wait)")
        for xi, (status, total) in enumerate(zip(sub["status"], comp + comm, strict=True)):
            if status != "complete":
                ax.text(xi, 0.05, "missing", rotation=90, ha="center", va="bottom", color="red")
            else:
                ax.text(xi, total, f"{total:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", ls="--", lw=1, label="ideal (linear scaling)")
        ax.set_ylim(0, top)
        ax.set_xticks(x, labels)
        ax.set_xlabel("GPUs (ranks)")
        base = sub["baseline_gpus"].dropna()
        ax.set_title(f"{problem} {mode}" + (f" (baseline {int(base.iloc[0])} GPU)" if not base.empty else ""))
    axes[0][0].set_ylabel("GPU-seconds relative to baseline")
    axes[0][-1].legend(loc="upper left", fontsize=8)
    fig.suptitle("Scaled GPU-seconds: 1.0 = perfect linear scaling")
    fig.tight_layout()
    return fig


def _per_section(table: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any], list[int]]:
    """Complete per-section rows keyed ``"<mode>: <section>"``, a colour per key, and every GPU count."""
    data = table[(table[K.SECTION] != ALL) & (table["status"] == "complete")].copy()
    data["key"] = data["mode"].astype(str) + ": " + data[K.SECTION].astype(str)
    keys = sorted(data["key"].unique())
    palette = dict(zip(keys, sns.color_palette("tab10", len(keys)), strict=False))
    return data, palette, sorted({int(g) for g in table["gpus"]})


def _section_lines(
    ax: Any, data: pd.DataFrame, col: str, palette: dict[str, Any], all_gpus: list[int], positive: bool = False
) -> None:
    """One line per (problem, mode: section): colour by section, line style by problem (2D solid, 3D dashed);
    its p10–p90 band (``positive``: band values <= 0 left out, for a log axis)."""
    styles = line_styles(data)
    for (problem, key), grp in data.groupby(["problem", "key"]):
        _line(
            ax, grp, col, all_gpus, color=palette[key], ls=styles[str(problem)], label=f"{problem} {key}",
            positive=positive,
        )  # fmt: skip


def plot_components(table: pd.DataFrame) -> Figure:
    """Chart 2: compute, transfer and wait per section vs GPU count (s/iteration), 2D solid, 3D dashed."""
    table = labelled(table)  # one series per (problem, variant)
    data, palette, all_gpus = _per_section(table)
    fig, axes = figure(1, 3, (15, 5.4), sharey=True)
    panels = [(K.COMPUTE_S, "compute"), (K.TRANSFER_S, "transfer"), (K.WAIT_S, "wait")]
    for ax, (col, title) in zip(axes, panels, strict=True):
        positive = data.assign(**{col: data[col].where(data[col] > 0)})  # zeros cannot sit on a log axis
        _section_lines(ax, positive, col, palette, all_gpus, positive=True)
        _mark_missing(ax, table)
        log2_x(ax, all_gpus)
        if (data[col] > 0).any():
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no complete run with a non-zero value", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, color=KIND_COLORS[title])
    axes[0].set_ylabel("seconds per iteration (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    fig.suptitle(
        "Compute, transfer and wait per section (2D solid, 3D dashed; zeros not drawn; "
        "band: p10–p90 of the measured iterations)"
    )
    rows = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, min(0.35, 0.06 * rows + 0.02), 1, 1))
    return fig


def _ratio_chart(table: pd.DataFrame, col: str, title: str, ylabel: str) -> Figure:
    table = labelled(table)  # one series per (problem, variant)
    panels = _panels(table)
    all_gpus = sorted({int(g) for g in table["gpus"]})
    fig, axes = figure(1, len(panels), (max(9.0, 5.0 * len(panels)), 4.4), squeeze=False, sharey=True)
    for ax, (problem, mode) in zip(axes[0], panels, strict=True):
        sub = table[(table["problem"] == problem) & (table["mode"] == mode) & (table["status"] == "complete")]
        sections = [s for s in dict.fromkeys(sub[K.SECTION]) if s != ALL]
        colors = sns.color_palette("tab10", len(sections))
        for color, section in zip(colors, sections, strict=True):
            _line(ax, sub[sub[K.SECTION] == section], col, all_gpus, color=color, ls="-", label=section)
        _line(
            ax,
            sub[sub[K.SECTION] == ALL],
            col,
            all_gpus,
            color="black",
            ls="--",
            label="combined (all sections)",
        )
        _mark_missing(ax, table, problem, mode)
        log2_x(ax, all_gpus)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{problem} {mode}")
        ax.legend(fontsize=8, loc="lower left")
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title + "\nband: p10–p90 of the measured iterations", fontsize=11)
    fig.tight_layout()
    return fig


def plot_load_balance(table: pd.DataFrame) -> Figure:
    """Chart 3: load balance per section (solid) and combined over sections (dashed) vs GPU count."""
    return _ratio_chart(
        table, K.LB, "Load balance: LB = C / C_max (section, solid) and ΣC / ΣC_max (dashed)", "load balance"
    )


def plot_comm_efficiency(table: pd.DataFrame) -> Figure:
    """Chart 4: communication efficiency per section and combined vs GPU count."""
    return _ratio_chart(
        table, K.COMM_E, "Communication efficiency: CommE = ΣC_max / ΣS_max (section solid, combined dashed)", "CommE"
    )


def plot_wait_pct(table: pd.DataFrame) -> Figure:
    """Chart 5: wait as a percentage of compute per section vs GPU count (2D solid, 3D dashed)."""
    table = labelled(table)  # one series per (problem, variant)
    data, palette, all_gpus = _per_section(table)
    fig, ax = figure(1, 1, (8, 4.6))
    _section_lines(ax, data, "wait_pct_of_compute", palette, all_gpus)
    _mark_missing(ax, table)
    log2_x(ax, all_gpus)
    ax.set_ylabel("wait / compute (%)")
    ax.set_title("Wait as % of compute per section (2D solid, 3D dashed; band: p10–p90 of the iterations)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


CAUSE_LABELS = {
    K.WAIT_LATE_START_S: "late start (entry skew)",
    K.WAIT_IMBALANCE_S: "uneven work (systematic)",
    K.WAIT_JITTER_S: "jitter (the rest)",
}


def plot_wait_causes(table: pd.DataFrame) -> Figure:
    """Chart 6: wait by cause per section vs GPU count, stacked (s/iteration), one panel per section.

    Positive parts stack upwards, negative ones (a late start that saved wait, a faster-than-usual
    critical rank) downwards; a black dot marks the measured wait (their sum). Points without the split
    (run folders older than it) are labelled ``no split``; failed points ``missing``.
    """
    table = labelled(table)  # one series per (problem, variant)
    data = table[(table[K.SECTION] != ALL)]
    keys = sorted({(p, m, s) for p, m, s in zip(data["problem"], data["mode"], data[K.SECTION], strict=True)})
    keys = keys or [("", "", "")]
    ncols = min(2, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = figure(nrows, ncols, (6.5 * ncols, 3.8 * nrows), squeeze=False)
    colors = dict(zip(CAUSE_LABELS, sns.color_palette("deep")[1:4], strict=True))
    for ax, (problem, mode, section) in zip(axes.flat, keys, strict=False):
        sub = data[(data["problem"] == problem) & (data["mode"] == mode) & (data[K.SECTION] == section)]
        sub = sub.sort_values("gpus")
        x = np.arange(len(sub))
        up, down = np.zeros(len(sub)), np.zeros(len(sub))
        for col, label in CAUSE_LABELS.items():
            v = (sub[col] if col in sub else pd.Series(np.nan, index=sub.index)).to_numpy(float)
            v = np.nan_to_num(v)
            pos, neg = np.clip(v, 0, None), np.clip(v, None, 0)
            ax.bar(x, pos, bottom=up, color=colors[col], label=label)
            ax.bar(x, neg, bottom=down, color=colors[col])
            up, down = up + pos, down + neg
        ax.plot(x, sub[K.WAIT_S].to_numpy(float), "o", color="black", label="measured wait")
        ax.axhline(0, color="black", lw=0.8)
        for xi, (_, r) in enumerate(sub.iterrows()):
            if r["status"] != "complete":
                ax.text(xi, 0, "missing", rotation=90, ha="center", va="bottom", color="red")
            elif any(c not in r or pd.isna(r[c]) for c in CAUSE_LABELS):
                ax.text(xi, 0, "no split", rotation=90, ha="center", va="bottom", color="gray")
        ax.set_xticks(x, [str(int(g)) for g in sub["gpus"]])
        ax.set_xlabel("GPUs (ranks)")
        ax.set_ylabel("wait per iteration (s)")
        ax.set_title(f"{problem} {mode}: {section}")
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Why ranks wait: wait split by cause (late start + uneven work + jitter = measured wait)")
    fig.tight_layout()
    return fig


CHARTS = {
    layout.SCALED_COST_PNG: plot_scaled_cost,
    layout.COMPONENTS_PNG: plot_components,
    layout.LOAD_BALANCE_PNG: plot_load_balance,
    layout.COMM_EFFICIENCY_PNG: plot_comm_efficiency,
    layout.WAIT_PCT_PNG: plot_wait_pct,
    layout.WAIT_CAUSES_PNG: plot_wait_causes,
}


def save(fig: Figure, path: Path) -> None:
    """Write ``fig`` as a PNG atomically (temporary name, then rename: :func:`pnpscale.core.layout.atomic_path`)."""

    with layout.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
