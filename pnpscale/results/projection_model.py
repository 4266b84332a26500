"""The projection's model: fit on a sweep's measured points, evaluate at any N, check it (pure functions).

Input: the summary table of :func:`pnpscale.results.runs.load` (one row per complete point x section,
seconds per measured iteration), optionally with an ``algorithm`` column (the one NCCL logged). Per
(problem, mode) and section s, from the measured points N_i (at least 2 GPU counts):

* **compute** — deepinv's round-robin assignment (item i on rank ``i % N``) of the M operators and T
  tiles gives each rank's work; rank r's mean compute is ``μ_r(N) = a + b·ops_r + c·tiles_r`` (units of
  the section, :data:`pnpscale.rank.assignment.SECTION_WORK`: gradient operators, denoiser tiles,
  training's sections both), ``a, b, c >= 0``. ``C = mean_r μ_r``.
* **jitter** (the study's wait cause 2: same work, different finishing time) — each rank's compute is
  ``μ_r·(1 + σ_s·Z_r)`` with independent standard normals ``Z_r``, so the critical path is
  ``C_max = E[max_r μ_r·(1 + σ_s·Z_r)]`` (:func:`pnpscale.results.jitter.expected_max`); ranks of equal
  work: ``μ·(1 + σ_s·e(N))``, ``e(n)`` the expected maximum of n standard normals
  (:func:`pnpscale.results.jitter.expected_max_normal`; e(1) = 0, e(2) = 0.564, e(64) = 2.344).
  ``σ_s`` is the mean of ``(C_max/C − 1)/e(N)`` over the section's measured *balanced* points (every
  rank the same work; N > 1); none: the mean over the other sections' balanced points, else 0 (stated).
* the fit — ``a, b, c`` by non-negative least squares (weights 1/value) on the measured ``C`` and
  ``C_max`` (:func:`pnpscale.results.jitter.nonnegative_lstsq`). When the points cannot tell ``b`` from
  ``c`` apart (every rank holds the same share of both), one combined unit ``ops_r/M + tiles_r/T``: the
  operators weigh as much as the tiles (stated; wrong when one dominates, which leave-one-out shows).
  Refused (naming the points) when the unconstrained fit needs a negative coefficient and the
  non-negative one misses a measured compute by more than the tolerance (default 10 %): points that
  scale faster than 1/N.
* **wait** — uneven work + jitter ``= C_max − C`` (one collective closes the section and every rank
  leaves it together), plus ``ψ_s·e(N)·C_max`` when the measured wait exceeds ``C_max − C`` (several
  synchronising collectives per section, e.g. training's unrolled iterations), ``ψ_s >= 0`` the mean of
  ``(W − (C_max − C))/(e(N)·C_max)`` over the measured multi-GPU points.
* **transfer** — ``T(N) = L_s + B_s(N) / R(route)``: ``B_s`` the bytes each GPU sends for an all_reduce
  of the section's payload per iteration ``P_s = n_main·main_payload + other_payload``
  (:func:`pnpscale.results.transfer.bytes_per_gpu`: ring ``2P(N−1)/N``, tree ``2P(nodes−1)/nodes``),
  ``nodes = ceil(N / gpus_per_node)``. Route: on one node ``intra-node, g GPUs`` (one rate per GPU
  count: the study's 40 GB/s on 2 V100s, 119 on 4), else ``inter-node <algorithm>``. Algorithm per node
  count (and section, i.e. size): given (``--algorithm NODES=ALGO``), else the one NCCL logged at that
  node count, else ring (assumed; every choice stated). One node: the ring's bytes. Rates: given
  (``--rate``), else fitted with latencies ``L_s >= 0`` when the points identify them (every route seen
  at byte counts at least 20 % apart), else ``L_s = 0`` and the route's ``ΣB/ΣT`` over its points (the
  reason stated). A one-node GPU count never measured takes the nearest measured one's rate (stated).
* section time ``S = C + T + W`` (>= ``C_max`` by construction); ranks leave each section together, so the
  slowest rank's ``S_max = S``; ``LB = C/C_max``, ``CommE = C_max/S_max``, ``PE = C/S_max`` (POP),
  combined (section ``all``) from the sums; GPU-seconds ``N·S``; scaled cost ``N·S / (N0·S_all(N0))``,
  N0 the smallest measured GPU count. No projected number is impossible: C, T, W >= 0, LB, CommE,
  PE <= 1 (checked on every row).
* **CPU ranks** (backend gloo) share the machine's cores (``devices``, default: this machine's):
  points with more ranks than cores time-share them (compute and transfer), which the model does not
  describe, so they are not fitted and N past the cores is not projected (said).

Checks: :func:`residuals` (the fit at its own points), :func:`leave_one_out` (each measured N predicted
from the others, with its own nodes and algorithm); the headline is the largest measured N predicted
from the smaller ones, its worst error over time, transfer, wait and PE.

Units: seconds per iteration, bytes, GB/s = 1e9 B/s. Sources: the study "Communication under the hood:
transfer vs wait" (metrics, byte formulas, routes), nccl-tests' PERFORMANCE.md (bytes per GPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.core.errors import InputError
from pnpscale.rank.assignment import round_robin, section_work
from pnpscale.results.jitter import expected_max, expected_max_normal, nonnegative_lstsq
from pnpscale.results.transfer import GB, bytes_per_gpu, route_label

ALL = "all"
GROUP = [K.PROBLEM, K.MODE]
INTRA = "intra-node"
RING = "inter-node ring"
TREE = "inter-node tree"
ROUTE_ALIASES = {"intra": INTRA, "intra-node": INTRA, "ring": RING, "inter-node ring": RING, "tree": TREE,
                 "inter-node tree": TREE}  # fmt: skip
ALGORITHMS = ("ring", "tree")
#: metrics compared by :func:`residuals` and :func:`leave_one_out`.
VALIDATED = (K.SECTION_S, K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.LB, K.COMM_E, K.PE)
#: the headline's metrics: its error is the worst of these (section ``all``).
HEADLINE = (K.SECTION_S, K.TRANSFER_S, K.WAIT_S, K.PE)
RESIDUAL = "residual"
LOO = "leave-one-out"
_EPS = 1e-9


class ProjectionError(InputError, ValueError):
    """A projection that cannot be made honestly (too few points, unknown assignment or rate, a fit)."""


@dataclass(frozen=True)
class Options:
    """Projection settings.

    Attributes:
        gpus_per_node: GPUs per node for ``nodes = ceil(N / gpus_per_node)``; None: from the measured
            multi-node runs (``gpus / nodes`` at the largest), else every N on one node.
        rates: route -> GB/s (1e9 B/s) given by the user (:func:`parse_rates`): ``intra-node`` (every
            one-node GPU count), ``intra-node, g GPUs``, ``inter-node ring``, ``inter-node tree``.
        algorithms: node count -> all_reduce algorithm (``ring``/``tree``) given by the user.
        pe_min: PE threshold of the "largest N" finding.
        devices: the cores CPU ranks share (None: this machine's for gloo sweeps; GPU sweeps: a device
            per rank). Points with more ranks than devices are not fitted, N past them not projected.
        tolerance: relative error above which the fit is said to miss its own points (and a fit that
            needs negative compute is refused).
    """

    gpus_per_node: int | None = None
    rates: Mapping[str, float] = field(default_factory=dict)
    algorithms: Mapping[int, str] = field(default_factory=dict)
    pe_min: float = 0.8
    devices: int | None = None
    tolerance: float = 0.10


def intra_route(gpus: int) -> str:
    """The route of an all_reduce on one node with ``gpus`` GPUs (:func:`pnpscale.results.transfer.route_label`).

    >>> intra_route(4)
    'intra-node, 4 GPUs'
    """
    return route_label(gpus, 1, "ring")


def parse_rates(items: Iterable[str]) -> dict[str, float]:
    """``ROUTE=GBps`` strings -> ``{route: GB/s}``; ``intra:G`` names the one-node route of G GPUs.

    Raises:
        ProjectionError: an unknown route or a rate that is not a positive number.

    >>> parse_rates(["intra=40", "intra:4=119", "tree=17", "inter-node ring=10.5"])
    {'intra-node': 40.0, 'intra-node, 4 GPUs': 119.0, 'inter-node tree': 17.0, 'inter-node ring': 10.5}
    """
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        name, _, count = key.strip().lower().partition(":")
        route = ROUTE_ALIASES.get(name.strip())
        if route == INTRA and count:
            route = intra_route(int(count)) if count.strip().isdigit() and int(count) >= 2 else None
        elif count:
            route = None
        if route is None:
            raise ProjectionError(
                f"--rate {item}: route must be intra, intra:G (G >= 2 GPUs on one node), tree or ring"
            )
        try:
            rate = float(value)
        except ValueError:
            rate = math.nan
        if not rate > 0 or not math.isfinite(rate):
            raise ProjectionError(f"--rate {item}: the rate must be a positive number of GB/s")
        out[route] = rate
    return out


def parse_algorithms(items: Iterable[str]) -> dict[int, str]:
    """``NODES=ALGO`` strings -> ``{nodes: algorithm}``.

    Raises:
        ProjectionError: NODES not an integer >= 2 (one node is modelled as a ring: the tree's byte
            model counts inter-node bytes), or ALGO not ring/tree.

    >>> parse_algorithms(["2=tree", "4=RING"])
    {2: 'tree', 4: 'ring'}
    """
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        algo = value.strip().lower()
        if not key.strip().isdigit() or int(key) < 2:
            raise ProjectionError(f"--algorithm {item}: NODES must be an integer >= 2 (one node: ring bytes)")
        if algo not in ALGORITHMS:
            raise ProjectionError(f"--algorithm {item}: ALGO must be ring or tree (the byte models pnpscale has)")
        out[int(key)] = algo
    return out


def local_cores() -> int:
    """The cores this process may run on (the default ``devices`` of a CPU sweep)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass
