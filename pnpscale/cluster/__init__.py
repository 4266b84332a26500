"""Stage 1b, where the ranks run: cluster backends behind one interface, chosen from a registry.

* :mod:`~pnpscale.cluster.base`: the :class:`~pnpscale.cluster.base.Cluster` interface and registry;
* :mod:`~pnpscale.cluster.local`: ranks on this machine (torch.distributed elastic);
* :mod:`~pnpscale.cluster.slurm`: one SLURM task per rank (submitit), pure sbatch builders.
"""
