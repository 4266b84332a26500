"""The projection's checks: the fit at its own points (residuals) and leave-one-out (pure functions).

:func:`residuals` evaluates the fit at each measured point with that point's own nodes and NCCL-logged
algorithm; :func:`leave_one_out` fits without each measured N and predicts it the same way; :func:`misses`
picks the residuals beyond a tolerance. Rows: :data:`pnpscale.columns.VALIDATION_COLUMNS`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.results.projection.base import (
    ALL,
    HEADLINE,
    INTRA,
    LOO,
    RESIDUAL,
    VALIDATED,
    Model,
    Options,
    ProjectionError,
    Unidentified,
    measured_points,
    row_algorithm,
    row_nodes,
)
from pnpscale.results.projection.evaluate import evaluate, measured_rows
from pnpscale.results.projection.fit import fit
from pnpscale.results.projection.routes import observed_route


def _own(pts: pd.DataFrame, n: int, gpn: int | None) -> dict[int, tuple[int, dict[str, str]]]:
    """A measured point's own nodes and NCCL-logged algorithm per section."""
    g = pts[pts[K.GPUS] == n]
    algos = {str(r[K.SECTION]): a for _, r in g.iterrows() if (a := row_algorithm(r)) is not None}
    return {n: (row_nodes(g.iloc[0], gpn), algos)}


