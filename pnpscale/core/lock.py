"""One process at a time per run folder and per sweep folder (``flock(2)``), and who holds it.

A point's run folder is locked by the Hydra task for as long as its ranks run; a sweep folder by
the sweeper for the whole sweep (before Hydra writes its ``multirun.yaml``). The lock is an
exclusive ``flock(2)`` of ``<folder>/.pnpscale.lock`` (the kernel drops it when the holder dies,
even by SIGKILL, so a stale lock is simply taken over). While held, the lock file holds its holder
as JSON (pid, host, start time, command), so a second process refuses with one line naming the
holder. It is removed on release, so nothing is left in the user's folders: a lock file found
free is one whose holder died holding it, and the process taking it over says so.

Removing it opens no race with a concurrent taker: the file is unlinked while still locked, and a
process that locked it after opening the path (before the unlink) finds that the path no longer
names the file it locked (``os.path.samestat``) and takes the path's new file instead, the usual
lock-file protocol. (``filelock``, which the lock used before, keeps its files by design, and only
its recent versions make that check.)

A stop signal can land as :meth:`FolderLock.release` is called, before its first statement (Python runs a
signal's handler at a function's entry): the release never starts, and the file would be left behind
holding a dead holder's name (seen: a sweep interrupted just as a point ended kept that point's lock
file). Every lock this process holds is therefore also released when the interpreter exits
(:func:`release_held`, registered with ``atexit``), whatever cut the release short.

Also here: :func:`process_gone`, which tells a ``running`` record whose process no longer exists
(killed before it could record its end) from one still running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pnpscale.core import layout
from pnpscale.core.errors import PnpscaleError
from pnpscale.core.record import now_iso
from pnpscale.core.signals import deferred


@dataclass(frozen=True)
class Holder:
    """The process holding a lock: ``pid`` on ``host`` since ``started_at`` (ISO 8601 UTC)."""

    pid: int | None
    host: str | None
    started_at: str | None
    command: str | None = None

    def text(self) -> str:
        """``pid 123 on host node1 since 2025-01-01T00:00:00+00:00``."""
        return f"pid {self.pid} on host {self.host} since {self.started_at}"

    @classmethod
    def me(cls) -> Holder:

        return cls(os.getpid(), socket.gethostname(), now_iso(), " ".join(["python", "-m", "pnpscale", *sys.argv[1:]]))


class Busy(PnpscaleError, RuntimeError):
    """The folder is locked by another live process; ``str()`` names the folder and the holder."""

    def __init__(self, folder: Path, holder: Holder | None) -> None:
        self.folder, self.holder = folder, holder
        who = holder.text() if holder is not None else "another process (not yet recorded)"
        super().__init__(f"{folder} is in use by {who}")


def _read_holder(path: Path) -> Holder | None:
    try:
        data = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return Holder(data.get("pid"), data.get("host"), data.get("started_at"), data.get("command"))


#: The locks this process holds (acquired, not yet released), for :func:`release_held`.
_HELD: set[FolderLock] = set()


def release_held() -> int:
    """Release every lock this process still holds (registered with ``atexit``): a stop signal that landed as
    :meth:`FolderLock.release` was called cut it short before its first statement. Locks inherited through
    ``fork`` are left to the process that took them.

    Returns:
        how many were released.
    """
    mine = [lock for lock in list(_HELD) if lock._pid == os.getpid()]
    for lock in mine:
        lock.release()
    return len(mine)


atexit.register(release_held)

#: How many times :meth:`FolderLock.acquire` takes the lock anew after locking a file just removed.
ACQUIRE_TRIES = 5


class FolderLock:
    """Exclusive lock of one folder (created if missing); use as a context manager or
    :meth:`acquire` / :meth:`release`.

    Attributes:
        folder: the locked folder.
        previous: after :meth:`acquire`, the holder recorded by a process that died holding the
            lock (taken over), else ``None``.
    """

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / layout.LOCK
        self.previous: Holder | None = None
        self._fd: int | None = None
        self._pid: int | None = None  # the process that took it

    def acquire(self) -> FolderLock:
        """Take the lock now or refuse; never waits.

        A stop signal arriving while the lock file is being created and taken is held back until the lock is
        this object's (:func:`pnpscale.core.signals.deferred`), then raised with the lock released: either this returns
        holding the lock or it raises holding nothing, so a Ctrl-C at that moment never leaves the file behind.

        Raises:
            Busy: another live process holds it.
            OSError: the folder cannot be created or written.
        """
        import fcntl

        try:
            with deferred():  # a stop signal meanwhile waits until the lock is held and known to release()
                self.folder.mkdir(parents=True, exist_ok=True)
                before = _read_holder(self.path)
                for _ in range(ACQUIRE_TRIES):
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        raise Busy(self.folder, _read_holder(self.path)) from None
                    except BaseException:
                        os.close(fd)
                        raise
                    try:
                        if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                            break
                    except FileNotFoundError:
                        pass
                    os.close(fd)  # its holder removed it on release, after we opened it: take the path's new file
                else:  # pragma: no cover - the lock file replaced ACQUIRE_TRIES times in a row
                    raise Busy(self.folder, _read_holder(self.path))
                self._fd, self._pid = fd, os.getpid()
                _HELD.add(self)
                me = Holder.me()
                if before is not None and before.pid != me.pid:
                    self.previous = before
                data = json.dumps(asdict(me)).encode()
                try:  # through the locked file itself
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, data, 0)
                except OSError:  # a full disk: the lock holds, only the holder's name is missing
                    pass
        except BaseException:  # the held signal raised as the block ended, or a failure: never return unlocked-but-held
            self.release()
            raise
        return self

    def forget_holder(self) -> bool:
        """Empty the lock file (the lock holds; only the holder's name goes), giving its block back to a disk
        too full for a status record. Returns whether it held a name."""
        if self._fd is None:
            return False
        try:
            had = os.fstat(self._fd).st_size > 0
            os.ftruncate(self._fd, 0)
        except OSError:
            return False
        return had

    def release(self) -> None:
        """Drop the lock and remove its file (unlinked while still locked; see the module doc). A stop signal
        arriving meanwhile is held back until both are done (:func:`pnpscale.core.signals.deferred`): a
        Ctrl-C just as a point ends never leaves the file behind."""
        if self._fd is None:
            return
        with deferred():
            try:
                if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                    self.path.unlink()
            except OSError:  # gone already, or a folder no longer writable: at least no holder is named
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing the only open of the file drops its flock
                self._fd = None
                _HELD.discard(self)

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def in_use(folder: Path | str) -> Busy | None:
    """Whether another live process holds ``folder``'s lock, without taking it or creating anything.

    The pre-checks ask this before Hydra writes a ``.hydra/`` record into the folder: the lock
    file is opened read-only and ``flock(2)``-tested (a free lock is unlocked at once, its file
    and holder left as they were).

    Returns:
        the :class:`Busy` error naming the folder and its holder, or ``None`` when the folder has
        no lock file or its lock is free (also when the file cannot be read: the task's own
        :meth:`FolderLock.acquire` then decides).
    """
    import fcntl

    path = Path(folder) / layout.LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return Busy(Path(folder), _read_holder(path))
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def process_gone(pid: Any, host: Any, started_at: Any = None) -> bool:
    """Whether the process ``pid`` on ``host`` that started a record at ``started_at`` is gone.

    Only decidable on the same host: the pid does not exist, or exists but started after the
    record did (the pid was reused). ``False`` when undecidable (another host, no pid).
    """
    if not isinstance(pid, int) or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    born = _process_start(pid)
    if born is None or not started_at:
        return False
    import datetime as dt

    try:
        recorded = dt.datetime.fromisoformat(str(started_at)).timestamp()
    except ValueError:
        return False
    return born > recorded + 1.0  # ISO seconds are truncated


def _process_start(pid: int) -> float | None:
    """Start time of ``pid`` (seconds since the epoch) from ``/proc``, else ``None``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")
