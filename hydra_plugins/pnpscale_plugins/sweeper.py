"""pnpscale's sweeper: Hydra's basic sweeper, one sweep at a time per sweep folder.

Registered as ``hydra/sweeper: pnpscale_basic`` (the default in ``conf/config.yaml``). Before Hydra
writes ``<sweep dir>/multirun.yaml``, the sweep folder is checked (one line, exit 2, for a folder
that cannot be created or written) and locked (:class:`pnpscale.core.lock.FolderLock`): a second
sweep into a folder in use is refused with one line naming the holder (exit 2) and leaves the
folder, ``multirun.yaml`` included, as it was; so does a sweep refused by the launcher's
validation. A file that cannot be written later (a full disk) ends the sweep with one line (exit 1).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional  # noqa: UP035 - OmegaConf reads these annotations

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore

from hydra_plugins.pnpscale_plugins.launcher import SweepFailed, refuse
from pnpscale.core import layout
from pnpscale.core.errors import Abort, PnpscaleError
from pnpscale.core.lock import Busy, FolderLock
from pnpscale.sweep.point import writable_dir

MULTIRUN_YAML = "multirun.yaml"  # Hydra's name


@dataclass
class PnpscaleBasicSweeperConf:  # Hydra's BasicSweeperConf, our target
    _target_: str = "hydra_plugins.pnpscale_plugins.sweeper.PnpscaleBasicSweeper"
    max_batch_size: Optional[int] = None  # noqa: UP045
    params: Optional[Dict[str, str]] = None  # noqa: UP006, UP045


ConfigStore.instance().store(
    group="hydra/sweeper", name="pnpscale_basic", node=PnpscaleBasicSweeperConf, provider="pnpscale"
)


class IOFailure(PnpscaleError):
    """A sweep file that could not be written (a full disk, ...): one ``pnpscale: error:`` line, exit 1
    (raised wrapped in :class:`pnpscale.core.errors.Abort`, printed by ``python -m pnpscale``)."""


class PnpscaleBasicSweeper(BasicSweeper):
    """Hydra's basic sweeper with the sweep folder checked and locked first (see the module doc)."""

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Nothing here: both launchers compose and check every point before any starts
        (:func:`hydra_plugins.pnpscale_plugins.launcher.validate_points`), with one line per bad point
        (Hydra's own check composes them too, and prints a composition error over several lines)."""

    def sweep(self, arguments: list[str]) -> Any:

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        if not writable_dir(sweep_dir):
            raise refuse(f"hydra.sweep.dir={sweep_dir}: must be a folder this user can create and write")
        created = not sweep_dir.exists()
        lock = FolderLock(sweep_dir)
        try:
            lock.acquire()
        except Busy as exc:
            raise refuse(f"sweep refused, nothing was started: {exc}; wait for it, or use another "
                                   "hydra.sweep.dir") from None  # fmt: skip
        except OSError as exc:
            raise refuse(f"hydra.sweep.dir={sweep_dir}: {exc}") from None
        multirun = sweep_dir / MULTIRUN_YAML
        before = multirun.read_bytes() if multirun.is_file() else None
        refused = False
        try:
            return super().sweep(arguments)
        except Abort as stop:  # refused by the launcher: leave the folder as it was
            if isinstance(stop.error, SweepFailed):  # the points ran: a failed sweep's end, nothing to undo
                raise
            refused = True
            if before is not None:
                layout.atomic_write_bytes(multirun, before)
            else:
                multirun.unlink(missing_ok=True)
            raise
        except OSError as exc:
            raise Abort(IOFailure(f"sweep stopped: {exc}")) from None
        finally:
            lock.release()  # its lock file goes with it
            if refused and created and sweep_dir.is_dir() and not any(sweep_dir.iterdir()):
                sweep_dir.rmdir()
