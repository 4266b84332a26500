"""Projection of a sweep's scaling curve to GPU counts that were not run (pure functions).

Input: the summary table of :func:`pnpscale.results.runs.load` (one row per complete point x section,
seconds per measured iteration), optionally with an ``algorithm`` column (the one NCCL logged). Per
(problem, mode) and section s, from the measured points N_i (at least 2 GPU counts):

* **compute** — deepinv's round-robin assignment (item i on rank ``i % N``) of the M operators and T
  tiles gives each rank's work ``ops_r(N)``, ``tiles_r(N)``; the section's compute per rank is
  ``c_r(N) = a + b·ops_r + c·tiles_r`` (units of the section: gradient operators, denoiser tiles,
  training's forward and backward both, :data:`pnpscale.rank.assignment.SECTION_WORK`). ``a, b, c`` are
  fitted by least squares, weighted by 1/value, on the measured ``C = mean_r c_r`` and
  ``C_max = max_r c_r`` (rank 0 holds the most of both). When the points cannot tell ``b`` from ``c``
  apart, one combined unit ``ops_r/M + tiles_r/T`` is used (stated).
* **transfer** — ``T(N) = L_s + B_s(N) / R(route(N))``: ``B_s`` the bytes each GPU sends for an
  all_reduce of the section's payload per iteration ``P_s = n_main·main_payload + other_payload``
  (:func:`pnpscale.results.transfer.bytes_per_gpu`; ring ``2P(N−1)/N``, tree ``2P(nodes−1)/nodes``),
  ``nodes = ceil(N / gpus_per_node)`` (all on one node when the measured runs were and no
  ``gpus_per_node`` is given); route ``intra-node`` or ``inter-node <algorithm>``; algorithm: the one
  NCCL logged at the largest measured point of the same kind of route, else ring (assumed). The
  latencies ``L_s`` and one rate per route are fitted together by least squares (weights 1/value) on
  the measured multi-GPU points; a rate given by the user is used as is. Too few points: ``L_s = 0``,
  rate = median of ``B/T`` (stated).
* **wait** — the imbalance model ``C_max − C`` plus a jitter fraction ``φ_s·C_max``, ``φ_s`` the
  mean of ``(W − (C_max − C)) / C_max`` over the measured multi-GPU points (0 on one GPU), floored at 0.
* section time ``S = C + T + W``; ``LB = C/C_max``, ``CommE = C_max/S``, ``PE = LB·CommE``; combined
  (section ``all``) from the sums; GPU-seconds ``N·S``; scaled cost ``N·S / (N0·S_all(N0))`` with N0
  the smallest measured GPU count (as in :mod:`pnpscale.results.summary`).

Findings over every integer N from 1 to the largest asked: the crossover N (first N where transfer
exceeds the critical-path compute ``C_max``), the N with the least time per iteration, the largest N
with ``PE >= pe_min``. Honesty: :func:`leave_one_out` refits without each measured N and predicts it;
the headline is the largest measured N predicted from the smaller ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.core.errors import InputError
from pnpscale.rank.assignment import round_robin, section_work
from pnpscale.results.transfer import GB, bytes_per_gpu

ALL = "all"
GROUP = [K.PROBLEM, K.MODE]
INTRA = "intra-node"
ROUTE_ALIASES = {
    "intra": INTRA,
    "intra-node": INTRA,
    "ring": "inter-node ring",
    "inter-node ring": "inter-node ring",
    "tree": "inter-node tree",
    "inter-node tree": "inter-node tree",
}
#: metrics compared by :func:`leave_one_out`.
VALIDATED = (K.SECTION_S, K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.PE)


class ProjectionError(InputError, ValueError):
    """A projection that cannot be made honestly (too few points, unknown assignment or rate)."""


@dataclass(frozen=True)
class Options:
    """Projection settings.

    Attributes:
        gpus_per_node: GPUs per node for ``nodes = ceil(N / gpus_per_node)``; None: from the measured
            multi-node runs (``gpus / nodes`` at the largest), else every N on one node.
        rates: route -> GB/s (1e9 B/s) given by the user (keys of :data:`ROUTE_ALIASES`).
        pe_min: PE threshold of the "largest N" finding.
        devices: ranks share this many devices (CPU runs: cores / threads per rank); each rank's compute
            is then stretched by ``max(1, N / devices)`` (time-sharing). None: one device per rank.
    """

    gpus_per_node: int | None = None
    rates: Mapping[str, float] = field(default_factory=dict)
    pe_min: float = 0.8
    devices: int | None = None


def parse_rates(items: Iterable[str]) -> dict[str, float]:
    """``ROUTE=GBps`` strings -> ``{route: GB/s}`` with routes normalised.

    Raises:
        ProjectionError: an unknown route or a rate that is not a positive number.

    >>> parse_rates(["intra=40", "tree=17", "inter-node ring=10.5"])
    {'intra-node': 40.0, 'inter-node tree': 17.0, 'inter-node ring': 10.5}
    """
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        route = ROUTE_ALIASES.get(key.strip().lower())
        if route is None:
            raise ProjectionError(f"--rate {item}: route must be one of {', '.join(sorted(ROUTE_ALIASES))}")
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if not rate > 0 or not math.isfinite(rate):
            raise ProjectionError(f"--rate {item}: the rate must be a positive number of GB/s")
        out[route] = rate
    return out


@dataclass
class SectionModel:
    """Fitted model of one section (see module doc); seconds, bytes."""

    section: str
    units: tuple[str, ...]
    coef: np.ndarray  # a, then one coefficient per unit
    latency_s: float
    payload_bytes: float
    jitter_fraction: float


@dataclass
class Model:
    """Fitted model of one (problem, mode)."""

    problem: str
    mode: str
    num_operators: int
    num_tiles: int
    gpus_per_node: int | None
    algorithms: dict[str, str]  # "intra"/"inter" -> algorithm
    rates: dict[str, float]  # route -> GB/s
    sections: list[SectionModel]
    baseline_gpus: int
    baseline_s: float
    measured_gpus: list[int]
    assumptions: list[str]
    devices: int | None = None


def _counts(total: int, n: int) -> np.ndarray:
    return np.array([len(x) for x in round_robin(total, n)], dtype=float)


def _work(units: Sequence[str], m: int, t: int, n: int) -> np.ndarray:
    """Per rank work features (rank x unit), ``combined`` = ops/M + tiles/T."""
    cols = []
    for u in units:
        if u == "operators":
            cols.append(_counts(m, n))
        elif u == "tiles":
            cols.append(_counts(t, n))
        else:  # combined
            cols.append(_counts(m, n) / m + _counts(t, n) / t)
    return np.column_stack(cols)


def _stretch(n: int, devices: int | None) -> float:
    """Time-sharing factor of N ranks on ``devices`` devices: ``max(1, N / devices)`` (1 without a limit)."""
    return 1.0 if devices is None else max(1.0, n / devices)


def _compute(sm: SectionModel, m: int, t: int, n: int, devices: int | None = None) -> tuple[float, float]:
    per_rank = (sm.coef[0] + _work(sm.units, m, t, n) @ sm.coef[1:]) * _stretch(n, devices)
    return float(per_rank.mean()), float(per_rank.max())


def _nodes(n: int, gpus_per_node: int | None) -> int:
    return 1 if gpus_per_node is None else max(1, math.ceil(n / gpus_per_node))


def _route(n: int, model_gpn: int | None, algorithms: Mapping[str, str]) -> tuple[int, str, str]:
    nodes = _nodes(n, model_gpn)
    kind = "intra" if nodes == 1 else "inter"
    algo = algorithms.get(kind, "ring")
    return nodes, algo, INTRA if nodes == 1 else f"inter-node {algo}"


def _bytes(payload: float, n: int, nodes: int, algo: str) -> float:
    if n <= 1:
        return 0.0
    return bytes_per_gpu("all_reduce", payload, n, nodes, algo)


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, int]:
    w = 1.0 / np.where(np.abs(y) > 0, np.abs(y), 1.0)
    xw, yw = x * w[:, None], y * w
    coef, *_ = np.linalg.lstsq(xw, yw, rcond=None)
    return coef, int(np.linalg.matrix_rank(xw))


def _points(rows: pd.DataFrame, unique: bool = True) -> pd.DataFrame:
    """The complete per-section rows, each variant folded into PROBLEM (one series per (problem, variant):
    :func:`pnpscale.results.plotting.labelled`).

    Raises:
        ProjectionError: a needed column is missing, or (``unique``) two rows share a (problem, mode,
            GPU count, section): a fit would mix two measurements of one point.
    """
    from pnpscale.results.plotting import labelled

    need = [K.GPUS, K.SECTION, K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.SECTION_S]
    missing = [c for c in need if c not in rows]
    if missing:
        raise ProjectionError(f"summary table lacks column(s) {', '.join(missing)}")
    if "status" in rows:
        rows = rows[rows["status"] == "complete"]
    rows = labelled(rows[rows[K.SECTION] != ALL])
    if unique:
        keys = [c for c in GROUP if c in rows] + [K.GPUS, K.SECTION]
        dup = rows[rows.duplicated(keys, keep=False)]
        if not dup.empty:
            first = dup.iloc[0]
            where = " ".join(f"{k}={first[k]}" for k in keys)
            raise ProjectionError(
                f"{len(dup)} rows share {where} (and maybe other points): one measurement per point is needed "
                "(rows of several sweeps or variants not told apart)"
            )
    return rows


def fit(rows: pd.DataFrame, options: Options = Options()) -> Model:
    """Fit the model of one (problem, mode) on its measured points (see module doc).

    Args:
        rows: summary rows of one (problem, mode): GPUS, SECTION, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S,
            WAIT_S, SECTION_S (seconds per iteration), MAIN_PAYLOAD_BYTES, N_MAIN, OTHER_PAYLOAD_BYTES,
            ``num_operators``, ``num_tiles``, optionally NODES, ALGORITHM, ``status`` (only complete rows
            are used).
        options: :class:`Options`.

    Returns:
        :class:`Model`.

    Raises:
        ProjectionError: fewer than 2 measured GPU counts, no multi-GPU point with a payload, unknown
            operator or tile counts, or rows of several (problem, mode).
    """
    pts = _points(rows)
    keys = pts[GROUP].drop_duplicates() if set(GROUP) <= set(pts) else pd.DataFrame([{K.PROBLEM: "", K.MODE: ""}])
    if len(keys) != 1:
        raise ProjectionError(f"fit takes one (problem, mode), got {len(keys)}")
    problem, mode = str(keys.iloc[0][K.PROBLEM]), str(keys.iloc[0][K.MODE])
    label = f"{problem} {mode}".strip()
    gpus = sorted({int(g) for g in pts[K.GPUS]})
    if len(gpus) < 2:
        raise ProjectionError(f"{label}: {len(gpus)} measured GPU count(s); a projection needs at least 2")
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

    gpn = options.gpus_per_node
    assumptions = [
        f"assignment: deepinv's round-robin (item i on rank i % N) of {m} operators and {t} tiles",
        "compute per rank = a + b·(its units) per section, fitted (weights 1/value) on the measured mean and "
        "max compute; the busiest rank holds the most units (rank 0 under round-robin)",
        "one device per rank"
        if options.devices is None
        else f"ranks share {options.devices} device(s): compute per rank x max(1, N / {options.devices})",
    ]
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

    algorithms: dict[str, str] = {}
    if K.ALGORITHM in pts:
        logged = pts[pts[K.ALGORITHM].notna() & (pts[K.GPUS] > 1)]
        for kind, sel in (("intra", _nodes_of(logged, gpn) == 1), ("inter", _nodes_of(logged, gpn) > 1)):
            if sel.any():
                top = logged[sel].sort_values(K.GPUS).iloc[-1]
                algorithms[kind] = str(top[K.ALGORITHM]).lower()
    for kind, where in (("intra", "one node"), ("inter", "several nodes")):
        if kind in algorithms:
            assumptions.append(f"algorithm on {where}: {algorithms[kind]} (NCCL's log at the largest such point)")
        else:
            assumptions.append(f"algorithm on {where}: ring (assumed: no NCCL log for such a point)")
    assumptions.append(
        "transfer = fitted latency + bytes per GPU / route rate; a section's collectives are modelled as one "
        "all_reduce of their summed payload (n_main x main payload + other payload)"
    )
    assumptions.append("wait = (C_max − C) + φ·C_max, φ a per-section jitter fraction fitted on the measured points")

    names = list(dict.fromkeys(pts[K.SECTION]))
    sections: list[SectionModel] = []
    for name in names:
        s = pts[pts[K.SECTION] == name].sort_values(K.GPUS)
        units = section_work(name)
        coef, used = _fit_compute(s, units, m, t, options.devices)
        if used != units:
            assumptions.append(
                f"{name}: operators and tiles cannot be told apart on these points: one unit ops/M+tiles/T"
            )
        multi = s[s[K.GPUS] > 1]
        payload = _payload(multi)
        if payload is None:
            raise ProjectionError(f"{label} {name}: no measured multi-GPU point with a payload: no transfer model")
        excess = (multi[K.WAIT_S] - (multi[K.COMPUTE_MAX_S] - multi[K.COMPUTE_S])) / multi[K.COMPUTE_MAX_S]
        phi = float(excess.mean()) if not multi.empty else 0.0
        sections.append(SectionModel(name, used, coef, 0.0, payload, phi))

    rates, latencies, rate_notes = _fit_transfer(pts, sections, gpn, algorithms, options.rates, label)
    for sm in sections:
        sm.latency_s = latencies[sm.section]
    assumptions += rate_notes
    base_n = gpus[0]
    base = pts[pts[K.GPUS] == base_n][K.SECTION_S].sum()
    assumptions.append(f"scaled cost relative to the measured {base_n} GPU(s): {base:.6g} s per iteration")
    return Model(
        problem, mode, m, t, gpn, algorithms, rates, sections, base_n, float(base), gpus, assumptions, options.devices
    )


def _nodes_of(rows: pd.DataFrame, gpn: int | None) -> pd.Series:
    if K.NODES in rows:
        nodes = pd.to_numeric(rows[K.NODES], errors="coerce")
        return nodes.fillna(rows[K.GPUS].map(lambda n: _nodes(int(n), gpn)))
    return rows[K.GPUS].map(lambda n: _nodes(int(n), gpn))


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


def _fit_compute(
    s: pd.DataFrame, units: tuple[str, ...], m: int, t: int, devices: int | None
) -> tuple[np.ndarray, tuple[str, ...]]:
    for use in (units, ("combined",)):
        x, y = [], []
        for _, r in s.iterrows():
            n = int(r[K.GPUS])
            w, k = _work(use, m, t, n), _stretch(n, devices)
            x += [[k, *(k * w.mean(axis=0))], [k, *(k * w[0])]]
            y += [float(r[K.COMPUTE_S]), float(r[K.COMPUTE_MAX_S])]
        coef, rank = _lstsq(np.array(x), np.array(y))
        if rank == 1 + len(use):
            return coef, use
    raise ProjectionError(f"section {s[K.SECTION].iloc[0]!r}: the measured points cannot fit fixed + per-unit compute")


def _fit_transfer(
    pts: pd.DataFrame,
    sections: list[SectionModel],
    gpn: int | None,
    algorithms: Mapping[str, str],
    given: Mapping[str, float],
    label: str,
) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """Latency per section and rate per route: ``T = L_s + B/R`` by weighted least squares."""
    obs = []
    for sm in sections:
        s = pts[(pts[K.SECTION] == sm.section) & (pts[K.GPUS] > 1)]
        for _, r in s.iterrows():
            n = int(r[K.GPUS])
            nodes = int(r[K.NODES]) if K.NODES in r and pd.notna(r[K.NODES]) else _nodes(n, gpn)
            kind = "intra" if nodes == 1 else "inter"
            algo = (
                str(r[K.ALGORITHM]).lower()
                if K.ALGORITHM in r and pd.notna(r[K.ALGORITHM])
                else algorithms.get(kind, "ring")
            )
            route = INTRA if nodes == 1 else f"inter-node {algo}"
            obs.append((sm.section, route, _bytes(sm.payload_bytes, n, nodes, algo), float(r[K.TRANSFER_S])))
    names = [sm.section for sm in sections]
    free = sorted({o[1] for o in obs} - set(given))
    notes = [f"rate {k}: {v:g} GB/s (given)" for k, v in given.items()]
    x = np.zeros((len(obs), len(names) + len(free)))
    y = np.zeros(len(obs))
    for i, (sec, route, b, tr) in enumerate(obs):
        x[i, names.index(sec)] = 1.0
        if route in given:
            y[i] = tr - b / (given[route] * GB)
        else:
            x[i, len(names) + free.index(route)] = b
            y[i] = tr
    keep = list(range(x.shape[1]))  # a negative fitted latency is refitted as 0
    while True:
        coef = np.zeros(x.shape[1])
        sub, rank = _lstsq(x[:, keep], y) if len(obs) else (np.zeros(len(keep)), len(keep))
        coef[keep] = sub
        negative = [i for i in keep if i < len(names) and coef[i] < 0]
        if not negative or rank < len(keep):
            break
        keep = [i for i in keep if i not in negative]
    inv = coef[len(names) :]
    if rank == len(keep) and (inv > 0).all():
        latencies = dict(zip(names, coef[: len(names)].tolist(), strict=True))
        rates = {r: 1.0 / v / GB for r, v in zip(free, inv, strict=True)}
        notes += [
            f"rate {k}: {v:.4g} GB/s (fitted with the latencies on the measured points)" for k, v in rates.items()
        ]
        notes.append(
            "latency per section (s, constant in N, >= 0): " + ", ".join(f"{k} {v:.3g}" for k, v in latencies.items())
        )
    else:
        latencies = dict.fromkeys(names, 0.0)
        rates = {}
        for route in free:
            ratios = [b / tr for _, rr, b, tr in obs if rr == route and tr > 0 and b > 0]
            if ratios:
                rates[route] = float(np.median(ratios)) / GB
        notes += [f"rate {k}: {v:.4g} GB/s (median of bytes/transfer: too few points to fit a latency; latency 0)"
                  for k, v in rates.items()]  # fmt: skip
    rates.update(given)
    return rates, latencies, notes


def evaluate(model: Model, gpus: Iterable[int]) -> pd.DataFrame:
    """The model's numbers at each N: one row per N x section plus section ``all``.

    Returns:
        Columns :data:`pnpscale.columns.PROJECTION_COLUMNS` with MEASURED False (seconds per iteration).

    Raises:
        ProjectionError: a route at some N with neither a measured nor a given rate.
    """
    rows = []
    for n in sorted({int(g) for g in gpus}):
        if n < 1:
            raise ProjectionError(f"gpus={n}: must be >= 1")
        nodes, algo, route = _route(n, model.gpus_per_node, model.algorithms)
        rate = model.rates.get(route)
        per = []
        for sm in model.sections:
            c, cmax = _compute(sm, model.num_operators, model.num_tiles, n, model.devices)
            if n == 1:
                tr, wait = 0.0, 0.0
            else:
                if rate is None:
                    raise ProjectionError(
                        f"{model.problem} {model.mode} gpus={n}: no rate for route {route!r} (measured routes: "
                        f"{', '.join(sorted(model.rates)) or 'none'}); give --rate {route.split()[-1]}=GBps"
                    )
                tr = sm.latency_s + _bytes(sm.payload_bytes, n, nodes, algo) / (rate * GB)
                wait = max(0.0, (cmax - c) + sm.jitter_fraction * cmax)
            per.append((sm.section, c, cmax, tr, wait))
        for section, c, cmax, tr, wait in [*per, (ALL, *np.sum([p[1:] for p in per], axis=0))]:
            rows.append(_row(model, n, nodes, section, c, cmax, tr, wait, route if n > 1 else "", rate))
    return pd.DataFrame(rows, columns=list(K.PROJECTION_COLUMNS))


def _row(model: Model, n: int, nodes: int, section: str, c: float, cmax: float, tr: float, wait: float,
         route: str, rate: float | None) -> dict[str, Any]:  # fmt: skip
    s = c + tr + wait
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
        K.COMM_E: cmax / s if s else math.nan,
        K.PE: c / s if s else math.nan,
        K.GPU_SECONDS: n * s,
        K.SCALED_COST: n * s / (model.baseline_gpus * model.baseline_s) if model.baseline_s else math.nan,
        K.ROUTE: route,
        K.RATE_GBPS: rate if route else math.nan,
        K.MEASURED: False,
    }


def measured_rows(rows: pd.DataFrame, model: Model) -> pd.DataFrame:
    """The measured points in the projection's columns (MEASURED True), section rows and ``all``."""
    pts = _points(rows)
    out = []
    for n, g in pts.groupby(K.GPUS):
        nodes = int(g[K.NODES].iloc[0]) if K.NODES in g and pd.notna(g[K.NODES].iloc[0]) else _nodes(int(n), None)
        for _, r in g.iterrows():
            out.append((r[K.SECTION], r[K.COMPUTE_S], r[K.COMPUTE_MAX_S], r[K.TRANSFER_S], r[K.WAIT_S], int(n), nodes))
        tot = g[[K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S]].sum()
        out.append((ALL, *tot.tolist(), int(n), nodes))
    df = pd.DataFrame(
        [_row(model, n, nodes, s, c, cm, tr, w, "", None) for s, c, cm, tr, w, n, nodes in out],
        columns=list(K.PROJECTION_COLUMNS),
    )
    df[K.MEASURED] = True
    return df


