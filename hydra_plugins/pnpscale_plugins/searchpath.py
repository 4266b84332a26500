"""Adds the repository root to pnpscale's config search path, so ``sweeps/NAME.yaml`` is group ``sweeps``."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

ROOT = Path(__file__).resolve().parents[2]


class PnpscaleSearchPathPlugin(SearchPathPlugin):
    """Only acts for pnpscale's own app (its ``conf/`` is on the search path)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        ours = (ROOT / "conf").as_posix()
        if any(ours in (p.path or "") for p in search_path.get_path()):
            search_path.append(provider="pnpscale-sweeps", path=f"file://{ROOT.as_posix()}")
