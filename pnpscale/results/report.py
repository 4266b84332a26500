"""Sweep report: charts, ``summary.parquet`` and a README from any folder of run folders.

``python -m pnpscale.report DIR [--out OUT]`` (also run at the end of every multirun) reads every
run under ``DIR`` (several sweeps and reruns: the newest complete run per point wins, and the
choice is printed), then writes ``DIR/report/``::

    scaled_cost.png  compute_transfer_wait.png  load_balance.png  comm_efficiency.png  wait_pct.png
    summary.parquet  (the tidy table, one row per point x section, with scaled cost)
    transfer.png     (inference: measured transfer and its prediction from one rate per route)
    transfer.parquet (inference: bytes per GPU, algorithm, route, rate, prediction, error per run x section)
    rates.parquet    (one rate per route and the rows that made it)
    README.md        (a table per (problem, mode), the study's headline checks, transfer explained)
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
from pnpscale import layout
from pnpscale.results.runs import NoRunsError, discover, select, table_of

SUMMARY, README, TRANSFER, RATES = layout.SUMMARY, layout.REPORT_README, layout.TRANSFER, layout.RATES
TRANSFER_PNG = "transfer.png"


def build_table(path: str | Path, echo: Callable[[str], None] = print) -> pd.DataFrame:
    """Discover, select (printing the choices), load and add scaled cost.

    Raises:
        NoRunsError: no run folder under ``path``.
    """
    from pnpscale.results.summary import scaled_cost

    sel = select(discover(path))
    for note in sel.notes:
        echo(note)
    return scaled_cost(table_of(sel, path))


def write_report(path: str | Path, out: str | Path | None = None, echo: Callable[[str], None] = print) -> Path:
    """Write the report of every run under ``path`` into ``out`` (default ``path/report``).

    Returns:
        the report folder.

    Raises:
        NoRunsError: no run folder under ``path``.
    """
    from pnpscale.results.charts import CHARTS, save

    table = build_table(path, echo)
    out = Path(out) if out is not None else Path(path) / layout.REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, plot in CHARTS.items():
        save(plot(table), out / name)
    files = {SUMMARY: lambda p: table.to_parquet(p, index=False)}
    transfer = transfer_explained(table)
    charts = list(CHARTS)
    if transfer is not None:
        rows, rates = transfer
        save(plot_transfer_figure(rows), out / TRANSFER_PNG)
        charts.append(TRANSFER_PNG)
        files[TRANSFER] = lambda p: rows.to_parquet(p, index=False)
        files[RATES] = lambda p: rates.to_parquet(p, index=False)
    layout.commit_files(out, files)
    layout.atomic_write_text(out / README, markdown(table, charts, transfer, run_anomalies(table)))
    return out


def run_anomalies(table: pd.DataFrame) -> dict[str, list[dict[str, Any]] | None]:
    """``"problem mode gpus=N"`` -> the ``anomalies`` of that complete run's ``run.json`` (``None``: not recorded)."""
    out: dict[str, list[dict[str, Any]] | None] = {}
    rows = table[(table["status"] == "complete") & table["run_dir"].notna()].drop_duplicates("run_dir")
    for _, r in rows.sort_values(["problem", "mode", "gpus"]).iterrows():
        try:
            doc = layout.read_json(Path(r["run_dir"]) / layout.RUN_JSON)
        except (OSError, ValueError):
            continue
        out[f"{r['problem']} {r['mode']} gpus={int(r['gpus'])}"] = doc.get("anomalies")
    return out


