"""The projection's fit: compute per rank, jitter and wait of each section on the measured points (pure functions).

:func:`fit` reads one (problem, mode)'s measured points and returns a :class:`~pnpscale.results.projection.base.Model`
(:mod:`pnpscale.results.projection.model` states the model), in named steps a test can call one by one. With
per-rank samples (:mod:`pnpscale.results.projection.samples`): ``μ_r = f_node(r)·(a + b·ops_r + c·tiles_r)`` by
least squares on the rank means grouped by (N, node, work) (:func:`rank_groups`, :func:`solve_groups`: an
unbiased mean, no clamp; a coefficient below 0 is set to 0 and said, with how many standard errors it was below
and what 0 costs; refused beyond the tolerance), node speed factors kept where they differ from 1 by more than
3 standard errors, the jitter σ from the samples, and the band's bootstrap replicates (:func:`bootstrap`).
Without samples: non-negative least squares on the summary's C and C_max (a max statistic: noise pushes it
up; said) and σ from the balanced points (:func:`fit_section_summary`). Then the wait beyond ``C_max − C``
(ψ) and the transfer (:func:`pnpscale.results.projection.routes.fit_transfer`).

Units: seconds per iteration, bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.rank.assignment import section_work
from pnpscale.results.jitter import expected_max_normal, nonnegative_lstsq
from pnpscale.results.projection.base import (
    MIN_JITTER_ITERATIONS,
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
from pnpscale.results.projection.samples import cells, iterations_of, jitter, resample, section_arrays


def fit(rows: pd.DataFrame, options: Options = Options(), samples: pd.DataFrame | None = None) -> Model:
    """Fit the model of one (problem, mode) on its measured points (see module doc), in named steps:
    :func:`assignment_counts`, :func:`fitted_points`, :func:`node_size`, :func:`logged_algorithms`,
    :func:`fit_sections` (per section :func:`fit_section_samples` or :func:`fit_section_summary`), the transfer
    (:func:`pnpscale.results.projection.routes.fit_transfer`), the baseline, and :func:`bootstrap`.

    Args:
        rows: summary rows of one (problem, mode): GPUS, SECTION, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S,
            WAIT_S, SECTION_S (seconds per iteration), MAIN_PAYLOAD_BYTES, N_MAIN, OTHER_PAYLOAD_BYTES,
            ``num_operators``, ``num_tiles``, optionally NODES, ALGORITHM, ``backend``, ``status`` (only
            complete rows are used).
        options: :class:`Options`.
        samples: per-rank, per-iteration compute (:data:`pnpscale.results.projection.samples.SAMPLE_COLUMNS`,
            seconds); a section with samples at every fitted point is fitted on them (unbiased rank means,
            jitter, node speeds, the band), else on the summary's C and C_max.

    Returns:
        :class:`Model`.

    Raises:
        ProjectionError: fewer than 2 GPU counts to fit on, no multi-GPU point with a payload, unknown
            operator or tile counts, rows of several (problem, mode), or a compute that no non-negative
            model fits (the points named).
    """
    pts = measured_points(rows)
    problem, mode, label = series_key(pts)
    m, t = assignment_counts(pts, label)
    assumptions = [f"assignment: deepinv's round-robin (item i on rank i % N) of {m} operators and {t} tiles"]
    cores, fitted = fitted_points(pts, options, label, assumptions)
    pts = pts[pts[K.GPUS].isin(fitted)]
    gpn, largest_node = node_size(pts, options, assumptions, cores)
    logged = logged_algorithms(pts, gpn)
    mine = None
    if samples is not None and not samples.empty:
        mine = samples[(samples[K.PROBLEM].astype(str) == problem) & (samples[K.MODE].astype(str) == mode)]
    sections, arrays = fit_sections(pts, m, t, gpn, options, label, assumptions, mine)
    assumptions.append(
        "C_max = E[max_r μ_r·(1 + σ·Z_r)], Z_r independent standard normals (equal work: μ·(1 + σ·e(N)), e(N) "
        "the expected maximum of N standard normals); wait = uneven work + jitter = C_max − C (+ ψ·e(N)·C_max); "
        "ranks leave each "
        "section together (S_max = S), CommE = ΣC_max/ΣS_max, PE = ΣC/ΣS_max"
    )
    model = Model(problem, mode, m, t, gpn, logged, dict(options.algorithms), {}, {}, sections, fitted[0], 0.0,
                  [int(g) for g in sorted(set(rows_gpus(rows)))], fitted, assumptions, cores, options.tolerance,
                  largest_node=largest_node, from_samples=bool(arrays))  # fmt: skip
    fit_transfer(model, pts, options.rates, label)
    assumptions.append(
        "transfer = latency per collective and hop x n_main x hops (ring 2(N−1), tree 2(log2 nodes + ranks per node "
        "− 1)) + bytes per GPU / route rate; a section's collectives are modelled as one all_reduce of their summed "
        "payload (n_main x main payload + other payload); one node: ring bytes 2P(N−1)/N, a rate per GPU count"
    )
    base = pts[pts[K.GPUS] == fitted[0]][K.SECTION_S].sum()
    model.baseline_s = float(base)
    assumptions.append(f"scaled cost relative to the measured {fitted[0]} GPU(s): {base:.6g} s per iteration")
    bootstrap(model, arrays, options)
    return model


def rows_gpus(rows: pd.DataFrame) -> list[int]:
    """The GPU counts of the complete per-section rows."""
    return sorted({int(g) for g in measured_points(rows)[K.GPUS]})


def assignment_counts(pts: pd.DataFrame, label: str) -> tuple[int, int]:
    """(operators M, tiles T) of the points.

    Raises:
        ProjectionError: unknown, or not the same at every point.
    """
    m_t = {}
    for col in ("num_operators", "num_tiles"):
        vals = pts[col].dropna().unique() if col in pts else []
        if len(vals) != 1:
            raise ProjectionError(
                f"{label}: {col} is {'unknown' if len(vals) == 0 else 'not the same at every point'} "
                "(run.json's assignment); the compute model needs it"
            )
        m_t[col] = int(vals[0])
    return m_t["num_operators"], m_t["num_tiles"]


def fitted_points(pts: pd.DataFrame, options: Options, label: str,
                  assumptions: list[str]) -> tuple[int | None, list[int]]:  # fmt: skip
    """(cores CPU ranks time-share or None, the GPU counts fitted): points past the cores are not fitted.

    Raises:
        ProjectionError: fewer than 2 GPU counts left to fit on.
    """
    measured = sorted({int(g) for g in pts[K.GPUS]})
    cores, cores_note = cpu_cores_of(pts, options)
    fitted = [n for n in measured if cores is None or n <= cores]
    if cores is not None:
        past = [n for n in measured if n > cores]
        assumptions.append(
            f"{cores_note}: more ranks than {cores} time-share the cores (compute and transfer): no honest "
            f"projection exists there, so N > {cores} is not projected"
            + (f"; measured {', '.join(map(str, past))} not fitted" if past else "")
        )
    if len(fitted) < 2:
        raise ProjectionError(
            f"{label}: {len(fitted)} GPU count(s) to fit on ({', '.join(map(str, fitted)) or 'none'}"
            + (f"; ranks past {cores} cores are not fitted" if len(fitted) < len(measured) else "")
            + "); a projection needs at least 2"
        )
    return cores, fitted


def node_size(pts: pd.DataFrame, options: Options, assumptions: list[str], cores: int | None = None
              ) -> tuple[int | None, int | None]:  # fmt: skip
    """(GPUs per node, or None; the largest node known when it is None): ``--gpus-per-node``, else
    ``ceil(gpus / nodes)`` of the largest measured multi-node run (its hosts or SLURM's node count), else
    unknown: every measured run sat on one node, of at least the largest measured GPU count, or of the GPUs its
    hosts showed (NODE_GPUS, NVML's count: a lower bound inside a device cgroup) when more (CPU ranks: the
    ``cores`` of their machine), and a node bigger than that is never assumed (N past it refused:
    :class:`~pnpscale.results.projection.base.NodeSizeUnknown`)."""
    gpn = options.gpus_per_node
    if gpn is not None:
        assumptions.append(f"nodes = ceil(N / {gpn}) (--gpus-per-node)")
        return gpn, None
    if K.NODES in pts:
        multi = pts[pd.to_numeric(pts[K.NODES], errors="coerce") > 1]
        if not multi.empty:
            top = multi.loc[multi[K.GPUS].idxmax()]
            gpn = math.ceil(int(top[K.GPUS]) / int(top[K.NODES]))
            assumptions.append(f"nodes = ceil(N / {gpn}) ({gpn} GPUs per node, as in the measured runs)")
            return gpn, None
    largest = int(pts[K.GPUS].max())
    held = pd.to_numeric(pts[K.NODE_GPUS], errors="coerce").dropna() if K.NODE_GPUS in pts else pd.Series()
    if cores is None and not held.empty and int(held.min()) > largest:  # the node holds more than was used
        node = int(held.min())
        assumptions.append(
            f"every measured run sat on one node of {node} GPUs (NVML's count on its hosts): N up to {node} on that "
            f"node; no N past {node} is projected (the node size is unknown): give --gpus-per-node and an "
            "inter-node --rate"
        )
        return None, node
    if cores is not None:  # CPU ranks on one machine: it holds its cores' worth (past them: time-shared)
        assumptions.append(f"every N on one machine of {cores} cores (CPU ranks)")
        return None, max(largest, cores)
    assumptions.append(
        f"node size unknown: every measured run sat on one node (of at least {largest} GPUs); no N past {largest} "
        "is projected (a node bigger than any measured one is not assumed): give --gpus-per-node and an "
        "inter-node --rate"
    )
    return None, largest


def logged_algorithms(pts: pd.DataFrame, gpn: int | None) -> dict[tuple[int, str], str]:
    """(nodes, section) -> the all_reduce algorithm NCCL logged at a measured multi-node point."""
    logged: dict[tuple[int, str], str] = {}
    for _, r in pts[pts[K.GPUS] > 1].iterrows():
        algo, nodes = row_algorithm(r), row_nodes(r, gpn)
        if algo is not None and nodes > 1:
            logged[(nodes, str(r[K.SECTION]))] = algo
    return logged


def fit_sections(pts: pd.DataFrame, m: int, t: int, gpn: int | None, options: Options, label: str,
                 assumptions: list[str], samples: pd.DataFrame | None
                 ) -> tuple[list[SectionModel], dict[str, dict[int, np.ndarray]]]:  # fmt: skip
    """Every section's :class:`SectionModel` and the per-rank sample arrays it was fitted on (sections fitted on
    the summary have none)."""
    names = list(dict.fromkeys(pts[K.SECTION]))
    fitted = sorted({int(g) for g in pts[K.GPUS]})
    arrays: dict[str, dict[int, np.ndarray]] = {}
    if samples is not None:
        for name in names:
            a = section_arrays(samples, name, fitted, label)
            if a is not None:
                arrays[name] = a
    if samples is not None and len(arrays) < len(names):
        assumptions.append(f"per-rank samples missing for {', '.join(n for n in names if n not in arrays)} at some "
                           "fitted point: fitted on the summary's C and C_max (a max statistic: noise pushes it up; "
                           "no band)")  # fmt: skip
    elif samples is None:
        assumptions.append("no per-rank samples (ranks.parquet): compute fitted on the summary's C and C_max (a max "
                           "statistic: noise pushes it up), jitter from the balanced points; no band")  # fmt: skip
    sigmas = _jitter(pts, names, m, t)
    sig_all = [v for vals in sigmas.values() for v in vals]
    sections = []
    for name in names:
        s = pts[pts[K.SECTION] == name].sort_values(K.GPUS)
        if name in arrays:
            sm = fit_section_samples(s, arrays[name], m, t, gpn, options.tolerance, label, assumptions,
                                     (sigmas[name], sig_all))  # fmt: skip
        else:
            sm = fit_section_summary(s, m, t, sigmas[name], sig_all, options.tolerance, label, assumptions)
        multi = s[s[K.GPUS] > 1]
        payload = _payload(multi)
        if payload is None:
            raise ProjectionError(f"{label} {name}: no measured multi-GPU point with a payload: no transfer model")
        sm.payload_bytes = payload
        sm.n_collectives = _n_collectives(multi)
        sm.excess = _excess(multi, sm, m, t)
        if sm.excess:
            assumptions.append(f"{name}: wait beyond C_max − C: ψ = {sm.excess:.3g} x e(N)·C_max")
        sections.append(sm)
    return sections, arrays


def fit_section_summary(s: pd.DataFrame, m: int, t: int, own: list[float], every: list[float], tolerance: float,
                        label: str, assumptions: list[str]) -> SectionModel:  # fmt: skip
    """One section fitted on the summary's C and C_max (no per-rank samples): σ from its balanced points (else the
    other sections', else 0 and the jitter unknown), then :func:`_fit_compute`."""
    name = str(s[K.SECTION].iloc[0])
    units = section_work(name)
    jitter_unknown = ""
    fitted = [int(g) for g in s[K.GPUS]]
    if own:
        sigma = max(0.0, float(np.mean(own)))
        where = f"its balanced points {', '.join(str(int(g)) for g in _balanced_gpus(s, units, m, t))}"
    elif every:
        sigma = max(0.0, float(np.mean(every)))
        where = "the other sections' balanced points (it has none)"
    else:
        sigma, where = 0.0, "no balanced multi-GPU point: jitter not modelled"
        jitter_unknown = (f"no fitted point ({', '.join(map(str, fitted))}) gives the ranks of any "
                          "section the same work, so the jitter (same work, different finishing time) was never "
                          "measured apart from the uneven work")  # fmt: skip
    coef, used = _fit_compute(s, units, m, t, sigma, tolerance, label)
    unidentified = _unidentified_note(name, units, used, fitted, m, t, assumptions)
    sm = SectionModel(name, used, coef, 0.0, 0.0, sigma, 0.0, unidentified, jitter_unknown)
    parts = ", ".join(f"{u} {v:.4g} s" for u, v in zip(("fixed", *used), coef, strict=True))
    assumptions.append(
        f"{name}: compute per rank = {parts} (non-negative fit on C and C_max, weights 1/value); jitter σ = "
        f"{sigma:.3g} (from {where})"
        + ("; C_max and wait at N where every rank holds the same work (jitter alone) are not projected"
           if jitter_unknown else "")
    )  # fmt: skip
    return sm


