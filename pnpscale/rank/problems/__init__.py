"""Reconstruction problems: a registry of :class:`~pnpscale.rank.problems.base.Problem` classes.

Each problem is a class (``pnpscale.rank.problems.superres``, ``.blur3d``, or any importable
module) named by ``impl: module:Class`` in its ``conf/problem/<name>.yaml``; see
:mod:`pnpscale.rank.problems.base`.
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