def transfer_explained(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Transfer table and rates per route of the complete multi-GPU inference runs, or ``None``.

    Restricted to inference, as on the study: there each section issues exactly one
    image-sized all_reduce, so the byte model is exact; training's sections carry more messages.
    """
    from pnpscale.analysis.offline import transfer_inputs
    from pnpscale.results.transfer import calibrate, predict, transfer_rows

    runs = table[(table["status"] == "complete") & (table["mode"] == "inference") & (table["gpus"] > 1)]
    dirs = sorted(set(runs["run_dir"]))
    if not dirs:
        return None
    inputs = transfer_inputs(dirs)
    if inputs.empty:
        return None
    rows = transfer_rows(inputs)
    cal = calibrate(rows)
    return predict(rows, cal), cal.rates


def plot_transfer_figure(rows: pd.DataFrame) -> Figure:
    """The transfer chart (:func:`pnpscale.results.transfer.plot_transfer`) on its own figure."""
    from pnpscale.results.charts import _figure
    from pnpscale.results.transfer import plot_transfer

    fig, ax = _figure(1, 1, (9, 5))
    plot_transfer(rows, ax)
    ax.set_yscale("log")
    fig.tight_layout()
    return fig


def _fmt(v: object, pattern: str) -> str:
    return "—" if v is None or (isinstance(v, float) and pd.isna(v)) else format(v, pattern)


def markdown(
    table: pd.DataFrame,
    charts: list[str],
    transfer: tuple[pd.DataFrame, pd.DataFrame] | None = None,
    anomalies: dict[str, list[dict[str, Any]] | None] | None = None,
) -> str:
    """README of a report: one table per (problem, mode), the headline checks, transfer explained, anomalies.

    ``anomalies``: :func:`run_anomalies`; every run's anomaly summary is listed, and a report without
    any says so.
    """
    from pnpscale.results.summary import describe, headline_checks

    lines = ["# pnpscale report", ""]
    lines += [f"![{c}]({c})" for c in charts] + [""]
    lines += [
        "Times are seconds per measured iteration summed over sections; scaled cost is GPU-seconds relative to "
        "the smallest GPU count of each (problem, mode) (1.0 = linear scaling); LB = ΣC/ΣC_max, "
        "CommE = ΣC_max/ΣS, PE = LB × CommE (POP). `missing` marks a point without a complete run.",
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
                    "status": r["status"] if ok else f"missing ({r['status']})",
                    "scaled cost": _fmt(r["scaled_cost"], ".3f"),
                    "compute s": _fmt(r[K.COMPUTE_S], ".4g"),
                    "transfer s": _fmt(r[K.TRANSFER_S], ".4g"),
                    "wait s": _fmt(r[K.WAIT_S], ".4g"),
                    "LB": _fmt(r[K.LB], ".3f"),
                    "CommE": _fmt(r[K.COMM_E], ".3f"),
                    "PE": _fmt(r[K.PE], ".3f"),
                }
            )
        lines += [pd.DataFrame(rows).to_markdown(index=False), ""]
        lines += [f"- {s}" for s in describe(checks[(problem, mode)])] + [""]
        errors = grp[(grp["status"] != "complete")]
        for _, r in errors.iterrows():
            lines.append(f"- gpus={int(r['gpus'])}: {r.get('error') or r['status']} ({r['run_dir']})")
        if not errors.empty:
            lines.append("")
    if transfer is not None:
        lines += _transfer_markdown(*transfer)
    if anomalies is not None:
        lines += _anomalies_markdown(anomalies)
    return "\n".join(lines)


def _anomalies_markdown(anomalies: dict[str, list[dict[str, Any]] | None]) -> list[str]:
    from pnpscale.analysis.anomalies import summary_lines

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
        "Bytes each GPU sends for the section's image-sized all_reduce: ring `2·P·(n−1)/n`, tree "
        "`2·P·(nodes−1)/nodes`, with the algorithm NCCL logged for that size, or `ring` assumed where there is "
        "no NCCL log (gloo). Rate = bytes / transfer (GB/s = 1e9 B/s); one rate per route (the median of its "
        "rows) predicts every row.",
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
            "predicted s": rows[K.PREDICTED_TRANSFER_S].map(lambda v: _fmt(v, ".4g")),
            "error": rows[K.REL_ERROR].map(lambda v: _fmt(100 * v, "+.1f") + "%" if pd.notna(v) else "—"),
        }
    ).sort_values(["problem", "section", "gpus"])
    lines += [view.to_markdown(index=False), ""]
    notes = sorted({str(n) for n in rows[K.ALGORITHM_NOTE].dropna()})
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m pnpscale.report DIR [--out OUT]``; exit code 2 on a folder without runs."""
    parser = argparse.ArgumentParser(prog="python -m pnpscale.report", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder holding run folders (a sweep, or outputs/ with several sweeps)")
    parser.add_argument("--out", default=None, help="report folder (default: PATH/report)")
    args = parser.parse_args(argv)
    try:
        out = write_report(args.path, args.out)
    except NoRunsError as exc:
        print(f"pnpscale.report: error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {out}")
    return 0
