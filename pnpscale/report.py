"""Sweep report: charts, ``summary.parquet`` and a README from any folder of run folders.

``python -m pnpscale.report DIR [--out OUT]`` (also run at the end of every multirun) reads every
run under ``DIR`` (several sweeps and reruns: the newest complete run per point wins, and the
choice is printed), then writes ``DIR/report/``::

    scaled_cost.png  compute_transfer_wait.png  load_balance.png  comm_efficiency.png  wait_pct.png
    summary.parquet  (the tidy table, one row per point x section, with scaled cost)
    README.md        (a table per (problem, mode) and the seed page's headline checks)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from pnpscale import columns as K
from pnpscale import layout
from pnpscale.runs import NoRunsError, discover, select, table_of

SUMMARY = "summary.parquet"
README = "README.md"


def build_table(path: str | Path, echo: Callable[[str], None] = print) -> pd.DataFrame:
    """Discover, select (printing the choices), load and add scaled cost.

    Raises:
        NoRunsError: no run folder under ``path``.
    """
    from pnpscale.summary import scaled_cost

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
    from pnpscale.charts import CHARTS, save

    table = build_table(path, echo)
    out = Path(out) if out is not None else Path(path) / layout.REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, plot in CHARTS.items():
        save(plot(table), out / name)
    layout.commit_files(out, {SUMMARY: lambda p: table.to_parquet(p, index=False)})
    layout.atomic_write_text(out / README, markdown(table, list(CHARTS)))
    return out


def _fmt(v: object, pattern: str) -> str:
    return "—" if v is None or (isinstance(v, float) and pd.isna(v)) else format(v, pattern)


def markdown(table: pd.DataFrame, charts: list[str]) -> str:
    """README of a report: one table per (problem, mode) and the headline checks."""
    from pnpscale.summary import describe, headline_checks

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
    return "\n".join(lines)


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


if __name__ == "__main__":
    raise SystemExit(main())