def findings(model: Model, up_to: int, pe_min: float) -> dict[str, Any]:
    """Crossover, fastest N and largest N with PE >= ``pe_min``, over every integer N in 1..``up_to``.

    Returns:
        ``{"crossover_gpus": N or None, "crossover_by_section": {section: N or None}, "fastest_gpus",
        "fastest_s", "pe_min", "largest_gpus_pe", "searched_up_to"}``.
    """
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


def leave_one_out(rows: pd.DataFrame, options: Options = Options()) -> pd.DataFrame:
    """Fit without each measured N (keeping at least 2 others) and predict it.

    Returns:
        One row per held-out N x section (and ``all``) x metric of :data:`VALIDATED`: PROBLEM, MODE,
        ``held_out_gpus``, ``fitted_on`` (the GPU counts used), SECTION, ``metric``, ``measured_value``,
        ``projected_value``, REL_ERROR (projected / measured − 1) and ``headline`` (True when the held-out
        N is the largest measured one; the fit then used only smaller ones).
    """
    pts = _points(rows)
    gpus = sorted({int(g) for g in pts[K.GPUS]})
    out = []
    for held in gpus:
        rest = pts[pts[K.GPUS] != held]
        if rest[K.GPUS].nunique() < 2:
            continue
        try:
            model = fit(rest, options)
            pred = evaluate(model, [held]).set_index(K.SECTION)
        except ProjectionError:
            continue
        meas = measured_rows(pts[pts[K.GPUS] == held], model).set_index(K.SECTION)
        for section in pred.index:
            for metric in VALIDATED:
                mv, pv = float(meas.loc[section, metric]), float(pred.loc[section, metric])
                out.append(
                    {
                        K.PROBLEM: model.problem,
                        K.MODE: model.mode,
                        "held_out_gpus": held,
                        "fitted_on": ",".join(map(str, sorted(int(g) for g in rest[K.GPUS].unique()))),
                        K.SECTION: section,
                        "metric": metric,
                        "measured_value": mv,
                        "projected_value": pv,
                        K.REL_ERROR: pv / mv - 1.0 if mv else math.nan,
                        "headline": held == gpus[-1],
                    }
                )
    return pd.DataFrame(out, columns=list(K.VALIDATION_COLUMNS))


