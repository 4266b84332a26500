"""The ground floor: what every stage shares, importing nothing of pnpscale above it.

* :mod:`~pnpscale.core.config`: the dataclass schema behind ``conf/``, value rules, ``scale``
  presets, the frozen :class:`~pnpscale.core.config.RunSpec` a rank receives;
* :mod:`~pnpscale.core.record`: the typed, versioned ``run.json`` (one writer, one reader);
* :mod:`~pnpscale.core.errors`: the one error family (:class:`~pnpscale.core.errors.PnpscaleError`);
* :mod:`~pnpscale.core.plugins`: ``impl: module:Class`` of a problem, mode or cluster backend, resolved;
* :mod:`~pnpscale.core.signals`: stop signals (SIGINT, SIGTERM, SIGHUP) as exceptions, exit codes;
* :mod:`~pnpscale.core.lock`: one process per run folder and per sweep folder;
* :mod:`~pnpscale.core.layout`: every file name under ``outputs/`` (tables, charts, reports), atomic writes.

The schema module at the package root, :mod:`pnpscale.columns` (every column name), belongs to the same floor.
``tests/test_architecture.py`` checks that every import, at module level or inside a function, runs
down the floors.
"""

__version__ = "0.1.0"
