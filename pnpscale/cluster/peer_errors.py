"""Which rank's failure is the echo of another's: decided on the rank's failure record, and only where that
is silent on the error's text, read in one place (:func:`foreign_echo`) against gloo's and NCCL's exact words.

When one rank fails, its peers fail moments later because they lost it (gloo: the socket to it closed; NCCL:
the communicator aborted) or gave up waiting for it (a timeout). Those errors are never the root cause. The
facts come first (:func:`echo_kind`): a rank's failure record (:func:`pnpscale.core.record.read_rank_failures`,
written in the rank from the exception object) says whether pnpscale raised the error itself (``own``: a
cause, whatever its words), whether the rank had waited ``dist.timeout_s`` in one step (``kind`` =
:data:`pnpscale.core.errors.TIMEOUT`), and the error's class (``error_type``): gloo raises a plain
``RuntimeError`` for a lost peer and NCCL a ``torch.distributed.DistBackendError``, so an error of any other
class (``ValueError``, ``torch.OutOfMemoryError``) is a cause and its text is not read. Only a transport
error's text (:data:`TRANSPORT_ERROR_TYPES`), or the error of a rank that left no record, is read, against
:data:`FOREIGN_ECHOES`.

Used by :func:`pnpscale.cluster.local.root_failure` and :func:`pnpscale.cluster.slurm.is_secondary_error`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pnpscale.core.errors import TIMEOUT

#: The echo of a peer that is gone (its process ended, its socket closed, its communicator aborted).
PEER_LOST = "peer_lost"

#: Error classes whose message may be a transport's echo of another rank (read by :func:`foreign_echo`): gloo's
#: ``RuntimeError`` (its ``gloo::IoException`` surfaces as one: seen on torch 2.14.1) and torch's
#: ``torch.distributed.DistError`` family (``DistBackendError``: NCCL, ``TORCH_CHECK_WITH(DistBackendError, ...)``
#: in ``NCCLUtils.cpp``; ``DistNetworkError``, ``DistStoreError``). An error of any other class is the rank's own
#: cause.
TRANSPORT_ERROR_TYPES = frozenset({"RuntimeError", "DistError", "DistBackendError", "DistNetworkError",
                                   "DistStoreError"})  # fmt: skip

#: The exact texts of the errors a rank gets because another rank failed: (text, echo kind, source). Each is a
#: literal of the source named (gloo as vendored in torch, ``third_party/gloo``; torch's c10d; NCCL), checked
#: in torch 2.14.1's ``libtorch_cpu.so`` / ``libtorch_cuda.so`` and NCCL's ``libnccl.so.2``. Matched as
#: substrings, case and spaces exact. ``GLOO_ERROR_MSG`` prefixes gloo's with ``"[<file>:<line>] "``.
FOREIGN_ECHOES: tuple[tuple[str, str, str], ...] = (
    ("Connection closed by peer ", PEER_LOST,
     'gloo gloo/transport/tcp/pair.cc Pair::read, on EOF: "Connection closed by peer " + peer'),
    ("This is typically caused by a remote worker hanging or bugs in the application. ", PEER_LOST,
     'gloo gloo/transport/tcp/pair.cc Pair::read: "Read error " + peer + ": " + strerror(errno) + ". " + this '
     "(ECONNRESET: \"Connection reset by peer\")"),
    ("] writev ", PEER_LOST,
     'gloo gloo/transport/tcp/pair.cc Pair::write: GLOO_ERROR_MSG("writev ", peer, ": ", strerror(errno)) '
     '(EPIPE: "Broken pipe")'),
    ("] Socket closed ", PEER_LOST,
     'gloo gloo/transport/tcp/pair.cc Pair::verifyConnected: GLOO_ERROR_MSG("Socket closed ", peer)'),
    ("NCCL communicator was aborted on rank ", PEER_LOST,
     "torch torch/csrc/distributed/c10d/NCCLUtils.cpp NCCLComm::getNcclComm (DistBackendError), after an abort"),
    ("ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
     PEER_LOST, "torch torch/csrc/distributed/c10d/NCCLUtils.cpp getNcclErrorDetailStr(ncclRemoteError)"),
    ("remote process exited or there was a network error", PEER_LOST,
     "NCCL ncclGetErrorString(ncclRemoteError), in torch's \"NCCL error in: <file>:<line>, ...\""),
    ("] Timed out waiting ", TIMEOUT,
     'gloo gloo/transport/tcp/unbound_buffer.cc: "Timed out waiting " + ms + "ms for recv operation to complete"'
     ' (or "send")'),
    ("] Read timeout ", TIMEOUT, 'gloo gloo/transport/tcp/pair.cc Pair::read (sync mode): "Read timeout " + peer'),
    ("Watchdog caught collective operation timeout: ", TIMEOUT,
     "torch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp WorkNCCL::checkTimeout"),
)  # fmt: skip


def foreign_echo(message: str) -> str | None:
    """The one reader of a third-party error's text: :data:`PEER_LOST` or :data:`pnpscale.core.errors.TIMEOUT`
    when ``message`` holds one of gloo's or NCCL's texts of :data:`FOREIGN_ECHOES`, else ``None``.

    >>> foreign_echo("RuntimeError: [/src/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
    ...              "[127.0.0.1]:29904. This is typically caused by a remote worker crashing.")
    'peer_lost'
    >>> foreign_echo("RuntimeError: [/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for "
    ...              "recv operation to complete")
    'timeout'
    >>> foreign_echo("ValueError: connection closed by peer"), foreign_echo("RuntimeError: odd timeout")
    (None, None)
    """
    return next((kind for text, kind, _ in FOREIGN_ECHOES if text in message), None)


def echo_kind(message: str, record: Mapping[str, Any] | None = None) -> str | None:
    """Whether a rank's failure is the echo of another rank's, and which: :data:`PEER_LOST`,
    :data:`pnpscale.core.errors.TIMEOUT`, or ``None`` (a cause).

    Decided on the rank's failure ``record`` when it wrote one: ``own`` (pnpscale's own error) is a cause and a
    recorded timeout (``kind``) is one, whatever the words; an ``error_type`` outside
    :data:`TRANSPORT_ERROR_TYPES` is a cause; only then (a transport error, or no record) on the words
    (:func:`foreign_echo`).

    Args:
        message: the rank's error line (``"RuntimeError: ..."``).
        record: the rank's failure record (``kind``, ``own``, ``error_type``), ``None`` when it left none.

    >>> echo_kind("InputError: Connection closed by peer ", {"kind": "InputError", "own": True}) is None
    True
    >>> echo_kind("RuntimeError: odd", {"kind": "timeout", "own": False})
    'timeout'
    >>> echo_kind("OutOfMemoryError: ... Connection closed by peer ", {"kind": "OutOfMemoryError",
    ...           "error_type": "OutOfMemoryError"}) is None
    True
    >>> echo_kind("DistBackendError: NCCL communicator was aborted on rank 1. ", {"error_type": "DistBackendError"})
    'peer_lost'
    """
    if record is not None:
        if record.get("own"):
            return None
        if record.get("kind") == TIMEOUT:
            return TIMEOUT
        error_type = record.get("error_type")
        if error_type is not None and error_type not in TRANSPORT_ERROR_TYPES:
            return None
    return foreign_echo(message)


#: What torch's NCCL watchdog writes to a rank's stderr before it aborts the process (SIGABRT) when a
#: collective ran past ``dist.timeout_s`` (``ProcessGroupNCCL.cpp``, ``WorkNCCL::checkTimeout``): the rank raises
#: nothing in Python, so its error is only in its stderr log.
WATCHDOG_TIMEOUT = "Watchdog caught collective operation timeout"


def watchdog_line(text: str) -> str | None:
    """The NCCL watchdog's timeout line in a rank's stderr ``text`` (from :data:`WATCHDOG_TIMEOUT` on, one line,
    at most 300 characters), ``None`` when it holds none.

    >>> watchdog_line("[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation "
    ...               "timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 2000 milliseconds\\nnext line")
    'Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 2000 milliseconds'
    >>> watchdog_line("RuntimeError: odd timeout") is None
    True
    """
    at = text.find(WATCHDOG_TIMEOUT)
    if at < 0:
        return None
    return text[at:].splitlines()[0].strip()[:300]


def watchdog_timeouts(stderr: Mapping[int, str]) -> dict[int, str]:
    """rank -> its watchdog line (:func:`watchdog_line`), for the ranks whose stderr holds one: those ranks
    were waiting in a collective that timed out (:data:`pnpscale.core.errors.TIMEOUT`), not the rank that
    hung.

    >>> watchdog_timeouts({0: "... Watchdog caught collective operation timeout: WorkNCCL(...)", 1: "hang"})
    {0: 'Watchdog caught collective operation timeout: WorkNCCL(...)'}
    """
    out = {}
    for rank, text in stderr.items():
        line = watchdog_line(text)
        if line is not None:
            out[rank] = line
    return out


def watchdog_timeouts_in_files(stderr: Mapping[int, Path | str], limit: int = 64 * 1024) -> dict[int, str]:
    """:func:`watchdog_timeouts` of each rank's stderr file (its last ``limit`` bytes; a missing or unreadable
    file says nothing): for launchers whose ranks leave logs, not error records, when aborted (SLURM tasks).

    >>> watchdog_timeouts_in_files({0: "/nonexistent/0.err"})
    {}
    """
    texts = {}
    for rank, path in stderr.items():
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - limit))
                texts[rank] = f.read().decode(errors="replace")
        except OSError:
            continue
    return watchdog_timeouts(texts)
