"""Sweep report: charts, ``summary.parquet`` and a README from any folder of run folders.

``python -m pnpscale.report DIR [--out OUT]`` (also run at the end of every multirun) reads every
run under ``DIR`` (several sweeps and reruns: the newest complete run per point wins, and the
choice is printed), then writes ``DIR/report/``::

    scaled_cost.png  compute_transfer_wait.png  load_balance.png  comm_efficiency.png  wait_pct.png
    summary.parquet  (the tidy table, one row per point x section, with scaled cost)
    transfer.png     (inference: measured transfer and its prediction from one rate per route)
    transfer.parquet (inference: bytes per GPU, algorithm, route, rate, prediction, error per run x section)
    rates.parquet    (one rate per route and the rows that made it)
    wait_causes.png  (wait by cause per section vs GPU count)
    timeline.png     (the largest GPU count of each (problem, mode): one median iteration, a row per rank)
    wait_ranks.parquet (per point x section x rank: compute, critical-path share, wait by cause, assignment)
    projection.png, projection.parquet, projection_validation.parquet, projection.md
                     (only when something is projected: a (problem, mode) with >= 3 measured GPU counts
                     the model may describe, see pnpscale.results.projection.output; otherwise the README
                     says why, e.g. that no honest projection exists from time-shared CPU ranks)
    compare.png, compare.parquet  (when the runs vary problem, solver.denoiser_collective or
                     problem.num_operators: the values side by side per GPU count, pnpscale.results.compare)
    README.md        (a table per (problem, mode) with each point's time-shared flag, the study's headline
                      checks (time-shared points named first), why the ranks wait, transfer explained, the
                      projection, the side-by-side comparison)

A variant (a value of ``solver.denoiser_collective`` or ``problem.num_operators`` that the runs of one
(problem, mode) vary) is its own series everywhere: ``2d denoiser_collective=all_gather``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from pnpscale import columns as K
from pnpscale.analysis.anomalies import summary_lines
from pnpscale.analysis.spread import MIN_ITERATIONS, too_few
from pnpscale.analysis.waits import RANK_TABLE_COLUMNS, rank_table
from pnpscale.core import layout, signals
from pnpscale.core.errors import command_prog
from pnpscale.core.record import RecordError, read_record
from pnpscale.rank.assignment import section_work
from pnpscale.results.charts import CHARTS, save
from pnpscale.results.compare import COMPARE, COMPARE_PNG, comparison, plot_comparison
from pnpscale.results.compare import markdown as compare_markdown
from pnpscale.results.plotting import figure
from pnpscale.results.projection.command import options_command, user_projection
from pnpscale.results.projection.output import (
    Options,
    ProjectionError,
    default_targets,
    project,
    rank_samples,
    readme_section,
    with_algorithms,
    write_files,
)
from pnpscale.results.runs import NoRunsError, build_table, read_table
from pnpscale.results.series import labelled
from pnpscale.results.summary import describe, headline_checks
from pnpscale.results.timeline_chart import ROLE, critical_ranks, drawn_note, plot_timeline, timeline_table
from pnpscale.results.transfer import (
    MISS_TOLERANCE,
    calibrate,
    plot_transfer,
    predict,
    transfer_inputs,
    transfer_rows,
)

SUMMARY, README, TRANSFER, RATES = layout.SUMMARY, layout.REPORT_README, layout.TRANSFER, layout.RATES
TRANSFER_PNG = layout.TRANSFER_PNG
WAIT_RANKS = layout.WAIT_RANKS


#: Every file a report folder may hold besides the charts (removed when a new report no longer writes it).
REPORT_FILES = (
    SUMMARY, README, TRANSFER, RATES, TRANSFER_PNG, WAIT_RANKS,
    layout.PROJECTION, layout.PROJECTION_VALIDATION, layout.PROJECTION_PNG, layout.PROJECTION_MD,
    layout.PROJECTION_OPTIONS, layout.PROJECTION_OVERLAP,
    layout.COMPARE, layout.COMPARE_PNG, layout.TIMELINE_PNG,
)  # fmt: skip


def write_report(path: str | Path, out: str | Path | None = None, echo: Callable[[str], None] = print) -> Path:
    """Write the report of every run under ``path`` into ``out`` (default ``path/report``).

    Every file is written into a staging folder first and moved into ``out`` together
    (:func:`pnpscale.core.layout.commit_folder`): a failure (a full disk) or a signal while it is written
    leaves the previous report as it was.

    Returns:
        the report folder.

    Raises:
        NoRunsError: no run folder under ``path``.
        OSError: the report could not be written (the previous one is intact).
    """

    table = build_table(path, echo)
    view = labelled(table)  # one series per (problem, variant)
    for line in too_few_points(view):
        echo(line)
    out = Path(out) if out is not None else Path(path) / layout.REPORT_DIR

    def build(stage: Path) -> None:
        for name, plot in CHARTS.items():
            save(plot(view), stage / name)
        table.to_parquet(stage / SUMMARY, index=False)
        ranks = wait_ranks(view)
        ranks.to_parquet(stage / WAIT_RANKS, index=False)
        transfer = transfer_explained(view)
        charts = list(CHARTS)
        if transfer is not None:
            rows, rates = transfer
            save(plot_transfer_figure(rows, shared_points(view)), stage / TRANSFER_PNG)
            charts.append(TRANSFER_PNG)
            rows.to_parquet(stage / TRANSFER, index=False)
            rates.to_parquet(stage / RATES, index=False)
        files: dict[str, Callable[[Path], None]] = {}
        extra = comparison_section(table, stage, files)
        for name, write in files.items():
            write(stage / name)
        projected = project_sweep(view, stage, out)
        if (stage / layout.PROJECTION_PNG).exists():  # drawn only when something was projected
            charts.append(layout.PROJECTION_PNG)
        timeline = timeline_chart(view, stage, ranks)
        charts += [layout.TIMELINE_PNG] if (stage / layout.TIMELINE_PNG).exists() else []
        readme = markdown(view, charts, transfer, ranks, run_anomalies(view))
        (stage / README).write_text("\n".join([readme, *timeline, *spread_markdown(view), *projected, *extra]))

    layout.commit_folder(out, build, stale=(*REPORT_FILES, *CHARTS))
    return out


def timeline_chart(table: pd.DataFrame, out: Path, ranks: pd.DataFrame | None = None) -> list[str]:
    """Draw ``timeline.png`` into ``out`` (:mod:`pnpscale.results.timeline_chart`) and return its README lines:
    per (problem, mode), the iteration drawn, the ranks drawn, and per section the critical-path rank (the one
    the chart marks: ``ranks``' (:func:`wait_ranks`) most often critical rank, as the wait sentences name it)
    and the largest wait among the drawn ranks, and why a (problem, mode) is not drawn (runs without collective
    starts); no chart when none is drawn."""

    skipped: dict[tuple[str, str], str] = {}
    tl = timeline_table(table, skipped=skipped, wait_ranks=ranks)
    notes = [f"- {md_escape(p)} {md_escape(m)}: not drawn: {md_escape(why)}" for (p, m), why in skipped.items()]
    if tl.empty:
        return ["## One iteration per rank", "", *notes, ""] if notes else []
    save(plot_timeline(tl), out / layout.TIMELINE_PNG)
    lines = [
        "## One iteration per rank",
        "",
        f"`{layout.TIMELINE_PNG}`: the largest GPU count of each (problem, mode), its median measured iteration; "
        "per collective the wait (for the last rank) comes first and the transfer last, compute fills the rest; "
        f"every run folder's `{layout.TIMELINE_JSON}` holds every iteration (open it in https://ui.perfetto.dev).",
        "",
    ]
    for (problem, mode), sub in tl.groupby([K.PROBLEM, K.MODE], sort=True):
        parts = []
        crit = critical_ranks(sub)
        for sec, g in sub.groupby(K.SECTION, sort=False):
            comp = g[g[K.KIND] == "compute"].groupby(K.RANK)[K.DURATION_S].sum()
            wait = g[g[K.KIND] == "wait"].groupby(K.RANK)[K.DURATION_S].sum()
            rank = crit.get(str(sec), int(comp.idxmax()))
            text = f"{sec}: critical-path rank {rank} ({comp.get(rank, float('nan')):.4g} s of compute)"
            if not wait.empty:
                text += f", rank {int(wait.idxmax())} waits longest ({wait.max():.4g} s)"
            parts.append(text)
        head = f"{problem} {mode} at {int(sub[K.GPUS].iloc[0])} GPUs, iteration {int(sub[K.ITERATION].iloc[0])}"
        world = int(sub[K.WORLD_SIZE].iloc[0])
        shown = sub.drop_duplicates(K.RANK).set_index(K.RANK)[ROLE]
        if len(shown) < world:
            head += f" ({len(shown)} of {world} ranks {drawn_note(shown)})"  # the critical ranks follow per section
        lines.append(f"- {md_escape(head)}: " + "; ".join(md_escape(p) for p in parts) + ".")
    return [*lines, *notes, ""]


def too_few_points(table: pd.DataFrame, markdown: bool = False) -> list[str]:
    """One line per (problem, mode) naming its complete points with fewer measured iterations than
    :data:`pnpscale.analysis.spread.MIN_ITERATIONS` (too few to say how much the numbers move); printed by
    the report and listed in its README (``markdown``: the names escaped, the override a code span)."""

    done = table[(table["status"] == "complete") & (table[K.SECTION] == "all")]
    lines = []
    for (problem, mode), grp in done.groupby(["problem", "mode"], sort=True):
        few = grp[[too_few(n) for n in grp[K.ITERATIONS]]].sort_values("gpus")
        if not few.empty:
            counts = " / ".join(sorted({str(n) for n in few[K.ITERATIONS]}))
            head = f"{problem} {mode} gpus={', '.join(str(int(g)) for g in few['gpus'])}"
            lines.append(
                f"{md_escape(head) if markdown else head}: {counts} measured iterations, too few to say how much the "
                f"numbers move (need ≥ {MIN_ITERATIONS}: `iterations={MIN_ITERATIONS}`); differences there are not "
                "called gains."
            )
    return lines


def spread_markdown(table: pd.DataFrame) -> list[str]:
    """The README's spread section: per point, the section time per iteration (all sections) as mean and
    p10 / median / p90 over the measured iterations, and one line per (problem, mode) naming the points with
    too few measured iterations to state a spread (:data:`pnpscale.analysis.spread.MIN_ITERATIONS`)."""
    done = table[(table["status"] == "complete") & (table[K.SECTION] == "all")]
    cols = [K.spread_column(K.SECTION_S, q) for q in K.SPREAD_QUANTILES]
    if done.empty or any(c not in done for c in cols):
        return []
    lines = [
        "## Spread over the measured iterations",
        "",
        "Section time per iteration summed over sections: the mean (the tables above) and the p10 / median / p90 "
        "of the measured iterations (`summary.parquet`: `section_p10_s` ... for every metric and section; the "
        "bands of the line charts).",
        "",
    ]
    view = pd.DataFrame({
        "series": done["problem"], "mode": done["mode"], "gpus": done["gpus"], "iterations": done[K.ITERATIONS],
        "mean s": done[K.SECTION_S].map(lambda v: _fmt(v, ".4g")),
        **{f"p{q} s": done[c].map(lambda v: _fmt(v, ".4g")) for q, c in zip(K.SPREAD_QUANTILES, cols, strict=True)},
    }).sort_values(["series", "mode", "gpus"])  # fmt: skip
    lines += [view.to_markdown(index=False), ""]
    lines += [f"- {line}" for line in too_few_points(done, markdown=True)]
    return [*lines, ""]


def run_anomalies(table: pd.DataFrame) -> dict[str, list[dict[str, Any]] | None]:
    """``"problem mode gpus=N"`` -> the ``anomalies`` of that complete run's ``run.json`` (``None``: not recorded)."""
    out: dict[str, list[dict[str, Any]] | None] = {}
    rows = table[(table["status"] == "complete") & table["run_dir"].notna()].drop_duplicates("run_dir")
    for _, r in rows.sort_values(["problem", "mode", "gpus"]).iterrows():
        try:
            doc = read_record(r["run_dir"]).to_dict()
        except RecordError:
            continue
        variant = r.get(K.VARIANT) if isinstance(r.get(K.VARIANT), str) else ""
        out[layout.point_label(r["problem"], r["mode"], int(r["gpus"]), variant)] = doc.get("anomalies")
    return out


def project_sweep(table: pd.DataFrame, out: Path, report_dir: Path | None = None) -> list[str]:
    """The report's projection (:mod:`pnpscale.results.projection.output`).

    A projection a user made into this report folder with ``python -m pnpscale.project`` (its options
    recorded in :data:`pnpscale.core.layout.PROJECTION_OPTIONS` of ``report_dir``) is kept: projected again with
    those options on the runs now present, its options file carried over. Otherwise (or when its options no
    longer give a projection: said in the README, the options file kept) every (problem, mode) with >= 3
    measured GPU counts, to the powers of two above the largest measured N up to 16 times it, default options.

    Writes projection.parquet, projection_validation.parquet, projection.png and projection.md into ``out``
    (the report's staging folder) when some (problem, mode) qualifies.

    Returns:
        README lines (empty when nothing qualifies).
    """

    done = table[table["status"] == "complete"]
    kept: list[str] = []
    if report_dir is not None and (Path(report_dir) / layout.PROJECTION_OPTIONS).is_file():
        recorded = Path(report_dir) / layout.PROJECTION_OPTIONS
        (out / layout.PROJECTION_OPTIONS).write_bytes(recorded.read_bytes())  # kept either way
        try:
            mine = user_projection(report_dir, done)
        except ProjectionError as exc:
            kept = [f"- the projection made by `{recorded.name}`'s options no longer projects "
                    f"({md_escape(str(exc))}): the report's default projection instead", ""]  # fmt: skip
        else:
            if mine is not None:
                p, options = mine
                lines = write_files(p, out)
                return readme_section(
                    lines, f"Written by the report with the options of your `{options_command(options)}` "
                    f"(kept in `{layout.PROJECTION_OPTIONS}`; delete it for the default projection)"
                )  # fmt: skip
    if done.empty or not (done.groupby(["problem", "mode"])["gpus"].nunique() >= 3).any():
        return ["## Projection", "", *kept] if kept else []
    p = project(with_algorithms(done), default_targets(int(done["gpus"].max())), Options(), min_points=3,
                samples=rank_samples(done))  # the unbiased per-rank fit and its band, as the command's
    if not p.findings:
        skipped = [f"- {k[0]} {k[1]}: not projected: {honest_refusal(v)}" for k, v in p.skipped.items()]
        return ["## Projection", "", *kept, *skipped, *(f"- {n}" for n in p.overlap_notes), ""]
    lines = write_files(p, out)
    section = readme_section(lines, "Written by the report (default options)")
    return [*section[:2], *kept, *section[2:]] if kept else section


#: the projection's hint that leads to another refusal (``--devices 64``: "past the 64 cores").
_DEVICES_HINT = "(give --devices D for the cores the runs had)"


def honest_refusal(reason: str) -> str:
    """A projection refusal as the report prints it: a hint that would only lead to another refusal (``give
    --devices D``) is replaced by what is true of CPU ranks past their cores.

    >>> text = honest_refusal("past the 2 cores the CPU ranks share (give --devices D for the cores the runs had)")
    >>> text.split("; ")[0]
    'past the 2 cores the CPU ranks share: no honest projection exists from time-shared CPU ranks'
    """
    if _DEVICES_HINT not in reason:
        return reason
    head = reason.replace(_DEVICES_HINT, "").rstrip(" ,;:")
    return (f"{head}: no honest projection exists from time-shared CPU ranks; measure on a machine with a core per "
            "rank thread (or on GPUs), then project from those runs")  # fmt: skip


def comparison_section(table: pd.DataFrame, out: Path, files: dict[str, Callable[[Path], None]]) -> list[str]:
    """The side-by-side comparison (:mod:`pnpscale.results.compare`) when a compared key varies:
    draws ``compare.png``, adds ``compare.parquet`` to ``files``, returns the README lines."""

    cmp = comparison(table)
    if cmp is None:
        return []
    save(plot_comparison(cmp), out / COMPARE_PNG)
    files[COMPARE] = lambda p: cmp.to_parquet(p, index=False)
    return compare_markdown(cmp)


def transfer_explained(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Transfer table and rates per route of the complete multi-GPU inference runs, or ``None``.

    Restricted to inference, as in the study: there each section issues exactly one
    image-sized all_reduce, so the byte model is exact; training's sections carry more messages.
    """

    runs = table[(table["status"] == "complete") & (table["mode"] == "inference") & (table["gpus"] > 1)]
    dirs = sorted(set(runs["run_dir"]))
    if not dirs:
        return None
    label = runs.groupby("run_dir")["problem"].first()  # the series (problem and variant) of each run
    inputs = pd.concat([transfer_inputs([d]).assign(**{K.PROBLEM: label[d]}) for d in dirs], ignore_index=True)
    if inputs.empty:
        return None
    rows = transfer_rows(inputs)
    cal = calibrate(rows)
    return predict(rows, cal), cal.rates


def wait_ranks(table: pd.DataFrame) -> pd.DataFrame:
    """Per complete point x section x rank: :func:`pnpscale.analysis.waits.rank_table` with its point.

    Reads each run's ``ranks.parquet``, ``collectives.parquet`` and ``run.json``'s assignment (read whole
    by :func:`pnpscale.results.runs.table_of` already: a damaged one made its point ``unreadable``).

    Raises:
        ValueError: a file that became unreadable since (``<file>: <reason>``; RecordError for run.json).

    Returns:
        PROBLEM, MODE, GPUS and :data:`pnpscale.analysis.waits.RANK_TABLE_COLUMNS`; empty (with those
        columns) when no run completed.
    """

    frames = []
    done = table[table["status"] == "complete"].drop_duplicates("run_dir")
    for _, r in done.iterrows():
        d = Path(r["run_dir"])
        assignment = read_record(d).assignment or {}
        t = rank_table(
            read_table(d / layout.RANKS),
            read_table(d / layout.COLLECTIVES),
            assignment.get("operators_per_rank"),
            assignment.get("tiles_per_rank"),
        )
        frames.append(t.assign(**{K.PROBLEM: r["problem"], K.MODE: r["mode"], K.GPUS: int(r["gpus"])}))
    cols = [K.PROBLEM, K.MODE, K.GPUS, *RANK_TABLE_COLUMNS]
    if not frames:
        return pd.DataFrame(columns=cols)
    return pd.concat(frames, ignore_index=True)[cols]


def wait_sentence(row: pd.Series, ranks: pd.DataFrame) -> str:
    """One sentence on why a section waits at one point (the report's README).

    Args:
        row: the summary row of the point x section (WAIT_S and the parts, seconds per iteration).
        ranks: that point x section's rows of :func:`wait_ranks`.

    >>> row = pd.Series({"section": "gradient", "gpus": 16, "wait_s": 1.0, "wait_late_start_s": 0.02,
    ...                  "wait_imbalance_s": 0.83, "wait_jitter_s": 0.15})
    >>> rk = pd.DataFrame({"rank": range(16), "operators": [1] * 8 + [0] * 8, "tiles": 1,
    ...                    "critical": [True] + [False] * 15, "critical_share": 1.0})
    >>> text = wait_sentence(row, rk)
    >>> text.split(" (")[0]
    'gradient at 16: 83 % of wait is uneven work: 8 of 16 ranks hold no operator'
    >>> text.split(" (")[1]
    'critical-path rank 0: 1 operator, 100 % of iterations).'

    A part below zero (late start or jitter: the rank started early, or did its work faster than usual) is
    named, so that a share above 100 % reads as what it is:

    >>> wait_sentence(pd.Series({**row, "wait_imbalance_s": 1.12, "wait_jitter_s": -0.14}), rk).split(":")[1]
    ' 112 % of wait is uneven work (jitter -14 %'

    With one measured iteration (``iterations`` 1) the usual work is that iteration's own, so there is no
    jitter from one iteration to the next to tell apart: the third part is named what it is, the rest (ranks
    not leaving a collective at the same instant, overlap):

    >>> one = pd.Series({**row, "iterations": 1, "wait_imbalance_s": 0.2, "wait_jitter_s": 0.78})
    >>> wait_sentence(one, rk).replace(" (critical-path rank 0: 1 operator, 100 % of iterations)", "")
    'gradient at 16: 78 % of wait is the rest; one measured iteration: the rest is not jitter between iterations.'
    """

    head = f"{row[K.SECTION]} at {int(row['gpus'])}"
    wait = row[K.WAIT_S]
    if pd.isna(wait) or wait <= 0:
        return f"{head}: no wait."
    if any(pd.isna(row.get(c)) for c in K.WAIT_CAUSES):
        return f"{head}: wait {wait:.4g} s per iteration, not split by cause (run recorded before the split)."
    one = row.get(K.ITERATIONS) == 1  # no iteration-to-iteration jitter to tell apart: the rest
    rest = "the rest" if one else "jitter"
    names = {K.WAIT_LATE_START_S: "late start", K.WAIT_IMBALANCE_S: "uneven work", K.WAIT_JITTER_S: rest}
    top = max(K.WAIT_CAUSES, key=lambda c: row[c])
    text = f"{head}: {100 * row[top] / wait:.0f} % of wait is {names[top]}"
    saved = [f"{names[c]} {100 * row[c] / wait:.0f} %" for c in K.WAIT_CAUSES if round(100 * row[c] / wait) < 0]
    if saved:  # late start and jitter can be negative (waiting.md): say so where a share passes 100 %
        text += f" ({', '.join(saved)}: wait it saved; the parts sum to 100 %)"
    said_rest = one and (top == K.WAIT_JITTER_S or round(100 * row[K.WAIT_JITTER_S] / wait) < 0)
    crit = ranks[ranks["critical"]] if not ranks.empty else ranks
    units = section_work(str(row[K.SECTION]))
    if top == K.WAIT_IMBALANCE_S and not ranks.empty:
        why: list[str] = []  # uneven assignments
        same: list[str] = []  # the units every rank holds equally
        for unit in units:
            counts = ranks[unit].dropna() if unit in ranks else pd.Series(dtype="Int64")
            if counts.empty:
                continue
            idle = int((counts == 0).sum())
            if idle:
                why.append(f"{idle} of {len(counts)} ranks hold no {unit[:-1]}")
            elif counts.min() != counts.max():
                why.append(f"{unit} per rank range {int(counts.min())}–{int(counts.max())}")
            else:
                k = int(counts.iloc[0])
                same.append(f"{k} {unit if k != 1 else unit[:-1]}")
        if same:  # one clause for every evenly held unit (training's sections hold operators and tiles)
            evenly = f"every rank holds {' and '.join(same)}"
            why.append(evenly if why else f"{evenly}: the ranks differ in speed")
        text += (": " + ", ".join(why)) if why else ""
    elif top == K.WAIT_JITTER_S and not crit.empty and not one:
        text += ": the same work finishes at different times from one iteration to the next"
    elif top == K.WAIT_LATE_START_S:
        text += ": ranks enter the section at different times (the previous section's tail)"
    if not crit.empty:
        c = crit.iloc[0]
        held = [f"{int(c[u])} {u[:-1] if int(c[u]) == 1 else u}" for u in units if u in c and pd.notna(c[u])]
        text += f" (critical-path rank {int(c[K.RANK])}: " + ", ".join(
            held + [f"{100 * float(c['critical_share']):.0f} % of iterations"]
        )
        text += ")"
    if said_rest:
        text += "; one measured iteration: the rest is not jitter between iterations"
    return text + "."


def _wait_markdown(table: pd.DataFrame, ranks: pd.DataFrame, problem: str, mode: str) -> list[str]:
    """Why the ranks wait, for one (problem, mode): a sentence per section at each GPU count."""
    sub = table[
        (table["problem"] == problem)
        & (table["mode"] == mode)
        & (table["status"] == "complete")
        & (table[K.SECTION] != "all")
        & (table["gpus"] > 1)
    ]
    if sub.empty:
        return []
    lines = ["Why the ranks wait (wait by cause: late start + uneven work + jitter = wait; `wait_causes.png`):", ""]
    for _, row in sub.sort_values(["gpus", K.SECTION]).iterrows():
        rk = ranks[
            (ranks[K.PROBLEM] == problem)
            & (ranks[K.MODE] == mode)
            & (ranks[K.GPUS] == row["gpus"])
            & (ranks[K.SECTION] == row[K.SECTION])
        ]
        lines.append(f"- {wait_sentence(row, rk)}")
    return lines + [""]


def shared_points(table: pd.DataFrame) -> list[str]:
    """``"<problem> <mode> gpus=N"`` of the complete points whose ranks time-shared cores or GPUs.

    >>> shared_points(pd.DataFrame({"problem": "2d", "mode": "inference", "gpus": [2, 4], "section": "all",
    ...                             "status": "complete", "time_shared": [False, True]}))
    ['2d inference gpus=4']
    """
    if K.TIME_SHARED not in table:
        return []
    done = table[(table["status"] == "complete") & (table[K.SECTION] == "all")]
    flag = done[K.TIME_SHARED].astype("boolean").fillna(False).to_numpy(dtype=bool)
    return [f"{p} {m} gpus={int(g)}" for p, m, g in zip(done["problem"][flag], done["mode"][flag], done["gpus"][flag],
                                                         strict=True)]  # fmt: skip


def plot_transfer_figure(rows: pd.DataFrame, shared: list[str] | None = None) -> Figure:
    """The transfer chart (:func:`pnpscale.results.transfer.plot_transfer`) on its own figure; ``shared``
    (:func:`shared_points`) named in its title: their transfer is measured on time-shared cores."""

    fig, ax = figure(1, 1, (9, 5))
    plot_transfer(rows, ax)
    ax.set_yscale("log")
    # one meaning per word: this chart's transfer is the main collective's only (compute_transfer_wait.png: all)
    note = f"\ntime-shared, not a scaling result: {', '.join(shared)}" if shared else ""
    ax.set_title("Main (image-sized) collective's transfer only, measured vs predicted\n"
                 f"(every collective's transfer: {layout.COMPONENTS_PNG}){note}", fontsize=10)  # fmt: skip
    legend = ax.get_legend()
    if legend is not None:  # the legend lies below the axes: one more line of height per legend row
        n = len(legend.get_texts())
        fig.set_size_inches(9, 4.2 + 0.24 * (n if n <= 6 else -(-n // 2)))
    fig.tight_layout()
    return fig


def md_escape(text: object) -> str:
    r"""``text`` safe inside a Markdown table cell or list item: ``\``, ``|``, ``<``, ``>`` and backticks
    escaped, line breaks as spaces (error texts and paths come from users and failed runs).

    >>> print(md_escape("a|b <script> c\\d `x`"))
    a\|b &lt;script&gt; c\\d \`x\`
    >>> print(md_escape("x\ny"))
    x y
    """
    out = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    out = out.replace("`", "\\`")  # a backtick would open a code span that swallows the cell
    return " ".join(out.splitlines())


def _flag(v: object) -> str:
    """A TIME_SHARED cell: ``yes`` / ``no``, ``—`` when unknown (older folders)."""
    return "—" if v is None or v is pd.NA or (isinstance(v, float) and pd.isna(v)) else ("**yes**" if v else "no")


def _fmt(v: object, pattern: str) -> str:
    return "—" if v is None or (isinstance(v, float) and pd.isna(v)) else format(v, pattern)


def markdown(
    table: pd.DataFrame,
    charts: list[str],
    transfer: tuple[pd.DataFrame, pd.DataFrame] | None = None,
    ranks: pd.DataFrame | None = None,
    anomalies: dict[str, list[dict[str, Any]] | None] | None = None,
) -> str:
    """README of a report: one table per (problem, mode), the headline checks, why the ranks wait (when
    ``ranks``, :func:`wait_ranks`, is given), transfer explained, anomalies.

    ``anomalies``: :func:`run_anomalies`; every run's anomaly summary is listed, and a report without
    any says so.
    """

    lines = ["# pnpscale report", ""]
    lines += [f"![{c}]({c})" for c in charts] + [""]
    lines += [
        "Times are seconds per measured iteration summed over sections; scaled cost is GPU-seconds relative to "
        "the smallest GPU count of each (problem, mode) (1.0 = linear scaling); LB = ΣC/ΣC_max, "
        "CommE = ΣC_max/ΣS_max (S_max: the slowest rank's section time), PE = LB × CommE (POP); hidden s is "
        "communication overlapped by compute (not in compute + transfer + wait). `missing` marks a point without "
        "a complete run. transfer s is every collective's transfer (the main collective's alone: `main_transfer_s` "
        "in `summary.parquet`, `transfer.png`). `time-shared` **yes**: the point's ranks needed more cores than "
        "its host had (ranks × threads per rank > usable cores) or shared a GPU: its times measure contention, "
        "not scaling (hollow markers, hatched bars in the charts).",
        "",
    ]
    checks = {(c["problem"], c["mode"]): c for c in headline_checks(table)}
    for (problem, mode), grp in table[table[K.SECTION] == "all"].groupby(["problem", "mode"], sort=True):
        lines += [f"## {problem} {mode}", ""]
        rows = []
        for _, r in grp.sort_values("gpus").iterrows():
            ok = r["status"] == "complete"
            rows.append(
                {
                    "gpus": int(r["gpus"]),
                    "status": md_escape(r["status"] if ok else f"missing ({r['status']})"),
                    "time-shared": _flag(r.get(K.TIME_SHARED)),
                    "scaled cost": _fmt(r["scaled_cost"], ".3f"),
                    "compute s": _fmt(r[K.COMPUTE_S], ".4g"),
                    "transfer s": _fmt(r[K.TRANSFER_S], ".4g"),
                    "wait s": _fmt(r[K.WAIT_S], ".4g"),
                    "hidden s": _fmt(r.get(K.HIDDEN_S), ".4g"),
                    "LB": _fmt(r[K.LB], ".3f"),
                    "CommE": _fmt(r[K.COMM_E], ".3f"),
                    "PE": _fmt(r[K.PE], ".3f"),
                }
            )
        lines += [pd.DataFrame(rows).to_markdown(index=False), ""]
        lines += [f"- {s}" for s in describe(checks[(problem, mode)])] + [""]
        if ranks is not None:
            lines += _wait_markdown(table, ranks, problem, mode)
        errors = grp[(grp["status"] != "complete")]
        for _, r in errors.iterrows():
            lines.append(
                f"- gpus={int(r['gpus'])}: {md_escape(r.get('error') or r['status'])} ({md_escape(r['run_dir'])})"
            )
        if not errors.empty:
            lines.append("")
    if transfer is not None:
        lines += _transfer_markdown(*transfer)
    if anomalies is not None:
        lines += _anomalies_markdown(anomalies)
    return "\n".join(lines)


def _anomalies_markdown(anomalies: dict[str, list[dict[str, Any]] | None]) -> list[str]:

    lines = ["## Anomalies", ""]
    found = {k: v for k, v in anomalies.items() if v}
    unknown = [k for k, v in anomalies.items() if v is None]
    if not found:
        lines.append("No anomaly in any run: nothing was dropped, assumed or repaired.")
    for label, recs in found.items():
        lines += [f"- {label}: {line}" for line in summary_lines(recs)]
    if unknown:
        lines.append(f"- not recorded (runs written before anomaly reports): {', '.join(unknown)}")
    return [*lines, ""]


def _transfer_markdown(rows: pd.DataFrame, rates: pd.DataFrame) -> list[str]:
    lines = [
        "## Transfer explained (inference)",
        "",
        "Bytes each GPU sends per iteration for the section's main (image-carrying) collectives, each by its own "
        "model and summed (a pipelined transfer's bands, a reduce_scatter and its all_gather), the same bytes as "
        "the side-by-side table: all_reduce ring `2·P·(n−1)/n`, tree `2·P·(nodes−1)/nodes`, all_gather, "
        "reduce_scatter and all_to_all `S·(n−1)/n`, with the algorithm NCCL logged for that size, or `ring` assumed "
        "where there is no NCCL log (gloo). Rate = bytes / transfer (GB/s = 1e9 B/s); one rate per route (the "
        "median of its rows) predicts every row. Only exposed blocking transfer sets a rate: a row overlapped with "
        "compute (`solver.overlap=pipelined`, or hidden time) exposes what the overlap left, which is not bytes / "
        "rate, so it is neither used nor predicted (`calibrates` = no).",
        "",
        "### Rates per route",
        "",
        rates.assign(**{K.RATE_GBPS: rates[K.RATE_GBPS].map(lambda v: _fmt(v, ".4g"))}).to_markdown(index=False),
        "",
        "### Per row",
        "",
    ]
    view = pd.DataFrame(
        {
            "problem": rows[K.PROBLEM],
            "section": rows[K.SECTION],
            "gpus": rows[K.GPUS],
            "nodes": rows[K.NODES],
            "algorithm": rows[K.ALGORITHM].astype(str) + " (" + rows[K.ALGORITHM_SOURCE].astype(str) + ")",
            "bytes/GPU": rows[K.BYTES_PER_GPU].map(lambda v: "—" if pd.isna(v) else f"{round(v):,}"),
            "transfer s": rows[K.TRANSFER_S].map(lambda v: _fmt(v, ".4g")),
            "rate GB/s": rows[K.RATE_GBPS].map(lambda v: _fmt(v, ".4g")),
            "route": rows[K.ROUTE],
            "calibrates": rows[K.CALIBRATES].map(lambda v: "yes" if v else "no"),
            "predicted s": rows[K.PREDICTED_TRANSFER_S].map(lambda v: _fmt(v, ".4g")),
            "error": rows[K.REL_ERROR].map(lambda v: _fmt(100 * v, "+.1f") + "%" if pd.notna(v) else "—"),
        }
    ).sort_values(["problem", "section", "gpus"])
    lines += [view.to_markdown(index=False), ""]
    notes = sorted({str(n) for n in rows[K.ALGORITHM_NOTE].dropna() if str(n)})
    lines += [f"- {n}" for n in notes]
    missed = rows[rows[K.MISSES].astype(bool)]
    if not missed.empty:
        worst = missed.loc[missed[K.REL_ERROR].abs().idxmax()]
        lines.append(
            f"- One rate per route does not explain {len(missed)} of {int(rows[K.REL_ERROR].notna().sum())} "
            f"predicted row(s): they miss by more than ±{100 * MISS_TOLERANCE:.0f}% (worst "
            f"{worst[K.SECTION]} at {int(worst[K.GPUS])} GPUs, {100 * worst[K.REL_ERROR]:+.0f}%, its rate "
            f"{worst[K.RATE_GBPS]:.4g} GB/s vs the route's {worst[K.CALIBRATED_RATE_GBPS]:.4g}); rows of one route "
            "moved their bytes at different rates, so something besides bytes and rate (latency, contention, "
            "protocol) sets their transfer."
        )
    lines.append(
        "- The projection's rate of a route (`projection.md`) is its bytes / its transfer summed over the points "
        "(or fitted with a latency per collective and hop), a transfer-weighted mean that the slowest rows "
        "dominate; this table's is the median of the rows' rates. Where the rows agree the two are equal; where "
        "they differ, this table's misses above say by how much."
    )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    """``python -m pnpscale.report DIR [--out OUT] [--strict]``.

    Exit codes: 0 report written; 1 the report could not be written (one line; the previous report
    is intact), or ``--strict`` and some point's run folder is unreadable; 2 a folder without runs;
    130 / 143 / 129 stopped by SIGINT / SIGTERM / SIGHUP (one line; the previous report is intact).
    """

    parser = argparse.ArgumentParser(prog=command_prog("pnpscale.report"), description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder holding run folders (a sweep, or outputs/ with several sweeps)")
    parser.add_argument("--out", default=None, help="report folder (default: PATH/report)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a point's run folder is unreadable (reported either way)",
    )
    args = parser.parse_args(argv)
    unreadable: list[str] = []

    def echo(line: str) -> None:
        print(line)
        if ": unreadable: " in line:
            unreadable.append(line)

    signals.install()
    target = Path(args.out) if args.out is not None else Path(args.path) / layout.REPORT_DIR
    problem = layout.report_out_problem(args.path, args.out)
    if problem is not None:  # refused before any run folder is read
        print(f"pnpscale.report: error: {problem}", file=sys.stderr)
        return 2
    try:
        out = write_report(args.path, args.out, echo=echo)
    except KeyboardInterrupt as exc:
        stop = signals.as_interrupted(exc)
        what = str(stop) if stop is not None else "interrupted"
        print(f"pnpscale.report: {what}: {layout.report_not_written(target)}", file=sys.stderr)
        return signals.exit_code(exc)
    except NoRunsError as exc:
        print(f"pnpscale.report: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - any failure: one line, non-zero, previous report intact
        stop = signals.stop_behind(exc)
        if stop is not None:  # a Ctrl-C a library turned into another error
            print(f"pnpscale.report: {stop}: {layout.report_not_written(target)}", file=sys.stderr)
            return stop.exit_code
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        said = layout.report_not_written(target)
        print(f"pnpscale.report: error: {said.split(',')[0]} ({type(exc).__name__}: {first})"
              f"{',' + said.split(',', 1)[1] if ',' in said else ''}", file=sys.stderr)  # fmt: skip
        return 1
    stop = signals.received()  # a stop whose exception Python swallowed after the report was published
    if stop is not None:
        print(f"pnpscale.report: {stop}: after the report was written: {out}", file=sys.stderr)
        return stop.exit_code
    print(f"report: {out}")
    if args.strict and unreadable:
        print(f"pnpscale.report: error: {len(unreadable)} point(s) unreadable (--strict)", file=sys.stderr)
        return 1
    return 0
