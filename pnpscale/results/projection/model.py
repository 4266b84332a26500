"""The projection's model: fit on a sweep's measured points, evaluate at any N, check it (pure functions).

Input: the summary table of :func:`pnpscale.results.runs.load` (one row per complete point x section,
seconds per measured iteration), optionally with an ``algorithm`` column (the one NCCL logged), and the
runs' per-rank, per-iteration compute (``ranks.parquet``: :mod:`pnpscale.results.projection.samples`). Per
(problem, mode) and section s, from the measured points N_i (at least 2 GPU counts):

* **nodes** — ``nodes = ceil(N / gpus_per_node)``: ``--gpus-per-node``, else the measured multi-node runs'
  ``gpus / nodes`` (their hosts, or SLURM's node count); else every measured run sat on one node and its size
  is unknown: N past the largest measured one is refused
  (:class:`~pnpscale.results.projection.base.NodeSizeUnknown`: a node bigger than any measured one is never
  assumed), and past the measured nodes only a measured or given inter-node rate is used.
* **with per-rank samples** (the default of the command; :func:`pnpscale.results.projection.fit.fit_section_samples`):
  rank r's mean compute ``μ_r = f_node(r)·(a + b·ops_r + c·tiles_r)`` by least squares on the rank means grouped
  by (N, node, work) — an unbiased mean, not the max — with ``f_k`` node k's speed relative to node 0 (rank r on
  node ``r // gpus_per_node``), kept where it differs from 1 by more than 3 standard errors and then on the
  critical path at every projected N (nodes never measured run at node 0's speed); a coefficient fitted below 0
  is set to 0 and said (how many standard errors below, and the error that costs; refused beyond the tolerance);
  the jitter σ from the per-rank, per-iteration samples with each iteration's common factor removed (said
  uncertain below 20 iterations). The **band**: 5–95 % over bootstrap replicates (iterations, and ranks within
  their node and work, resampled; compute, jitter and node speeds refitted; rates, latencies and ψ held) of
  time per iteration, scaled cost, CommE and PE at every projected N. Without samples, the summary's fit below
  (a max statistic that noise pushes up; no band; said).

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
  rank the same work; N > 1); none: the mean over the other sections' balanced points, else 0 (stated),
  and then C_max and wait at N where every rank holds the same work (jitter alone) are refused
  (:class:`~pnpscale.results.projection.base.Unidentified`).
* the fit — ``a, b, c`` by non-negative least squares (weights 1/value) on the measured ``C`` and
  ``C_max`` (:func:`pnpscale.results.jitter.nonnegative_lstsq`). When the points cannot tell ``b`` from
  ``c`` apart (every rank holds the same share of both), one combined unit ``ops_r/M + tiles_r/T``: exact
  at N where every rank holds the same share of both; at any other N the critical path depends on the
  unknown split, so C_max and wait there are refused (:class:`~pnpscale.results.projection.base.Unidentified`,
  naming the section, N, the fitted points and the ranks' shares), not guessed.
  Refused (naming the points) when the unconstrained fit needs a negative coefficient and the
  non-negative one misses a measured compute by more than the tolerance (default 10 %): points that
  scale faster than 1/N.
* **wait** — uneven work + jitter ``= C_max − C`` (one collective closes the section and every rank
  leaves it together), plus ``ψ_s·e(N)·C_max`` when the measured wait exceeds ``C_max − C`` (several
  synchronising collectives per section, e.g. training's unrolled iterations), ``ψ_s >= 0`` the mean of
  ``(W − (C_max − C))/(e(N)·C_max)`` over the measured multi-GPU points.
* **transfer** — ``T(N) = ℓ_s·n_s·hops(N) + B_s(N) / R(route)``: ``ℓ_s`` a latency per collective and hop,
  ``n_s`` the section's main collectives per iteration, ``hops`` the algorithm's latency-bearing steps (ring
  ``2(N−1)``, tree ``2·(ceil(log2 nodes) + ceil(N/nodes) − 1)``: :func:`pnpscale.results.projection.base.hops`);
  ``B_s`` the bytes each GPU sends for an all_reduce of the section's payload per iteration
  ``P_s = n_main·main_payload + other_payload``
  (:func:`pnpscale.results.transfer.bytes_per_gpu`: ring ``2P(N−1)/N``, tree ``2P(nodes−1)/nodes``),
  ``nodes = ceil(N / gpus_per_node)``. Route: on one node ``intra-node, g GPUs`` (one rate per GPU
  count: the study's 40 GB/s on 2 V100s, 119 on 4), else ``inter-node <algorithm>``. Algorithm per node
  count (and section, i.e. size): given (``--algorithm NODES=ALGO``), else the one NCCL logged at that
  node count, else ring (assumed; every choice stated). One node: the ring's bytes. Rates: given
  (``--rate``), else fitted with latencies ``ℓ_s >= 0`` when the points identify them (every route seen
  at byte counts at least 20 % apart), else ``L_s = 0`` and the route's ``ΣB/ΣT`` over its points (the
  reason stated). A one-node GPU count never measured takes the nearest measured one's rate (stated).
* section time ``S = C + T + W`` (>= ``C_max`` by construction); ranks leave each section together, so the
  slowest rank's ``S_max = S``; ``LB = C/C_max``, ``CommE = C_max/S_max``, ``PE = C/S_max`` (POP),
  combined (section ``all``) from the sums; GPU-seconds ``N·S``; scaled cost ``N·S / (N0·S_all(N0))``,
  N0 the smallest measured GPU count. No projected number is impossible: C, T, W >= 0, LB, CommE,
  PE <= 1 (checked on every row).
* **CPU ranks** (backend gloo) share the machine's cores (``devices``: the cores the runs' machine had,
  default this machine's): points with more ranks than cores time-share them (compute and transfer), and no
  honest projection exists there: they are not fitted and N past the cores is not projected (said plainly;
  :class:`~pnpscale.results.projection.base.TimeShared`).
* **pipelined overlap** (``solver.overlap=pipelined`` beside ``none`` in one sweep): the pipelined series'
  exposed transfer from the blocking series' model and the measured hidden share held from the largest
  measured multi-GPU count, hidden at most the critical-path compute, and both crossovers
  (:mod:`pnpscale.results.projection.overlap`); a sweep without a pipelined series says so in one line.

Checks: :func:`residuals` (the fit at its own points), :func:`leave_one_out` (each measured N predicted
from the others, with its own nodes and algorithm); the headline is the largest measured N predicted
from the smaller ones, its worst error over time, transfer, wait and PE; every residual and every
leave-one-out error beyond the tolerance is listed (:func:`misses`, :func:`loo_misses`). Leave-one-out is the
error at measured points: it does not bound the error past them. A projection resting on a term its
leave-one-out could not predict (a held-out point refused, or the headline missed beyond the tolerance) is
marked (:func:`unpredicted`: the ``caveat`` column).

Units: seconds per iteration, bytes, GB/s = 1e9 B/s. Sources: the study "Communication under the hood:
transfer vs wait" (metrics, byte formulas, routes), nccl-tests' PERFORMANCE.md (bytes per GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.results.projection.base import (
    ALGORITHMS,
    ALL,
    GROUP,
    HEADLINE,
    INTRA,
    LOO,
    RESIDUAL,
    RING,
    ROUTE_ALIASES,
    TREE,
    VALIDATED,
    Model,
    NodeSizeUnknown,
    Options,
    ProjectionError,
    SectionModel,
    TimeShared,
    cpu_cores_of,
    intra_route,
    local_cores,
    measured_points,
    parse_algorithms,
    parse_rates,
)
from pnpscale.results.projection.checks import leave_one_out, loo_misses, misses, residuals
from pnpscale.results.projection.evaluate import check_possible, evaluate, findings, measured_rows, with_band
from pnpscale.results.projection.fit import fit
from pnpscale.results.projection.overlap import OverlapProjection, overlap_projections
from pnpscale.results.projection.routes import algorithm_at, rate_at

__all__ = [
    "ALGORITHMS", "ALL", "GROUP", "HEADLINE", "INTRA", "LOO", "RESIDUAL", "RING", "ROUTE_ALIASES", "TREE",
    "VALIDATED", "Model", "NodeSizeUnknown", "Options", "TimeShared", "unpredicted", "with_band",
    "OverlapProjection", "Projection", "ProjectionError", "SectionModel",
    "algorithm_at", "algorithm_notes", "check_possible", "evaluate", "findings", "fit", "intra_route",
    "leave_one_out", "local_cores", "loo_misses", "measured_rows", "misses", "option_notes", "parse_algorithms",
    "parse_rates", "project", "rate_at", "residuals",
]  # fmt: skip


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
        overlap: (pipelined series, mode) -> its exposed transfer projected from the blocking series
            (:mod:`pnpscale.results.projection.overlap`).
        overlap_notes: one line per pipelined series not projected (and why), or one line saying the
            sweep has no pipelined series.
    """

    table: pd.DataFrame
    validation: pd.DataFrame
    findings: dict[tuple[str, str], dict[str, Any]]
    assumptions: dict[tuple[str, str], list[str]]
    skipped: dict[tuple[str, str], str]
    notes: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    tolerance: float = 0.10
    overlap: dict[tuple[str, str], OverlapProjection] = field(default_factory=dict)
    overlap_notes: list[str] = field(default_factory=list)


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