def _unidentified_note(name: str, units: tuple[str, ...], used: tuple[str, ...], fitted: Sequence[int], m: int,
                       t: int, assumptions: list[str]) -> str:  # fmt: skip
    if used == units:
        return ""
    at = ", ".join(map(str, fitted))
    note = (f"on the fitted points {at} every rank holds the same share of the {m} operators and "
            f"{t} tiles, so the fit cannot tell an operator's compute from a tile's")  # fmt: skip
    assumptions.append(
        f"{name}: {note}: one unit ops/M + tiles/T, exact at N where every rank holds the same "
        "share of both; C_max and wait at any other N depend on the unknown split and are not projected"
    )
    return note


def fit_section_samples(s: pd.DataFrame, arrays: dict[int, np.ndarray], m: int, t: int, gpn: int | None,
                        tolerance: float, label: str, assumptions: list[str],
                        summary_sigmas: tuple[list[float], list[float]] = ([], [])) -> SectionModel:  # fmt: skip
    """One section fitted on its per-rank samples (:mod:`pnpscale.results.projection.samples`): the jitter σ
    (said uncertain below :data:`MIN_JITTER_ITERATIONS` iterations), then :func:`compute_from_means` (the rank
    means by work group, node speeds). A coefficient fitted below 0 is set to 0 and the rest refitted, said with
    how many standard errors it was below 0 (within 2: indistinguishable from 0) and the largest error at a
    rank mean that costs; more than 2 standard errors below 0 and that error beyond ``tolerance``: refused.

    Raises:
        ProjectionError: the compute falls faster than 1/N (naming the worst group of ranks)."""
    name = str(s[K.SECTION].iloc[0])
    units = section_work(name)
    fitted = sorted(arrays)
    sigma = jitter(arrays)
    iters = iterations_of(arrays)
    notes = []
    jitter_unknown = ""
    if sigma is None:  # one iteration per point (or one rank): a rank's own mean is its only sample
        own, every = summary_sigmas
        if own or every:
            sigma = max(0.0, float(np.mean(own or every)))
            notes.append(f"no multi-rank point with 2 iterations or more: jitter σ from the summary's balanced "
                         f"points ({'its own' if own else 'the other sections'})")  # fmt: skip
        else:
            sigma = 0.0
            jitter_unknown = (f"no multi-rank point with 2 iterations or more, and no fitted point "
                              f"({', '.join(map(str, fitted))}) gives the ranks of any section the same work, so the "
                              "jitter was never measured apart from the uneven work")  # fmt: skip
            notes.append("jitter not measured: σ = 0; C_max and wait at N where every rank holds the same work "
                         "(jitter alone) are not projected")  # fmt: skip
    elif iters < MIN_JITTER_ITERATIONS:
        notes.append(f"jitter from only {iters} iterations per point (fewer than ~{MIN_JITTER_ITERATIONS}: "
                     "uncertain, see the band)")  # fmt: skip
    coef, used, speed, se = compute_from_means(arrays, units, m, t, gpn, None)
    names = ("fixed", *used)
    neg = [i for i, v in enumerate(coef) if v < 0]
    if neg:
        z = {i: -coef[i] / se[i] if se[i] > 0 else math.inf for i in neg}  # inf: no spread to tell (1 iteration)
        keep = [i for i in range(len(coef)) if i not in neg]
        coef, _, speed, se = compute_from_means(arrays, units if used == units else used, m, t, gpn, keep)
        worst = _worst_misfit(arrays, coef, used, m, t, gpn, speed)
        said = ", ".join(f"{names[i]} fitted {z[i]:.1f} standard errors below 0" if math.isfinite(z[i])
                         else f"{names[i]} fitted below 0 (standard error unknown: 1 iteration)" for i in neg)
        if any(v > 2 for v in z.values()) and worst[0] > tolerance:
            raise ProjectionError(
                f"{label} {name}: no non-negative fixed + per-unit compute fits the per-rank means within "
                f"{100 * tolerance:g} % ({said}: the compute falls faster than 1/N, or grows as ranks are added, "
                f"e.g. CPU ranks sharing cores): {worst[1]}"
            )
        notes.append(f"{said}: "
                     + ("indistinguishable from 0, " if all(v <= 2 for v in z.values()) else "")
                     + f"set to 0 (the fit then misses the rank means by at most {100 * worst[0]:.1f} %)")  # fmt: skip
    unidentified = _unidentified_note(name, units, used, fitted, m, t, assumptions)
    sm = SectionModel(name, used, coef, 0.0, 0.0, sigma, 0.0, unidentified, jitter_unknown, speed)
    parts = ", ".join(
        f"{u} {v:.4g} s" + (" (indistinguishable from 0)" if 0 < v < 2 * e else "")
        for u, v, e in zip(("fixed", *used), coef, se, strict=True)
    )
    slow = "; ".join(f"node {k} x{v:.3f}" for k, v in sorted(speed.items()))
    assumptions.append(
        f"{name}: compute per rank = {parts} (least squares on the per-rank means by work group, weights "
        f"1/value); jitter σ = {sigma:.3g}"
        + (f" (per-rank, per-iteration samples, the iteration's common factor removed; {iters} iterations or more "
           "per point)" if iters >= 2 else "")
        + (f"; slower node(s), kept on the critical path: {slow} (compute relative to node 0; nodes never "
           "measured run at node 0's speed)" if slow else "")
        + "".join(f"; {n}" for n in notes)
    )  # fmt: skip
    return sm


