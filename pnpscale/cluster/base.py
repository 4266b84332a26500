"""The interface of a cluster backend: where and how the ranks of one sweep point run.

A backend is a :class:`Cluster` subclass named by its ``pnpscale/conf/cluster/<name>.yaml``
(``cluster.impl: module:Class``; the YAML also selects its Hydra launcher). The Hydra task
(:mod:`pnpscale.sweep.task`) knows only this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pnpscale.core.config import RunSpec


class Cluster(ABC):
    """Runs the ranks of one resolved point.

    Attributes:
        name: the ``cluster`` config group option.
        resumes_in_task: whether the Hydra task itself skips a point that is already complete
            (local), or its launcher did so before submitting anything (SLURM: a rank must never
            skip alone).
    """

    name: ClassVar[str] = ""
    resumes_in_task: ClassVar[bool] = True

    @abstractmethod
    def check(self, cfg: Mapping[str, Any], spec: RunSpec, cuda_devices: int) -> None:
        """Refuse, before anything starts, a point this backend cannot run (its own keys included).

        Raises:
            pnpscale.core.config.ConfigError: one line naming the key and what is allowed.
        """

    def enter(self, cfg: Mapping[str, Any]) -> None:
        """Called by the Hydra task before it records the point; refuse a wrong context.

        Raises:
            pnpscale.core.config.ConfigError: e.g. a SLURM point run outside a SLURM job.
        """
        return None

    def cpu_contention(self, spec: RunSpec) -> tuple[int, int] | None:
        """``(ranks x threads, cpus)`` when this backend's ranks share this machine's CPUs, else ``None``."""
        return None

    @abstractmethod
    def run(self, spec: RunSpec, run_dir: Path, config: dict[str, Any] | None) -> None:
        """Run every rank of ``spec`` and write ``run_dir`` (rank 0); raise what a rank hit."""