class SectionModel:
    """Fitted model of one section (see module doc); seconds, bytes."""

    section: str
    units: tuple[str, ...]
    coef: np.ndarray  # a, then one coefficient per unit (all >= 0)
    latency_s: float
    payload_bytes: float
    sigma: float  # jitter: relative spread of one rank's compute
    excess: float  # ψ: wait beyond C_max − C, per e(N)·C_max


@dataclass
class Model:
    """Fitted model of one (problem, mode)."""

    problem: str
    mode: str
    num_operators: int
    num_tiles: int
    gpus_per_node: int | None
    logged: dict[tuple[int, str], str]  # (nodes, section) -> algorithm NCCL logged
    given_algorithms: dict[int, str]
    rates: dict[str, float]  # route -> GB/s
    rate_sources: dict[str, str]
    sections: list[SectionModel]
    baseline_gpus: int
    baseline_s: float
    measured_gpus: list[int]
    fitted_gpus: list[int]
    assumptions: list[str]
    cores: int | None = None  # CPU ranks: projection refused past this many ranks
    tolerance: float = 0.10
    fit_routes: set[str] = field(default_factory=set)


# --- work and its features ---------------------------------------------------------------------


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


def _balanced(units: Sequence[str], m: int, t: int, n: int) -> bool:
    w = _work(units, m, t, n)
    return bool(n > 1 and np.allclose(w, w[0]))


