"""Jitter of ranks that do the same work: the expected maximum of N normals, and a non-negative fit (pure).

The study ("Communication under the hood: transfer vs wait", cause 2 of wait: "same work, different
finishing time") sees every rank of a balanced section finish at a slightly different moment; the
collective that closes the section waits for the last one. With each rank's compute ``μ·(1 + σ·Z_r)``,
``Z_r`` independent standard normals, the critical path is ``E[max_r] = μ·(1 + σ·e(N))`` with
``e(N) = E[max of N standard normals] = ∫ x·N·φ(x)·Φ(x)^(N−1) dx`` (order statistics; e(1) = 0,
e(2) = 1/√π ≈ 0.5642, e(64) ≈ 2.3437), computed here by quadrature on a fixed grid.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import combinations

import numpy as np

_GRID = np.linspace(-12.0, 12.0, 24001)
_PDF = np.exp(-0.5 * _GRID**2) / math.sqrt(2.0 * math.pi)
_CDF = np.array([0.5 * math.erfc(-x / math.sqrt(2.0)) for x in _GRID])
_LOG_CDF = np.log(np.maximum(_CDF, 1e-300))


@lru_cache(maxsize=4096)
def expected_max_normal(n: int) -> float:
    """``e(n)``: the expected maximum of ``n`` independent standard normal variables.

    ``∫ x·n·φ(x)·Φ(x)^(n−1) dx`` by the trapezoidal rule on [−12, 12] (step 0.001; error < 1e-6 for
    n ≤ 1e6).

    Raises:
        ValueError: ``n < 1``.

    >>> expected_max_normal(1), round(expected_max_normal(2), 4), round(1 / math.sqrt(math.pi), 4)
    (0.0, 0.5642, 0.5642)
    >>> round(expected_max_normal(64), 3)
    2.344
    """
    if int(n) != n or n < 1:
        raise ValueError(f"n={n}: must be an integer >= 1")
    if n == 1:
        return 0.0
    density = n * _PDF * np.exp((n - 1) * _LOG_CDF)
    return float(np.trapezoid(_GRID * density, _GRID))


def expected_max(means: np.ndarray, counts: np.ndarray, sigma: float) -> float:
    """``E[max_r X_r]`` of independent ``X_r ~ Normal(μ_r, (σ·μ_r)²)``, ``counts[g]`` ranks of mean ``means[g]``.

    ``E[max] = x_lo + ∫_{x_lo}^{x_hi} (1 − Π_g Φ((x − μ_g)/(σ·μ_g))^{k_g}) dx`` with ``x_lo`` 10 standard
    deviations below some group's mean (the product is 0 there) and ``x_hi`` 10 above every group's
    (it is 1), on 1201 points. Equal means: ``μ·(1 + σ·e(N))``, :func:`expected_max_normal`; ``σ = 0``:
    the largest mean.

    Raises:
        ValueError: negative ``sigma``, or no group.

    >>> e = expected_max(np.array([2.0]), np.array([64]), 0.01)
    >>> round(e / 2.0 - 1, 5) == round(0.01 * expected_max_normal(64), 5)
    True
    >>> expected_max(np.array([1.0, 3.0]), np.array([4, 1]), 0.0)
    3.0
    """
    means, counts = np.asarray(means, dtype=float), np.asarray(counts, dtype=float)
    if sigma < 0 or len(means) == 0:
        raise ValueError(f"expected_max: sigma={sigma} must be >= 0, with at least one group")
    top = float(means.max())
    if sigma == 0 or top <= 0:
        return top
    if len(means) == 1:  # equal work: the closed form
        return top * (1.0 + sigma * expected_max_normal(int(counts[0])))
    sd = np.maximum(sigma * np.abs(means), 1e-12 * top)
    lo, hi = float(np.max(means - 10 * sd)), float(np.max(means + 10 * sd))
    x = np.linspace(lo, hi, 1201)
    log_g = np.zeros_like(x)
    for mu, s, k in zip(means, sd, counts, strict=True):
        log_g += k * np.interp((x - mu) / s, _GRID, _LOG_CDF, left=_LOG_CDF[0], right=0.0)
    return max(top, lo + float(np.trapezoid(1.0 - np.exp(log_g), x)))


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with every coefficient ``>= 0``: ``min ||x·b − y||²`` over ``b >= 0``.

    Exact for the few columns of the projection's fits: every subset of columns is solved
    unconstrained, the subsets whose solution is non-negative are kept, and the one with the least
    residual wins (the non-negative optimum is the unconstrained optimum on its support).

    Returns:
        (coefficients, residual sum of squares).

    Raises:
        ValueError: more than 10 columns (the enumeration would be too long), or empty input.

    >>> b, _ = nonnegative_lstsq(np.array([[1.0, 8.0], [1.0, 4.0]]), np.array([1.0, 0.3]))
    >>> [round(float(v), 4) for v in b]  # unconstrained: a = -0.4, b = 0.175
    [0.0, 0.115]
    """
    rows, cols = x.shape
    if cols > 10 or rows == 0 or cols == 0:
        raise ValueError(f"nonnegative_lstsq: {rows} x {cols} system (1..10 columns, >= 1 row)")
    best, best_rss = np.zeros(cols), float(np.sum(y**2))
    for k in range(1, cols + 1):
        for subset in combinations(range(cols), k):
            idx = list(subset)
            sol, *_ = np.linalg.lstsq(x[:, idx], y, rcond=None)
            if (sol < -1e-15).any():
                continue
            b = np.zeros(cols)
            b[idx] = np.maximum(sol, 0.0)
            rss = float(np.sum((x @ b - y) ** 2))
            if rss < best_rss - 1e-18 * max(1.0, best_rss):
                best, best_rss = b, rss
    return best, best_rss
