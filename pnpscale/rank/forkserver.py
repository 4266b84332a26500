"""Imported by the forkserver that forks the local ranks (:data:`pnpscale.cluster.local.RANK_PRELOAD`).

A rank forked from the server first unpickles its process object from the launcher. When the launcher
was stopped (SIGTERM, Ctrl-C) while it was handing that object over, the launcher is gone and the
object names semaphores it already removed: the unpickling fails, and the forkserver prints the rank's
traceback (``multiprocessing.forkserver`` calls ``sys.excepthook``) on the terminal after the
launcher's last line. :func:`quiet_when_orphaned` (installed at import, in the server only) keeps
that silent when the launcher is gone; a rank that fails to start under a live launcher still prints
its traceback.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from pnpscale.rank.process import PARENT_PID_ENV, parent_of

#: The launching process: the local launcher exports its pid (``PNPSCALE_PARENT_PID``, set while the
#: server starts); the server's parent otherwise (it may be gone by the time this is imported).
LAUNCHER_PID = int(os.environ.get(PARENT_PID_ENV) or os.getppid())
#: How long a failing rank waits for its launcher to finish exiting before it prints its traceback.
ORPHAN_GRACE_S = 2.0


def launcher_gone(server_pid: int, launcher_pid: int = LAUNCHER_PID) -> bool:
    """Whether the forkserver ``server_pid`` no longer has ``launcher_pid`` as its parent (reparented:
    the launcher exited)."""
    return parent_of(server_pid) != launcher_pid


def quiet_when_orphaned(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """``sys.excepthook`` of a rank that failed before its own code ran: silent once the launcher is gone
    (nobody waits for it), else the usual traceback."""
    end = time.monotonic() + ORPHAN_GRACE_S
    while time.monotonic() < end:  # the launcher removes its semaphores just before it exits
        if launcher_gone(os.getppid()):
            return
        time.sleep(0.05)
    sys.__excepthook__(kind, value, tb)


def in_forkserver() -> bool:
    """Whether this process is a ``multiprocessing`` forkserver (its command line runs ``forkserver.main``)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"multiprocessing.forkserver import main" in f.read()
    except OSError:
        return False


def install() -> None:
    """Set :func:`quiet_when_orphaned` as ``sys.excepthook`` in the forkserver only (the parent of every
    rank it forks); anywhere else importing this module changes nothing."""
    if in_forkserver():
        sys.excepthook = quiet_when_orphaned


install()
