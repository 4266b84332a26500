"""pnpscale's config search path: ``conf/`` (the app's own) and ``sweeps/`` (group ``sweeps``), nothing else.

``sweeps/NAME.yaml`` must be the option ``NAME`` of group ``sweeps``, so the folder holding
``sweeps/`` (the repository root) goes on the search path, but through
:class:`SweepsOnlyConfigSource` (scheme ``pnpscale-sweeps://``), which shows only its ``sweeps/``
folder: Hydra's ``--help`` lists the groups of every folder on the search path, and a whole
repository root (with a ``.venv`` in it) takes minutes to walk.
"""

from pathlib import Path
from typing import List, Optional  # noqa: UP035 - Hydra's plugin signatures

from hydra._internal.core_plugins.file_config_source import FileConfigSource
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult
from hydra.plugins.search_path_plugin import SearchPathPlugin

ROOT = Path(__file__).resolve().parents[2]
SWEEPS_GROUP = "sweeps"
SCHEME = "pnpscale-sweeps"


class SweepsOnlyConfigSource(FileConfigSource):
    """A folder on the search path of which only the ``sweeps/`` sub-folder (one group) is visible."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    @staticmethod
    def _top(config_path: str) -> str:
        return config_path.strip("/").split("/", 1)[0]

    def _visible(self, config_path: str) -> bool:
        return self._top(config_path) == SWEEPS_GROUP

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") == "" or (self._visible(config_path) and super().is_group(config_path))

    def is_config(self, config_path: str) -> bool:
        return self._visible(config_path) and super().is_config(config_path)

    def load_config(self, config_path: str) -> ConfigResult:
        if not self._visible(config_path):
            raise ConfigLoadError(f"Config not found : {config_path} (only {SWEEPS_GROUP}/ is searched)")
        return super().load_config(config_path)

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:  # noqa: UP006, UP045
        if config_path.strip("/") == "":
            files: List[str] = []  # noqa: UP006
            if super().is_group(SWEEPS_GROUP):
                self._list_add_result(
                    files=files, file_path=SWEEPS_GROUP, file_name=SWEEPS_GROUP, results_filter=results_filter
                )
            return files
        return super().list(config_path, results_filter) if self._visible(config_path) else []


class PnpscaleSearchPathPlugin(SearchPathPlugin):
    """Only acts for pnpscale's own app (its ``conf/`` is on the search path)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        ours = (ROOT / "conf").as_posix()
        if any(ours in (p.path or "") for p in search_path.get_path()):
            search_path.append(provider="pnpscale-sweeps", path=f"{SCHEME}://{ROOT.as_posix()}")