def _n_top(w: np.ndarray, coef: np.ndarray | None = None) -> int:
    """Ranks holding the most work: rank 0's work vector (round-robin: the most of every unit), on the
    units whose coefficient is not 0."""
    cols = np.arange(w.shape[1]) if coef is None else np.flatnonzero(coef[1:] > 0)
    if len(cols) == 0:
        return w.shape[0]
    return int(np.all(np.isclose(w[:, cols], w[0, cols]), axis=1).sum())


def _cmax(mu: np.ndarray, sigma: float) -> float:
    """``E[max_r μ_r·(1 + σ·Z_r)]``, ranks grouped by equal work."""
    groups, counts = np.unique(np.round(mu, 15), return_counts=True)
    return expected_max(groups, counts, sigma)


def _compute(sm: SectionModel, m: int, t: int, n: int) -> tuple[float, float]:
    """(C, C_max) at N: the mean of ``μ_r`` and ``E[max_r μ_r·(1 + σ·Z_r)]``."""
    mu = sm.coef[0] + _work(sm.units, m, t, n) @ sm.coef[1:]
    return float(mu.mean()), _cmax(mu, sm.sigma)


def _nodes(n: int, gpus_per_node: int | None) -> int:
    return 1 if gpus_per_node is None else max(1, math.ceil(n / gpus_per_node))


def _bytes(payload: float, n: int, nodes: int, algo: str) -> float:
    if n <= 1:
        return 0.0
    return bytes_per_gpu("all_reduce", payload, n, nodes, algo if nodes > 1 else "ring")


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


def _row_nodes(r: Mapping[str, Any] | pd.Series, gpn: int | None) -> int:
    v = r[K.NODES] if K.NODES in r else None
    return int(v) if v is not None and pd.notna(v) else _nodes(int(r[K.GPUS]), gpn)


def _row_algorithm(r: Mapping[str, Any] | pd.Series) -> str | None:
    v = r[K.ALGORITHM] if K.ALGORITHM in r else None
    return str(v).lower() if v is not None and pd.notna(v) else None


# --- the fit ---------------------------------------------------------------------------------


def _label(pts: pd.DataFrame) -> tuple[str, str, str]:
    keys = pts[GROUP].drop_duplicates() if set(GROUP) <= set(pts) else pd.DataFrame([{K.PROBLEM: "", K.MODE: ""}])
    if len(keys) != 1:
        raise ProjectionError(f"fit takes one (problem, mode), got {len(keys)}")
    problem, mode = str(keys.iloc[0][K.PROBLEM]), str(keys.iloc[0][K.MODE])
    return problem, mode, f"{problem} {mode}".strip()


