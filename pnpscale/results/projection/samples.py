"""Per-rank, per-iteration compute samples: the projection's unbiased statistics and their bootstrap (pure).

A run's ``ranks.parquet`` holds each rank's section time and its time blocked on collectives per
iteration; their difference is the rank's compute (:func:`pnpscale.analysis.metrics.decompose`). From
those samples, per point (N) and section, an array ``x[i, r]`` (measured iterations x ranks, seconds):

* the rank's mean compute ``m_r = mean_i x[i, r]`` (an unbiased mean, not the max over ranks the summary's
  C_max is);
* the jitter ``σ``: the spread of ``x[i, r] / m_r`` across ranks within an iteration, after dividing out the
  iteration's common factor ``g_i = mean_r x[i, r] / m_r`` (a slow or fast iteration for every rank makes
  nobody wait): ``σ² = Σ_{i,r} (x[i, r] / (m_r·g_i) − 1)² / (I·(N − 1)·(1 − 1/I))`` pooled over the points
  with N > 1 (the ``N − 1`` and ``1 − 1/I`` correct for the two means taken);
* resampling for the band (:func:`resample`): iterations with replacement (the same ones for every rank: the
  iteration's common factor stays common), and ranks with replacement within their cell (same node, same
  work), so a node's speed and the round-robin's work stay where they are.

Units: seconds per iteration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.results.projection.base import ProjectionError

#: the per-rank samples a projection reads (PROBLEM carries the variant, as the summary rows do).
SAMPLE_COLUMNS = (K.PROBLEM, K.MODE, K.GPUS, K.SECTION, K.RANK, K.ITERATION, K.COMPUTE_S)

Arrays = dict[int, np.ndarray]  # N -> iterations x ranks (seconds)


def from_ranks(ranks: pd.DataFrame) -> pd.DataFrame:
    """One run's ``ranks.parquet`` -> RANK, ITERATION, SECTION, COMPUTE_S (``section_s − comm_s``) of its
    measured (non-warm-up) iterations.

    Raises:
        ProjectionError: a column missing, or a negative compute (naming rank, iteration, section).
    """
    need = [K.RANK, K.ITERATION, K.SECTION, K.SECTION_S, K.COMM_S]
    missing = [c for c in need if c not in ranks]
    if missing:
        raise ProjectionError(f"ranks table lacks column(s) {', '.join(missing)}")
    r = ranks[~ranks[K.WARMUP].astype(bool)] if K.WARMUP in ranks else ranks
    out = r[[K.RANK, K.ITERATION, K.SECTION]].copy()
    out[K.COMPUTE_S] = r[K.SECTION_S].astype(float) - r[K.COMM_S].astype(float)
    bad = out[out[K.COMPUTE_S] < -1e-9]
    if not bad.empty:
        b = bad.iloc[0]
        raise ProjectionError(f"rank {b[K.RANK]} iteration {b[K.ITERATION]} section {b[K.SECTION]}: "
                              f"compute {b[K.COMPUTE_S]:.4g} s < 0 (comm_s longer than section_s)")  # fmt: skip
    return out.reset_index(drop=True)


def section_arrays(samples: pd.DataFrame, section: str, gpus: Sequence[int], label: str) -> Arrays | None:
    """The samples of one section at each of ``gpus`` as ``{N: x[iterations, ranks]}``; None when some N has
    no sample (the fit then reads the summary).

    Raises:
        ProjectionError: a point whose ranks are not 0..N−1, or a rank without a sample at some iteration
            another rank has (naming N, section, rank and iteration).
    """
    s = samples[samples[K.SECTION] == section]
    out: Arrays = {}
    for n in gpus:
        g = s[s[K.GPUS] == n]
        if g.empty:
            return None
        ranks = sorted({int(r) for r in g[K.RANK]})
        if ranks != list(range(n)):
            raise ProjectionError(f"{label} {section} gpus={n}: samples of ranks {ranks[:8]}, must be 0..{n - 1}")
        its, it_idx = np.unique(g[K.ITERATION].to_numpy(), return_inverse=True)
        x = np.full((len(its), n), np.nan)
        x[it_idx, g[K.RANK].to_numpy(dtype=int)] = g[K.COMPUTE_S].to_numpy(dtype=float)
        if len(g) != x.size or np.isnan(x).any():
            i, r = (int(v[0]) for v in np.nonzero(np.isnan(x))) if np.isnan(x).any() else (0, 0)
            raise ProjectionError(f"{label} {section} gpus={n}: rank {r} has no sample at iteration {its[i]}"
                                  if np.isnan(x).any() else f"{label} {section} gpus={n}: two samples of one rank "
                                  "and iteration")  # fmt: skip
        out[n] = x
    return out


def rank_means(arrays: Mapping[int, np.ndarray]) -> Arrays:
    """``{N: m_r}``: each rank's mean compute over iterations."""
    return {n: x.mean(axis=0) for n, x in arrays.items()}


def jitter(arrays: Mapping[int, np.ndarray]) -> float | None:
    """The pooled jitter σ (module doc) over the points with N > 1 and 2 iterations or more; None without one."""
    num = den = 0.0
    for n, x in arrays.items():
        i = x.shape[0]
        if n < 2 or i < 2:
            continue
        m = x.mean(axis=0)
        if (m <= 0).any():
            continue
        e = x / m[None, :]
        z = e / e.mean(axis=1, keepdims=True) - 1.0
        num += float(np.sum(z**2))
        den += i * (n - 1) * (1.0 - 1.0 / i)
    return float(np.sqrt(num / den)) if den > 0 else None


def cells(n: int, work: np.ndarray, gpus_per_node: int | None) -> list[np.ndarray]:
    """The ranks of each (node, work) cell at N (``work``: ranks x units), rank r on node ``r // gpus_per_node``."""
    nodes = np.arange(n) // gpus_per_node if gpus_per_node else np.zeros(n, dtype=int)
    keys: dict[tuple, list[int]] = {}
    for r in range(n):
        keys.setdefault((int(nodes[r]), *np.round(work[r], 12)), []).append(r)
    return [np.array(v) for v in keys.values()]


def resample(arrays: Mapping[int, np.ndarray], groups: Mapping[int, Sequence[np.ndarray]],
             rng: np.random.Generator) -> tuple[Arrays, Arrays]:  # fmt: skip
    """One bootstrap replicate: per N, iterations drawn with replacement (the same for every rank), then each
    cell's ranks (``groups[N]``, :func:`cells`) drawn with replacement among themselves.

    Returns:
        (iterations resampled only: for :func:`jitter`, whose spread across ranks a rank drawn twice would
        shrink; iterations and ranks resampled: for the rank means)."""
    its: Arrays = {}
    both: Arrays = {}
    for n, x in arrays.items():
        rows = rng.integers(0, x.shape[0], x.shape[0])
        cols = np.arange(n)
        for c in groups[n]:
            cols[c] = rng.choice(c, len(c))
        its[n] = x[rows]
        both[n] = its[n][:, cols]
    return its, both


def iterations_of(arrays: Mapping[int, np.ndarray]) -> int:
    """The fewest measured iterations of any point."""
    return min(x.shape[0] for x in arrays.values())
