"""The report's ``timeline.png``: one median measured iteration, one row per rank, at the largest GPU count.

Compute → tidy table → render: :func:`timeline_table` reads the runs (``ranks.parquet``,
``collectives.parquet``) and returns the slices to draw (:func:`pnpscale.analysis.timeline_slices.slices`, on the
lowest rank's clock, seconds from the iteration's start); :func:`plot_timeline` draws them on explicit
axes; :func:`pnpscale.results.charts.save` writes the figure.

Per series (problem and variant) and mode: the complete run with the most GPUs; its *median measured
iteration* is the one whose iteration time (the slowest rank's section time, summed over sections) is the
median (the lower of the two middle ones for an even count). Ranks drawn: all when there are at most
``max_ranks`` (8); else every rank that holds an operator (``run.json``'s assignment), the critical-path rank
of each section (the report's: the rank most often critical over the measured iterations,
:func:`pnpscale.analysis.waits.rank_table`; without it, the largest compute ``S_r − Σ_c D_rc`` of the iteration
drawn), the fastest (least compute over the iteration) and the ranks closest to the median compute (typical),
the panel's title saying which ranks are drawn and why, and how many are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from pnpscale import columns as K
from pnpscale.analysis.timeline_slices import clock_offsets, slices
from pnpscale.analysis.waits import CRITICAL as CRITICAL_COL
from pnpscale.analysis.waits import OPERATORS
from pnpscale.core import layout
from pnpscale.results.plotting import KIND_COLORS, figure
from pnpscale.results.runs import read_table

ROLE = "role"
#: the sections (comma-separated) whose critical-path rank a drawn rank is ("" for none).
CRITICAL_FOR = "critical_for"
CRITICAL, FASTEST, TYPICAL, HOLDER = "critical", "fastest", "typical", "operator"
#: columns of :func:`timeline_table`: the point, the iteration, the rank and its role, and its slices.
TABLE_COLUMNS = (
    K.PROBLEM, K.MODE, K.GPUS, K.ITERATION, K.RANK, ROLE, CRITICAL_FOR, K.SECTION, K.KIND, K.START_S,
    K.DURATION_S, K.SEQ, K.COLLECTIVE, K.PAYLOAD_BYTES, K.MAIN,
)  # fmt: skip
MAX_RANKS = 8


def median_iteration(ranks: pd.DataFrame) -> int | None:
    """The measured iteration whose time (Σ over sections of max_r S_r) is the median; ``None`` without one.

    >>> r = pd.DataFrame({"rank": 0, "iteration": [0, 1, 2, 3], "section": "s",
    ...                   "warmup": [True, False, False, False], "section_s": [9.0, 3.0, 1.0, 2.0]})
    >>> median_iteration(r)
    3
    """
    m = ranks[~ranks[K.WARMUP].astype(bool)]
    if m.empty:
        return None
    per = m.groupby([K.ITERATION, K.SECTION])[K.SECTION_S].max().groupby(level=K.ITERATION).sum()
    order = per.sort_values(kind="stable")
    return int(order.index[(len(order) - 1) // 2])


def pick_ranks(
    sl: pd.DataFrame,
    max_ranks: int = MAX_RANKS,
    holders: Sequence[int] = (),
    critical: Mapping[str, int] | None = None,
) -> pd.DataFrame:
    """The ranks to draw for one iteration's slices, and why.

    Args:
        sl: :func:`pnpscale.analysis.timeline_slices.slices` rows of one iteration.
        max_ranks: the sample is filled up to this many (all ranks when the run has no more); the critical and
            operator-holding ranks are drawn even past it.
        holders: the ranks holding an operator (always drawn).
        critical: section -> its critical-path rank as the report names it (default: the largest compute of
            the iteration in ``sl``, ties to the lowest rank).

    Returns:
        RANK, ROLE (``critical`` for a section's critical-path rank, ``operator`` for a rank holding one,
        ``fastest``, ``typical``; ``""`` when every rank is drawn and it has no special role) and CRITICAL_FOR
        (the sections it is the critical-path rank of, comma-separated), ordered by rank.

    >>> sl = pd.DataFrame({"rank": range(10), "section": "s", "kind": "compute", "duration_s": range(10)})
    >>> pick_ranks(sl, 4).values.tolist()
    [[0, 'fastest', ''], [3, 'typical', ''], [4, 'typical', ''], [9, 'critical', 's']]
    >>> pick_ranks(sl, 4, holders=[0, 1, 2], critical={"s": 7})[["rank", "role"]].values.tolist()
    [[0, 'operator'], [1, 'operator'], [2, 'operator'], [5, 'typical'], [7, 'critical']]
    >>> pick_ranks(sl, 4, holders=[0, 1], critical={"s": 1}).values.tolist()[:2]
    [[0, 'operator', ''], [1, 'operator', 's']]
    """
    comp = sl[sl[K.KIND] == "compute"].groupby([K.SECTION, K.RANK])[K.DURATION_S].sum().unstack(K.RANK)
    comp = comp.reindex(columns=sorted(sl[K.RANK].unique())).fillna(0.0)
    total = comp.sum(axis=0)
    present = {int(r) for r in total.index}
    roles: dict[int, str] = {}
    crit_for: dict[int, list[str]] = {}
    for sec, row in comp.iterrows():  # critical path per section: the report's, else the largest compute
        mine = (critical or {}).get(str(sec))
        rank = int(mine) if mine is not None and int(mine) in present else int(row.idxmax())
        crit_for.setdefault(rank, []).append(str(sec))
    for r in holders:  # a holder's role says it holds an operator; CRITICAL_FOR says where it is critical too
        if int(r) in present:
            roles.setdefault(int(r), HOLDER)
    for rank in crit_for:
        roles.setdefault(rank, CRITICAL)
    if len(total) <= max_ranks:
        return pd.DataFrame({K.RANK: total.index.astype(int), ROLE: [roles.get(int(r), "") for r in total.index],
                             CRITICAL_FOR: [",".join(crit_for.get(int(r), [])) for r in total.index]})  # fmt: skip
    rest = total.drop(index=[r for r in roles if r in total.index])
    if not rest.empty and len(roles) < max_ranks:
        roles.setdefault(int(rest.idxmin()), FASTEST)
    median = float(rest.median()) if not rest.empty else 0.0
    for r in (rest - median).abs().sort_values(kind="stable").index:
        if len(roles) >= max_ranks:
            break
        roles.setdefault(int(r), TYPICAL)
    if len(roles) == len([r for r in roles if roles[r] in (CRITICAL, HOLDER)]) and not rest.empty:
        roles.setdefault(int((rest - median).abs().idxmin()), TYPICAL)  # always one of the others, for contrast
    out = pd.DataFrame(sorted(roles.items()), columns=[K.RANK, ROLE])
    out[CRITICAL_FOR] = [",".join(crit_for.get(int(r), [])) for r in out[K.RANK]]
    return out


def run_iteration(
    run_dir: Path, max_ranks: int = MAX_RANKS, holders: Sequence[int] = (), critical: Mapping[str, int] | None = None
) -> pd.DataFrame:
    """A run folder's median measured iteration, its drawn ranks' slices, seconds from the iteration's start
    on the lowest rank's clock (:func:`pnpscale.analysis.timeline_slices.clock_offsets`).

    Returns:
        :data:`TABLE_COLUMNS` without the point columns; empty when no slice can be placed (no measured
        iteration, or collective starts not recorded).

    Raises:
        ValueError: an unreadable table (``<file>: <reason>``).
    """

    ranks = read_table(run_dir / layout.RANKS)
    colls = read_table(run_dir / layout.COLLECTIVES)
    it = median_iteration(ranks)
    cols = [c for c in TABLE_COLUMNS if c not in (K.PROBLEM, K.MODE, K.GPUS)]
    if it is None:
        return pd.DataFrame(columns=cols)
    r_it, c_it = ranks[ranks[K.ITERATION] == it], colls[colls[K.ITERATION] == it]
    sl = slices(r_it, c_it)
    if sl.empty or sl.groupby([K.RANK, K.SECTION]).ngroups < len(r_it):
        return pd.DataFrame(columns=cols)  # some rank's section cannot be placed: draw nothing rather than part
    off = clock_offsets(colls)
    sl[K.START_S] = sl[K.START_S] + sl[K.RANK].map(off).fillna(0.0)
    sl[K.START_S] -= sl[K.START_S].min()
    picked = pick_ranks(sl, max_ranks, holders, critical)
    sl = sl.merge(picked, on=K.RANK, how="inner")
    if K.MAIN in colls:
        main = c_it[[K.RANK, K.SECTION, K.SEQ, K.MAIN]].assign(**{K.SECTION: c_it[K.SECTION].astype("string")})
        sl = sl.merge(main.astype({K.SEQ: "Int64"}), on=[K.RANK, K.SECTION, K.SEQ], how="left")
    else:
        sl[K.MAIN] = pd.NA
    sl[K.MAIN] = sl[K.MAIN].astype("boolean")
    sl[K.ITERATION] = it
    return sl[cols]


def timeline_table(
    table: pd.DataFrame,
    max_ranks: int = MAX_RANKS,
    skipped: dict[tuple[str, str], str] | None = None,
    wait_ranks: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """The slices of :func:`run_iteration` for the largest complete GPU count of each (problem, mode).

    Args:
        table: the report's view (:func:`pnpscale.results.series.labelled` of
            :func:`pnpscale.results.runs.load`: ``problem`` names the series), with ``run_dir`` and ``status``.
        max_ranks: see :func:`pick_ranks`.
        skipped: when given, filled with (problem, mode) -> why that run is not drawn (its slices cannot be
            placed, or a table became unreadable): one run never stops the others.
        wait_ranks: the report's per point x section x rank table (:func:`pnpscale.results.report.wait_ranks`:
            PROBLEM, MODE, GPUS, SECTION, RANK, ``operators``, ``critical``): its operator-holding ranks are drawn
            and its critical-path rank of each section is the one named (the report's text names the same).

    Returns:
        :data:`TABLE_COLUMNS` plus ``world_size`` (ranks in the run, drawn or not) and TIME_SHARED (the
        point's flag, NA unknown); empty (with those columns) when no run can be drawn.
    """
    done = table[(table["status"] == layout.STATUS_COMPLETE) & (table[K.SECTION] == "all")]
    frames = []
    for (problem, mode), grp in done.groupby([K.PROBLEM, K.MODE], sort=True):
        top = grp.sort_values(K.GPUS).iloc[-1]
        holders, critical = _assignment(wait_ranks, str(problem), str(mode), int(top[K.GPUS]))
        try:
            sl = run_iteration(Path(top["run_dir"]), max_ranks, holders, critical)
        except (ValueError, KeyError) as exc:  # a table that became unreadable since it was loaded
            if skipped is not None:
                skipped[(str(problem), str(mode))] = f"{type(exc).__name__}: {exc}"
            continue
        if sl.empty:
            if skipped is not None:
                skipped[(str(problem), str(mode))] = (
                    f"gpus={int(top[K.GPUS])}: no measured iteration whose slices can be placed "
                    "(collective starts not recorded)"
                )
            continue
        shared = top.get(K.TIME_SHARED)
        flag = None if shared is None or pd.isna(shared) else bool(shared)
        frames.append(sl.assign(**{K.PROBLEM: problem, K.MODE: mode, K.GPUS: int(top[K.GPUS]),
                                   K.WORLD_SIZE: int(top[K.GPUS]), K.TIME_SHARED: flag}))  # fmt: skip
    cols = [*TABLE_COLUMNS, K.WORLD_SIZE, K.TIME_SHARED]
    if not frames:
        return pd.DataFrame(columns=cols)
    return pd.concat(frames, ignore_index=True)[cols]


def _assignment(
    wait_ranks: pd.DataFrame | None, problem: str, mode: str, gpus: int
) -> tuple[list[int], dict[str, int]]:
    """The operator-holding ranks and each section's critical rank of one point in ``wait_ranks`` (none: empty)."""
    if wait_ranks is None or wait_ranks.empty:
        return [], {}
    w = wait_ranks[(wait_ranks[K.PROBLEM] == problem) & (wait_ranks[K.MODE] == mode) & (wait_ranks[K.GPUS] == gpus)]
    ops = w[OPERATORS] if OPERATORS in w else pd.Series(dtype="Int64")
    holders = sorted({int(r) for r, n in zip(w[K.RANK], ops, strict=False) if pd.notna(n) and int(n) > 0})
    crit = w[w[CRITICAL_COL].astype("boolean").fillna(False).to_numpy(dtype=bool)] if CRITICAL_COL in w else w.iloc[0:0]
    return holders, {str(s): int(r) for s, r in zip(crit[K.SECTION], crit[K.RANK], strict=True)}


def critical_ranks(tl: pd.DataFrame) -> dict[str, int]:
    """Section -> the critical-path rank of one panel of :func:`timeline_table` (its CRITICAL_FOR): the rank
    the chart marks and the README names."""
    out: dict[str, int] = {}
    for rank, secs in tl.drop_duplicates(K.RANK)[[K.RANK, CRITICAL_FOR]].itertuples(index=False):
        for sec in str(secs).split(",") if isinstance(secs, str) and secs else []:
            out[sec] = int(rank)
    return out


def _span_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``0–3, 7``."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and parts[-1].split("–")[-1] == str(r - 1):
            parts[-1] = f"{parts[-1].split('–')[0]}–{r}"
        else:
            parts.append(str(r))
    return ", ".join(parts)


def drawn_note(roles: pd.Series, critical: Mapping[str, int] | None = None) -> str:
    """Which ranks a panel draws and why (rank -> ROLE; ``critical``: section -> its critical-path rank,
    :func:`critical_ranks`).

    >>> note = drawn_note(pd.Series({0: "operator", 1: "operator", 16: "critical", 40: "typical"}), {"s": 16, "t": 1})
    >>> note.split("; ")[0]
    'drawn: ranks 0–1 (hold an operator), 16 (critical path), 40 (a sample of the rest)'
    >>> note.split("; ")[1]
    'critical path: s rank 16, t rank 1'
    """
    what = {HOLDER: "hold an operator", CRITICAL: "critical path", FASTEST: "fastest", TYPICAL: "a sample of the rest"}
    parts = []
    for role in (HOLDER, CRITICAL, FASTEST, TYPICAL):
        mine = [int(r) for r, v in roles.items() if v == role]
        if mine:
            parts.append(f"{_span_text(mine)} ({what[role]})")
    crit = "; critical path: " + ", ".join(f"{s} rank {r}" for s, r in critical.items()) if critical else ""
    return "drawn: ranks " + ", ".join(parts) + crit


def _label(payload: object) -> str:
    if payload is None or pd.isna(payload):
        return ""
    b = float(payload)  # type: ignore[arg-type]
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f" {b / scale:.3g} {unit}"
    return f" {int(b)} B"


def plot_timeline(tl: pd.DataFrame) -> Figure:
    """One panel per (problem, mode): the drawn ranks as rows, their slices as bars coloured by kind
    (:data:`pnpscale.results.plotting.KIND_COLORS`), every drawn rank's section boundaries as bars across its
    row (the lowest drawn rank's named above the panel), the critical-path rank (:func:`critical_ranks`, the
    report's) named on its row, the main collectives labelled (name and payload) above the panel, and in the
    title which ranks are drawn and why (:func:`drawn_note`) and how many are not."""

    panels = sorted({(p, m) for p, m in zip(tl[K.PROBLEM], tl[K.MODE], strict=True)}) or [("", "")]
    heights = [max(1.6, 0.45 * tl[(tl[K.PROBLEM] == p) & (tl[K.MODE] == m)][K.RANK].nunique() + 1.8) for p, m in panels]
    fig, axes = figure(len(panels), 1, (12, sum(heights) + 0.8), squeeze=False,
                        gridspec_kw={"height_ratios": heights})  # fmt: skip
    names: list[tuple[Any, float, float, str, float]] = []  # collective labels, placed once the layout is set
    for ax, (problem, mode) in zip(axes[:, 0], panels, strict=True):
        sub = tl[(tl[K.PROBLEM] == problem) & (tl[K.MODE] == mode)]
        if sub.empty:
            ax.text(0.5, 0.5, "no run whose slices can be placed", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        drawn = sorted(int(r) for r in sub[K.RANK].unique())
        y = {r: i for i, r in enumerate(reversed(drawn))}
        for kind, color in KIND_COLORS.items():
            k = sub[sub[K.KIND] == kind]
            # hidden communication lies over the compute it overlaps: a strip at the bottom of the row
            band = (-0.4, 0.22) if kind == "hidden" else (-0.4, 0.8)
            for r, g in k.groupby(K.RANK):
                ax.broken_barh(list(zip(g[K.START_S], g[K.DURATION_S], strict=True)), (y[int(r)] + band[0], band[1]),
                               facecolors=color, label=kind)  # fmt: skip
        for r, mine in sub[sub[K.KIND] != "hidden"].groupby(K.RANK):  # every drawn rank's section boundaries
            for _, g in mine.groupby(K.SECTION, sort=False):
                for x in (float(g[K.START_S].min()), float((g[K.START_S] + g[K.DURATION_S]).max())):
                    ax.plot([x, x], [y[int(r)] - 0.5, y[int(r)] + 0.5], color="black", lw=1.0)
        first = sub[sub[K.RANK] == drawn[0]]
        for sec, g in first.groupby(K.SECTION, sort=False):
            x0 = float(g[K.START_S].min())
            ax.text(x0, 1.0, f" {sec}", fontsize=8, va="bottom", ha="left", transform=ax.get_xaxis_transform())
        roles = sub.drop_duplicates(K.RANK).set_index(K.RANK)[ROLE]
        crit: dict[int, list[str]] = {}
        for sec, rank in critical_ranks(sub).items():
            crit.setdefault(rank, []).append(sec)
        ticks = []
        for r in reversed(drawn):
            own = roles[r] if roles[r] != CRITICAL else ""  # an operator holder may be critical too
            why = "; ".join(w for w in (own, f"critical: {', '.join(crit[r])}" if r in crit else "") if w)
            ticks.append(f"rank {r}" + (f"\n({why})" if why else ""))
        ax.set_yticks(range(len(drawn)), ticks, fontsize=9)
        for label, r in zip(ax.get_yticklabels(), reversed(drawn), strict=True):
            if r in crit:
                label.set_fontweight("bold")
        comm = sub[sub[K.KIND] == "transfer"]
        main = comm[comm[K.MAIN].fillna(False).astype(bool)] if comm[K.MAIN].notna().any() else comm
        for (_, _), g in main.groupby([K.SECTION, K.SEQ], sort=False):
            x = float((g[K.START_S] + g[K.DURATION_S]).max())
            name = str(g[K.COLLECTIVE].iloc[0]) + _label(g[K.PAYLOAD_BYTES].iloc[0])
            payload = g[K.PAYLOAD_BYTES].iloc[0]
            names.append((ax, x, len(drawn) - 0.45, name, 0.0 if pd.isna(payload) else float(payload)))
        ax.set_ylim(-0.6, len(drawn) + 0.1)
        ax.set_xlim(0, float((sub[K.START_S] + sub[K.DURATION_S]).max()) * 1.01)
        ax.set_xlabel("seconds from the iteration's start (lowest rank's clock)")
        world = int(sub[K.WORLD_SIZE].iloc[0])
        hidden = world - len(drawn)
        extra = f"; {len(drawn)} of {world} ranks drawn, {hidden} not drawn" if hidden else ""
        if hidden:
            extra += "\n" + drawn_note(roles, critical_ranks(sub)).replace("; critical path", "\ncritical path")
        if K.TIME_SHARED in sub and sub[K.TIME_SHARED].astype("boolean").fillna(False).any():
            extra += f"\ntime-shared: {world} ranks on too few cores (or GPUs), not a scaling result"
        ax.set_title(
            f"{problem} {mode}, {int(sub[K.GPUS].iloc[0])} GPUs: iteration {int(sub[K.ITERATION].iloc[0])} "
            f"(median measured){extra}",
            fontsize=10,
            pad=14,
        )
        ax.grid(False, axis="y")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
    fig.suptitle("One iteration per rank: compute, then per collective its wait (for the last rank) and transfer")
    fig.tight_layout(rect=(0, 0.45 / (sum(heights) + 0.8), 1, 1))
    _place_labels(fig, names)
    return fig


def _place_labels(fig: Figure, labels: list[tuple[Any, float, float, str, float]]) -> None:
    """Draw the collective labels that fit: the largest payloads first (then in time order), each ending at
    its collective's end, skipping any that would overlap a label already drawn on its panel (a training
    iteration holds dozens of collectives); a panel with labels left out says how many in its lower right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg


    renderer = FigureCanvasAgg(fig).get_renderer()
    placed: dict[Any, list[Any]] = {}
    skipped: dict[Any, int] = {}
    left: dict[Any, float] = {}  # each panel's left edge (pixels): a label never starts before it
    for ax, x, y, name, _ in sorted(labels, key=lambda t: (-t[4], t[1])):
        text = ax.annotate(name, (x, y), xytext=(-2, 1), textcoords="offset points", fontsize=7, ha="right",
                           va="bottom", color=KIND_COLORS["transfer"])  # fmt: skip
        box = text.get_window_extent(renderer).expanded(1.02, 1.0)
        if ax not in left:
            left[ax] = ax.get_window_extent(renderer).x0
        if box.x0 < left[ax] or any(box.overlaps(other) for other in placed.get(ax, [])):
            text.remove()
            skipped[ax] = skipped.get(ax, 0) + 1
            continue
        placed.setdefault(ax, []).append(box)
    for ax, n in skipped.items():
        shown = len(placed.get(ax, []))
        ax.title.set_text(f"{ax.title.get_text()}; {shown} of {shown + n} collectives labelled (no room for the rest)")