def _cpu_cores(pts: pd.DataFrame, options: Options) -> tuple[int | None, str | None]:
    cpu = "backend" in pts and (pts["backend"].astype(str).str.lower() == "gloo").any()
    if options.devices is not None:
        return options.devices, f"--devices {options.devices}"
    if cpu:
        return local_cores(), f"CPU ranks (gloo) on this machine's {local_cores()} core(s) (give --devices D otherwise)"
    return None, None


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
    pts = _points(rows)
    problem, mode, label = _label(pts)
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
    cores, cores_note = _cpu_cores(pts, options)
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
        algo, nodes = _row_algorithm(r), _row_nodes(r, gpn)
        if algo is not None and nodes > 1:
            logged[(nodes, str(r[K.SECTION]))] = algo

    names = list(dict.fromkeys(pts[K.SECTION]))
    sigmas = _jitter(pts, names, m, t)
    sig_all = [v for vals in sigmas.values() for v in vals]
    sections: list[SectionModel] = []
    for name in names:
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
        coef, used = _fit_compute(s, units, m, t, sigma, options.tolerance, label)
        if used != units:
            assumptions.append(
                f"{name}: operators and tiles cannot be told apart on these points (every rank holds the same share "
                "of both): one unit ops/M + tiles/T, the operators weighing as much as the tiles"
            )
        multi = s[s[K.GPUS] > 1]
        payload = _payload(multi)
        if payload is None:
            raise ProjectionError(f"{label} {name}: no measured multi-GPU point with a payload: no transfer model")
        sm = SectionModel(name, used, coef, 0.0, payload, sigma, 0.0)
        sm.excess = _excess(multi, sm, m, t)
        sections.append(sm)
        parts = ", ".join(f"{u} {v:.4g} s" for u, v in zip(("fixed", *used), coef, strict=True))
        assumptions.append(
            f"{name}: compute per rank = {parts} (non-negative fit, weights 1/value); jitter σ = {sigma:.3g} "
            f"(from {where})" + (f"; wait beyond C_max − C: ψ = {sm.excess:.3g} x e(N)·C_max" if sm.excess else "")
        )
    assumptions.append(
        "C_max = E[max_r μ_r·(1 + σ·Z_r)], Z_r independent standard normals (equal work: μ·(1 + σ·e(N)), e(N) "
        "the expected maximum of N standard normals); wait = uneven work + jitter = C_max − C (+ ψ·e(N)·C_max); "
        "ranks leave each "
        "section together (S_max = S), CommE = ΣC_max/ΣS_max, PE = ΣC/ΣS_max"
    )
    model = Model(problem, mode, m, t, gpn, logged, dict(options.algorithms), {}, {}, sections, fitted[0], 0.0,
                  measured, fitted, assumptions, cores, options.tolerance)  # fmt: skip
    _fit_transfer(model, pts, options.rates, label)
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
    return [int(g) for g in s[K.GPUS] if _balanced(units, m, t, int(g))]


def _jitter(pts: pd.DataFrame, names: Sequence[str], m: int, t: int) -> dict[str, list[float]]:
    """Per section, ``(C_max/C − 1)/e(N)`` at each balanced multi-GPU point."""
    out: dict[str, list[float]] = {}
    for name in names:
        s = pts[pts[K.SECTION] == name]
        vals = []
        for _, r in s.iterrows():
            n, c, cmax = int(r[K.GPUS]), float(r[K.COMPUTE_S]), float(r[K.COMPUTE_MAX_S])
            if _balanced(section_work(name), m, t, n) and c > 0:
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
        w = _work(use, m, t, n)
        if coef is None:
            f = 1.0 + sigma * expected_max_normal(_n_top(w))
        else:
            mu = coef[0] + w @ coef[1:]
            f = _cmax(mu, sigma) / mu.max() if mu.max() > 0 else 1.0
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


def _obs_route(model: Model, n: int, nodes: int, section: str, algo: str | None) -> tuple[str, str, str]:
    """(route, algorithm, algorithm source) at N on ``nodes`` nodes."""
    if nodes <= 1:
        return intra_route(n), "ring", "one node"
    if algo is not None:
        return f"inter-node {algo}", algo, "NCCL log"
    chosen, source = algorithm_at(model, nodes, section)
    return f"inter-node {chosen}", chosen, source


