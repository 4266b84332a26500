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

The commands (``python -m pnpscale``, ``pnpscale.report``, ``pnpscale.analyze``, ``pnpscale.project``) call
:func:`install_command` as their first statement, before any heavy import: one handler from then on.
While the command's modules import, a stop signal prints one line (``pnpscale.report: interrupted
(SIGINT)``) and ends the process at once with ``128 + signum`` (nothing was written yet). Once
:func:`run_command` runs the command, the first stop signal raises :class:`Interrupted` and every later
one is only recorded (a second Ctrl-C 20 ms after the first never interrupts the cleanup or the one
line); once the command's output is published (:func:`published`, called by
:func:`pnpscale.core.layout.commit_folder`) or the command returned, stop signals are ignored: a Ctrl-C
while Python finalises never turns a written report into exit 130.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
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


#: The command whose one handler is installed (:func:`install_command`), else ``""`` (a library caller).
_command: list[str] = [""]
#: The command's phase: ``"importing"`` (a stop exits at once), ``"running"`` (the first stop raises,
#: later ones are recorded), ``"settled"`` (its output is published: stops are ignored).
_phase: list[str] = [""]


def _raise(signum: int, frame: Any) -> None:
    if _phase[0] == "importing":  # nothing written yet: one line, and gone before any traceback
        _exit_now(signum)
    first = not _received
    _received.append(int(signum))
    if first or _phase[0] != "running":  # a command raises once; the sweep raises each stop (acknowledge())
        raise Interrupted(signum)


#: What a command says it left undone when stopped (``report not written, the previous one is intact``):
#: set by :func:`not_written`, read by the one line of a stop.
_said: list[Callable[[], str] | None] = [None]


def not_written(said: Callable[[], str]) -> None:
    """Set what the running command's one line adds after a stop (``PROG: interrupted (SIGINT): <said()>``),
    from while it imports on (:func:`install_command`) to its end (:func:`run_command`)."""
    _said[0] = said


def _suffix() -> str:
    try:
        return f": {_said[0]()}" if _said[0] is not None else ""
    except Exception:  # noqa: BLE001 - the line goes out whatever the message's own trouble
        return ""


def _exit_now(signum: int) -> None:
    try:
        os.write(2, f"{_command[0] or sys.argv[0]}: {Interrupted(signum)}{_suffix()}\n".encode())
    finally:
        os._exit(128 + int(signum))


def install_command(prog: str) -> None:
    """The first statement of a command (``prog``, e.g. ``pnpscale.report``), before its heavy imports: a
    stop signal from here until :func:`run_command` (or :func:`install`) prints ``PROG: interrupted
    (SIGINT)`` and exits ``128 + signum`` at once (``os._exit``: no traceback, nothing to clean up)."""
    _command[0] = prog
    _said[0] = None
    _phase[0] = "importing"
    _received.clear()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise)


def _ignore_stops() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def published() -> None:
    """The command's output is in place (a report's renames are done): from here stop signals are ignored
    (the command exits as it would have, 0 for a written report). Changes nothing outside a command run by
    :func:`run_command` (a sweep's report: the sweep still stops on the next signal)."""
    if _phase[0] == "running" and threading.current_thread() is threading.main_thread():
        _phase[0] = "settled"
        _ignore_stops()


def settled() -> bool:
    """Whether the running command's output is published (:func:`published`)."""
    return _phase[0] == "settled"


def run_command(main: Callable[[], int], not_written: Callable[[], str] | None = None) -> int:
    """Run a command's ``main`` under the one handler (:func:`install_command` first).

    The first stop signal raises :class:`Interrupted` in ``main`` (whose ``finally`` blocks remove what
    it staged); later ones are recorded only. A stop that reaches here prints one line, ``PROG:
    interrupted (SIGINT)`` plus ``: not_written()`` when given, and returns ``128 + signum``. Once
    ``main`` returned, stop signals are ignored.

    Returns:
        ``main``'s exit status, or ``128 + signum`` for a stop.
    """
    if not_written is not None:
        _said[0] = not_written
    _phase[0] = "running"
    try:
        code = main()
    except KeyboardInterrupt as exc:
        _ignore_stops()
        print(f"{_command[0]}: {as_interrupted(exc)}{_suffix()}", file=sys.stderr)
        return exit_code(exc)
    finally:
        _ignore_stops()  # the command is over: ignored from here (a later install() starts afresh)
        _phase[0] = ""
    return code


def _unraisable(info: Any) -> None:
    """``sys.unraisablehook``: an :class:`Interrupted` raised where Python cannot propagate it (a weakref
    callback, a finaliser) is silent here; :func:`check` raises it again at the next checkpoint."""
    if isinstance(info.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(info)


def install() -> None:
    """Make every stop signal raise :class:`Interrupted` in the main thread, and remember it (:func:`check`).

    Inside a command run by :func:`run_command` (``pnpscale.report``'s ``main``), its one handler stays as
    it is (the first stop raises, later ones are recorded); otherwise (the sweep) each stop raises."""
    if _phase[0] in ("running", "settled"):
        sys.unraisablehook = _unraisable
        return
    _phase[0] = ""
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
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in signals}
    try:  # a stop landing while the recorders go in: the handlers swapped so far are put back
        for sig in signals:
            signal.signal(sig, lambda signum, frame: pending.append(signum))
        yield
    finally:
        if not settled():  # else the body published the command's output (:func:`published`): stops dropped
            for sig, handler in before.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            if pending:
                signal.raise_signal(pending[0])
