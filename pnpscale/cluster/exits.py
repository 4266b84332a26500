"""How each local rank's process ended, as the launcher saw it: the order of the exits and their status.

torch elastic reports one failed rank, the first it sees exit at its 0.1 s poll: when a rank is killed
(SIGKILL, the OOM killer) its peers fail moments later with "Connection reset by peer", often within the
same poll, and the agent stops the others with SIGTERM, so the rank it names, and the error files the
ranks left, may not say which rank died first. :class:`ExitWatch` watches every rank of a launch through a
pidfd (``pidfd_open(2)``, Linux >= 5.3), opened as soon as the rank's heartbeat names its pid: the kernel
wakes it when a rank ends, so the exits are ordered as they happened (ranks ending between two wake-ups
share a place), and once the ranks are gone each pidfd gives the rank's wait status (``PIDFD_GET_INFO``
with ``PIDFD_INFO_EXIT``, Linux >= 6.15; ``None`` on older kernels): killed by signal 9, exited with code
1. :func:`pnpscale.cluster.local.root_failure` reads them.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pnpscale.rank.process import parent_of

#: ``PIDFD_GET_INFO`` = ``_IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, struct pidfd_info)``, its first version 64 bytes
#: (Linux ``include/uapi/linux/pidfd.h``).
PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
#: ``pidfd_info.mask`` bit: ``exit_code`` holds the wait status of the ended process.
PIDFD_INFO_EXIT = 1 << 3
#: Offset of ``__s32 exit_code`` in ``struct pidfd_info`` (``__u64 mask, cgroupid``, 11 ``__u32`` ids).
EXIT_CODE_OFFSET = 60
#: How long :class:`ExitWatch` waits for an exit before it looks for new ranks' heartbeats, seconds.
WATCH_POLL_S = 0.1


@dataclass(frozen=True)
class RankExit:
    """How one rank ended.

    Attributes:
        order: its place among the ranks' exits (0: first); ranks that ended between two wake-ups of the
            watcher share one.
        status: the wait status (``os.waitstatus_to_exitcode`` reads it), ``None`` when the kernel cannot say.
    """

    order: int
    status: int | None = None

    @property
    def clean(self) -> bool:
        """Exited with code 0 (finished its work)."""
        return self.status is not None and os.WIFEXITED(self.status) and os.WEXITSTATUS(self.status) == 0

    def text(self) -> str | None:
        """``Signal 9 (SIGKILL)`` (torch elastic's words), ``exit code 1``, or ``None`` when unknown.

        >>> RankExit(0, 9).text(), RankExit(1, 256).text(), RankExit(2).text()
        ('Signal 9 (SIGKILL)', 'exit code 1', None)
        """
        if self.status is None:
            return None
        if os.WIFSIGNALED(self.status):
            number = os.WTERMSIG(self.status)
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = "unknown signal"
            return f"Signal {number} ({name})"
        return f"exit code {os.waitstatus_to_exitcode(self.status)}"


def pidfd_exit_status(fd: int) -> int | None:
    """The wait status of the ended process of pidfd ``fd`` (``PIDFD_GET_INFO``), ``None`` when the kernel
    does not give it (before Linux 6.15, or the process has not ended)."""
    import fcntl

    buf = bytearray(64)
    struct.pack_into("Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(fd, PIDFD_GET_INFO, buf, True)
    except OSError:
        return None
    if not struct.unpack_from("Q", buf, 0)[0] & PIDFD_INFO_EXIT:
        return None
    return int(struct.unpack_from("i", buf, EXIT_CODE_OFFSET)[0])


def rank_pids(log_dir: Path) -> dict[int, int]:
    """rank -> pid of this launcher's ranks, from their heartbeats in ``log_dir``
    (:class:`pnpscale.rank.loop.Heartbeat`): a rank forked by the launcher's forkserver, or by the
    launcher itself; stale heartbeats of other processes are skipped."""

    me, out = os.getpid(), {}
    for f in log_dir.glob("rank*.progress"):
        try:
            beat = json.loads(f.read_text())
            rank, pid = int(beat["rank"]), int(beat["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        parent = parent_of(pid)
        if parent == me or (parent is not None and parent_of(parent) == me):
            out[rank] = pid
    return out


class ExitWatch:
    """Watch the ranks of one launch end (a background thread; see the module doc).

    Use as a context manager around the launch; :meth:`exits` then says how each rank whose pid was
    seen ended. Nothing is watched where ``pidfd_open`` is missing (the exits are then empty).
    """

    def __init__(self, log_dir: Path, ranks: int) -> None:
        self.log_dir, self.ranks = Path(log_dir), ranks
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # rank -> its pidfd (kept open until the end: its status)
        self._order: dict[int, int] = {}  # rank -> its place among the exits
        self._thread = threading.Thread(target=self._watch, name="pnpscale-rank-exits", daemon=True)

    def __enter__(self) -> ExitWatch:
        if hasattr(os, "pidfd_open"):
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        import select

        poller, place = select.poll(), 0
        by_fd: dict[int, int] = {}
        while True:
            if len(self._fds) < self.ranks:
                for rank, pid in rank_pids(self.log_dir).items():
                    if rank in self._fds:
                        continue
                    try:
                        fd = os.pidfd_open(pid)
                    except OSError:  # already gone and reaped: its exit is not known
                        continue
                    with self._lock:
                        self._fds[rank] = fd
                    by_fd[fd] = rank
                    poller.register(fd, select.POLLIN)
            stop = self._done.is_set()
            ready = poller.poll(0 if stop else int(WATCH_POLL_S * 1000)) if by_fd else []
            if ready:
                with self._lock:
                    for fd, _ in ready:
                        self._order[by_fd.pop(fd)] = place
                        poller.unregister(fd)
                place += 1
            elif not by_fd and not stop:
                self._done.wait(WATCH_POLL_S)
            if stop:
                return

    def exits(self) -> dict[int, RankExit]:
        """rank -> how it ended, for every watched rank that ended (its status read now, once the launch is over)."""
        with self._lock:
            out = {r: RankExit(o, pidfd_exit_status(self._fds[r])) for r, o in self._order.items()}
        return out

    def close(self) -> None:
        """Close the pidfds (after :meth:`exits`)."""
        with self._lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
