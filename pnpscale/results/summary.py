"""Scaling summary of a sweep (pure functions over the tidy table of :func:`pnpscale.results.runs.load`).

Scaled cost (the study, "How does communication cost grow"): for each (problem, mode), the
GPU-seconds of a run relative to the run at the smallest GPU count of that (problem, mode),
``cost(N) = N * S(N) / (N0 * S(N0))`` with ``S`` the section time per measured iteration summed
over sections; 1.0 is perfect linear scaling. It splits into a compute part ``N * C(N) / (N0 * S(N0))``
and a communication part ``N * (T + W)(N) / (N0 * S(N0))``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K

POINT = ["problem", "mode", "gpus"]
GROUP = ["problem", "mode"]
ALL = "all"


def group_keys(table: pd.DataFrame) -> list[str]:
    """The series of a table: (problem, mode), plus ``variant`` when the table has that column
    (:func:`pnpscale.results.runs.variants`: a sweep over a variant key makes one series per value)."""
    return GROUP + (["variant"] if "variant" in table else [])


def scaled_cost(tidy: pd.DataFrame) -> pd.DataFrame:
    """Scaled GPU-seconds per (problem, mode, gpus, section), relative to the smallest GPU count.

    Args:
        tidy: :func:`pnpscale.results.runs.load` output (``gpu_seconds``, ``compute_s``, ``transfer_s``,
            ``wait_s``, ``status`` columns; failed points with NaN metrics are kept as NaN).

    Returns:
        the input rows plus ``baseline_gpus`` (Int64), ``scaled_cost``, ``scaled_compute``,
        ``scaled_comm`` (compute + communication = scaled_cost) and ``section_growth`` (the
        section's own GPU-seconds relative to its own baseline).
    """
    out = tidy.copy()
    for col in ("baseline_gpus", "scaled_cost", "scaled_compute", "scaled_comm", "section_growth"):
        out[col] = np.nan
    complete = out["status"] == "complete"
    for _, idx in out[complete].groupby(group_keys(out), dropna=False).groups.items():
        grp = out.loc[idx]
        n0 = grp["gpus"].min()
        base_all = grp[(grp["gpus"] == n0) & (grp[K.SECTION] == ALL)][K.GPU_SECONDS]
        if base_all.empty:
            continue
        base = float(base_all.iloc[0])
        out.loc[idx, "baseline_gpus"] = n0
        gs = grp[K.GPU_SECONDS]
        out.loc[idx, "scaled_cost"] = gs / base
        out.loc[idx, "scaled_compute"] = grp["gpus"] * grp[K.COMPUTE_S] / base
        out.loc[idx, "scaled_comm"] = grp["gpus"] * (grp[K.TRANSFER_S] + grp[K.WAIT_S]) / base
        own = grp[grp["gpus"] == n0].set_index(K.SECTION)[K.GPU_SECONDS]
        out.loc[idx, "section_growth"] = gs / grp[K.SECTION].map(own)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["wait_pct_of_compute"] = 100.0 * out[K.WAIT_S] / out[K.COMPUTE_S]
    out["baseline_gpus"] = pd.to_numeric(out["baseline_gpus"]).astype("Int64")  # a GPU count: NA for failed points
    return out


def headline_checks(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The study's headline checks per (problem, mode), computed from the data.

    Args:
        table: :func:`scaled_cost` output.

    Returns:
        one dict per (problem, mode) with: ``largest_gpus``, ``baseline_gpus``,
        ``cost_vs_ideal`` (scaled cost at the largest GPU count; 1.0 = ideal),
        ``compute_max_s`` and ``transfer_s`` summed over sections at the largest GPU count and
        ``compute_over_transfer`` (their ratio: > 1 compute-bound, < 1 transfer-bound),
        ``fastest_growing_section`` and its ``growth`` (GPU-seconds relative to its own baseline),
        ``transfer_share_of_comm`` (transfer / (transfer + wait) at the largest GPU count),
        ``failed_gpus`` (points without a complete run), ``mixed`` (run settings that differ between
        the points compared: scale preset, measured iterations), ``time_shared_gpus`` (complete points whose
        ranks time-shared cores or GPUs, TIME_SHARED) and ``cores`` (their usable cores: a sorted list).
    """
    out = []
    for (problem, mode), grp in table.groupby(GROUP, sort=True):
        done = grp[grp["status"] == "complete"]
        failed = sorted(int(g) for g in grp.loc[grp["status"] != "complete", "gpus"].unique())
        row: dict[str, Any] = {"problem": problem, "mode": mode, "failed_gpus": failed, "mixed": {}}
        for col in ("scale", "iterations"):
            values = sorted({str(v) for v in grp.loc[grp["status"] == "complete", col].dropna()}) if col in grp else []
            if len(values) > 1:
                row["mixed"][col] = values
        alls = done[done[K.SECTION] == ALL]
        flag = alls[K.TIME_SHARED].astype("boolean").fillna(False) if K.TIME_SHARED in alls else None
        shared = alls[flag.to_numpy(dtype=bool)] if flag is not None else alls.iloc[0:0]
        row["time_shared_gpus"] = sorted(int(g) for g in shared["gpus"])
        cores = shared[K.CORES].dropna() if K.CORES in shared else pd.Series(dtype="Int64")
        row["cores"] = sorted({int(c) for c in cores})
        if done.empty:
            out.append(row)
            continue
        n = int(done["gpus"].max())
        top = done[(done["gpus"] == n) & (done[K.SECTION] == ALL)].iloc[0]
        sections = done[(done["gpus"] == n) & (done[K.SECTION] != ALL)]
        growth = sections.set_index(K.SECTION)["section_growth"].dropna()
        comm = top[K.TRANSFER_S] + top[K.WAIT_S]
        row.update(
            largest_gpus=n,
            baseline_gpus=int(done["gpus"].min()),
            cost_vs_ideal=float(top["scaled_cost"]),
            compute_max_s=float(top[K.COMPUTE_MAX_S]),
            transfer_s=float(top[K.TRANSFER_S]),
            compute_over_transfer=float(top[K.COMPUTE_MAX_S] / top[K.TRANSFER_S]) if top[K.TRANSFER_S] > 0 else None,
            fastest_growing_section=str(growth.idxmax()) if not growth.empty else None,
            growth=float(growth.max()) if not growth.empty else None,
            transfer_share_of_comm=float(top[K.TRANSFER_S] / comm) if comm > 0 else None,
        )
        out.append(row)
    return out


def time_shared_sentence(gpus: list[int], cores: list[int]) -> str | None:
    """The headline's warning on time-shared points, or ``None`` when there is none.

    >>> time_shared_sentence([4, 8, 16, 32, 64], [2])
    'gpus=4..64: 4–64 ranks on 2 cores, time-shared: not a scaling result.'
    >>> time_shared_sentence([4], [])
    'gpus=4: 4 ranks on fewer cores (or GPUs) than they need, time-shared: not a scaling result.'
    """
    if not gpus:
        return None
    where = f"gpus={gpus[0]}" if len(gpus) == 1 else f"gpus={gpus[0]}..{gpus[-1]}"
    ranks = f"{gpus[0]}" if len(gpus) == 1 else f"{gpus[0]}–{gpus[-1]}"
    on = (f"on {cores[0]} cores" if len(cores) == 1 else f"on {cores[0]}–{cores[-1]} cores") if cores else \
        "on fewer cores (or GPUs) than they need"
    return f"{where}: {ranks} ranks {on}, time-shared: not a scaling result."


def describe(check: dict[str, Any]) -> list[str]:
    """Sentences for one :func:`headline_checks` entry (the report's README); time-shared points are named
    first, and the sentences about the largest GPU count say when it is one of them."""
    if "largest_gpus" not in check:
        return ["No complete run: nothing to compare."]
    n, n0 = check["largest_gpus"], check["baseline_gpus"]
    shared = check.get("time_shared_gpus") or []
    first = time_shared_sentence(shared, check.get("cores") or [])
    at = f"At {n} GPUs" + (" (time-shared)" if n in shared else "")
    lines = [first] if first else []
    lines.append(f"{at} the run costs {check['cost_vs_ideal']:.2f}x the GPU-seconds of ideal scaling from {n0}.")
    ratio = check["compute_over_transfer"]
    if ratio is None:
        lines.append(f"{at} nothing is transferred (compute_max {check['compute_max_s']:.4g} s).")
    elif ratio >= 1:
        lines.append(
            f"Critical-path compute ({check['compute_max_s']:.4g} s) is {100 * (ratio - 1):.0f}% above transfer "
            f"({check['transfer_s']:.4g} s): compute-bound."
        )
    else:
        lines.append(
            f"Transfer ({check['transfer_s']:.4g} s) exceeds critical-path compute ({check['compute_max_s']:.4g} s): "
            + ("transfer-bound." if n not in shared else "transfer-bound as measured, on time-shared cores.")
        )
    if check.get("fastest_growing_section"):
        lines.append(
            f"The section that grows most relative to its own baseline is `{check['fastest_growing_section']}` "
            f"({check['growth']:.2f}x its GPU-seconds at {n0})."
        )
    if check.get("transfer_share_of_comm") is not None:
        lines.append(
            f"Transfer (all collectives) is {100 * check['transfer_share_of_comm']:.0f}% of the non-compute time at "
            f"{n} GPUs."
        )
    for col, values in check.get("mixed", {}).items():
        lines.append(f"Caution: the points compared differ in {col} ({', '.join(values)}).")
    if check["failed_gpus"]:
        lines.append(f"Missing (failed or incomplete) points: gpus={', '.join(map(str, check['failed_gpus']))}.")
    return lines
