"""Projection of a sweep's scaling curve to GPU counts that were not run: the facade and the files.

The model (compute with jitter, wait, transfer per route and algorithm, its fit and its checks) is
:mod:`pnpscale.results.projection.model`, re-exported here; this module turns a :class:`Projection`
into ``projection.md`` (findings, headline, the fit's residuals and leave-one-out, assumptions, notes),
``projection.png`` and the parquet files; the command ``python -m pnpscale.project`` is
:mod:`pnpscale.results.projection.command`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.results.charts import save
from pnpscale.results.plotting import KIND_COLORS, figure, log2_x
from pnpscale.results.projection.model import (
    ALL,
    HEADLINE,
    LOO,
    RESIDUAL,
    Model,
    Options,
    Projection,
    ProjectionError,
    evaluate,
    findings,
    fit,
    fitted_counts,
    leave_one_out,
    loo_misses,
    measured_rows,
    misses,
    parse_algorithms,
    parse_rates,
    project,
    residuals,
)
from pnpscale.results.projection.overlap import frame as overlap_frame
from pnpscale.results.projection.overlap import markdown as overlap_markdown
from pnpscale.results.projection.samples import SAMPLE_COLUMNS, from_ranks
from pnpscale.results.runs import read_table
from pnpscale.results.series import labelled
from pnpscale.results.transfer import transfer_inputs

__all__ = [
    "Model", "Options", "Projection", "ProjectionError", "evaluate", "findings", "fit", "leave_one_out",
    "measured_rows", "parse_algorithms", "parse_rates", "project", "rank_samples", "residuals", "markdown", "plot",
    "write", "write_files",
]  # fmt: skip

_NAMES = {K.SECTION_S: "time", K.TRANSFER_S: "transfer", K.WAIT_S: "wait", K.PE: "PE"}


def _pct(v: float) -> str:
    return "n/a" if pd.isna(v) else f"{100 * v:+.1f} %"


def headline(v: pd.DataFrame) -> dict[str, Any] | None:
    """The headline of one (problem, mode)'s checks: the largest fitted N predicted from the smaller ones,
    its error per :data:`HEADLINE` metric (section ``all``) and the worst of them; None without one."""
    head = v[(v["kind"] == LOO) & v["headline"] & (v[K.SECTION] == ALL) & v["metric"].isin(HEADLINE)]
    if head.empty:
        return None
    err = dict(zip(head["metric"], head[K.REL_ERROR], strict=True))
    note = str(head["note"].iloc[0])
    finite = {k: e for k, e in err.items() if pd.notna(e) and not (note and k == K.TRANSFER_S)}
    worst = max(finite, key=lambda k: abs(finite[k])) if finite else None
    return {"gpus": int(head[K.GPUS].iloc[0]), "fitted_on": head["fitted_on"].iloc[0], "errors": err, "worst": worst,
            "note": note}  # fmt: skip


def _checks_table(v: pd.DataFrame) -> list[str]:
    """Residual and leave-one-out errors (%) per measured N, section ``all``, the headline metrics."""
    a = v[(v[K.SECTION] == ALL) & v["metric"].isin(HEADLINE)]
    if a.empty:
        return []
    rows = []
    for n, g in a.groupby(K.GPUS):
        row: dict[str, Any] = {"gpus": int(n)}
        for kind, tag in ((RESIDUAL, "fit"), (LOO, "left out")):
            k = g[g["kind"] == kind].set_index("metric")
            for metric in HEADLINE:
                e = k.loc[metric, K.REL_ERROR] if metric in k.index else None
                row[f"{_NAMES[metric]} ({tag})"] = f"{100 * e:+.1f}" if e is not None and pd.notna(e) else "—"
        rows.append(row)
    return [pd.DataFrame(rows).to_markdown(index=False), ""]


def markdown(p: Projection) -> list[str]:
    """The projection as README lines: findings, headline error, the fit's residuals and leave-one-out
    (table), notes on the given options, assumptions, skipped (problem, mode)s."""
    lines: list[str] = []
    for key in sorted(set(p.findings) | set(p.skipped)):
        problem, mode = key
        lines += [f"### Projection: {problem} {mode}", ""]
        if key in p.skipped:
            lines += [f"- not projected: {p.skipped[key]}", ""]
            continue
        f = p.findings[key]
        t = p.table[(p.table[K.PROBLEM] == problem) & (p.table[K.MODE] == mode)]
        largest = int(t.loc[t[K.MEASURED], K.GPUS].max())
        cross = f["crossover_gpus"]
        lines += [
            "- crossover (transfer > critical-path compute): "
            + (f"N = {cross}" if cross else f"none up to {f['searched_up_to']}")
            + " (per section: "
            + ", ".join(f"{s} {n if n else '—'}" for s, n in f["crossover_by_section"].items())
            + ")",
            f"- least time per iteration at N = {f['fastest_gpus']} ({f['fastest_s']:.4g} s), "
            f"searched 1..{f['searched_up_to']}",
            f"- largest N with PE >= {f['pe_min']:g}: {f['largest_gpus_pe'] if f['largest_gpus_pe'] else 'none'}",
        ]
        v = p.validation[(p.validation[K.PROBLEM] == problem) & (p.validation[K.MODE] == mode)]
        h = headline(v)
        if h is not None:
            parts = ", ".join(f"{_NAMES[m]} {_pct(h['errors'].get(m))}" for m in HEADLINE)
            worst = f"worst: {_NAMES[h['worst']]} {_pct(h['errors'][h['worst']])}" if h["worst"] else "no error"
            lines.append(f"- headline: {h['gpus']} GPUs predicted from {h['fitted_on']} ({worst}; {parts})"
                         + (f"; {h['note']}" if h["note"] else ""))  # fmt: skip
        for _, r in v[(v["kind"] == LOO) & (v["note"] != "") & (v["metric"] == "")].iterrows():
            lines.append(f"- left out {int(r[K.GPUS])}: not predicted: {r['note']}")
        if not (v["kind"] == LOO).any():
            fitted = fitted_counts(v)
            lines.append(f"- leave-one-out: not made: {len(fitted)} fitted GPU count(s) "
                         f"({', '.join(map(str, fitted))}); each held-out N needs 2 others to fit on")  # fmt: skip
        far = loo_misses(v, p.tolerance)
        if not far.empty:
            lines.append(
                f"- **leave-one-out misses by more than {100 * p.tolerance:g} %**: "
                + "; ".join(f"N={int(r[K.GPUS])} from {r['fitted_on']}: {_NAMES[r['metric']]} {_pct(r[K.REL_ERROR])}"
                            for _, r in far.iterrows())
                + ": fitted without them, the model misses them (errors at measured points: they do not bound the "
                "error past them)"
            )  # fmt: skip
        bad = misses(v, p.tolerance)
        if bad.empty:
            lines.append(f"- the fit is within {100 * p.tolerance:g} % of its own points (time, transfer, wait, PE)")
        else:
            lines.append(
                f"- **the fit misses its own points by more than {100 * p.tolerance:g} %**: "
                + "; ".join(f"N={int(r[K.GPUS])} {_NAMES[r['metric']]} {_pct(r[K.REL_ERROR])}"
                            + (f" ({r['note']})" if r["note"] else "") for _, r in bad.iterrows())
                + ": read the projection with that error in mind"
            )  # fmt: skip
        lines += [f"- {n}" for n in p.notes.get(key, [])]
        lines.append("")
        proj = t[~t[K.MEASURED] & (t[K.SECTION] == ALL) & (t[K.GPUS] > largest)]
        if not proj.empty:
            view = proj[[K.GPUS, K.NODES, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.SECTION_S, K.LB, K.COMM_E, K.PE,
                         K.SCALED_COST]].copy()  # fmt: skip
            banded = proj[K.band_column(K.SECTION_S, "lo")].notna().any()
            if banded:
                for col in (K.SECTION_S, K.SCALED_COST, K.COMM_E, K.PE):
                    lo, hi = proj[K.band_column(col, "lo")], proj[K.band_column(col, "hi")]
                    view[f"{col} 5–95 %"] = [f"{a:.4g}–{b:.4g}" for a, b in zip(lo, hi, strict=True)]
            lines += [view.to_markdown(index=False, floatfmt=".4g"), ""]
            if banded:
                lines += ["5–95 %: the band of the sampling uncertainty (bootstrap over iterations and ranks of the "
                          "per-rank samples: compute, jitter, node speeds); the model's own assumptions and the "
                          "transfer rates are not in it.", ""]  # fmt: skip
            else:
                why = next((a for a in p.assumptions.get(key, []) if "no band" in a), "no per-rank samples")
                lines += [f"No band: {why.split('no band: ')[-1].split(' (')[0].removeprefix('no band')}.", ""]
            caveats = sorted({str(c) for c in proj[K.CAVEAT] if c})
            lines += [f"**Caveat: this projection {c}.**" for c in caveats] + ([""] if caveats else [])
        table = _checks_table(v)
        if table:
            lines += ["Relative error (%) at the measured points, section `all`: *fit* = the model fitted on every "
                      "point, *left out* = fitted without that N (leave-one-out):", "", *table]  # fmt: skip
        lines += ["Assumptions:", ""] + [f"- {s}" for s in p.assumptions[key]] + [""]
    for key in sorted(p.overlap):
        lines += overlap_markdown(p.overlap[key], p.tolerance)
    lines += [f"- {n}" for n in p.overlap_notes] + ([""] if p.overlap_notes else [])
    return lines


def plot(p: Projection) -> Any:
    """Per (problem, mode): measured points (markers) and the projection (lines) of time per iteration and
    its parts (top, the time's 5–95 % band shaded), LB, CommE and PE (middle, CommE's and PE's bands
    shaded), the relative error at the measured points of the fit and of
    leave-one-out with the tolerance band (bottom); a dotted line at the largest measured N.
    Returns a matplotlib Figure."""

    keys = sorted(p.findings) or [("", "")]
    fig, axes = figure(3, len(keys), (6.0 * len(keys), 11.0), squeeze=False)
    metrics = [(K.SECTION_S, "time per iteration"), (K.COMPUTE_MAX_S, "compute (critical path)"),
               (K.TRANSFER_S, "transfer"), (K.WAIT_S, "wait")]  # fmt: skip
    for j, (problem, mode) in enumerate(keys):
        t = p.table[(p.table[K.PROBLEM] == problem) & (p.table[K.MODE] == mode) & (p.table[K.SECTION] == ALL)]
        if t.empty:
            continue
        meas, proj = t[t[K.MEASURED]].sort_values(K.GPUS), t[~t[K.MEASURED]].sort_values(K.GPUS)
        top, mid, bottom = axes[0][j], axes[1][j], axes[2][j]
        lo, hi = proj[K.band_column(K.SECTION_S, "lo")], proj[K.band_column(K.SECTION_S, "hi")]
        if lo.notna().any():
            top.fill_between(proj[K.GPUS], lo.where(lo > 0), hi.where(hi > 0), color="black", alpha=0.12,
                             label="time per iteration, 5–95 % band")  # fmt: skip
        for i, (col, label) in enumerate(((K.PE, "PE"), (K.COMM_E, "CommE"))):
            lo, hi = proj[K.band_column(col, "lo")], proj[K.band_column(col, "hi")]
            if lo.notna().any():
                mid.fill_between(proj[K.GPUS], lo, hi, color=f"C{i}", alpha=0.15, label=f"{label}, 5–95 % band")
        for col, label in metrics:  # one colour per kind, as in every chart (plotting.KIND_COLORS)
            color = {K.COMPUTE_MAX_S: KIND_COLORS["compute"], K.TRANSFER_S: KIND_COLORS["transfer"],
                     K.WAIT_S: KIND_COLORS["wait"]}.get(col, "black")  # fmt: skip
            top.plot(proj[K.GPUS], proj[col].where(proj[col] > 0), "-", color=color, label=f"{label} (projected)")
            top.plot(meas[K.GPUS], meas[col].where(meas[col] > 0), "o", color=color, label=f"{label} (measured)")
        for i, (col, label) in enumerate(((K.PE, "PE"), (K.COMM_E, "CommE"), (K.LB, "LB"))):
            mid.plot(proj[K.GPUS], proj[col], "-", color=f"C{i}", label=f"{label} (projected)")
            mid.plot(meas[K.GPUS], meas[col], "o", color=f"C{i}", label=f"{label} (measured)")
        v = p.validation[(p.validation[K.PROBLEM] == problem) & (p.validation[K.MODE] == mode)
                         & (p.validation[K.SECTION] == ALL)]  # fmt: skip
        for i, metric in enumerate(HEADLINE):
            for kind, marker in ((RESIDUAL, "o"), (LOO, "x")):
                k = v[(v["kind"] == kind) & (v["metric"] == metric)].sort_values(K.GPUS)
                bottom.plot(k[K.GPUS], 100 * k[K.REL_ERROR], marker, color=f"C{i}", ls="none",
                            label=f"{_NAMES[metric]} ({'fit' if kind == RESIDUAL else 'left out'})")  # fmt: skip
        tol = 100 * p.tolerance
        bottom.axhspan(-tol, tol, color="gray", alpha=0.15, label=f"±{tol:g} % tolerance")
        bottom.axhline(0, color="gray", lw=0.8)
        largest = int(meas[K.GPUS].max())
        for ax in (top, mid, bottom):
            ax.axvline(largest, color="gray", ls=":", label=f"largest measured N = {largest}")
            log2_x(ax, t[K.GPUS])
        top.set_yscale("log")
        top.set_ylabel("seconds per iteration")
        top.set_title(f"{problem} {mode}: projection")
        mid.set_ylabel("efficiency")
        mid.set_ylim(0, 1.05)
        bottom.set_ylabel("error at measured points (%)")
        for ax in (top, mid, bottom):
            ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


# --- reading a sweep, writing the files, command line -------------------------------------------


def default_targets(largest: int) -> list[int]:
    """Powers of two above the largest measured N, up to 16 times it (the report's projection).

    >>> default_targets(4), default_targets(64)
    ([8, 16, 32, 64], [128, 256, 512, 1024])
    """
    out, n = [], 1
    while n <= 16 * largest:
        if n > largest:
            out.append(n)
        n *= 2
    return out


def with_algorithms(table: pd.DataFrame) -> pd.DataFrame:
    """The summary table plus ALGORITHM per complete multi-GPU run x section (NCCL's log; NA without one).

    Matched by run folder and section, so a table whose PROBLEM carries the variant
    (:func:`pnpscale.results.series.labelled`) gets its algorithms too.
    """

    done = table[(table["status"] == "complete") & (table[K.GPUS] > 1)] if "status" in table else table.iloc[0:0]
    if done.empty or "run_dir" not in done:
        return table.assign(**{K.ALGORITHM: pd.NA})
    frames = [transfer_inputs([d]).assign(run_dir=d) for d in sorted(set(done["run_dir"]))]
    algos = pd.concat(frames, ignore_index=True)
    if algos.empty:
        return table.assign(**{K.ALGORITHM: pd.NA})
    algos = algos[["run_dir", K.SECTION, K.ALGORITHM]].drop_duplicates(["run_dir", K.SECTION])
    return table.drop(columns=[K.ALGORITHM], errors="ignore").merge(algos, on=["run_dir", K.SECTION], how="left")


def rank_samples(table: pd.DataFrame) -> pd.DataFrame:
    """The per-rank, per-iteration compute of every complete run of ``table`` (its ``run_dir``), read from the
    run's ``ranks.parquet`` (:func:`pnpscale.results.projection.samples.from_ranks`), PROBLEM labelled with the
    variant as the summary rows are (:data:`pnpscale.results.projection.samples.SAMPLE_COLUMNS`, seconds).
    A run without a readable ``ranks.parquet`` gives none (its (problem, mode) is then fitted on the summary,
    and says so).

    Raises:
        ProjectionError: a run whose ranks table gives a negative compute (naming the run, rank, iteration).
    """
    from pathlib import Path

    cols = list(SAMPLE_COLUMNS)
    if "run_dir" not in table or table.empty:
        return pd.DataFrame(columns=cols)
    runs = labelled(table[table["status"] == "complete"] if "status" in table else table)
    frames = []
    for d, g in runs.groupby("run_dir", sort=True):
        path = Path(str(d)) / layout.RANKS
        try:
            ranks = read_table(path)
        except (OSError, ValueError):  # UnreadableFile is a ValueError
            continue
        try:
            x = from_ranks(ranks)
        except ProjectionError as exc:
            raise ProjectionError(f"{path}: {exc}") from None
        first = g.iloc[0]
        frames.append(x.assign(**{K.PROBLEM: str(first[K.PROBLEM]), K.MODE: str(first[K.MODE]),
                                  K.GPUS: int(first[K.GPUS])}))  # fmt: skip
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


README_HEADING = "## Projection"


def write_files(p: Projection, dest: Any) -> list[str]:
    """Write projection.parquet, projection_validation.parquet, projection_overlap.parquet (no row without a
    pipelined series), projection.png and projection.md into ``dest`` as they are (a staging folder:
    :func:`write` and the report commit them together).

    Returns:
        the markdown lines (also in projection.md).
    """
    from pathlib import Path


    dest = Path(dest)
    save(plot(p), dest / layout.PROJECTION_PNG)
    p.table.to_parquet(dest / layout.PROJECTION, index=False)
    p.validation.to_parquet(dest / layout.PROJECTION_VALIDATION, index=False)
    overlap_frame(p.overlap).to_parquet(dest / layout.PROJECTION_OVERLAP, index=False)  # always: never stale
    lines = markdown(p)
    (dest / layout.PROJECTION_MD).write_text("\n".join(["# pnpscale projection", "", *lines]))
    return lines


def readme_section(lines: Sequence[str], made_by: str) -> list[str]:
    """The report README's projection section around :func:`markdown`'s ``lines``; ``made_by`` says how."""
    return [
        f"{README_HEADING} past the measured GPU counts",
        "",
        f"{made_by}. `projection.png`, `projection.parquet` (measured and projected rows), "
        "`projection_validation.parquet` (residuals, leave-one-out), `projection_overlap.parquet` (the pipelined "
        "overlap); other GPU counts, rates or nodes: "
        "`python -m pnpscale.project <sweep dir> --gpus ...`.",
        "",
        *lines,
    ]


def replace_readme_section(text: str, section: Sequence[str]) -> str:
    r"""A report README with its projection section (from a ``## Projection`` heading to the next ``## ``
    heading) replaced by ``section``; inserted before ``## Side by side`` (else at the end) when it has none.
    The chart list at the top gains ``projection.png`` when it lacks it.

    >>> old = "# r\n\n![a.png](a.png)\n\n## 2d\n\n## Projection\n\n- no\n\n## Side by side: x\n"
    >>> print(replace_readme_section(old, ["## Projection past", "", "- yes", ""]))
    # r
    <BLANKLINE>
    ![a.png](a.png)
    ![projection.png](projection.png)
    <BLANKLINE>
    ## 2d
    <BLANKLINE>
    ## Projection past
    <BLANKLINE>
    - yes
    <BLANKLINE>
    ## Side by side: x
    <BLANKLINE>
    """

    lines = text.split("\n")
    start = next((i for i, x in enumerate(lines) if x.startswith(README_HEADING)), None)
    if start is None:
        start = next((i for i, x in enumerate(lines) if x.startswith("## Side by side")), len(lines))
        end = start
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    lines[start:end] = list(section)
    chart = f"![{layout.PROJECTION_PNG}]({layout.PROJECTION_PNG})"
    if chart not in lines:
        first = next((i for i, x in enumerate(lines) if x.startswith("![")), None)
        if first is None:
            lines[1:1] = [chart, ""]
        else:
            last = first
            while last + 1 < len(lines) and lines[last + 1].startswith("!["):
                last += 1
            lines.insert(last + 1, chart)
    return "\n".join(lines)


def write(p: Projection, out: Any, made_by: str | None = None, extra: dict[str, str] | None = None) -> list[str]:
    """Write the projection's files (:func:`write_files`) into ``out``, staged and renamed together
    (:func:`pnpscale.core.layout.commit_folder`): a failure leaves ``out`` as it was.

    When ``out`` holds a report (``README.md``), its projection section is rewritten in the same step
    (:func:`replace_readme_section`, ``made_by`` saying how the projection was made).

    ``extra``: more files to write in the same step (name -> text; the command's recorded options).

    Returns:
        the markdown lines (also in projection.md).

    Raises:
        OSError: the files could not be written (``out`` is unchanged).
    """
    from pathlib import Path


    out = Path(out)
    readme = out / layout.REPORT_README
    lines: list[str] = []

    def build(stage: Path) -> None:
        lines.extend(write_files(p, stage))
        for name, text in (extra or {}).items():
            (stage / name).write_text(text)
        if readme.is_file():
            section = readme_section(lines, made_by or "Written by `python -m pnpscale.project`")
            (stage / layout.REPORT_README).write_text(replace_readme_section(readme.read_text(), section))

    layout.commit_folder(out, build)
    return lines
