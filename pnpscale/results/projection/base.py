"""The projection's vocabulary: options, the fitted model's types, each rank's work, the measured points.

Shared by the parts of the projection (:mod:`pnpscale.results.projection.model` states the model):
the route and algorithm names and their parsing (``--rate``, ``--algorithm``), :class:`Options`,
:class:`Model` and :class:`SectionModel`, deepinv's round-robin work per rank and its critical path
under jitter, bytes per GPU, and the complete per-section rows a fit reads. Pure functions.

Units: seconds per iteration, bytes, GB/s = 1e9 B/s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.core.errors import InputError
from pnpscale.rank.assignment import round_robin
from pnpscale.results.jitter import expected_max
from pnpscale.results.series import labelled
from pnpscale.results.transfer import bytes_per_gpu, route_label

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
EPS = 1e-9


class ProjectionError(InputError, ValueError):
    """A projection that cannot be made honestly (too few points, unknown assignment or rate, a fit)."""


class NodeSizeUnknown(ProjectionError):
    """GPU counts past the largest measured node with no node size known: a node bigger than any measured
    one is never assumed (the fix: ``--gpus-per-node`` and an inter-node ``--rate``)."""


class TimeShared(ProjectionError):
    """GPU counts past the cores that CPU ranks time-share: no honest projection exists there."""


class Unidentified(ProjectionError):
    """A critical path the fitted points cannot identify: a section whose points never told an operator's
    compute from a tile's, evaluated at an N where the ranks hold unequal shares of the two; or a jitter
    never measured apart from uneven work, evaluated at an N where every rank holds the same work."""


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
        bootstrap: replicates of the band (resampling iterations and ranks of the per-rank samples;
            0: no band). seed: the bootstrap's random seed (the band is reproducible).
    """

    gpus_per_node: int | None = None
    rates: Mapping[str, float] = field(default_factory=dict)
    algorithms: Mapping[int, str] = field(default_factory=dict)
    pe_min: float = 0.8
    devices: int | None = None
    tolerance: float = 0.10
    bootstrap: int = 200
    seed: int = 0


#: fewer measured iterations than this per point: the jitter (a spread) is said to be uncertain.
MIN_JITTER_ITERATIONS = 20
#: the band's quantiles (5–95 %).
BAND = (0.05, 0.95)


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
    latency_s: float  # per collective and hop (:func:`hops`), seconds
    payload_bytes: float
    sigma: float  # jitter: relative spread of one rank's compute
    excess: float  # ψ: wait beyond C_max − C, per e(N)·C_max
    #: why the operators' and the tiles' weights are unknown (one ``combined`` unit fitted), else ""
    unidentified: str = ""
    #: why the jitter σ is unknown (no balanced point in any section: σ = 0 assumed), else ""
    jitter_unknown: str = ""
    #: node index -> compute speed factor relative to node 0 (> 1: slower), from the per-rank samples;
    #: a node not listed runs at node 0's speed. Ranks sit on nodes in blocks (rank r on node r // gpus_per_node).
    node_speed: dict[int, float] = field(default_factory=dict)
    #: collectives per iteration that each pay the latency per hop (the main ones: N_MAIN, at least 1)
    n_collectives: float = 1.0


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
    #: node size unknown and every measured run on one node: the largest measured node (GPUs); N past it refused
    largest_node: int | None = None
    #: the band's replicates: each the model's sections refitted on resampled iterations and ranks
    replicates: list[list[SectionModel]] = field(default_factory=list)
    #: True when compute and jitter come from the per-rank samples (unbiased means), False: summary C, C_max
    from_samples: bool = False


# --- work and its features ---------------------------------------------------------------------


def spread_counts(total: int, n: int) -> np.ndarray:
    return np.array([len(x) for x in round_robin(total, n)], dtype=float)


def work_per_rank(units: Sequence[str], m: int, t: int, n: int) -> np.ndarray:
    """Per rank work features (rank x unit), ``combined`` = ops/M + tiles/T."""
    cols = []
    for u in units:
        if u == "operators":
            cols.append(spread_counts(m, n))
        elif u == "tiles":
            cols.append(spread_counts(t, n))
        else:  # combined
            cols.append(spread_counts(m, n) / m + spread_counts(t, n) / t)
    return np.column_stack(cols)


def split_matters(m: int, t: int, n: int) -> bool:
    """Whether on N ranks some rank's share of the M operators differs from its share of the T tiles
    (round-robin): there a ``combined`` unit ``ops/M + tiles/T`` is an assumption, elsewhere it is exact
    (``μ_r = a + (b·M + c·T)·ops_r/M`` whenever ``ops_r/M = tiles_r/T`` for every rank).

    >>> split_matters(4, 256, 4), split_matters(4, 256, 8), split_matters(4, 256, 3)
    (False, True, True)
    """
    return not np.allclose(spread_counts(m, n) / m, spread_counts(t, n) / t)


def is_balanced(units: Sequence[str], m: int, t: int, n: int) -> bool:
    w = work_per_rank(units, m, t, n)
    return bool(n > 1 and np.allclose(w, w[0]))


def top_count(w: np.ndarray, coef: np.ndarray | None = None) -> int:
    """Ranks holding the most work: rank 0's work vector (round-robin: the most of every unit), on the
    units whose coefficient is not 0."""
    cols = np.arange(w.shape[1]) if coef is None else np.flatnonzero(coef[1:] > 0)
    if len(cols) == 0:
        return w.shape[0]
    return int(np.all(np.isclose(w[:, cols], w[0, cols]), axis=1).sum())


