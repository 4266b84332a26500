"""The interface of a cluster backend: where and how the ranks of one sweep point run.

A backend is a :class:`Cluster` subclass named by its ``conf/cluster/<name>.yaml``
(``cluster.impl: module:Class``; the YAML also selects its Hydra launcher). The Hydra task
(:mod:`pnpscale.sweep.task`) knows only this interface.
"""

from __future__ import annotations

import dataclasses
import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pnpscale.core.config import CLUSTER_SHARED_KEYS, ConfigError, RunSpec

#: A value rule: (accepts the value?, what is allowed), as :data:`pnpscale.core.config.RULES`.
Rule = tuple[Callable[[Any], bool], str]


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
    #: The backend's own keys under ``cluster.``: a dataclass whose fields are the keys (with their
    #: defaults, which its YAML repeats), ``None`` for a backend with none.
    params: ClassVar[type | None] = None
    #: Value rules of those keys (``"gpus_per_node" -> (ok, allowed)``), checked before anything starts.
    rules: ClassVar[Mapping[str, Rule]] = {}
    #: Keys whose children are free-form (``additional_parameters``).
    open_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key of this backend's ``cluster`` node: the shared ``name``, ``impl`` and its :attr:`params`."""
        own = tuple(f.name for f in dataclasses.fields(cls.params)) if cls.params is not None else ()
        return (*CLUSTER_SHARED_KEYS, *own)

    @classmethod
    def check_value(cls, key: str, value: Any) -> None:
        """One ``cluster.<key>=value`` against :attr:`rules` (``key`` without the ``cluster.`` prefix).

        Raises:
            ConfigError: the value is outside the allowed set (``cluster.<key>=<value>: <allowed>``).
        """
        rule = cls.rules.get(key)
        if rule is not None and not rule[0](value):
            raise ConfigError(f"cluster.{key}", value, rule[1])

    @classmethod
    def check_keys(cls, cluster: Mapping[str, Any]) -> None:
        """The composed ``cluster`` node holds only this backend's keys, each value within its rule.

        Raises:
            ConfigError: an unknown key (naming the closest known ones and every key of the backend), or
                a value outside its rule.
        """
        known = cls.keys()
        for key, value in cluster.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=2)
                hint = f"did you mean {', '.join('cluster.' + c for c in close)}? " if close else ""
                raise ConfigError(
                    f"cluster.{key}", value, f"unknown key for cluster={cls.name}; {hint}its keys: {', '.join(known)}"
                )
            cls.check_value(str(key), value)

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
