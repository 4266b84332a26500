"""The projection's evaluation: the model's numbers at any N, the measured rows beside them, the findings.

:func:`evaluate` gives per N and section C, C_max, T, W, S and LB, CommE, PE (POP), GPU-seconds and scaled
cost, and refuses an impossible number (:func:`check_possible`); :func:`measured_rows` puts the measured
points in the same columns; :func:`findings` searches 1..N for the crossover, the fastest N and the largest
N with PE >= a threshold. Pure functions; seconds per iteration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.results.jitter import expected_max_normal
from pnpscale.results.projection.base import (
    ALL,
    BAND,
    EPS,
    INTRA,
    Model,
    NodeSizeUnknown,
    ProjectionError,
    TimeShared,
    Unidentified,
    compute_at,
    hops,
    is_balanced,
    measured_points,
    nodes_for,
    row_algorithm,
    row_nodes,
    sent_bytes_of,
    split_matters,
    spread_counts,
)
from pnpscale.results.projection.routes import observed_route, rate_at
from pnpscale.results.transfer import GB


def evaluate(
    model: Model,
    gpus: Iterable[int],
    at: Mapping[int, tuple[int, Mapping[str, str]]] | None = None,
    past_cores: bool = False,
    assumed: bool = False,
) -> pd.DataFrame:
    """The model's numbers at each N: one row per N x section plus section ``all``.

    Args:
        model: :func:`fit`'s output. gpus: GPU counts.
        at: N -> (nodes, {section: algorithm}) to use instead of the model's (a measured point's own
            nodes and NCCL-logged algorithms: :func:`leave_one_out`, :func:`residuals`).
        past_cores: evaluate N past a CPU sweep's cores too (only to compare with a measured point).
        assumed: evaluate the terms the fitted points cannot identify under the stated assumption (one
            ``combined`` unit: operators weigh as much as tiles; no balanced point: jitter 0) where
            :class:`Unidentified` would refuse them (only to show what that assumption would give against
            a measured point: :func:`leave_one_out`).

    Returns:
        Columns :data:`pnpscale.columns.PROJECTION_COLUMNS` with MEASURED False (seconds per iteration).

    Raises:
        ProjectionError: a route at some N with neither a measured nor a given rate; N past the cores
            of CPU ranks; an impossible number (a bug: C, T, W < 0 or LB, CommE, PE > 1).
        Unidentified: a section whose fitted points never told an operator's compute from a tile's,
            at an N where ranks hold unequal shares of the two; or a jitter never measured apart from
            uneven work, at an N where every rank holds the same work (C_max and wait unknown there).
    """
    rows = []
    for n in sorted({int(g) for g in gpus}):
        nodes, per = numbers_at(model, n, at, past_cores, assumed)
        sums = np.sum([p[1:5] for p in per], axis=0)
        for section, c, cmax, tr, wait, route, rate, algo, source in [*per, (ALL, *sums, "", math.nan, "", "")]:
            rows.append(_row(model, n, nodes, section, c, cmax, tr, wait, route, rate, algo, source))
    out = pd.DataFrame(rows, columns=list(K.PROJECTION_COLUMNS))
    check_possible(out)
    return out


def numbers_at(model: Model, n: int, at: Mapping[int, tuple[int, Mapping[str, str]]] | None = None,
               past_cores: bool = False, assumed: bool = False) -> tuple[int, list[tuple[Any, ...]]]:  # fmt: skip
    """(nodes, per section ``(section, C, C_max, T, W, route, rate, algorithm, source)``) at N: :func:`evaluate`'s
    numbers before they become rows (the same refusals)."""
    m, t = model.num_operators, model.num_tiles
    if n < 1:
        raise ProjectionError(f"gpus={n}: must be >= 1")
    if model.cores is not None and n > model.cores and not past_cores:
        raise TimeShared(f"{model.problem} {model.mode} gpus={n}: more ranks than the {model.cores} cores "
                         "they time-share: no honest projection exists there")  # fmt: skip
    if model.gpus_per_node is None and model.largest_node is not None and n > model.largest_node \
            and n not in (at or {}):  # a measured point's own nodes are a fact
        raise NodeSizeUnknown(
            f"{model.problem} {model.mode} gpus={n}: every measured run sat on one node (of at least "
            f"{model.largest_node} GPUs) and the node size is unknown: a node of {n} GPUs, bigger than any "
            "measured one, is not assumed; give --gpus-per-node G and the inter-node rate (--rate ring=GBps)"
        )
    nodes, algos = (at or {}).get(n, (nodes_for(n, model.gpus_per_node), {}))
    if not assumed:
        _refuse_unidentified(model, n)
    per = []
    for sm in model.sections:
        c, cmax = compute_at(sm, m, t, n, model.gpus_per_node)
        route, algo, source = "", "", ""
        rate: float | None = math.nan
        if n == 1:
            tr = wait = 0.0
        else:
            route, algo, source = observed_route(model, n, nodes, sm.section, algos.get(sm.section))
            rate, _ = rate_at(model, n, route)
            if rate is None:
                flag = f"{'intra:' + str(n) if route.startswith(INTRA) else route.split()[-1]}=GBps"
                measured = ", ".join(sorted(model.rates)) or "none"
                if not route.startswith(INTRA) and all(r.startswith(INTRA) for r in model.rates):
                    raise ProjectionError(  # not the measured point's fault: nothing measured across nodes
                        f"{model.problem} {model.mode}: no rate for route {route!r}: no measured point has a "
                        f"multi-node route (measured: {measured}), and gpus={n} on {nodes} nodes "
                        f"({model.gpus_per_node} GPUs per node) takes it; give --rate {flag} "
                        f"(e.g. --rate {route.split()[-1]}=10.5), or --gpus-per-node of the measured nodes"
                    )
                raise ProjectionError(
                    f"{model.problem} {model.mode} gpus={n}: no rate for route {route!r} (measured routes: "
                    f"{measured}); give --rate {flag}"
                )
            steps = sm.n_collectives * hops(n, nodes, algo)
            tr = sm.latency_s * steps + sent_bytes_of(sm.payload_bytes, n, nodes, algo) / (rate * GB)
            wait = max(0.0, cmax - c) + sm.excess * expected_max_normal(n) * cmax  # cmax >= c: rounding only
        per.append((sm.section, c, cmax, tr, wait, route, rate, algo, source))
    return nodes, per


#: the band's metrics: each gets ``<metric>_lo`` and ``<metric>_hi`` (:data:`pnpscale.columns.PROJECTION_BAND_COLUMNS`).
BANDED = (K.SECTION_S, K.SCALED_COST, K.COMM_E, K.PE)


def with_band(model: Model, table: pd.DataFrame) -> pd.DataFrame:
    """``table`` (:func:`evaluate`'s rows of ``model``) with the 5–95 % band of :data:`BANDED` from the
    model's bootstrap replicates (``model.replicates``): every replicate evaluated at the same N and nodes,
    the quantiles per (N, section); NaN without replicates. A replicate that cannot be evaluated (an
    impossible number from a resampled coefficient) is left out; more than 5 % left out: no band (NaN).
    """
    out = table.copy()
    for col in BANDED:
        for name in band_columns(col):
            out[name] = math.nan
    if not model.replicates or table.empty:
        return out
    gpus = sorted({int(g) for g in table[K.GPUS]})
    values: dict[tuple[int, str], list[np.ndarray]] = {}
    for rep in model.replicates:
        sub = replace(model, sections=rep, replicates=[])
        try:
            got = {n: numbers_at(sub, n) for n in gpus}
        except ProjectionError:
            continue
        batch: dict[tuple[int, str], np.ndarray] = {}
        for n, (_, per) in got.items():
            parts = np.array([p[1:5] for p in per], dtype=float)  # C, C_max, T, W per section
            if (parts < -EPS).any():
                batch = {}
                break
            for (section, *_), row in zip([*per, (ALL,)], [*parts, parts.sum(axis=0)], strict=True):
                c, cmax, tr, wait = row
                sec = c + tr + wait
                base = model.baseline_gpus * model.baseline_s
                cost = n * sec / base if base else math.nan
                comm_e, pe = (cmax / sec, c / sec) if sec else (math.nan, math.nan)
                batch[(n, str(section))] = np.array([sec, cost, comm_e, pe])
        for k, v in batch.items():
            values.setdefault(k, []).append(v)
    done = min((len(v) for v in values.values()), default=0)
    if done < 0.95 * len(model.replicates):
        return out
    for i, row in out.iterrows():
        got_v = values.get((int(row[K.GPUS]), str(row[K.SECTION])))
        if got_v is None:
            continue
        q = np.quantile(np.array(got_v), list(BAND), axis=0)
        for j, col in enumerate(BANDED):
            lo, hi = band_columns(col)
            out.at[i, lo], out.at[i, hi] = float(q[0, j]), float(q[1, j])
    return out


def band_columns(col: str) -> tuple[str, str]:
    """(lo, hi) column names of a banded metric (:func:`pnpscale.columns.band_column`)."""
    return K.band_column(col, "lo"), K.band_column(col, "hi")


def _refuse_unidentified(model: Model, n: int) -> None:
    """Raise :class:`Unidentified` when a term the fitted points cannot identify sets C_max and wait at N."""
    m, t = model.num_operators, model.num_tiles
    for sm in model.sections:
        if sm.jitter_unknown and is_balanced(sm.units, m, t, n):
            ops, tiles = spread_counts(m, n), spread_counts(t, n)
            hint = next((k for k in range(2, 4 * max(model.fitted_gpus) + 2) if is_balanced(sm.units, m, t, k)), None)
            raise Unidentified(
                f"{model.problem} {model.mode} {sm.section}: compute_max and wait at gpus={n} not projected: "
                f"{sm.jitter_unknown}, and on {n} ranks every rank holds the same work ({ops[0]:g} of {m} "
                f"operators, {tiles[0]:g} of {t} tiles), where the wait is jitter alone"
                + (f"; measure a GPU count where the work is even (e.g. gpus={hint})" if hint else "")
            )
        if sm.unidentified and split_matters(m, t, n):
            ops, tiles = spread_counts(m, n), spread_counts(t, n)
            top = int(max(model.fitted_gpus))
            hint = next((k for k in range(top + 1, 4 * top + 2) if split_matters(m, t, k)), None)
            raise Unidentified(
                f"{model.problem} {model.mode} {sm.section}: compute_max and wait at gpus={n} not projected: "
                f"{sm.unidentified}, and on {n} ranks the shares differ (rank 0: {ops[0]:g} of {m} operators, "
                f"{tiles[0]:g} of {t} tiles; rank {n - 1}: {ops[-1]:g}, {tiles[-1]:g}), where the critical path "
                "depends on that split"
                + (f"; measure a GPU count where they differ (e.g. gpus={hint}) to project past {top}" if hint else "")
            )


def _row(model: Model, n: int, nodes: int, section: str, c: float, cmax: float, tr: float, wait: float,
         route: str, rate: float | None, algo: str = "", source: str = "",
         smax: float | None = None) -> dict[str, Any]:  # fmt: skip
    s = c + tr + wait
    smax = s if smax is None or not math.isfinite(smax) else smax
    return {
        K.PROBLEM: model.problem,
        K.MODE: model.mode,
        K.GPUS: n,
        K.NODES: nodes,
        K.SECTION: section,
        K.COMPUTE_S: c,
        K.COMPUTE_MAX_S: cmax,
        K.TRANSFER_S: tr,
        K.WAIT_S: wait,
        K.SECTION_S: s,
        K.LB: c / cmax if cmax else math.nan,
        K.COMM_E: cmax / smax if smax else math.nan,
        K.PE: c / smax if smax else math.nan,
        K.GPU_SECONDS: n * s,
        K.SCALED_COST: n * s / (model.baseline_gpus * model.baseline_s) if model.baseline_s else math.nan,
        K.ROUTE: route,
        K.RATE_GBPS: rate if route else math.nan,
        K.ALGORITHM: algo,
        K.ALGORITHM_SOURCE: source,
        K.MEASURED: False,
        **dict.fromkeys(K.PROJECTION_BAND_COLUMNS, math.nan),
        K.CAVEAT: "",
    }


def check_possible(table: pd.DataFrame) -> None:
    """Refuse an impossible projected number: a negative time, LB, CommE or PE above 1.

    Raises:
        ProjectionError: naming the first offending row and column.
    """
    for col, bad in (
        (K.COMPUTE_S, table[K.COMPUTE_S] < -EPS),
        (K.COMPUTE_MAX_S, table[K.COMPUTE_MAX_S] < table[K.COMPUTE_S] - EPS),
        (K.TRANSFER_S, table[K.TRANSFER_S] < -EPS),
        (K.WAIT_S, table[K.WAIT_S] < -EPS),
        (K.SECTION_S, table[K.SECTION_S] < -EPS),
        (K.LB, table[K.LB] > 1 + EPS),
        (K.COMM_E, table[K.COMM_E] > 1 + EPS),
        (K.PE, table[K.PE] > 1 + EPS),
    ):
        if bad.any():
            r = table[bad].iloc[0]
            raise ProjectionError(
                f"impossible projected {col} = {r[col]:.4g} at gpus={r[K.GPUS]} section {r[K.SECTION]}"
            )


def measured_rows(rows: pd.DataFrame, model: Model) -> pd.DataFrame:
    """The measured points in the projection's columns (MEASURED True), section rows and ``all``;
    CommE and PE use the slowest rank's section time SECTION_MAX_S when the table has it."""
    pts = measured_points(rows)
    out = []
    for n, g in pts.groupby(K.GPUS):
        nodes = row_nodes(g.iloc[0], model.gpus_per_node)
        cols = [K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S]
        smax = g[K.SECTION_MAX_S] if K.SECTION_MAX_S in g else pd.Series(math.nan, index=g.index)
        for (_, r), sm in zip(g.iterrows(), smax, strict=True):
            algo = row_algorithm(r) or ""
            out.append((r[K.SECTION], *(float(r[c]) for c in cols), int(n), nodes, algo, float(sm)))
        total_max = float(smax.sum()) if smax.notna().all() else math.nan
        out.append((ALL, *g[cols].sum().tolist(), int(n), nodes, "", total_max))
    df = pd.DataFrame(
        [_row(model, n, nodes, s, c, cm, tr, w, "", None, a, "NCCL log" if a else "", smx)
         for s, c, cm, tr, w, n, nodes, a, smx in out],
        columns=list(K.PROJECTION_COLUMNS),
    )  # fmt: skip
    df[K.MEASURED] = True
    return df


def findings(model: Model, up_to: int, pe_min: float) -> dict[str, Any]:
    """Crossover, fastest N and largest N with PE >= ``pe_min``, over every integer N in 1..``up_to``
    (capped at a CPU sweep's cores).

    Returns:
        ``{"crossover_gpus": N or None, "crossover_by_section": {section: N or None}, "fastest_gpus",
        "fastest_s", "pe_min", "largest_gpus_pe", "searched_up_to"}``.
    """
    up_to = min(up_to, model.cores) if model.cores is not None else up_to
    grid = evaluate(model, range(1, up_to + 1))
    out: dict[str, Any] = {"searched_up_to": up_to, "pe_min": pe_min, "crossover_by_section": {}}
    for section, g in grid.groupby(K.SECTION, sort=False):
        over = g[(g[K.GPUS] > 1) & (g[K.TRANSFER_S] > g[K.COMPUTE_MAX_S])]
        first = int(over[K.GPUS].min()) if not over.empty else None
        if section == ALL:
            out["crossover_gpus"] = first
        else:
            out["crossover_by_section"][section] = first
    a = grid[grid[K.SECTION] == ALL]
    best = a.loc[a[K.SECTION_S].idxmin()]
    out["fastest_gpus"], out["fastest_s"] = int(best[K.GPUS]), float(best[K.SECTION_S])
    ok = a[a[K.PE] >= pe_min]
    out["largest_gpus_pe"] = int(ok[K.GPUS].max()) if not ok.empty else None
    return out
