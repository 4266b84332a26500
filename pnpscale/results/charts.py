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
#: the scaled-cost chart goes to a log axis when its tallest bar passes this (the ideal line stays readable).
LOG_ABOVE = 6.0
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


#: the legend entry of the hollow markers (and hatched bars) of time-shared points.
TIME_SHARED_LABEL = "hollow / hatched: time-shared (ranks x threads > cores): not a scaling result"


def shared_gpus(table: pd.DataFrame) -> set[int]:
    """The GPU counts of ``table``'s rows whose point time-shared cores or GPUs (TIME_SHARED true; NA: not)."""
    if K.TIME_SHARED not in table:
        return set()
    flag = table[K.TIME_SHARED].astype("boolean").fillna(False).to_numpy(dtype=bool)
    return {int(g) for g in table.loc[flag, "gpus"]}


def _legend_once(ax: Any, label: str, **kw: Any) -> None:
    """A legend proxy for ``label`` on ``ax`` unless it has one."""
    if label not in ax.get_legend_handles_labels()[1]:
        ax.plot([], [], **kw, label=label)


def legend_below(fig: Figure, axes: Any, ncol: int = 4) -> None:
    """One legend for the whole figure, below its panels (never over the data, never cut at a panel's edge):
    every entry of every panel once, in the order first seen; the panels' room is made with ``tight_layout``.

    Args:
        fig: the figure; axes: its panels (any array or list of them).
        ncol: entries per legend row.
    """
    handles: list[Any] = []
    labels: list[str] = []
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles, labels = [*handles, h], [*labels, lab]
    cols = min(ncol, max(1, len(labels)))
    fig.legend(handles, labels, loc="lower center", ncol=cols, fontsize=8)
    rows = -(-len(labels) // cols)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, min(0.45, (0.22 * rows + 0.1) / height), 1, 1))


def mark_time_shared(ax: Any, rows: pd.DataFrame, values: pd.Series, color: Any) -> None:
    """Hollow markers over the points of one line whose ranks time-shared cores or GPUs, and the legend entry
    :data:`TIME_SHARED_LABEL` once per panel.

    Args:
        ax: the panel.
        rows: the line's rows (``gpus`` and TIME_SHARED columns; :func:`shared_gpus`).
        values: the plotted values indexed by GPU count (NaN: no marker).
        color: the line's colour (the markers' edge).
    """
    shared = sorted(g for g in shared_gpus(rows) if g in values.index and np.isfinite(float(values[g])))
    if shared:
        ax.plot(shared, values[shared].to_numpy(dtype=float), "o", ms=9, mfc="white", mec=color, mew=1.8)
        _legend_once(ax, TIME_SHARED_LABEL, marker="o", ls="none", mfc="white", mec="black")


def _line(ax: Any, grp: pd.DataFrame, y: str, all_gpus: list[int], **kw: Any) -> bool:
    """Plot y vs gpus with NaN at every GPU count of the sweep that this group lacks (a gap), and, where the
    table has the spread of ``y`` (:data:`pnpscale.columns.SPREAD_COLUMNS`), a band from its per-iteration
    p10 to p90 in the line's colour (values <= 0 left out: they cannot sit on a log axis). Time-shared points
    (:func:`shared_gpus`) get hollow markers. Returns whether a band of non-zero width was drawn."""
    positive_only = kw.pop("positive", False)
    s = grp.set_index("gpus")[y].reindex(all_gpus)
    (line,) = ax.plot(s.index, s.to_numpy(dtype=float), marker="o", **kw)
    mark_time_shared(ax, grp, s, line.get_color())
    lo, hi = K.spread_column(y, 10), K.spread_column(y, 90)
    if y in K.SPREAD_METRICS and lo in grp and hi in grp:
        band = grp.set_index("gpus")[[lo, hi]].reindex(all_gpus).astype(float)
        positive = band.where(band > 0) if positive_only else band
        ax.fill_between(band.index, positive[lo], positive[hi], color=line.get_color(), alpha=0.18, lw=0)
        ax.vlines(band.index, positive[lo], positive[hi], color=line.get_color(), alpha=0.45, lw=3)  # lone points
        width = (positive[hi] - positive[lo]).to_numpy(dtype=float)
        return bool((np.nan_to_num(width) > 0).any())
    return False


def band_note(drawn: bool) -> str:
    """What a chart's title says of its bands: only what it drew.

    >>> band_note(True), band_note(False)
    ('band: p10–p90 of the measured iterations', 'no p10–p90 band: too few measured iterations to draw one')
    """
    drew = "band: p10–p90 of the measured iterations"
    return drew if drawn else "no p10–p90 band: too few measured iterations to draw one"


def style_note(table: pd.DataFrame) -> str:
    """The line styles of the problems present, in words (``2d solid, 3d dashed``): a legend true to the sweep.

    >>> style_note(pd.DataFrame({"problem": ["2d"], "linestyle": ["-"]}))
    '2d solid'
    """
    words = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
    return ", ".join(f"{p} {words.get(s, s)}" for p, s in line_styles(table).items())


def plot_scaled_cost(table: pd.DataFrame) -> Figure:
    """Chart 1: scaled GPU-seconds per GPU count, stacked compute vs communication, ideal = 1.0."""
    table = labelled(table)  # one series per (problem, variant)
    panels = _panels(table)
    fig, axes = figure(1, len(panels), (max(8.0, 5.0 * len(panels)), 5.0), squeeze=False, sharey=True)
    all_rows = table[table[K.SECTION] == ALL]
    totals = (all_rows["scaled_compute"] + all_rows["scaled_comm"]).to_numpy(float)
    finite = totals[np.isfinite(totals)]
    top = max(1.2, 1.15 * float(finite.max())) if finite.size else 1.2
    log = top > LOG_ABOVE  # on a linear 0-140 axis the ideal line at 1.0 is lost: a log axis keeps it readable
    for ax, (problem, mode) in zip(axes[0], panels, strict=True):
        sub = table[(table["problem"] == problem) & (table["mode"] == mode) & (table[K.SECTION] == ALL)]
        sub = sub.sort_values("gpus")
        labels = [str(int(g)) for g in sub["gpus"]]
        x = np.arange(len(sub))
        comp, comm = sub["scaled_compute"].to_numpy(float), sub["scaled_comm"].to_numpy(float)
        shared = [int(g) in shared_gpus(sub) for g in sub["gpus"]]
        hatch = ["//" if s else None for s in shared]
        ax.bar(x, comp, color=KIND_COLORS["compute"], label="compute", hatch=hatch, edgecolor="white")
        ax.bar(x, comm, bottom=comp, color=KIND_COLORS["wait"], label="communication (transfer + wait)",
               hatch=hatch, edgecolor="white")  # fmt: skip
        if any(shared):
            ax.bar([0], [0], color="lightgray", hatch="//", edgecolor="white", label=TIME_SHARED_LABEL)
        for xi, (status, total, sh) in enumerate(zip(sub["status"], comp + comm, shared, strict=True)):
            if status != "complete":
                ax.text(xi, 0.05 if not log else 0.12, "missing", rotation=90, ha="center", va="bottom", color="red")
            else:
                ax.text(xi, total, f"{total:.2f}" + (" time-shared" if sh else ""), ha="center", va="bottom",
                        fontsize=8, rotation=90 if sh else 0)  # fmt: skip
        ax.axhline(1.0, color="black", ls="--", lw=1.5, label="ideal (linear scaling)", zorder=3)
        ax.text(1.0, 1.0, " ideal 1.0", transform=ax.get_yaxis_transform(), va="center", ha="left", fontsize=8)
        if log:
            ax.set_yscale("log")
            ax.set_ylim(0.1, top * 2)
        else:
            ax.set_ylim(0, top)
        ax.set_xticks(x, labels)
        ax.set_xlabel("GPUs (ranks)")
        base = sub["baseline_gpus"].dropna()
        ax.set_title(f"{problem} {mode}" + (f" (baseline {int(base.iloc[0])} GPU)" if not base.empty else ""))
    axes[0][0].set_ylabel("GPU-seconds relative to baseline" + (" (log)" if log else ""))
    fig.suptitle("Scaled GPU-seconds: 1.0 = perfect linear scaling" + (" (log axis)" if log else ""))
    legend_below(fig, axes, ncol=2)  # below the bars: never over a bar's label
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
) -> bool:
    """One line per (problem, mode: section): colour by section, line style by problem (:func:`style_note`);
    its p10–p90 band (``positive``: band values <= 0 left out, for a log axis). Returns whether a band was drawn."""
    styles = line_styles(data)
    drawn = False
    for (problem, key), grp in data.groupby(["problem", "key"]):
        drawn |= _line(
            ax, grp, col, all_gpus, color=palette[key], ls=styles[str(problem)], label=f"{problem} {key}",
            positive=positive,
        )  # fmt: skip
    return drawn