def project(table: pd.DataFrame, gpus: Sequence[int], options: Options = Options(), min_points: int = 2,
            samples: pd.DataFrame | None = None) -> Projection:  # fmt: skip
    """Project every (problem, mode) of a summary table with at least ``min_points`` measured GPU counts.

    A sweep's variants (``variant`` column: :func:`pnpscale.results.runs.variants`) are projected one by one,
    each as its own series: PROBLEM ``2d denoiser_collective=all_gather`` (:func:`pnpscale.results.series.labelled`).

    Args:
        table: :func:`pnpscale.results.runs.load` output (optionally with ALGORITHM per row).
        gpus: GPU counts to project (the measured ones are evaluated too, for the lines).
        options: :class:`Options`. min_points: measured GPU counts needed (the report uses 3).
        samples: per-rank, per-iteration compute (:data:`pnpscale.results.projection.samples.SAMPLE_COLUMNS`;
            PROBLEM labelled as the table's): the unbiased fit and the band (:func:`fit`).

    Returns:
        :class:`Projection`; a (problem, mode) that cannot be projected is in ``skipped`` with the reason.
        GPU counts refused (past the cores CPU ranks time-share, past the largest measured node with no node
        size) are said in ``notes``; when every asked count is refused the (problem, mode) is skipped.
    """
    pts = measured_points(table, unique=False)  # each (problem, mode) is checked by fit
    frames, vals, found, assumed, skipped, notes = [], [], {}, {}, {}, {}
    models: dict[tuple[str, str], Model] = {}
    for (problem, mode), rows in pts.groupby(GROUP, sort=True):
        key = (str(problem), str(mode))
        measured = sorted({int(g) for g in rows[K.GPUS]})
        if len(measured) < min_points:
            skipped[key] = f"{len(measured)} measured GPU count(s); the projection needs {min_points}"
            continue
        try:
            cores, _ = cpu_cores_of(rows, options)  # checked first: the reason that matters for CPU runs
            asked = sorted(set(gpus))
            allowed = [n for n in asked if cores is None or n <= cores]
            refused = [n for n in asked if n not in allowed]
            if asked and not allowed:
                raise TimeShared(
                    f"GPU counts {', '.join(map(str, refused))} are past the {cores} cores the CPU ranks share: "
                    "ranks there time-share the cores, and no honest projection exists past them (time-sharing "
                    "changes compute and transfer in ways the model does not describe), so nothing is projected"
                )
            model = fit(rows, options, samples)
            node_refused = [n for n in allowed if model.largest_node is not None and n > model.largest_node]
            if asked and allowed and len(node_refused) == len(allowed):
                evaluate(model, node_refused[:1])  # raises NodeSizeUnknown, naming the fix
            allowed = [n for n in allowed if n not in node_refused]
            proj = with_band(model, evaluate(model, sorted(set(allowed) | set(model.fitted_gpus))))
            found[key] = findings(model, max([*allowed, *model.fitted_gpus]), options.pe_min)
            checks = pd.concat([residuals(rows, model), leave_one_out(rows, options, model, samples)],
                               ignore_index=True)  # fmt: skip
        except ProjectionError as exc:  # said after the key: the message's own "<problem> <mode>: " goes
            skipped[key] = str(exc).removeprefix(f"{key[0]} {key[1]}: ")
            continue
        caveat = unpredicted(checks, options.tolerance)
        if caveat:
            past = ~proj[K.GPUS].isin(model.fitted_gpus)
            proj.loc[past, K.CAVEAT] = caveat
        models[key] = model
        frames += [measured_rows(rows, model), proj]
        vals.append(checks)
        assumed[key] = model.assumptions + algorithm_notes(model, proj)
        notes[key] = option_notes(model, proj, options) + (
            [f"not projected: {', '.join(map(str, refused))} GPUs (past the {model.cores} cores the CPU ranks "
             "share: time-shared, no honest projection exists there)"]
            if refused else []
        ) + (
            [f"not projected: {', '.join(map(str, node_refused))} GPUs (past the largest measured node, "
             f"{model.largest_node} GPUs, with no node size: give --gpus-per-node G and --rate ring=GBps)"]
            if node_refused else []
        ) + ([f"caveat: {caveat}"] if caveat else []) + [
            f"warning: {a.split('; ')[0].split(':')[0]}: {w}" for a in model.assumptions for w in a.split("; ")
            if w.startswith("jitter from only")
        ]  # fmt: skip
    cols = list(K.PROJECTION_COLUMNS)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    val = pd.concat(vals, ignore_index=True) if vals else pd.DataFrame(columns=list(K.VALIDATION_COLUMNS))
    searched = {k: int(f["searched_up_to"]) for k, f in found.items()}
    overlap, overlap_notes = overlap_projections(pts, models, searched, skipped, sorted(set(gpus)))
    return Projection(out, val, found, assumed, skipped, notes, options.tolerance, overlap, overlap_notes)


