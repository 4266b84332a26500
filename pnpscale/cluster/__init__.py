"""Stage 1b, where the ranks run: cluster backends behind one interface, chosen from a registry.

* :mod:`~pnpscale.cluster.base`: the :class:`~pnpscale.cluster.base.Cluster` interface;
* :mod:`~pnpscale.cluster.local`: ranks on this machine (torch.distributed elastic);
* :mod:`~pnpscale.cluster.slurm`: one SLURM task per rank (submitit), pure sbatch builders.

Adding a backend: a module with a :class:`~pnpscale.cluster.base.Cluster` subclass, its
``conf/cluster/<name>.yaml``, and one line in :data:`CLUSTERS`.
"""

from __future__ import annotations

from typing import Any

#: The registry: ``cluster`` option -> ``module:Class`` (imported only when used).
CLUSTERS: dict[str, str] = {
    "local": "pnpscale.cluster.local:LocalCluster",
    "slurm": "pnpscale.cluster.slurm:SlurmCluster",
}


def cluster_backend(name: str) -> Any:
    """An instance of the backend registered as ``name``.

    Raises:
        pnpscale.sweep.config.ConfigError: ``name`` is not in :data:`CLUSTERS`.
    """
    import importlib

    from pnpscale.sweep.config import ConfigError

    if name not in CLUSTERS:
        raise ConfigError("cluster", name, "allowed values: " + ", ".join(CLUSTERS))
    module, _, cls = CLUSTERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()