def plot_components(table: pd.DataFrame) -> Figure:
    """Chart 2: compute, transfer and wait per section vs GPU count (s/iteration), a line style per problem.

    "transfer" is every collective's (TRANSFER_S); the main (image-sized) collective's share of it
    (MAIN_TRANSFER_S, what ``transfer.png`` models) is drawn beside it, thin and dotted, where it differs."""
    table = labelled(table)  # one series per (problem, variant)
    data, palette, all_gpus = _per_section(table)
    fig, axes = figure(1, 3, (15, 5.4), sharey=True)
    panels = [(K.COMPUTE_S, "compute"), (K.TRANSFER_S, "transfer"), (K.WAIT_S, "wait")]
    banded = False
    for ax, (col, title) in zip(axes, panels, strict=True):
        positive = data.assign(**{col: data[col].where(data[col] > 0)})  # zeros cannot sit on a log axis
        banded |= _section_lines(ax, positive, col, palette, all_gpus, positive=True)
        if col == K.TRANSFER_S and K.MAIN_TRANSFER_S in data:
            main = data[K.MAIN_TRANSFER_S].astype(float)
            differs = data.assign(_m=main.where((main > 0) & ((data[col] - main).abs() > 1e-12 * data[col].abs())))
            for (_, key), grp in differs.dropna(subset=["_m"]).groupby(["problem", "key"]):
                s = grp.set_index("gpus")["_m"].reindex(all_gpus)
                ax.plot(s.index, s.to_numpy(dtype=float), ls=":", lw=1, marker=".", color=palette[key])
                _legend_once(ax, "dotted: the main collective's share (transfer.png)", ls=":", color="black")
            title = "transfer (all collectives)"
        _mark_missing(ax, table)
        log2_x(ax, all_gpus)
        if (data[col] > 0).any():
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "no complete run with a non-zero value", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, color=KIND_COLORS[title.split(" ")[0]])
    axes[0].set_ylabel("seconds per iteration (log)")
    fig.suptitle(
        f"Compute, transfer and wait per section ({style_note(data) or 'no complete run'}; zeros not drawn; "
        f"{band_note(banded)})"
    )
    legend_below(fig, axes)  # the proxies only some panels hold (main collective, time-shared) included
    return fig


