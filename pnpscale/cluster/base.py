"""The interface of a cluster backend: where and how the ranks of one sweep point run.

A backend is a :class:`Cluster` subclass, listed in :data:`pnpscale.cluster.CLUSTERS` (name ->
``module:Class``), with its ``conf/cluster/<name>.yaml`` (which selects its Hydra launcher). The
Hydra task (:mod:`pnpscale.sweep.task`) knows only this interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar


class Cluster:
    """Runs the ranks of one resolved point.

    Attributes:
        name: the ``cluster`` config group option.
        resumes_in_task: whether the Hydra task itself skips a point that is already complete
            (local), or its launcher did so before submitting anything (SLURM: a rank must never
            skip alone).
    """

    name: ClassVar[str] = ""
    resumes_in_task: ClassVar[bool] = True

    def check(self, cfg: Any, spec: Any, cuda_devices: int) -> None:
        """Refuse, before anything starts, a point this backend cannot run.

        Raises:
            pnpscale.sweep.config.ConfigError: one line naming the key and what is allowed.
        """

    def enter(self, cfg: Any) -> None:
        """Called by the Hydra task before it records the point; refuse a wrong context.

        Raises:
            pnpscale.sweep.config.ConfigError: e.g. a SLURM point run outside a SLURM job.
        """

    def cpu_contention(self, spec: Any) -> tuple[int, int] | None:
        """``(ranks x threads, cpus)`` when this backend's ranks share this machine's CPUs, else ``None``."""
        return None

    def run(self, spec: Any, run_dir: Path, config: dict[str, Any] | None) -> None:
        """Run every rank of ``spec`` and write ``run_dir`` (rank 0); raise what a rank hit."""
        raise NotImplementedError(f"{type(self).__name__}.run")