@dataclass
class Projection:
    """Everything :func:`project` found.

    Attributes:
        table: measured rows and projected rows (:data:`pnpscale.columns.PROJECTION_COLUMNS`).
        validation: :func:`leave_one_out` of every (problem, mode).
        findings: (problem, mode) -> :func:`findings`.
        assumptions: (problem, mode) -> stated assumptions.
        skipped: (problem, mode) -> why it was not projected.
    """

    table: pd.DataFrame
    validation: pd.DataFrame
    findings: dict[tuple[str, str], dict[str, Any]]
    assumptions: dict[tuple[str, str], list[str]]
    skipped: dict[tuple[str, str], str]


def project(table: pd.DataFrame, gpus: Sequence[int], options: Options = Options(), min_points: int = 2) -> Projection:
    """Project every (problem, mode) of a summary table with at least ``min_points`` measured GPU counts.

    A sweep's variants (``variant`` column: :func:`pnpscale.results.runs.variants`) are projected one by one,
    each as its own series: PROBLEM ``2d denoiser_collective=all_gather`` (:func:`pnpscale.results.plotting.labelled`).

    Args:
        table: :func:`pnpscale.results.runs.load` output (optionally with ALGORITHM per row).
        gpus: GPU counts to project (the measured ones are evaluated too, for the lines).
        options: :class:`Options`. min_points: measured GPU counts needed (the report uses 3).

    Returns:
        :class:`Projection`; a (problem, mode) that cannot be projected is in ``skipped`` with the reason.
    """
    pts = _points(table, unique=False)  # each (problem, mode) is checked by fit
    frames, vals, found, assumed, skipped = [], [], {}, {}, {}
    for (problem, mode), rows in pts.groupby(GROUP, sort=True):
        key = (str(problem), str(mode))
        measured = sorted({int(g) for g in rows[K.GPUS]})
        if len(measured) < min_points:
            skipped[key] = f"{len(measured)} measured GPU count(s); the projection needs {min_points}"
            continue
        try:
            model = fit(rows, options)
            proj = evaluate(model, sorted(set(gpus) | set(measured)))
            found[key] = findings(model, max([*gpus, *measured]), options.pe_min)
        except ProjectionError as exc:
            skipped[key] = str(exc)
            continue
        frames += [measured_rows(rows, model), proj]
        vals.append(leave_one_out(rows, options))
        assumed[key] = model.assumptions
    cols = list(K.PROJECTION_COLUMNS)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    val = pd.concat(vals, ignore_index=True) if vals else pd.DataFrame(columns=list(K.VALIDATION_COLUMNS))
    return Projection(out, val, found, assumed, skipped)