def _worst_misfit(arrays: dict[int, np.ndarray], coef: np.ndarray, use: Sequence[str], m: int, t: int,
                  gpn: int | None, speed: dict[int, float]) -> tuple[float, str]:  # fmt: skip
    """(largest relative error of the fit at a group mean, that group named)."""
    g = rank_groups(arrays, use, m, t, gpn)
    f = np.array([speed.get(int(k), 1.0) for k in g.node])
    rel = (f * (g.x @ coef) - g.y) / np.where(np.abs(g.y) > 0, np.abs(g.y), 1.0)
    i = int(np.argmax(np.abs(rel)))
    work = ", ".join(f"{u} {v:g}" for u, v in zip(use, g.x[i, 1:], strict=True))
    where = f"ranks holding {work} on node {int(g.node[i])}: mean {g.y[i]:.4g} s (fit {100 * rel[i]:+.0f} %)"
    return float(abs(rel[i])), where


@dataclass
class Groups:
    """The rank means by (N, node, work): design rows ``x`` (groups x (1 + units)), mean ``y`` (s), its
    variance ``var`` (s²: the variance over iterations of the group's per-iteration mean, over the iterations;
    the iteration's common factor included), its node."""

    x: np.ndarray
    y: np.ndarray
    var: np.ndarray
    node: np.ndarray