def algorithm_at(model: Model, nodes: int, section: str) -> tuple[str, str]:
    """(algorithm, source) of a section's all_reduce on ``nodes`` nodes: given, else NCCL's log at that
    node count, else ring (``assumed``)."""
    if nodes <= 1:
        return "ring", "one node"
    if nodes in model.given_algorithms:
        return model.given_algorithms[nodes], "given"
    if (nodes, section) in model.logged:
        return model.logged[(nodes, section)], "NCCL log"
    return "ring", "assumed"


def _fit_transfer(model: Model, pts: pd.DataFrame, given: Mapping[str, float], label: str) -> None:
    """Latency per section and rate per route: ``T = L_s + B/R`` (see module doc); fills ``model``."""
    obs = []
    for sm in model.sections:
        s = pts[(pts[K.SECTION] == sm.section) & (pts[K.GPUS] > 1)]
        for _, r in s.iterrows():
            n, nodes = int(r[K.GPUS]), _row_nodes(r, model.gpus_per_node)
            route, algo, _ = _obs_route(model, n, nodes, sm.section, _row_algorithm(r))
            obs.append((sm.section, route, _bytes(sm.payload_bytes, n, nodes, algo), float(r[K.TRANSFER_S]), n))
    model.fit_routes = {o[1] for o in obs}
    names = [sm.section for sm in model.sections]

    def given_rate(route: str) -> float | None:
        return given.get(route, given.get(INTRA) if route.startswith(INTRA) else None)

    free = sorted({o[1] for o in obs if given_rate(o[1]) is None})
    x = np.zeros((len(obs), len(names) + len(free)))
    y = np.zeros(len(obs))
    for i, (sec, route, b, tr, _) in enumerate(obs):
        x[i, names.index(sec)] = 1.0
        g = given_rate(route)
        if g is not None:
            y[i] = tr - b / (g * GB)
        else:
            x[i, len(names) + free.index(route)] = b
            y[i] = tr

    def spread(route: str) -> float:  # relative spread of a route's byte counts: a latency needs >= 20 %
        b = [o[2] for o in obs if o[1] == route and o[2] > 0]
        return (max(b) - min(b)) / max(b) if b else 0.0

    single = [r for r in free if spread(r) < 0.2]
    coef, why = None, ""
    if obs and not single:
        w = 1.0 / np.where(np.abs(y) > 0, np.abs(y), 1.0)
        sol, _ = nonnegative_lstsq(x * w[:, None], y * w)
        if (sol[len(names) :] > 0).all():
            coef = sol
        else:
            bad = [r for r, v in zip(free, sol[len(names) :], strict=True) if v <= 0]
            why = f"the joint fit with latencies gave no positive rate for {', '.join(bad)}"
    elif single:
        where = "; ".join(f"{r} at {', '.join(sorted({str(o[4]) for o in obs if o[1] == r}))} GPUs" for r in single)
        why = f"latency not identifiable: route(s) measured at byte counts within 20 % of each other ({where})"
    notes = []
    for route in sorted(set(given)):
        measured = [o[2] / o[3] / GB for o in obs if o[1] == route and o[3] > 0]
        m_note = f"; measured {float(np.median(measured)):.4g} GB/s" if measured else ""
        notes.append(f"rate {route}: {given[route]:g} GB/s (given{m_note})")
    if coef is not None:
        latencies = dict(zip(names, coef[: len(names)].tolist(), strict=True))
        for r, v in zip(free, coef[len(names) :], strict=True):
            model.rates[r], model.rate_sources[r] = 1.0 / v / GB, "fitted with the latencies"
        notes.append("latency per section (s, constant in N, >= 0): "
                     + ", ".join(f"{k} {v:.3g}" for k, v in latencies.items()))  # fmt: skip
    else:
        latencies = dict.fromkeys(names, 0.0)
        for route in free:
            pairs = [(b, tr) for _, rr, b, tr, _ in obs if rr == route and tr > 0 and b > 0]
            if pairs:
                model.rates[route] = sum(b for b, _ in pairs) / sum(tr for _, tr in pairs) / GB
                model.rate_sources[route] = f"its bytes / its transfer, summed over its points; latency 0 ({why})"
    for route, rate in model.rates.items():
        notes.append(f"rate {route}: {rate:.4g} GB/s ({model.rate_sources[route]})")
    for route, rate in given.items():
        model.rates[route], model.rate_sources[route] = rate, "given"
    for sm in model.sections:
        sm.latency_s = latencies[sm.section]
    model.assumptions += notes


