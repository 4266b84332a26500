"""Stage 1b, where the ranks run: cluster backends behind one interface, discovered from the config.

* :mod:`~pnpscale.cluster.base`: the :class:`~pnpscale.cluster.base.Cluster` interface (an ABC);
* :mod:`~pnpscale.cluster.local`: ranks on this machine (torch.distributed elastic);
* :mod:`~pnpscale.cluster.slurm`: one SLURM task per rank (submitit), pure sbatch builders;
* :mod:`~pnpscale.cluster.resources`: will a local point fit in this machine's memory?

The registry is the config group ``cluster``: each ``pnpscale/conf/cluster/<name>.yaml`` names its
backend class (``cluster.impl: module:Class``). Adding a backend is a module with a
:class:`~pnpscale.cluster.base.Cluster` subclass and its YAML (which selects its Hydra launcher); a
backend kept outside pnpscale works the same way through ``hydra.searchpath``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pnpscale.cluster.base import Cluster
from pnpscale.core.plugins import resolve_impl


def cluster_backend(cluster: Mapping[str, Any]) -> Cluster:
    """An instance of the backend named by the ``cluster`` config node (its ``impl``, ``module:Class``).

    Raises:
        pnpscale.core.config.ConfigError: ``cluster.impl`` is not importable or not a
            :class:`~pnpscale.cluster.base.Cluster` subclass.
    """
    return resolve_impl("cluster.impl", str(cluster["impl"]), Cluster)()
