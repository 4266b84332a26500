"""Imported FIRST by the forkserver that forks the local ranks (:data:`pnpscale.cluster.local.RANK_PRELOAD`),
before the heavy preloads (torch takes 10-20 s to import on a loaded machine); light on purpose: it
imports nothing but the standard library.

In the server only (anywhere else importing it changes nothing), at import:

* **the launcher is watched** (:func:`watch_launcher`): a daemon thread waits for the launcher's end
  (pidfd, else a poll every :data:`POLL_S`) and ends the server at once. ``multiprocessing.forkserver``
  itself notices the launcher's end only in its fork loop, after every preload is imported: a launcher
  killed (SIGKILL, SIGTERM, SIGHUP) while torch loads left the server, and the resource tracker that
  waits for it, alive for the rest of the import. The thread is stopped and joined by the last
  preload, :mod:`pnpscale.rank.preloaded`, so the server never forks with a second thread;
* **SIGINT is ignored while the preloads import** (the server's fork loop ignores it too): a Ctrl-C to
  the process group used to interrupt the import with a 30-line ``KeyboardInterrupt`` traceback from
  ``multiprocessing/forkserver.py``. The launcher handles the Ctrl-C; :mod:`pnpscale.rank.preloaded`
  puts Python's handler back so the ranks get it as before;
* **the server dies with the launcher** (:func:`die_with_launcher`): the kernel SIGKILLs it when the
  launcher ends (``PR_SET_PDEATHSIG``, set through ``ctypes``' ``prctl``), SIGKILL of the launcher
  included, and once the preloads are in, its own exit (the fork loop's ``SystemExit`` when the
  launcher's "alive" pipe closes) is an immediate ``os._exit`` (:func:`preloaded`): finalising torch
  and pandas in a ~790 MB server took 3-10 s on a loaded machine, long after the launcher ended;
* :func:`quiet_when_orphaned` becomes ``sys.excepthook``: a rank forked from the server first unpickles
  its process object from the launcher; when the launcher was stopped while handing it over, the
  unpickling fails, and the server would print the rank's traceback on the terminal after the
  launcher's last line. Silent when the launcher is gone; a rank that fails to start under a live
  launcher still prints its traceback.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from typing import Any

#: The launcher exports its pid under this name while the server starts (the value of
#: :data:`pnpscale.rank.process.PARENT_PID_ENV`, not imported from there: that module imports torch).
PARENT_PID_ENV = "PNPSCALE_PARENT_PID"
#: The launching process: the local launcher exports its pid (:data:`PARENT_PID_ENV`); the server's parent
#: otherwise (it may be gone by the time this is imported).
LAUNCHER_PID = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
#: How long a failing rank waits for its launcher to finish exiting before it prints its traceback.
ORPHAN_GRACE_S = 2.0
#: Seconds between two looks at the launcher where no pidfd can be opened.
POLL_S = 0.1


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def launcher_gone(server_pid: int, launcher_pid: int = LAUNCHER_PID) -> bool:
    """Whether the forkserver ``server_pid`` no longer has ``launcher_pid`` as its parent (reparented:
    the launcher exited)."""
    return _parent_of(server_pid) != launcher_pid


def quiet_when_orphaned(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """``sys.excepthook`` of a rank that failed before its own code ran: silent once the launcher is gone
    (nobody waits for it), else the usual traceback."""
    end = time.monotonic() + ORPHAN_GRACE_S
    while time.monotonic() < end:  # the launcher removes its semaphores just before it exits
        if launcher_gone(os.getppid()):
            return
        time.sleep(0.05)
    sys.__excepthook__(kind, value, tb)


#: ``prctl`` option that sets the signal a process gets when its parent ends (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1


def die_with_launcher(launcher_pid: int = LAUNCHER_PID) -> bool:
    """Ask the kernel to SIGKILL this process when its parent ends (``PR_SET_PDEATHSIG``); ends this
    process at once (``os._exit(0)``) when the parent is already not ``launcher_pid`` (it ended before
    the request: the kernel would never send the signal).

    The signal is tied to the parent *thread* that forked this process: the launcher starts its
    forkserver from its main thread (elastic's agent runs in the caller's thread), which ends with it.

    Returns:
        whether the kernel took the request (``False``: not Linux, or no ``prctl`` in the C library).
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        took = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if os.getppid() != launcher_pid:
        os._exit(0)
    return took


def _exit_at_once(server_pid: int) -> None:
    """``atexit`` of the server: skip Python's finalisation (seconds with torch loaded); a process forked
    from it (a rank: multiprocessing ends those with ``os._exit``) is left alone."""
    if os.getpid() == server_pid:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def in_forkserver() -> bool:
    """Whether this process is a ``multiprocessing`` forkserver (its command line runs ``forkserver.main``)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"multiprocessing.forkserver import main" in f.read()
    except OSError:
        return False


class LauncherWatch:
    """A daemon thread that ends this process (``os._exit(0)``) once the launcher ``pid`` is gone:
    woken by a pidfd (Linux >= 5.3), else polling the parent every :data:`POLL_S`; :meth:`stop` ends
    the thread (it returns once the thread has)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stop_r, self._stop_w = os.pipe()
        self.thread = threading.Thread(target=self._run, name=f"pnpscale-launcher-{pid}", daemon=True)
        self.thread.start()

    def _gone(self) -> bool:
        return os.getppid() != self.pid  # reparented: the launcher, this process's parent, exited

    def _run(self) -> None:
        import select

        try:
            fd: int | None = os.pidfd_open(self.pid)
        except (OSError, AttributeError):  # gone already, or no pidfd (old kernel, gVisor)
            fd = None
        try:
            while not self._gone():
                ready, _, _ = select.select([self._stop_r] + ([fd] if fd is not None else []), [], [], POLL_S)
                if self._stop_r in ready:
                    return
                if fd is not None and fd in ready:
                    break
        finally:
            if fd is not None:
                os.close(fd)
        os._exit(0)

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        self.thread.join()
        os.close(self._stop_r)
        os.close(self._stop_w)


#: The server's watch while its preloads import (stopped by :mod:`pnpscale.rank.preloaded`), else ``None``.
WATCH: LauncherWatch | None = None
#: The server's SIGINT handler before :func:`install` ignored it (put back by :func:`preloaded`).
_SIGINT_BEFORE: Any = None


def install() -> None:
    """In the forkserver only: watch the launcher, ignore SIGINT, and set :func:`quiet_when_orphaned` as
    ``sys.excepthook`` (see the module doc); anywhere else importing this module changes nothing."""
    global WATCH, _SIGINT_BEFORE
    if not in_forkserver():
        return
    if WATCH is None:
        _SIGINT_BEFORE = signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_launcher()
    sys.excepthook = quiet_when_orphaned
    if WATCH is None:
        WATCH = LauncherWatch(LAUNCHER_PID)


def preloaded() -> None:
    """The preloads are imported: the server's own fork loop watches the launcher from here (its "alive"
    pipe), so the watch thread ends; SIGINT gets Python's handler back, which the ranks inherit; the
    server's own exit skips Python's finalisation (:func:`_exit_at_once`)."""
    global WATCH
    if WATCH is not None:
        WATCH.stop()
        WATCH = None
        atexit.register(_exit_at_once, os.getpid())
        signal.signal(signal.SIGINT, signal.default_int_handler if _SIGINT_BEFORE is None else _SIGINT_BEFORE)


install()