def rate_at(model: Model, n: int, route: str) -> tuple[float | None, str]:
    """(GB/s, source) of a route: given or fitted; a one-node GPU count never measured takes the
    nearest measured one's rate (the largest below, else the smallest above; stated)."""
    if route in model.rates:
        return model.rates[route], model.rate_sources[route]
    if route.startswith(INTRA):
        if INTRA in model.rates:
            return model.rates[INTRA], "given (every one-node GPU count)"
        known = sorted(int(r.split(", ")[1].split()[0]) for r in model.rates if r.startswith(INTRA + ","))
        if known:
            below = [g for g in known if g <= n]
            g = below[-1] if below else known[0]
            return model.rates[intra_route(g)], f"not measured on {n} GPUs: the rate of {intra_route(g)} (assumed)"
    return None, ""


# --- evaluation ----------------------------------------------------------------------------------


def evaluate(
    model: Model,
    gpus: Iterable[int],
    at: Mapping[int, tuple[int, Mapping[str, str]]] | None = None,
    past_cores: bool = False,
) -> pd.DataFrame:
    """The model's numbers at each N: one row per N x section plus section ``all``.

    Args:
        model: :func:`fit`'s output. gpus: GPU counts.
        at: N -> (nodes, {section: algorithm}) to use instead of the model's (a measured point's own
            nodes and NCCL-logged algorithms: :func:`leave_one_out`, :func:`residuals`).
        past_cores: evaluate N past a CPU sweep's cores too (only to compare with a measured point).

    Returns:
        Columns :data:`pnpscale.columns.PROJECTION_COLUMNS` with MEASURED False (seconds per iteration).

    Raises:
        ProjectionError: a route at some N with neither a measured nor a given rate; N past the cores
            of CPU ranks; an impossible number (a bug: C, T, W < 0 or LB, CommE, PE > 1).
    """
    rows = []
    m, t = model.num_operators, model.num_tiles
    for n in sorted({int(g) for g in gpus}):
        if n < 1:
            raise ProjectionError(f"gpus={n}: must be >= 1")
        if model.cores is not None and n > model.cores and not past_cores:
            raise ProjectionError(f"{model.problem} {model.mode} gpus={n}: more ranks than the {model.cores} cores "
                                  "they share: time-sharing is not modelled")  # fmt: skip
        nodes, algos = (at or {}).get(n, (_nodes(n, model.gpus_per_node), {}))
        per = []
        for sm in model.sections:
            c, cmax = _compute(sm, m, t, n)
            route, algo, source = "", "", ""
            rate: float | None = math.nan
            if n == 1:
                tr = wait = 0.0
            else:
                route, algo, source = _obs_route(model, n, nodes, sm.section, algos.get(sm.section))
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
                tr = sm.latency_s + _bytes(sm.payload_bytes, n, nodes, algo) / (rate * GB)
                wait = (cmax - c) + sm.excess * expected_max_normal(n) * cmax
            per.append((sm.section, c, cmax, tr, wait, route, rate, algo, source))
        sums = np.sum([p[1:5] for p in per], axis=0)
        for section, c, cmax, tr, wait, route, rate, algo, source in [*per, (ALL, *sums, "", math.nan, "", "")]:
            rows.append(_row(model, n, nodes, section, c, cmax, tr, wait, route, rate, algo, source))
    out = pd.DataFrame(rows, columns=list(K.PROJECTION_COLUMNS))
    check_possible(out)
    return out


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
    }


def check_possible(table: pd.DataFrame) -> None:
    """Refuse an impossible projected number: a negative time, LB, CommE or PE above 1.

    Raises:
        ProjectionError: naming the first offending row and column.
    """
    for col, bad in (
        (K.COMPUTE_S, table[K.COMPUTE_S] < -_EPS),
        (K.COMPUTE_MAX_S, table[K.COMPUTE_MAX_S] < table[K.COMPUTE_S] - _EPS),
        (K.TRANSFER_S, table[K.TRANSFER_S] < -_EPS),
        (K.WAIT_S, table[K.WAIT_S] < -_EPS),
        (K.SECTION_S, table[K.SECTION_S] < -_EPS),
        (K.LB, table[K.LB] > 1 + _EPS),
        (K.COMM_E, table[K.COMM_E] > 1 + _EPS),
        (K.PE, table[K.PE] > 1 + _EPS),
    ):
        if bad.any():
            r = table[bad].iloc[0]
            raise ProjectionError(
                f"impossible projected {col} = {r[col]:.4g} at gpus={r[K.GPUS]} section {r[K.SECTION]}"
            )