def rank_groups(arrays: dict[int, np.ndarray], use: Sequence[str], m: int, t: int, gpn: int | None) -> Groups:
    """The rank means of every fitted point grouped by (node, work) (rank r on node ``r // gpn``)."""
    x, y, var, node = [], [], [], []
    for n, a in sorted(arrays.items()):
        w = work_per_rank(use, m, t, n)
        nodes = np.arange(n) // gpn if gpn else np.zeros(n, dtype=int)
        keys = np.column_stack([nodes, np.round(w, 12)])
        for key in np.unique(keys, axis=0):
            g = np.all(keys == key, axis=1)
            series = a[:, g].mean(axis=1)  # the group's mean per iteration: its ranks' and the iteration's noise
            x.append([1.0, *w[g][0]])
            y.append(float(series.mean()))
            var.append(float(series.var(ddof=1) / len(series)) if len(series) > 1 else 0.0)
            node.append(int(key[0]))
    return Groups(np.array(x), np.array(y), np.array(var), np.array(node))


def solve_groups(g: Groups, cols: Sequence[int], slow: Sequence[int]
                 ) -> tuple[np.ndarray, dict[int, float], np.ndarray, np.ndarray, bool]:  # fmt: skip
    """Weighted (1/value) least squares of ``y_g = f_node(g)·(x_g·coef)`` over the coefficients ``cols`` and
    the speed factors of the nodes ``slow`` (the others 1), by Gauss–Newton from the fit with every f = 1.

    Returns:
        (coefficients, {node: f}, standard errors of the coefficients and of the factors (propagated from each
        group mean's variance), whether the points identify them all (full-rank Jacobian)).
    """
    cols = list(cols)
    wts = 1.0 / np.where(np.abs(g.y) > 0, np.abs(g.y), 1.0)
    coef = np.zeros(g.x.shape[1])
    sol, *_ = np.linalg.lstsq(g.x[:, cols] * wts[:, None], g.y * wts, rcond=None)
    coef[cols] = sol
    logf = np.zeros(len(slow))
    jac = np.zeros((len(g.y), len(cols) + len(slow)))
    for _ in range(50):
        f = np.ones(len(g.y))
        for j, k in enumerate(slow):
            f[g.node == k] = math.exp(logf[j])
        pred = g.x @ coef
        res = (f * pred - g.y) * wts
        jac = np.column_stack([(f[:, None] * g.x[:, cols]) * wts[:, None],
                               *[(f * pred * (g.node == k)) * wts for k in slow]])  # fmt: skip
        step, *_ = np.linalg.lstsq(jac, -res, rcond=None)
        coef[cols] += step[: len(cols)]
        logf += step[len(cols) :]
        if float(np.max(np.abs(step))) < 1e-13 * max(1.0, float(np.max(np.abs(coef)))):
            break
    full = int(np.linalg.matrix_rank(jac)) == jac.shape[1]
    pinv = np.linalg.pinv(jac)
    cov = pinv @ np.diag(g.var * wts**2) @ pinv.T
    err = np.sqrt(np.maximum(np.diag(cov), 0.0))
    se = np.full(g.x.shape[1], math.nan)
    se[cols] = err[: len(cols)]
    speed = {int(k): math.exp(v) for k, v in zip(slow, logf, strict=True)}
    return coef, speed, se, err[len(cols) :], full