def _compare(kind: str, model: Model, pts: pd.DataFrame, n: int, fitted_on: Sequence[int], headline: bool,
             past_cores: bool = False, assumed: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    pred = evaluate(model, [n], _own(pts, n, model.gpus_per_node), past_cores=past_cores,
                    assumed=assumed).set_index(K.SECTION)  # fmt: skip
    meas = measured_rows(pts[pts[K.GPUS] == n], model).set_index(K.SECTION)
    out = []
    for section in pred.index:
        if section not in meas.index:
            continue
        for metric in VALIDATED:
            mv, pv = float(meas.loc[section, metric]), float(pred.loc[section, metric])
            out.append({
                K.PROBLEM: model.problem, K.MODE: model.mode, "kind": kind, K.GPUS: n,
                "fitted_on": ",".join(map(str, fitted_on)), K.SECTION: section, "metric": metric,
                "measured_value": mv, "projected_value": pv,
                K.REL_ERROR: pv / mv - 1.0 if mv and math.isfinite(mv) else math.nan,
                "headline": headline, "note": "",
            })  # fmt: skip
    return out


def _failed(kind: str, model: Model, n: int, fitted_on: Sequence[int], why: str) -> dict[str, Any]:
    return {K.PROBLEM: model.problem, K.MODE: model.mode, "kind": kind, K.GPUS: n,
            "fitted_on": ",".join(map(str, fitted_on)), K.SECTION: ALL, "metric": "", "measured_value": math.nan,
            "projected_value": math.nan, K.REL_ERROR: math.nan, "headline": False, "note": why}  # fmt: skip


def residuals(rows: pd.DataFrame, model: Model) -> pd.DataFrame:
    """The fit at its own measured points (each with its own nodes and algorithm): one row per N x
    section x metric of :data:`VALIDATED`, ``kind`` = ``residual`` (points past a CPU sweep's cores,
    not fitted, are compared too and say so in ``note``)."""
    pts = measured_points(rows)
    out = []
    for n in sorted({int(g) for g in pts[K.GPUS]}):
        try:
            rows_n = _compare(RESIDUAL, model, pts, n, model.fitted_gpus, False, past_cores=True)
        except ProjectionError as exc:
            out.append(_failed(RESIDUAL, model, n, model.fitted_gpus, str(exc)))
            continue
        if n not in model.fitted_gpus:
            for r in rows_n:
                r["note"] = "not fitted: more ranks than cores"
        out += rows_n
    return pd.DataFrame(out, columns=list(K.VALIDATION_COLUMNS))


def leave_one_out(rows: pd.DataFrame, options: Options = Options(), model: Model | None = None,
                  samples: pd.DataFrame | None = None) -> pd.DataFrame:  # fmt: skip
    """Fit without each fitted N (keeping at least 2 others) and predict it with its own nodes and
    NCCL-logged algorithm (``gpus_per_node`` and the options of the full fit; the per-rank ``samples`` of
    the other points, no band). It measures the error at measured points, inside or at the edge of the fitted
    range: it does not bound the error past them.

    Returns:
        One row per held-out N x section (and ``all``) x metric of :data:`VALIDATED`, ``kind`` =
        ``leave-one-out``; ``headline`` True for the largest fitted N (predicted from the smaller
        ones). A held-out N that cannot be predicted (no rate for its route without it) is one row with
        the reason in ``note``.
    """
    pts = measured_points(rows)
    full = model or fit(pts, replace(options, bootstrap=0), samples)
    gpus = full.fitted_gpus
    opts = replace(options, gpus_per_node=full.gpus_per_node, devices=full.cores, bootstrap=0)
    out = []
    for held in gpus:
        rest_gpus = [g for g in gpus if g != held]
        if len(rest_gpus) < 2:
            continue
        try:
            sub = fit(pts[pts[K.GPUS].isin(rest_gpus)], opts, samples)
            own = _own(pts, held, full.gpus_per_node)[held]
            lacking = sorted({  # a route of its own: none of the other points measured it (one-node counts too)
                route for sm in sub.sections
                if not _has_rate(sub, route := observed_route(sub, held, own[0], sm.section,
                                                          own[1].get(sm.section))[0]) and route in full.rates
            } if held > 1 else set())  # fmt: skip
            note = ""
            if lacking:  # no other point takes its route: its own rate, and its transfer is no prediction
                own_rates = replace(opts, rates={**opts.rates, **{r: full.rates[r] for r in lacking}})
                sub = fit(pts[pts[K.GPUS].isin(rest_gpus)], own_rates, samples)
                note = (f"rate of {', '.join(lacking)} from this point itself (no other point takes that route): "
                        "its transfer is not a prediction")  # fmt: skip
            try:
                rows_n = _compare(LOO, sub, pts, held, rest_gpus, held == gpus[-1])
            except Unidentified as exc:  # refused: say what the stated assumption would have given
                why = f"{exc}{_assumed_errors(sub, pts, held, rest_gpus, own_rate=bool(note))}"
                out.append(_failed(LOO, full, held, rest_gpus, why))
                continue
            for r in rows_n:
                r["note"] = note
            out += rows_n
        except (ProjectionError, KeyError) as exc:
            out.append(_failed(LOO, full, held, rest_gpus, str(exc)))
    return pd.DataFrame(out, columns=list(K.VALIDATION_COLUMNS))


def _has_rate(model: Model, route: str) -> bool:
    """Whether a route has a rate of its own in the model (given or fitted), not a neighbour's."""
    return route in model.rates or (route.startswith(INTRA) and INTRA in model.rates)


def _assumed_errors(sub: Model, pts: pd.DataFrame, held: int, rest: Sequence[int], own_rate: bool) -> str:
    """The errors at the held-out point of the refused assumption (operators weighing as much as tiles, or
    jitter 0), section ``all``, :data:`HEADLINE` metrics (not the transfer when it took the point's own
    rate): what printing the refused number would have cost."""
    try:
        rows = _compare(LOO, sub, pts, held, rest, False, assumed=True)
    except ProjectionError:
        return ""
    names = {K.SECTION_S: "time", K.TRANSFER_S: "transfer", K.WAIT_S: "wait", K.PE: "PE"}
    errs = [f"{names[r['metric']]} {100 * r[K.REL_ERROR]:+.0f} %" for r in rows
            if r[K.SECTION] == ALL and r["metric"] in HEADLINE and math.isfinite(r[K.REL_ERROR])
            and not (own_rate and r["metric"] == K.TRANSFER_S)]  # fmt: skip
    return f" (the assumption would miss it: {', '.join(errs)})" if errs else ""


def misses(validation: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Rows of :func:`residuals` (section ``all``, :data:`HEADLINE` metrics) off by more than ``tolerance``."""
    v = validation[(validation["kind"] == RESIDUAL) & (validation[K.SECTION] == ALL)
                   & validation["metric"].isin(HEADLINE)]  # fmt: skip
    return v[v[K.REL_ERROR].abs() > tolerance]


def loo_misses(validation: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Rows of :func:`leave_one_out` (section ``all``, :data:`HEADLINE` metrics) off by more than ``tolerance``;
    a transfer taken from the held-out point's own rate (its ``note`` says so) is no prediction and left out."""
    v = validation[(validation["kind"] == LOO) & (validation[K.SECTION] == ALL)
                   & validation["metric"].isin(HEADLINE)]  # fmt: skip
    own = (v["metric"] == K.TRANSFER_S) & (v["note"].astype(str) != "")
    return v[~own & (v[K.REL_ERROR].abs() > tolerance)]