def markdown(p: Projection) -> list[str]:
    """The projection as README lines: findings, headline error, LOO table, assumptions, skipped."""
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
        head = v[v["headline"] & (v[K.SECTION] == ALL)]
        if not head.empty:
            err = dict(zip(head["metric"], head[K.REL_ERROR], strict=True))
            lines.append(
                f"- headline: {largest} GPUs projected from {head['fitted_on'].iloc[0]}: time per iteration "
                f"{100 * err[K.SECTION_S]:+.1f} %, PE {100 * err[K.PE]:+.1f} %"
            )
        lines.append("")
        proj = t[~t[K.MEASURED] & (t[K.SECTION] == ALL) & (t[K.GPUS] > largest)]
        if not proj.empty:
            view = proj[[K.GPUS, K.NODES, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.SECTION_S, K.LB, K.COMM_E, K.PE,
                         K.SCALED_COST]]  # fmt: skip
            lines += [view.to_markdown(index=False, floatfmt=".4g"), ""]
        if not v.empty:
            a = v[v[K.SECTION] == ALL].pivot_table(index="held_out_gpus", columns="metric", values=K.REL_ERROR)
            a = (100 * a).round(1)
            lines += ["Leave-one-out relative error (%), section `all` (fit without N, predict N):", ""]
            lines += [a.reset_index().to_markdown(index=False), ""]
        lines += ["Assumptions:", ""] + [f"- {s}" for s in p.assumptions[key]] + [""]
    return lines