def compute_from_means(
    arrays: dict[int, np.ndarray], units: tuple[str, ...], m: int, t: int, gpn: int | None, keep: Sequence[int] | None
) -> tuple[np.ndarray, tuple[str, ...], dict[int, float], np.ndarray]:
    """The compute coefficients and node speeds from the rank means by (N, node, work) (:func:`rank_groups`,
    :func:`solve_groups`): every node measured besides node 0 gets a speed factor, kept where it differs from 1
    by more than 3 standard errors (else 1, not listed), and dropped altogether where the points cannot tell it
    from the work. ``keep``: the coefficients fitted (the others 0). Falls back on one ``combined`` unit when the
    points cannot tell the units apart.

    Returns:
        (coefficients, units, {node: speed factor relative to node 0}, standard errors of the coefficients).

    Raises:
        ProjectionError: not even the combined unit is identified.
    """
    for use in (units, ("combined",)):
        g = rank_groups(arrays, use, m, t, gpn)
        cols = list(range(g.x.shape[1])) if keep is None or use != units else list(keep)
        if int(np.linalg.matrix_rank(g.x[:, cols])) < len(cols):
            continue
        slow = sorted({int(k) for k in g.node if k > 0})
        coef, speed, se, se_f, full = solve_groups(g, cols, slow)
        if not full:  # a node's speed the work explains as well: no factor
            coef, speed, se, se_f, full = solve_groups(g, cols, [])
        kept = [k for k, e in zip(slow, se_f, strict=False) if k in speed and abs(speed[k] - 1.0) > 3 * e]
        if len(kept) < len(speed):
            coef, speed, se, _, _ = solve_groups(g, cols, kept)
        return coef, use, speed, se
    raise ProjectionError(f"the rank means cannot fit fixed + per-unit compute (units {', '.join(units)})")


