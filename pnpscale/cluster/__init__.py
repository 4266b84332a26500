"""Stage 1b, where the ranks run: cluster backends behind one interface, discovered from the config.

* :mod:`~pnpscale.cluster.base`: the :class:`~pnpscale.cluster.base.Cluster` interface (an ABC);
* :mod:`~pnpscale.cluster.local`: ranks on this machine (torch.distributed elastic);
* :mod:`~pnpscale.cluster.exits`: how each local rank ended, as the launcher saw it (order, signal);
* :mod:`~pnpscale.cluster.peer_errors`: which rank's failure is the echo of another's (its failure record
  first; gloo's and NCCL's exact words in one function after);
* :mod:`~pnpscale.cluster.slurm`: one SLURM task per rank (submitit), pure sbatch builders;
* :mod:`~pnpscale.cluster.resources`: will a local point fit in this machine's memory?

The registry is the config group ``cluster``: each ``conf/cluster/<name>.yaml`` names its
backend class (``cluster.impl: module:Class``). Adding a backend is a module with a
:class:`~pnpscale.cluster.base.Cluster` subclass and its YAML (which selects its Hydra launcher); a
backend kept outside pnpscale works the same way through ``hydra.searchpath``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pnpscale.cluster.base import Cluster
from pnpscale.core.config import CONF_DIR, ConfigError
from pnpscale.core.plugins import resolve_impl


def cluster_backend(cluster: Mapping[str, Any]) -> Cluster:
    """An instance of the backend named by the ``cluster`` config node (its ``impl``, ``module:Class``).

    Raises:
        pnpscale.core.config.ConfigError: ``cluster.impl`` is not importable or not a
            :class:`~pnpscale.cluster.base.Cluster` subclass.
    """
    return resolve_impl("cluster.impl", str(cluster["impl"]), Cluster)()


def cluster_backends(search_dirs: Sequence[Path] = ()) -> dict[str, type[Cluster]]:
    """Every backend of the config group ``cluster``: option name -> class, read from each option's YAML
    (``conf/cluster/<name>.yaml`` and ``<dir>/cluster/<name>.yaml`` of every extra folder on
    ``hydra.searchpath``; ``cluster.impl``), for checks made before Hydra composes (the command line's keys).

    Raises:
        ConfigError: a YAML whose ``cluster.impl`` is missing or does not name a Cluster subclass.
    """
    from omegaconf import OmegaConf

    out: dict[str, type[Cluster]] = {}
    for folder in (CONF_DIR, *map(Path, search_dirs)):
        for path in sorted((folder / "cluster").glob("*.yaml")):
            node = OmegaConf.load(path)
            impl = OmegaConf.select(node, "cluster.impl") if OmegaConf.is_dict(node) else None
            if not isinstance(impl, str):
                raise ConfigError("cluster.impl", impl, f"{path}: every cluster option names its backend class")
            out.setdefault(path.stem, resolve_impl("cluster.impl", impl, Cluster))
    return out
