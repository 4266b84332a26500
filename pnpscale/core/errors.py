"""One error family: every error pnpscale raises on purpose is a :class:`PnpscaleError`.

Each carries structured fields (never re-parsed from its text) and the exit code a command gives for
it: :class:`InputError` (a refused command line, config value or input file: nothing started) exits 2,
any other :class:`PnpscaleError` (a run or analysis that failed) exits 1. The command-line entry points
turn any of them into one line ``pnpscale: error: <message>``; inside a rank, the error becomes the
``error`` of the point's failed record (:func:`pnpscale.core.record.write_failure`).

Concrete errors keep a builtin base too (``ValueError``, ``RuntimeError``...), so code written against
those bases still catches them.

>>> err = InputError("gpus=0: must be an integer in 1..64", key="gpus")
>>> (err.exit_code, err.key, err.rank, str(err))
(2, 'gpus', None, 'gpus=0: must be an integer in 1..64')
"""

from __future__ import annotations

from typing import Any, ClassVar


class PnpscaleError(Exception):
    """Base of every error pnpscale raises on purpose.

    Attributes:
        exit_code: what a command exits with for it (1: a failure; :class:`InputError`: 2).
        key: the config key at fault, when one is (``"gpus"``, ``"problem.impl"``).
        path: the file or folder at fault, when one is.
        rank: the rank at fault, when one is.
        iteration: the iteration at fault, when one is.
    """

    exit_code: ClassVar[int] = 1
    key: str | None = None
    path: str | None = None
    rank: int | None = None
    iteration: int | None = None

    def __init__(
        self,
        *args: Any,
        key: str | None = None,
        path: str | None = None,
        rank: int | None = None,
        iteration: int | None = None,
    ) -> None:
        super().__init__(*args)
        for name, value in (("key", key), ("path", path), ("rank", rank), ("iteration", iteration)):
            if value is not None:  # a subclass may have set it before calling this
                setattr(self, name, value)

    def one_line(self) -> str:
        """The message as one line (the first line of ``str(self)``, or the class name when empty)."""
        text = str(self).strip()
        return text.splitlines()[0] if text else type(self).__name__

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its class, ``args`` and attributes, never through ``__init__``: a subclass whose
        ``__init__`` takes other arguments than its message (``RunFailed(label, run_dir, error)``) still comes
        back whole from another process (a SLURM task's result, a rank's error through torch elastic)."""
        return (rebuild_error, (type(self), self.args, dict(self.__dict__)))


def rebuild_error(cls: type[PnpscaleError], args: tuple[Any, ...], state: dict[str, Any]) -> PnpscaleError:
    """The unpickling half of :meth:`PnpscaleError.__reduce__`: an instance of ``cls`` with ``args`` and
    ``state`` (its ``__dict__``), ``__init__`` not called."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


#: The failure kind of a rank that gave up waiting for the others (:func:`failure_kind`).
TIMEOUT = "timeout"


def failure_kind(exc: BaseException, waited_s: float, timeout_s: float, world: int) -> str:
    """The kind of a rank's failure, decided in the rank from structured facts only, never from the error's text.

    Args:
        exc: what the rank raised.
        waited_s: seconds the rank had been in its current step (its last heartbeat) when ``exc`` came.
        timeout_s: the process group's timeout (``dist.timeout_s``).
        world: the ranks of the run.

    Returns:
        :data:`TIMEOUT` when an error that is not pnpscale's own came after the rank had waited at least
        ``timeout_s`` in one step of a multi-rank run (a collective or a barrier that timed out: gloo and
        NCCL raise a plain ``RuntimeError``), else the error's class name (``"InjectedFailure"``,
        ``"RuntimeError"``).

    >>> failure_kind(RuntimeError("x"), 10.2, 10.0, 2), failure_kind(RuntimeError("timeout"), 0.1, 10.0, 2)
    ('timeout', 'RuntimeError')
    >>> failure_kind(PnpscaleError("dist.timeout_s"), 99.0, 10.0, 2), failure_kind(OSError(), 99.0, 10.0, 1)
    ('PnpscaleError', 'OSError')
    """
    if world > 1 and not isinstance(exc, PnpscaleError) and waited_s >= timeout_s:
        return TIMEOUT
    return type(exc).__name__


class InputError(PnpscaleError):
    """Input refused before anything runs (a bad config value, command line, trace or folder): exit 2."""

    exit_code: ClassVar[int] = 2


class UnreadableFile(PnpscaleError, ValueError):
    """A file of a run folder that cannot be read (damaged, truncated, foreign): ``str()`` is ``<file>: <reason>``.

    Attributes:
        path: the file (a string).
    """

    def __init__(self, path: Any, reason: str) -> None:
        super().__init__(f"{path}: {reason}", path=str(path))


class Abort(BaseException):  # noqa: N818 - a carrier, not an error of its own
    """Carries a :class:`PnpscaleError` from inside Hydra (a launcher or sweeper plugin) to the command's
    entry point, which prints it and exits with its exit code.

    Hydra catches every ``Exception`` raised under it and prints a stack trace; a ``BaseException``
    passes through untouched (as ``SystemExit`` would), and nothing prints until the entry point does.

    Attributes:
        error: the error to report.
    """

    def __init__(self, error: PnpscaleError) -> None:
        super().__init__(error)
        self.error = error


def report_lines(error: BaseException) -> list[str]:
    r"""The ``pnpscale: error: ...`` lines a command prints for ``error`` (one per line of its message).

    >>> report_lines(InputError("a\nb"))
    ['pnpscale: error: a', 'pnpscale: error: b']
    """
    text = str(error).strip() or type(error).__name__
    return [f"pnpscale: error: {line}" for line in text.splitlines()]


def command_prog(module: str) -> str:
    """The command's name for its ``--help`` usage line, as the user typed it: the console script's name
    (``pnpscale-analyze``) when ``sys.argv[0]`` is one, else ``python -m MODULE``.

    >>> import sys; saved = sys.argv[0]; sys.argv[0] = "/venv/bin/pnpscale-report"
    >>> command_prog("pnpscale.report")
    'pnpscale-report'
    >>> sys.argv[0] = "/src/pnpscale/report.py"; command_prog("pnpscale.report")
    'python -m pnpscale.report'
    >>> sys.argv[0] = saved
    """
    import os
    import sys

    name = os.path.basename(sys.argv[0] if sys.argv else "")
    return name if name.startswith("pnpscale-") or name == "pnpscale" else f"python -m {module}"