def _ratio_chart(table: pd.DataFrame, col: str, title: str, ylabel: str) -> Figure:
    table = labelled(table)  # one series per (problem, variant)
    panels = _panels(table)
    all_gpus = sorted({int(g) for g in table["gpus"]})
    fig, axes = figure(1, len(panels), (max(9.0, 5.0 * len(panels)), 5.0), squeeze=False, sharey=True)
    banded = False
    for ax, (problem, mode) in zip(axes[0], panels, strict=True):
        sub = table[(table["problem"] == problem) & (table["mode"] == mode) & (table["status"] == "complete")]
        sections = [s for s in dict.fromkeys(sub[K.SECTION]) if s != ALL]
        colors = sns.color_palette("tab10", len(sections))
        for color, section in zip(colors, sections, strict=True):
            banded |= _line(ax, sub[sub[K.SECTION] == section], col, all_gpus, color=color, ls="-", label=section)
        banded |= _line(
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
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(f"{title}\n{band_note(banded)}", fontsize=11)
    legend_below(fig, axes, ncol=3)
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
    """Chart 5: wait as a percentage of compute per section vs GPU count (a line style per problem)."""
    table = labelled(table)  # one series per (problem, variant)
    data, palette, all_gpus = _per_section(table)
    fig, ax = figure(1, 1, (8, 4.6))
    banded = _section_lines(ax, data, "wait_pct_of_compute", palette, all_gpus)
    _mark_missing(ax, table)
    log2_x(ax, all_gpus)
    ax.set_ylabel("wait / compute (%)")
    ax.set_title(f"Wait as % of compute per section\n({style_note(data) or 'no complete run'}; {band_note(banded)})",
                 fontsize=10)  # fmt: skip
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
    # shades of wait's red (plotting.KIND_COLORS): the causes are parts of the wait, not other kinds of time
    colors = dict(zip(CAUSE_LABELS, sns.light_palette(KIND_COLORS["wait"], 5, reverse=True)[:3], strict=True))
    for ax, (problem, mode, section) in zip(axes.flat, keys, strict=False):
        sub = data[(data["problem"] == problem) & (data["mode"] == mode) & (data[K.SECTION] == section)]
        sub = sub.sort_values("gpus")
        x = np.arange(len(sub))
        up, down = np.zeros(len(sub)), np.zeros(len(sub))
        hatch = ["//" if int(g) in shared_gpus(sub) else None for g in sub["gpus"]]
        for col, label in CAUSE_LABELS.items():
            v = (sub[col] if col in sub else pd.Series(np.nan, index=sub.index)).to_numpy(float)
            v = np.nan_to_num(v)
            pos, neg = np.clip(v, 0, None), np.clip(v, None, 0)
            ax.bar(x, pos, bottom=up, color=colors[col], label=label, hatch=hatch, edgecolor="white")
            ax.bar(x, neg, bottom=down, color=colors[col], hatch=hatch, edgecolor="white")
            up, down = up + pos, down + neg
        ax.plot(x, sub[K.WAIT_S].to_numpy(float), "o", color="black", label="measured wait")
        if any(hatch):
            ax.bar([0], [0], color="lightgray", hatch="//", edgecolor="white", label=TIME_SHARED_LABEL)
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
