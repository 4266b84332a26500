"""Signals: SIGINT / SIGTERM / SIGHUP stop the sweep the same way at any moment, with the right exit code.

``python -m pnpscale`` installs :func:`install` first: each of :data:`STOP_SIGNALS` raises
:class:`Interrupted` (a ``KeyboardInterrupt``, so nothing on the way swallows it as an ordinary
error) wherever the main thread is. The Hydra task records the running point as failed
(``interrupted (SIGINT)`` / ``terminated (SIGTERM)``), the launcher writes the report of what
completed and logs the command that resumes the sweep, and the process exits with
``128 + signal number`` (130 for SIGINT, 143 for SIGTERM), as a shell reports a process killed by
that signal.

torch elastic installs its own handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT when it starts the
ranks (they raise its ``SignalException``) and never puts the previous ones back:
:func:`preserved` restores them around a launch. :func:`deferred` holds the stop signals back
during a few short writes (a status record, the renames that publish a report) so that a signal
never lands between two renames; it is delivered as soon as the block ends.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Signals that stop a sweep (SIGHUP: the terminal went away).
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Signals torch elastic takes over while ranks run (``TORCHELASTIC_SIGNALS_TO_HANDLE``'s default).
ELASTIC_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

_VERB = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``str()`` is the status text, e.g. ``terminated (SIGTERM)``.

    Attributes:
        signum: the signal number.
        exit_code: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        sig = signal.Signals(self.signum)
        super().__init__(f"{_VERB.get(sig, 'stopped')} ({sig.name})")


#: The stop signals received since :func:`install` (a handler's exception can be swallowed: see :func:`check`).
_received: list[int] = []


def _raise(signum: int, frame: Any) -> None:
    _received.append(int(signum))
    raise Interrupted(signum)


def _unraisable(info: Any) -> None:
    """``sys.unraisablehook``: an :class:`Interrupted` raised where Python cannot propagate it (a weakref
    callback, a finaliser) is silent here; :func:`check` raises it again at the next checkpoint."""
    if isinstance(info.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(info)


def install() -> None:
    """Make every stop signal raise :class:`Interrupted` in the main thread, and remember it (:func:`check`)."""
    _received.clear()
    sys.unraisablehook = _unraisable
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise)


def received() -> Interrupted | None:
    """The first stop signal received since :func:`install`, as an :class:`Interrupted`, else ``None``."""
    return Interrupted(_received[0]) if _received else None


def acknowledge() -> None:
    """The stop received so far is being handled (its exception caught: the launcher writes the report
    of what completed): :func:`check` raises only for a signal received after this."""
    _received.clear()


def check() -> None:
    """Raise the stop signal received since :func:`install` (or :func:`acknowledge`), if any.

    A signal handler's exception is raised wherever the main thread is; inside a weakref callback or a
    finaliser Python only prints "Exception ignored" and goes on, so a Ctrl-C could be lost (a report
    published, exit 0). The places that must not go on after a stop call this: before a report's
    renames, before each sweep point, at the end of a command.

    Raises:
        Interrupted: a stop signal arrived.
    """
    stop = received()
    if stop is not None:
        raise stop


def as_interrupted(exc: BaseException) -> Interrupted | None:
    """``exc`` as an :class:`Interrupted`: itself, a plain ``KeyboardInterrupt`` (SIGINT), or torch
    elastic's ``SignalException`` (its signal); ``None`` for any other exception."""
    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    sigval = getattr(exc, "sigval", None)
    if type(exc).__name__ == "SignalException" and sigval is not None:
        return Interrupted(int(sigval))
    return None


def stop_behind(exc: BaseException) -> Interrupted | None:
    """The stop behind ``exc``: :func:`as_interrupted`, else a stop signal received since :func:`install`
    (:func:`received`) whose exception a library turned into another error (matplotlib raising
    ``ValueError: Invalid bounding box`` for a Ctrl-C while it draws), else ``None``."""
    return as_interrupted(exc) or received()


def exit_code(exc: BaseException) -> int:
    """The exit status for a stop: ``128 + signum`` (130 for a plain ``KeyboardInterrupt``)."""
    stop = as_interrupted(exc)
    return stop.exit_code if stop is not None else 1


@contextmanager
def preserved(signals: tuple[signal.Signals, ...] = ELASTIC_SIGNALS) -> Iterator[None]:
    """Put back the handlers of ``signals`` on exit, whatever the body installed (torch elastic)."""
    before = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None:  # None: installed from C, cannot be put back from Python
                signal.signal(sig, handler)


@contextmanager
def deferred(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Hold ``signals`` back during the body (a short write); the first one that arrived is raised
    again, through the handler in place before, as soon as the body ends.

    Python-level (the handlers are swapped for a recorder), so it holds whichever thread the kernel
    delivers to; outside the main thread it holds nothing.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if pending:
            signal.raise_signal(pending[0])