def fitted_counts(checks: pd.DataFrame) -> list[int]:
    """The GPU counts the fit was made on: the ``fitted_on`` of the residual rows (a measured point the fit left
    out, e.g. past the cores CPU ranks share, has a residual row but was not fitted).

    >>> fitted_counts(pd.DataFrame({"kind": RESIDUAL, "gpus": [1, 2, 4], "fitted_on": "1,2"}))
    [1, 2]
    """
    res = checks[checks["kind"] == RESIDUAL]
    named = {int(n) for text in res["fitted_on"].dropna().astype(str) for n in text.split(",") if n.strip()}
    return sorted(named) if named else sorted({int(g) for g in res[K.GPUS]})


def unpredicted(checks: pd.DataFrame, tolerance: float) -> str:
    """Why the projection rests on a term its validation could not predict, or "": no leave-one-out at all (2
    fitted GPU counts), a held-out point leave-one-out refused (a term the other points cannot identify), or the
    headline (the largest fitted N from the smaller ones) missed by more than ``tolerance`` (time, transfer, wait
    or PE)."""
    loo = checks[checks["kind"] == LOO]
    if loo.empty:
        fitted = fitted_counts(checks)
        return (f"rests on a fit no leave-one-out checked ({len(fitted)} fitted GPU counts: each held-out N needs 2 "
                "others)")  # fmt: skip
    refused = loo[(loo["metric"] == "") & (loo["note"].astype(str) != "")]
    parts = [f"leave-one-out could not predict {int(g)} GPUs" for g in sorted(set(refused[K.GPUS].astype(int)))]
    far = loo_misses(loo[loo["headline"].astype(bool)], tolerance)
    if not far.empty:
        worst = far.loc[far[K.REL_ERROR].abs().idxmax()]
        parts.append(f"leave-one-out misses {int(worst[K.GPUS])} GPUs by {100 * worst[K.REL_ERROR]:+.0f} % "
                     f"({worst['metric']})")  # fmt: skip
    return ("rests on a model its validation could not confirm: " + "; ".join(parts)) if parts else ""
