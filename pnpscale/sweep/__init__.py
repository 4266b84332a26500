"""Stage 1a, one sweep point: config schema, command-line checks, the point, its run record, the Hydra task.

* :mod:`~pnpscale.sweep.config`: the dataclass schema behind ``conf/``, value rules, ``scale`` presets;
* :mod:`~pnpscale.sweep.cli`: one-line errors for bad command lines before Hydra composes;
* :mod:`~pnpscale.sweep.point`: a point resolved once (spec, label/path, resume rule);
* :mod:`~pnpscale.sweep.record`: the typed ``run.json`` (one writer, one reader);
* :mod:`~pnpscale.sweep.task`: the Hydra task (``python -m pnpscale``): validate, launch, record.
"""
