"""Reconstruction problems: a registry of :class:`~pnpscale.rank.problems.base.Problem` classes.

Each problem is a class (:mod:`~pnpscale.rank.problems.superres` = 2d, :mod:`~pnpscale.rank.problems.blur3d`
= 3d, :mod:`~pnpscale.rank.problems.ct`, or any importable module) named by ``impl: module:Class`` in its
``conf/problem/<name>.yaml``; the base class is in :mod:`pnpscale.rank.problems.base`.
"""

from pnpscale.rank.problems.base import (
    Problem,
    ProblemData,
    ProblemError,
    make_problem,
    measurements,
    problem_class,
    synthetic_signal,
)

__all__ = [
    "Problem",
    "ProblemData",
    "ProblemError",
    "make_problem",
    "measurements",
    "problem_class",
    "synthetic_signal",
]
