"""Projection of a sweep's scaling curve to GPU counts that were not run.

* :mod:`~pnpscale.results.projection.model`: the model (stated in its docstring) and its assembly over a
  table (:func:`project`), made of :mod:`~pnpscale.results.projection.base` (options, the model's types,
  work per rank, the measured points), :mod:`~pnpscale.results.projection.fit` (compute, jitter, wait),
  :mod:`~pnpscale.results.projection.routes` (algorithm per node count, routes, rates),
  :mod:`~pnpscale.results.projection.evaluate` (the numbers at any N, no impossible number, findings),
  :mod:`~pnpscale.results.projection.checks` (residuals, leave-one-out) and
  :mod:`~pnpscale.results.projection.overlap` (the pipelined series from the blocking one and its hidden share);
* :mod:`~pnpscale.results.projection.output`: the projection's files and chart (imported on its own: it
  draws, the model does not);
* :mod:`~pnpscale.results.projection.command`: its command (``python -m pnpscale.project``).
"""

from pnpscale.results.projection.model import (
    Model,
    Options,
    Projection,
    ProjectionError,
    evaluate,
    findings,
    fit,
    leave_one_out,
    measured_rows,
    parse_algorithms,
    parse_rates,
    project,
    residuals,
)

__all__ = [
    "Model", "Options", "Projection", "ProjectionError", "evaluate", "findings", "fit", "leave_one_out",
    "measured_rows", "parse_algorithms", "parse_rates", "project", "residuals",
]  # fmt: skip
