"""Stage 1a (floor 5), one sweep point: command-line checks, the point, the Hydra task.

* :mod:`~pnpscale.sweep.cli`: one-line errors for bad command lines before Hydra composes;
* :mod:`~pnpscale.sweep.point`: a point resolved once (spec, label/path, resume rule);
* :mod:`~pnpscale.sweep.task`: the Hydra task (``python -m pnpscale``): validate, launch, record.

The config schema, the run record, signals and locks are the ground floor (:mod:`pnpscale.core`).
"""
