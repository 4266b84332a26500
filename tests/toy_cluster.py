"""A cluster backend defined outside pnpscale, through the registry only (tests/data/conf/cluster/toy.yaml + this).

It runs the ranks as the local backend does and owns one key of its own, ``cluster.note``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pnpscale.cluster.local import LocalCluster


@dataclass
class ToyParams:
    """The toy backend's own keys: ``note``, a non-empty string."""

    note: str = "toy"


class ToyCluster(LocalCluster):
    name = "toy"
    params = ToyParams
    rules = {"note": (lambda v: isinstance(v, str) and bool(v), "must be a non-empty string")}

    def enter(self, cfg: Any) -> None:
        return None