def expected_cmax(mu: np.ndarray, sigma: float) -> float:
    """``E[max_r μ_r·(1 + σ·Z_r)]``, ranks grouped by equal work."""
    groups, counts = np.unique(np.round(mu, 15), return_counts=True)
    return expected_max(groups, counts, sigma)


def speed_per_rank(sm: SectionModel, n: int, gpus_per_node: int | None) -> np.ndarray:
    """Each of N ranks' speed factor (rank r on node ``r // gpus_per_node``; one node without a node size)."""
    f = np.ones(n)
    if sm.node_speed:
        nodes = np.arange(n) // gpus_per_node if gpus_per_node else np.zeros(n, dtype=int)
        for k, v in sm.node_speed.items():
            f[nodes == k] = v
    return f


def compute_at(sm: SectionModel, m: int, t: int, n: int, gpus_per_node: int | None = None) -> tuple[float, float]:
    """(C, C_max) at N: the mean of ``μ_r = f_node(r)·(a + b·ops_r + c·tiles_r)`` and
    ``E[max_r μ_r·(1 + σ·Z_r)]`` (``f`` the node speed factors, 1 without)."""
    mu = (sm.coef[0] + work_per_rank(sm.units, m, t, n) @ sm.coef[1:]) * speed_per_rank(sm, n, gpus_per_node)
    return float(mu.mean()), expected_cmax(mu, sm.sigma)


def nodes_for(n: int, gpus_per_node: int | None) -> int:
    return 1 if gpus_per_node is None else max(1, math.ceil(n / gpus_per_node))


def hops(n: int, nodes: int, algo: str) -> int:
    """Latency-bearing steps of one all_reduce on N ranks over ``nodes`` nodes: the ring's ``2(N − 1)`` (a
    reduce-scatter and an all-gather, N − 1 steps each); the tree's ``2·(ceil(log2 nodes) + ceil(N / nodes) − 1)``
    (up and down a binary tree of nodes and the chain of each node's ranks). Source: nccl-tests' PERFORMANCE.md.

    >>> hops(1, 1, "ring"), hops(4, 1, "ring"), hops(64, 16, "ring"), hops(8, 2, "tree")
    (0, 6, 126, 8)
    """
    if n <= 1:
        return 0
    if algo == "tree" and nodes > 1:
        return 2 * (math.ceil(math.log2(nodes)) + math.ceil(n / nodes) - 1)
    return 2 * (n - 1)


def sent_bytes_of(payload: float, n: int, nodes: int, algo: str) -> float:
    if n <= 1:
        return 0.0
    return bytes_per_gpu("all_reduce", payload, n, nodes, algo if nodes > 1 else "ring")


def measured_points(rows: pd.DataFrame, unique: bool = True) -> pd.DataFrame:
    """The complete per-section rows, each variant folded into PROBLEM (one series per (problem, variant):
    :func:`pnpscale.results.series.labelled`).

    Raises:
        ProjectionError: a needed column is missing, or (``unique``) two rows share a (problem, mode,
            GPU count, section): a fit would mix two measurements of one point.
    """

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


def row_nodes(r: Mapping[str, Any] | pd.Series, gpn: int | None) -> int:
    v = r[K.NODES] if K.NODES in r else None
    return int(v) if v is not None and pd.notna(v) else nodes_for(int(r[K.GPUS]), gpn)


def row_algorithm(r: Mapping[str, Any] | pd.Series) -> str | None:
    v = r[K.ALGORITHM] if K.ALGORITHM in r else None
    return str(v).lower() if v is not None and pd.notna(v) else None


def series_key(pts: pd.DataFrame) -> tuple[str, str, str]:
    keys = pts[GROUP].drop_duplicates() if set(GROUP) <= set(pts) else pd.DataFrame([{K.PROBLEM: "", K.MODE: ""}])
    if len(keys) != 1:
        raise ProjectionError(f"fit takes one (problem, mode), got {len(keys)}")
    problem, mode = str(keys.iloc[0][K.PROBLEM]), str(keys.iloc[0][K.MODE])
    return problem, mode, f"{problem} {mode}".strip()


def recorded_cores(pts: pd.DataFrame) -> int | None:
    """The usable cores the runs recorded (``cores`` in ``run.json``: their most loaded host's), the fewest of any
    point; ``None`` when no point says (older folders)."""
    if K.CORES not in pts:
        return None
    known = pd.to_numeric(pts[K.CORES], errors="coerce").dropna()
    return int(known.min()) if not known.empty else None


def cpu_cores_of(pts: pd.DataFrame, options: Options) -> tuple[int | None, str | None]:
    """(the cores CPU ranks time-share, its source) or ``(None, None)`` for GPU runs: ``--devices``, else the cores
    the runs recorded (:func:`recorded_cores`: the machine they ran on, wherever this analysis runs), else this
    machine's (:func:`local_cores`)."""
    cpu = "backend" in pts and (pts["backend"].astype(str).str.lower() == "gloo").any()
    if options.devices is not None:
        return options.devices, f"--devices {options.devices}"
    if cpu:
        recorded = recorded_cores(pts)
        if recorded is not None:
            return recorded, f"CPU ranks (gloo) time-sharing their machine's {recorded} core(s) (run.json)"
        return local_cores(), f"CPU ranks (gloo) time-sharing this machine's {local_cores()} core(s)"
    return None, None