def plot(p: Projection) -> Any:
    """Measured points (markers) and the projection (lines) per (problem, mode): time per iteration and its
    parts (top), PE (bottom); a dotted line at the largest measured N. Returns a matplotlib Figure."""
    from pnpscale.results.plotting import figure, log2_x

    keys = sorted(p.findings) or [("", "")]
    fig, axes = figure(2, len(keys), (6.0 * len(keys), 8.0), squeeze=False)
    metrics = [(K.SECTION_S, "time per iteration"), (K.COMPUTE_MAX_S, "compute (critical path)"),
               (K.TRANSFER_S, "transfer"), (K.WAIT_S, "wait")]  # fmt: skip
    for j, (problem, mode) in enumerate(keys):
        t = p.table[(p.table[K.PROBLEM] == problem) & (p.table[K.MODE] == mode) & (p.table[K.SECTION] == ALL)]
        if t.empty:
            continue
        meas, proj = t[t[K.MEASURED]].sort_values(K.GPUS), t[~t[K.MEASURED]].sort_values(K.GPUS)
        top, bottom = axes[0][j], axes[1][j]
        for i, (col, label) in enumerate(metrics):
            color = f"C{i}"
            top.plot(proj[K.GPUS], proj[col].where(proj[col] > 0), "-", color=color, label=f"{label} (projected)")
            top.plot(meas[K.GPUS], meas[col].where(meas[col] > 0), "o", color=color, label=f"{label} (measured)")
        bottom.plot(proj[K.GPUS], proj[K.PE], "-", color="C0", label="PE (projected)")
        bottom.plot(meas[K.GPUS], meas[K.PE], "o", color="C0", label="PE (measured)")
        largest = int(meas[K.GPUS].max())
        for ax in (top, bottom):
            ax.axvline(largest, color="gray", ls=":", label=f"largest measured N = {largest}")
            log2_x(ax, t[K.GPUS])
        top.set_yscale("log")
        top.set_ylabel("seconds per iteration")
        top.set_title(f"{problem} {mode}: projection")
        bottom.set_ylabel("parallel efficiency")
        bottom.set_ylim(0, 1.05)
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
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
    (:func:`pnpscale.results.plotting.labelled`) gets its algorithms too.
    """
    from pnpscale.results.transfer import transfer_inputs

    done = table[(table["status"] == "complete") & (table[K.GPUS] > 1)] if "status" in table else table.iloc[0:0]
    if done.empty or "run_dir" not in done:
        return table.assign(**{K.ALGORITHM: pd.NA})
    frames = [transfer_inputs([d]).assign(run_dir=d) for d in sorted(set(done["run_dir"]))]
    algos = pd.concat(frames, ignore_index=True)
    if algos.empty:
        return table.assign(**{K.ALGORITHM: pd.NA})
    algos = algos[["run_dir", K.SECTION, K.ALGORITHM]].drop_duplicates(["run_dir", K.SECTION])
    return table.drop(columns=[K.ALGORITHM], errors="ignore").merge(algos, on=["run_dir", K.SECTION], how="left")


README_HEADING = "## Projection"


def write_files(p: Projection, dest: Any) -> list[str]:
    """Write projection.parquet, projection_validation.parquet, projection.png and projection.md into
    ``dest`` as they are (a staging folder: :func:`write` and the report commit them together).

    Returns:
        the markdown lines (also in projection.md).
    """
    from pathlib import Path

    from pnpscale import layout
    from pnpscale.results.charts import save

    dest = Path(dest)
    save(plot(p), dest / layout.PROJECTION_PNG)
    p.table.to_parquet(dest / layout.PROJECTION, index=False)
    p.validation.to_parquet(dest / layout.PROJECTION_VALIDATION, index=False)
    lines = markdown(p)
    (dest / layout.PROJECTION_MD).write_text("\n".join(["# pnpscale projection", "", *lines]))
    return lines


def readme_section(lines: Sequence[str], made_by: str) -> list[str]:
    """The report README's projection section around :func:`markdown`'s ``lines``; ``made_by`` says how."""
    return [
        f"{README_HEADING} past the measured GPU counts",
        "",
        f"{made_by}. `projection.png`, `projection.parquet` (measured and projected rows), "
        "`projection_validation.parquet` (leave-one-out); other GPU counts, rates or nodes: "
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
    from pnpscale import layout

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


def write(p: Projection, out: Any, made_by: str | None = None) -> list[str]:
    """Write the projection's files (:func:`write_files`) into ``out``, staged and renamed together
    (:func:`pnpscale.layout.commit_folder`): a failure leaves ``out`` as it was.

    When ``out`` holds a report (``README.md``), its projection section is rewritten in the same step
    (:func:`replace_readme_section`, ``made_by`` saying how the projection was made).

    Returns:
        the markdown lines (also in projection.md).

    Raises:
        OSError: the files could not be written (``out`` is unchanged).
    """
    from pathlib import Path

    from pnpscale import layout

    out = Path(out)
    readme = out / layout.REPORT_README
    lines: list[str] = []

    def build(stage: Path) -> None:
        lines.extend(write_files(p, stage))
        if readme.is_file():
            section = readme_section(lines, made_by or "Written by `python -m pnpscale.project`")
            (stage / layout.REPORT_README).write_text(replace_readme_section(readme.read_text(), section))

    layout.commit_folder(out, build)
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m pnpscale.project SWEEP_DIR --gpus 128,256,512,1024 ...``; exit 2 on bad input or no projection."""
    import argparse
    import sys
    from pathlib import Path

    from pnpscale import layout
    from pnpscale.results.runs import NoRunsError, build_table

    parser = argparse.ArgumentParser(
        prog="python -m pnpscale.project", description="Project a sweep's scaling curve to unmeasured GPU counts."
    )
    parser.add_argument("path", help="folder holding run folders (a sweep)")
    parser.add_argument("--gpus", default=None, help="GPU counts to project, comma-separated (default: powers of "
                        "two above the largest measured, up to 16 times it)")  # fmt: skip
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: as measured; "
                        "single-node sweeps: every N on one node)")  # fmt: skip
    parser.add_argument("--rate", action="append", default=[], metavar="ROUTE=GBps",
                        help="a route's rate in GB/s (1e9 B/s): intra, tree or ring; repeatable")  # fmt: skip
    parser.add_argument("--pe-min", type=float, default=0.8, help="PE threshold (default 0.8)")
    parser.add_argument("--devices", type=int, default=None, help="ranks share this many devices (CPU runs: "
                        "cores / threads per rank): compute per rank x max(1, N/devices)")  # fmt: skip
    parser.add_argument("--fit-gpus", default=None, help="fit only on these measured GPU counts (comma-separated)")
    parser.add_argument("--out", default=None, help="output folder (default: PATH/report)")
    args = parser.parse_args(argv)

    def ints(text: str, what: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            vals = []
        if not vals or min(vals) < 1:
            raise ProjectionError(f"{what}={text}: give positive integers, comma-separated")
        return vals

    try:
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise ProjectionError(f"--gpus-per-node={args.gpus_per_node}: must be >= 1")
        if args.devices is not None and args.devices < 1:
            raise ProjectionError(f"--devices={args.devices}: must be >= 1")
        if not 0 < args.pe_min <= 1:  # NaN fails too
            raise ProjectionError(f"--pe-min={args.pe_min:g}: must be in (0, 1] (a parallel efficiency)")
        targets = ints(args.gpus, "--gpus") if args.gpus else None
        fit_gpus = ints(args.fit_gpus, "--fit-gpus") if args.fit_gpus else None
        options = Options(args.gpus_per_node, parse_rates(args.rate), args.pe_min, args.devices)
        table = build_table(args.path, echo=lambda s: print(s, file=sys.stderr))
        table = table[table["status"] == "complete"]
        if table.empty:
            raise ProjectionError(f"{args.path}: no complete run to fit on")
        if fit_gpus:
            measured = sorted({int(g) for g in table[K.GPUS]})
            never = sorted(set(fit_gpus) - set(measured))
            if never:
                raise ProjectionError(
                    f"--fit-gpus={args.fit_gpus}: no complete run at {', '.join(map(str, never))} GPU(s) "
                    f"(measured: {', '.join(map(str, measured))})"
                )
            table = table[table[K.GPUS].isin(fit_gpus)]
        gpus = targets or default_targets(int(table[K.GPUS].max()))
        p = project(with_algorithms(table), gpus, options)
        if not p.findings:
            why = "; ".join(f"{k[0]} {k[1]}: {v}" for k, v in sorted(p.skipped.items()))
            raise ProjectionError(f"nothing could be projected ({why or 'no (problem, mode)'}); nothing written")
    except (NoRunsError, ProjectionError) as exc:
        print(f"pnpscale.project: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.path) / layout.REPORT_DIR
    import shlex

    command = shlex.join(["python", "-m", "pnpscale.project", *(argv if argv is not None else sys.argv[1:])])
    made_by = "Written by `" + command.replace("`", "'") + "`"
    try:
        lines = write(p, out, made_by)
    except OSError as exc:
        print(f"pnpscale.project: error: projection not written ({exc}); {out} is as it was", file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"projection: {out / layout.PROJECTION}")
    return 0
