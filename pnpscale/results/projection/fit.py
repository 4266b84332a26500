"""The projection's fit: compute per rank, jitter and wait of each section on the measured points (pure functions).

:func:`fit` reads one (problem, mode)'s measured points and returns a :class:`~pnpscale.results.projection.base.Model`
(:mod:`pnpscale.results.projection.model` states the model): ``μ_r = a + b·ops_r + c·tiles_r`` by non-negative
least squares on C and C_max, the jitter σ from the balanced points, the wait beyond ``C_max − C`` (ψ), then the
transfer (:func:`pnpscale.results.projection.routes.fit_transfer`).

Units: seconds per iteration, bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.rank.assignment import section_work
from pnpscale.results.jitter import expected_max_normal, nonnegative_lstsq
from pnpscale.results.projection.base import (
    Model,
    Options,
    ProjectionError,
    SectionModel,
    cpu_cores_of,
    expected_cmax,
    is_balanced,
    measured_points,
    row_algorithm,
    row_nodes,
    series_key,
    top_count,
    work_per_rank,
)
from pnpscale.results.projection.routes import fit_transfer


def fit(rows: pd.DataFrame, options: Options = Options()) -> Model:
    """Fit the model of one (problem, mode) on its measured points (see module doc).

    Args:
        rows: summary rows of one (problem, mode): GPUS, SECTION, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S,
            WAIT_S, SECTION_S (seconds per iteration), MAIN_PAYLOAD_BYTES, N_MAIN, OTHER_PAYLOAD_BYTES,
            ``num_operators``, ``num_tiles``, optionally NODES, ALGORITHM, ``backend``, ``status`` (only
            complete rows are used).
        options: :class:`Options`.

    Returns:
        :class:`Model`.

    Raises:
        ProjectionError: fewer than 2 GPU counts to fit on, no multi-GPU point with a payload, unknown
            operator or tile counts, rows of several (problem, mode), or a compute that no non-negative
            model fits (the points named).
    """
    pts = measured_points(rows)
    problem, mode, label = series_key(pts)
    measured = sorted({int(g) for g in pts[K.GPUS]})
    m_t = {}
    for col in ("num_operators", "num_tiles"):
        vals = pts[col].dropna().unique() if col in pts else []
        if len(vals) != 1:
            raise ProjectionError(
                f"{label}: {col} is {'unknown' if len(vals) == 0 else 'not the same at every point'} "
                "(run.json's assignment); the compute model needs it"
            )
        m_t[col] = int(vals[0])
    m, t = m_t["num_operators"], m_t["num_tiles"]
    cores, cores_note = cpu_cores_of(pts, options)
    fitted = [n for n in measured if cores is None or n <= cores]
    assumptions = [f"assignment: deepinv's round-robin (item i on rank i % N) of {m} operators and {t} tiles"]
    if cores is not None:
        past = [n for n in measured if n > cores]
        assumptions.append(
            f"{cores_note}: more ranks than {cores} time-share the cores (compute and transfer), which the model "
            f"does not describe: N > {cores} is not projected"
            + (f"; measured {', '.join(map(str, past))} not fitted" if past else "")
        )
    if len(fitted) < 2:
        raise ProjectionError(
            f"{label}: {len(fitted)} GPU count(s) to fit on ({', '.join(map(str, fitted)) or 'none'}"
            + (f"; ranks past {cores} cores are not fitted" if len(fitted) < len(measured) else "")
            + "); a projection needs at least 2"
        )
    pts = pts[pts[K.GPUS].isin(fitted)]

    gpn = options.gpus_per_node
    if gpn is None and K.NODES in pts:
        multi = pts[pd.to_numeric(pts[K.NODES], errors="coerce") > 1]
        if not multi.empty:
            top = multi.loc[multi[K.GPUS].idxmax()]
            gpn = math.ceil(int(top[K.GPUS]) / int(top[K.NODES]))
            assumptions.append(f"nodes = ceil(N / {gpn}) ({gpn} GPUs per node, as in the measured runs)")
    if gpn is None:
        assumptions.append("every N on one node, as the measured runs (give --gpus-per-node to model nodes)")
    elif options.gpus_per_node is not None:
        assumptions.append(f"nodes = ceil(N / {gpn}) (--gpus-per-node)")

    logged: dict[tuple[int, str], str] = {}
    for _, r in pts[pts[K.GPUS] > 1].iterrows():
        algo, nodes = row_algorithm(r), row_nodes(r, gpn)
        if algo is not None and nodes > 1:
            logged[(nodes, str(r[K.SECTION]))] = algo

    names = list(dict.fromkeys(pts[K.SECTION]))
    sigmas = _jitter(pts, names, m, t)
    sig_all = [v for vals in sigmas.values() for v in vals]
    sections: list[SectionModel] = []
    for name in names:
        jitter_unknown = ""
        s = pts[pts[K.SECTION] == name].sort_values(K.GPUS)
        units = section_work(name)
        if sigmas[name]:
            sigma = max(0.0, float(np.mean(sigmas[name])))
            where = f"its balanced points {', '.join(str(int(g)) for g in _balanced_gpus(s, units, m, t))}"
        elif sig_all:
            sigma = max(0.0, float(np.mean(sig_all)))
            where = "the other sections' balanced points (it has none)"
        else:
            sigma, where = 0.0, "no balanced multi-GPU point: jitter not modelled"
            jitter_unknown = (f"no fitted point ({', '.join(str(int(g)) for g in fitted)}) gives the ranks of any "
                              "section the same work, so the jitter (same work, different finishing time) was never "
                              "measured apart from the uneven work")  # fmt: skip
        coef, used = _fit_compute(s, units, m, t, sigma, options.tolerance, label)
        unidentified = ""
        if used != units:
            at = ", ".join(str(int(g)) for g in s[K.GPUS])
            unidentified = (f"on the fitted points {at} every rank holds the same share of the {m} operators and "
                            f"{t} tiles, so the fit cannot tell an operator's compute from a tile's")  # fmt: skip
            assumptions.append(
                f"{name}: {unidentified}: one unit ops/M + tiles/T, exact at N where every rank holds the same "
                "share of both; C_max and wait at any other N depend on the unknown split and are not projected"
            )
        multi = s[s[K.GPUS] > 1]
        payload = _payload(multi)
        if payload is None:
            raise ProjectionError(f"{label} {name}: no measured multi-GPU point with a payload: no transfer model")
        sm = SectionModel(name, used, coef, 0.0, payload, sigma, 0.0, unidentified, jitter_unknown)
        sm.excess = _excess(multi, sm, m, t)
        sections.append(sm)
        parts = ", ".join(f"{u} {v:.4g} s" for u, v in zip(("fixed", *used), coef, strict=True))
        assumptions.append(
            f"{name}: compute per rank = {parts} (non-negative fit, weights 1/value); jitter σ = {sigma:.3g} "
            f"(from {where})" + (f"; wait beyond C_max − C: ψ = {sm.excess:.3g} x e(N)·C_max" if sm.excess else "")
            + ("; C_max and wait at N where every rank holds the same work (jitter alone) are not projected"
               if jitter_unknown else "")
        )  # fmt: skip
    assumptions.append(
        "C_max = E[max_r μ_r·(1 + σ·Z_r)], Z_r independent standard normals (equal work: μ·(1 + σ·e(N)), e(N) "
        "the expected maximum of N standard normals); wait = uneven work + jitter = C_max − C (+ ψ·e(N)·C_max); "
        "ranks leave each "
        "section together (S_max = S), CommE = ΣC_max/ΣS_max, PE = ΣC/ΣS_max"
    )
    model = Model(problem, mode, m, t, gpn, logged, dict(options.algorithms), {}, {}, sections, fitted[0], 0.0,
                  measured, fitted, assumptions, cores, options.tolerance)  # fmt: skip
    fit_transfer(model, pts, options.rates, label)
    assumptions.append(
        "transfer = latency + bytes per GPU / route rate; a section's collectives are modelled as one all_reduce "
        "of their summed payload (n_main x main payload + other payload); one node: ring bytes 2P(N−1)/N, a rate "
        "per GPU count"
    )
    base = pts[pts[K.GPUS] == fitted[0]][K.SECTION_S].sum()
    model.baseline_s = float(base)
    assumptions.append(f"scaled cost relative to the measured {fitted[0]} GPU(s): {base:.6g} s per iteration")
    return model


def _balanced_gpus(s: pd.DataFrame, units: Sequence[str], m: int, t: int) -> list[int]:
    return [int(g) for g in s[K.GPUS] if is_balanced(units, m, t, int(g))]


def _jitter(pts: pd.DataFrame, names: Sequence[str], m: int, t: int) -> dict[str, list[float]]:
    """Per section, ``(C_max/C − 1)/e(N)`` at each balanced multi-GPU point."""
    out: dict[str, list[float]] = {}
    for name in names:
        s = pts[pts[K.SECTION] == name]
        vals = []
        for _, r in s.iterrows():
            n, c, cmax = int(r[K.GPUS]), float(r[K.COMPUTE_S]), float(r[K.COMPUTE_MAX_S])
            if is_balanced(section_work(name), m, t, n) and c > 0:
                vals.append((cmax / c - 1.0) / expected_max_normal(n))
        out[name] = vals
    return out


def _excess(multi: pd.DataFrame, sm: SectionModel, m: int, t: int) -> float:
    vals = []
    for _, r in multi.iterrows():
        n, cmax = int(r[K.GPUS]), float(r[K.COMPUTE_MAX_S])
        extra = float(r[K.WAIT_S]) - (cmax - float(r[K.COMPUTE_S]))
        if cmax > 0:
            vals.append(extra / (expected_max_normal(n) * cmax))
    psi = float(np.mean(vals)) if vals else 0.0
    return psi if psi > 1e-9 else 0.0


def _payload(multi: pd.DataFrame) -> float | None:
    if multi.empty or K.MAIN_PAYLOAD_BYTES not in multi:
        return None
    top = multi.sort_values(K.GPUS).iloc[-1]
    main = top[K.MAIN_PAYLOAD_BYTES]
    if pd.isna(main):
        return None
    n_main = top[K.N_MAIN] if K.N_MAIN in top and pd.notna(top[K.N_MAIN]) else 1
    other = top[K.OTHER_PAYLOAD_BYTES] if K.OTHER_PAYLOAD_BYTES in top and pd.notna(top[K.OTHER_PAYLOAD_BYTES]) else 0
    return float(main) * float(n_main) + float(other)


def _design(s: pd.DataFrame, use: Sequence[str], m: int, t: int, sigma: float,
            coef: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, list[str]]:  # fmt: skip
    """Rows ``C = a + b·mean(work)`` and ``C_max = q·(a + b·work_0)``, ``q = E[max]/μ_max`` at ``coef``
    (first pass: ``1 + σ·e(n_top)``): linear in the coefficients for a fixed q."""
    x, y, names = [], [], []
    for _, r in s.iterrows():
        n = int(r[K.GPUS])
        w = work_per_rank(use, m, t, n)
        if coef is None:
            f = 1.0 + sigma * expected_max_normal(top_count(w))
        else:
            mu = coef[0] + w @ coef[1:]
            f = expected_cmax(mu, sigma) / mu.max() if mu.max() > 0 else 1.0
        x += [[1.0, *w.mean(axis=0)], [f, *(f * w[0])]]
        y += [float(r[K.COMPUTE_S]), float(r[K.COMPUTE_MAX_S])]
        names += [f"N={n} compute {float(r[K.COMPUTE_S]):.4g} s",
                  f"N={n} compute_max {float(r[K.COMPUTE_MAX_S]):.4g} s"]  # fmt: skip
    return np.array(x), np.array(y), names


def _fit_compute(s: pd.DataFrame, units: tuple[str, ...], m: int, t: int, sigma: float, tolerance: float,
                 label: str) -> tuple[np.ndarray, tuple[str, ...]]:  # fmt: skip
    """Non-negative weighted least squares of ``a + Σ b_u·units`` on C and C_max (see module doc)."""
    section = str(s[K.SECTION].iloc[0])
    for use in (units, ("combined",)):
        x, y, names = _design(s, use, m, t, sigma, None)
        w = 1.0 / np.where(np.abs(y) > 0, np.abs(y), 1.0)
        xw, yw = x * w[:, None], y * w
        if int(np.linalg.matrix_rank(xw)) < x.shape[1]:
            continue
        coef, _ = nonnegative_lstsq(xw, yw)
        for _ in range(4):  # q at the fitted coefficients (who can be the critical path)
            x, y, names = _design(s, use, m, t, sigma, coef)
            xw, yw = x * w[:, None], y * w
            coef, _ = nonnegative_lstsq(xw, yw)
        free, *_ = np.linalg.lstsq(xw, yw, rcond=None)
        rel = (x @ coef - y) / np.where(np.abs(y) > 0, np.abs(y), 1.0)
        if (free < -1e-12).any() and np.abs(rel).max() > tolerance:
            bad = [f"{nm} (fit {100 * e:+.0f} %)" for nm, e in zip(names, rel, strict=True) if abs(e) > tolerance]
            raise ProjectionError(
                f"{label} {section}: no non-negative fixed + per-unit compute fits the measured points within "
                f"{100 * tolerance:g} % (the best fit needs a negative term: the compute falls faster than "
                "1/N, or grows as ranks are added, e.g. CPU ranks sharing cores): "
                + "; ".join(bad)
            )
        if not coef.any():
            raise ProjectionError(f"{label} {section}: the measured compute is 0 or negative: nothing to fit")
        return coef, use
    raise ProjectionError(f"{label} section {section!r}: the measured points cannot fit fixed + per-unit compute")