def bootstrap(model: Model, arrays: dict[str, dict[int, np.ndarray]], options: Options) -> None:
    """The band's replicates (``model.replicates``): ``options.bootstrap`` resamplings of iterations and ranks
    (:func:`pnpscale.results.projection.samples.resample`), each section's compute coefficients (the same units
    as the point fit), jitter and node speeds refitted; the transfer and ψ held. Only when every section was
    fitted on samples."""
    if options.bootstrap <= 0 or not arrays or len(arrays) < len(model.sections):
        return
    if min(iterations_of(a) for a in arrays.values()) < 2:
        model.assumptions.append("no band: a point with one measured iteration has no spread to resample")
        return
    rng = np.random.default_rng(options.seed)
    m, t, gpn = model.num_operators, model.num_tiles, model.gpus_per_node
    groups = {name: {n: cells(n, work_per_rank(sm.units, m, t, n), gpn) for n in arrays[name]}
              for name, sm in ((sm.section, sm) for sm in model.sections)}  # fmt: skip
    for _ in range(options.bootstrap):
        rep = []
        for sm in model.sections:
            its, a = resample(arrays[sm.section], groups[sm.section], rng)
            keep = [i for i, v in enumerate(sm.coef) if v != 0]
            try:
                coef, _, speed, _ = compute_from_means(a, sm.units, m, t, gpn, keep)
            except ProjectionError:
                coef, speed = sm.coef, sm.node_speed
            sigma = jitter(its)
            rep.append(replace(sm, coef=coef, sigma=sm.sigma if sigma is None else sigma, node_speed=speed))
        model.replicates.append(rep)
    model.assumptions.append(
        f"band: 5–95 % over {options.bootstrap} bootstrap replicates (iterations resampled, and ranks within their "
        "node and work), compute, jitter and node speeds refitted; transfer rates, latencies and ψ held (their "
        "uncertainty is not in the band)"
    )


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


def _n_collectives(multi: pd.DataFrame) -> float:
    """The section's latency-bearing collectives per iteration: N_MAIN at the largest multi-GPU point (>= 1)."""
    if multi.empty or K.N_MAIN not in multi:
        return 1.0
    v = multi.sort_values(K.GPUS)[K.N_MAIN].iloc[-1]
    return max(1.0, float(v)) if pd.notna(v) else 1.0


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