def measured_rows(rows: pd.DataFrame, model: Model) -> pd.DataFrame:
    """The measured points in the projection's columns (MEASURED True), section rows and ``all``;
    CommE and PE use the slowest rank's section time SECTION_MAX_S when the table has it."""
    pts = _points(rows)
    out = []
    for n, g in pts.groupby(K.GPUS):
        nodes = _row_nodes(g.iloc[0], model.gpus_per_node)
        cols = [K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S]
        smax = g[K.SECTION_MAX_S] if K.SECTION_MAX_S in g else pd.Series(math.nan, index=g.index)
        for (_, r), sm in zip(g.iterrows(), smax, strict=True):
            algo = _row_algorithm(r) or ""
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


# --- checks: the fit at its own points, leave-one-out ------------------------------------------


def _own(pts: pd.DataFrame, n: int, gpn: int | None) -> dict[int, tuple[int, dict[str, str]]]:
    """A measured point's own nodes and NCCL-logged algorithm per section."""
    g = pts[pts[K.GPUS] == n]
    algos = {str(r[K.SECTION]): a for _, r in g.iterrows() if (a := _row_algorithm(r)) is not None}
    return {n: (_row_nodes(g.iloc[0], gpn), algos)}


def _compare(kind: str, model: Model, pts: pd.DataFrame, n: int, fitted_on: Sequence[int], headline: bool,
             past_cores: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    pred = evaluate(model, [n], _own(pts, n, model.gpus_per_node), past_cores=past_cores).set_index(K.SECTION)
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
    pts = _points(rows)
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


def leave_one_out(rows: pd.DataFrame, options: Options = Options(), model: Model | None = None) -> pd.DataFrame:
    """Fit without each fitted N (keeping at least 2 others) and predict it with its own nodes and
    NCCL-logged algorithm (``gpus_per_node`` and the options of the full fit).

    Returns:
        One row per held-out N x section (and ``all``) x metric of :data:`VALIDATED`, ``kind`` =
        ``leave-one-out``; ``headline`` True for the largest fitted N (predicted from the smaller
        ones). A held-out N that cannot be predicted (no rate for its route without it) is one row with
        the reason in ``note``.
    """
    pts = _points(rows)
    full = model or fit(pts, options)
    gpus = full.fitted_gpus
    opts = replace(options, gpus_per_node=full.gpus_per_node, devices=full.cores)
    out = []
    for held in gpus:
        rest_gpus = [g for g in gpus if g != held]
        if len(rest_gpus) < 2:
            continue
        try:
            sub = fit(pts[pts[K.GPUS].isin(rest_gpus)], opts)
            own = _own(pts, held, full.gpus_per_node)[held]
            lacking = sorted({
                route for sm in sub.sections
                if rate_at(sub, held, route := _obs_route(sub, held, own[0], sm.section,
                                                          own[1].get(sm.section))[0])[0] is None
            } if held > 1 else set())  # fmt: skip
            note = ""
            if lacking:  # no other point takes its route: its own rate, and its transfer is no prediction
                sub = fit(pts[pts[K.GPUS].isin(rest_gpus)],
                          replace(opts, rates={**opts.rates, **{r: full.rates[r] for r in lacking}}))  # fmt: skip
                note = (f"rate of {', '.join(lacking)} from this point itself (no other point takes that route): "
                        "its transfer is not a prediction")  # fmt: skip
            rows_n = _compare(LOO, sub, pts, held, rest_gpus, held == gpus[-1])
            for r in rows_n:
                r["note"] = note
            out += rows_n
        except (ProjectionError, KeyError) as exc:
            out.append(_failed(LOO, full, held, rest_gpus, str(exc)))
    return pd.DataFrame(out, columns=list(K.VALIDATION_COLUMNS))


def misses(validation: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    """Rows of :func:`residuals` (section ``all``, :data:`HEADLINE` metrics) off by more than ``tolerance``."""
    v = validation[(validation["kind"] == RESIDUAL) & (validation[K.SECTION] == ALL)
                   & validation["metric"].isin(HEADLINE)]  # fmt: skip
    return v[v[K.REL_ERROR].abs() > tolerance]


# --- everything for one table ------------------------------------------------------------------


@dataclass
class Projection:
    """Everything :func:`project` found.

    Attributes:
        table: measured rows and projected rows (:data:`pnpscale.columns.PROJECTION_COLUMNS`).
        validation: :func:`residuals` and :func:`leave_one_out` of every (problem, mode).
        findings: (problem, mode) -> :func:`findings`.
        assumptions: (problem, mode) -> stated assumptions.
        skipped: (problem, mode) -> why it was not projected.
        notes: (problem, mode) -> what became of the given options and of the GPU counts asked
            (a ``--rate`` or ``--algorithm`` not used and why, GPU counts refused).
        tolerance: the residual tolerance (relative).
    """

    table: pd.DataFrame
    validation: pd.DataFrame
    findings: dict[tuple[str, str], dict[str, Any]]
    assumptions: dict[tuple[str, str], list[str]]
    skipped: dict[tuple[str, str], str]
    notes: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    tolerance: float = 0.10


def algorithm_notes(model: Model, table: pd.DataFrame) -> list[str]:
    """One line per node count > 1 of ``table`` (projected rows): the algorithm used and where it came from."""
    rows = table[(table[K.NODES] > 1) & (table[K.SECTION] != ALL)]
    out = []
    for nodes, g in rows.groupby(K.NODES):
        parts = sorted({f"{r[K.ALGORITHM]} ({r[K.ALGORITHM_SOURCE]})" for _, r in g.iterrows()})
        out.append(f"algorithm on {int(nodes)} nodes: {', '.join(parts)}")
    if any("assumed" in line for line in out):
        out.append("ring is assumed at node counts where NCCL's choice was never logged: give --algorithm NODES=ALGO")
    for route, g in table[table[K.ROUTE].astype(bool) & (table[K.SECTION] != ALL)].groupby(K.ROUTE):
        if route not in model.rates:
            rate, source = rate_at(model, int(g[K.GPUS].iloc[0]), str(route))
            out.append(f"rate {route}: {rate:.4g} GB/s, {source}; give --rate intra:G=GBps")
    return out


def option_notes(model: Model, table: pd.DataFrame, options: Options) -> list[str]:
    """What became of each given ``--rate`` and ``--algorithm``: used, or why not."""
    used = set(table[K.ROUTE].dropna()) | model.fit_routes
    used.discard("")
    out = []
    for route, rate in options.rates.items():
        hit = any(u.startswith(INTRA) for u in used) if route == INTRA else route in used
        if hit:
            out.append(f"--rate {route}={rate:g}: used")
        else:
            out.append(f"--rate {route}={rate:g}: not used: no measured or projected point takes route {route} "
                       f"(routes used: {', '.join(sorted(used)) or 'none'})")  # fmt: skip
    node_counts = sorted({int(x) for x in table[K.NODES]})
    for nodes, algo in options.algorithms.items():
        if nodes in node_counts:
            out.append(f"--algorithm {nodes}={algo}: used")
        else:
            out.append(f"--algorithm {nodes}={algo}: not used: no projected point on {nodes} nodes "
                       f"(node counts: {', '.join(map(str, node_counts))})")  # fmt: skip
    return out


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
    frames, vals, found, assumed, skipped, notes = [], [], {}, {}, {}, {}
    for (problem, mode), rows in pts.groupby(GROUP, sort=True):
        key = (str(problem), str(mode))
        measured = sorted({int(g) for g in rows[K.GPUS]})
        if len(measured) < min_points:
            skipped[key] = f"{len(measured)} measured GPU count(s); the projection needs {min_points}"
            continue
        try:
            cores, _ = _cpu_cores(rows, options)  # checked first: the reason that matters for CPU runs
            asked = sorted(set(gpus))
            allowed = [n for n in asked if cores is None or n <= cores]
            refused = [n for n in asked if n not in allowed]
            if asked and not allowed:
                raise ProjectionError(
                    f"GPU counts {', '.join(map(str, refused))} are past the {cores} cores the CPU ranks "
                    "share: time-sharing of compute and transfer is not modelled, so nothing is projected "
                    "(give --devices D for the cores the runs had)"
                )
            model = fit(rows, options)
            proj = evaluate(model, sorted(set(allowed) | set(model.fitted_gpus)))
            found[key] = findings(model, max([*allowed, *model.fitted_gpus]), options.pe_min)
            checks = pd.concat([residuals(rows, model), leave_one_out(rows, options, model)], ignore_index=True)
        except ProjectionError as exc:  # said after the key: the message's own "<problem> <mode>: " goes
            skipped[key] = str(exc).removeprefix(f"{key[0]} {key[1]}: ")
            continue
        frames += [measured_rows(rows, model), proj]
        vals.append(checks)
        assumed[key] = model.assumptions + algorithm_notes(model, proj)
        notes[key] = option_notes(model, proj, options) + (
            [f"not projected: {', '.join(map(str, refused))} GPUs (past the {model.cores} cores the CPU ranks share)"]
            if refused else []
        )  # fmt: skip
    cols = list(K.PROJECTION_COLUMNS)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    val = pd.concat(vals, ignore_index=True) if vals else pd.DataFrame(columns=list(K.VALIDATION_COLUMNS))
    return Projection(out, val, found, assumed, skipped, notes, options.tolerance)
