"""The lost-peer rule: facts of the failure record first, gloo's and NCCL's exact words in one function after."""

from __future__ import annotations

import os

import pytest

from pnpscale.cluster.local import root_failure
from pnpscale.cluster.peer_errors import FOREIGN_ECHOES, PEER_LOST, TRANSPORT_ERROR_TYPES, echo_kind, foreign_echo
from pnpscale.cluster.slurm import is_secondary_error, ranks_by_cause
from pnpscale.core.errors import TIMEOUT

# What a rank's error line reads, from 2-rank gloo runs on torch 2.14.1 (a peer SIGKILLed; a peer asleep past
# the 5 s timeout; the survivor then calling the dead one) and, for NCCL, assembled by torch's own formats.
GLOO_RESET = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
    "[127.0.0.1]:11672: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
    "application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️"
)
GLOO_CLOSED = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
    "[127.0.0.1]:29904. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
    "before reporting an error. GLHF! 🏖️"
)
GLOO_TIMEOUT = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "5000ms for recv operation to complete"
)
GLOO_WRITEV = "RuntimeError: [/src/third_party/gloo/gloo/transport/tcp/pair.cc:333] writev [10.0.0.2]:4242: Broken pipe"
GLOO_SOCKET = "RuntimeError: [/src/third_party/gloo/gloo/transport/tcp/pair.cc:812] Socket closed [10.0.0.2]:4242"
GLOO_READ_TIMEOUT = "RuntimeError: [/src/third_party/gloo/gloo/transport/tcp/pair.cc:420] Read timeout [10.0.0.2]:4242"
NCCL_ABORTED = (
    "DistBackendError: NCCL communicator was aborted on rank 1.  Original reason for failure was: [Rank 1] Watchdog "
    "caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, "
    "Timeout(ms)=2000) ran for 2003 milliseconds before timing out."
)
NCCL_REMOTE = (
    "DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, remote process "
    "exited or there was a network error, NCCL version 2.27.7"
)
NCCL_REMOTE_DETAIL = (
    "DistBackendError: NCCL error in: ../ProcessGroupNCCL.cpp:1, ncclRemoteError: A call failed possibly due to a "
    "network error or a remote process exiting prematurely."
)
NCCL_WATCHDOG = (
    "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=BROADCAST, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."
)

REAL = [
    (GLOO_RESET, PEER_LOST), (GLOO_CLOSED, PEER_LOST), (GLOO_WRITEV, PEER_LOST), (GLOO_SOCKET, PEER_LOST),
    (NCCL_ABORTED, PEER_LOST), (NCCL_REMOTE, PEER_LOST), (NCCL_REMOTE_DETAIL, PEER_LOST),
    (GLOO_TIMEOUT, TIMEOUT), (GLOO_READ_TIMEOUT, TIMEOUT), (NCCL_WATCHDOG, TIMEOUT),
]  # fmt: skip


@pytest.mark.parametrize(("message", "kind"), REAL)
def test_gloo_and_nccl_words_are_read_exactly(message, kind):
    assert foreign_echo(message) == kind
    assert echo_kind(message, None) == kind  # a rank that left no record
    assert echo_kind(message, {"kind": message.split(":")[0], "error_type": message.split(":")[0]}) == kind


def test_every_quoted_text_is_matched_by_a_real_message_and_none_is_dead():
    """Each text of FOREIGN_ECHOES is what some real message above is matched on (no text kept for nothing)."""
    for text, kind, source in FOREIGN_ECHOES:
        assert source and kind in (PEER_LOST, TIMEOUT)
        assert any(text in message and k == kind for message, k in REAL), text


@pytest.mark.parametrize(
    "message",
    [
        "RuntimeError: connection closed by peer",  # not gloo's case, nor its form (no peer after it)
        "RuntimeError: Connection closed by peer",
        "ConnectionResetError: [Errno 104] Connection reset by peer",  # Python's own errno text, not a transport's
        "RuntimeError: the step timed out",
        "RuntimeError: timeout",
        "BrokenPipeError: [Errno 32] Broken pipe",
        "RuntimeError: NCCL communicator was aborted",  # torch writes "... on rank N"
        "exit code 1 (no Python exception recorded; see the rank's log)",
    ],
)
def test_words_that_only_resemble_an_echo_are_a_cause(message):
    assert foreign_echo(message) is None
    assert not is_secondary_error(message)


def test_the_record_decides_before_any_words():
    # pnpscale's own error is a cause, whatever it says
    assert echo_kind(GLOO_CLOSED, {"kind": "InputError", "own": True, "error_type": "InputError"}) is None
    # a recorded timeout is one, whatever it says
    assert echo_kind("RuntimeError: odd", {"kind": TIMEOUT, "own": False}) == TIMEOUT
    # an error of a class no transport raises is a cause: its words are not read
    assert echo_kind(GLOO_CLOSED, {"kind": "OutOfMemoryError", "error_type": "OutOfMemoryError"}) is None
    assert echo_kind(GLOO_CLOSED, {"kind": "ValueError", "error_type": "ValueError"}) is None
    # a transport's class: the words decide
    for error_type in sorted(TRANSPORT_ERROR_TYPES):
        assert echo_kind(GLOO_CLOSED, {"kind": error_type, "error_type": error_type}) == PEER_LOST
        assert echo_kind(f"{error_type}: x", {"kind": error_type, "error_type": error_type}) is None
    # a record cut to its size limit keeps kind and own, not error_type: the words decide
    assert echo_kind(NCCL_ABORTED, {"rank": 1, "kind": "DistBackendError", "own": False}) == PEER_LOST


def test_local_and_slurm_apply_the_same_rule():
    """The local launcher's root cause and SLURM's order of causes come from the one rule."""
    records = {0: {"kind": "RuntimeError", "error_type": "RuntimeError", "own": False}}
    for message, kind in REAL:
        for rec in (None, records):
            failures = {0: (5, message), 1: (6, "ValueError: bad input")}
            want = 1 if kind == PEER_LOST else 0  # local: a timeout stays the reported rank (hung_message)
            assert root_failure(failures, 2, records=rec) == want, message
            assert ranks_by_cause({0: message, 1: "ValueError: bad input"}, rec) == [1, 0], message
    # the same words from an error of another class: a cause on both
    rec = {0: {"kind": "OutOfMemoryError", "error_type": "OutOfMemoryError", "own": False}}
    assert root_failure({0: (5, "OutOfMemoryError: " + GLOO_CLOSED), 1: (6, "ValueError: x")}, 2, records=rec) == 0
    assert ranks_by_cause({0: "OutOfMemoryError: " + GLOO_CLOSED, 1: "ValueError: x"}, rec) == [0, 1]


# --- a rank aborted by torch's NCCL watchdog: no Python error, only its stderr says it timed out waiting ---

#: what torch 2.x's ProcessGroupNCCL writes before it takes the process down (SIGABRT)
WATCHDOG_STDERR = (
    "[rank0]:[E1202 13:40:01.123 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=2000) ran for 2003 milliseconds "
    "before timing out.\n[rank0]:[E1202 13:40:01.124 ProcessGroupNCCL.cpp:2168] [PG ID 0 PG GUID 0(default_pg) Rank 0]"
    " To avoid data inconsistency, we are taking the entire process down.\nterminate called after throwing an "
    "instance of 'c10::DistBackendError'\n"
)


def test_the_watchdog_line_is_read_from_a_ranks_stderr():
    from pnpscale.cluster.peer_errors import watchdog_line, watchdog_timeouts

    line = watchdog_line(WATCHDOG_STDERR)
    assert line.startswith("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE")
    assert "\n" not in line and foreign_echo(line) == TIMEOUT  # the same text the rule reads as a timeout
    assert watchdog_timeouts({0: WATCHDOG_STDERR, 1: "still computing\n", 2: ""}) == {0: line}


def test_a_watchdog_abort_is_a_timeout_and_the_heartbeats_name_the_hung_rank():
    # what run_ranks makes of it: the aborted rank's line, recorded as a timeout; hung_message then names the
    # rank that never reached the collective (fewer heartbeats), not the one that waited
    from pnpscale.cluster.local import RankFailed, hung_message
    from pnpscale.cluster.peer_errors import watchdog_line

    line = watchdog_line(WATCHDOG_STDERR)
    failures = {0: (5, line), 1: (6, "SignalException: Process 11 got signal: 15")}  # rank 1: stopped by the agent
    records = {0: {"kind": TIMEOUT, "own": False, "error_type": "DistBackendError"},
               1: {"kind": "SignalException", "error_type": "SignalException", "own": False}}  # fmt: skip
    assert root_failure(failures, 2, records=records) == 0
    failed = RankFailed(0, line)
    failed.kinds = {0: TIMEOUT}
    progress = {0: {"beat": 9, "iteration": 2, "section": "denoiser"},
                1: {"beat": 8, "iteration": 2, "section": "gradient"}}  # fmt: skip
    text = hung_message(failed, progress, 2, 2.0)
    assert text is not None and text.startswith("rank 1 did not arrive within dist.timeout_s=2 s")
    assert "section 'gradient' of iteration 2" in text and "rank 0 gave up waiting in section 'denoiser'" in text


def _watchdog_rank(spec_dict: dict, run_dir: str, config: dict | None = None) -> None:
    """A fake rank: rank 0 waits in a collective until the (fake) NCCL watchdog aborts it; rank 1 hangs."""
    import json
    import sys
    import time

    from pnpscale.core import layout

    rank = int(os.environ["RANK"])
    section = ["denoiser", "gradient"][rank]
    beat = {"rank": rank, "pid": os.getpid(), "beat": 9 - rank, "iteration": 2, "section": section}
    layout.progress_file(run_dir, rank).write_text(json.dumps(beat))
    if rank == 0:
        time.sleep(1.0)
        sys.stderr.write(WATCHDOG_STDERR)
        sys.stderr.flush()
        os.abort()
    time.sleep(120)


@pytest.mark.slow
def test_a_local_launch_whose_rank_the_watchdog_aborts_names_the_hung_rank(tmp_path, monkeypatch):
    import pnpscale.rank.worker as worker
    from pnpscale.cluster import local
    from pnpscale.core.config import resolve_spec
    from pnpscale.sweep.cli import compose_config

    _watchdog_rank.__module__ = __name__  # pickled by name into the forkserver's ranks
    monkeypatch.setattr(worker, "rank_main", _watchdog_rank)
    spec = resolve_spec(compose_config(["gpus=2", "scale=small", "dist.backend=gloo", "dist.timeout_s=2"]),
                        cuda_available=False)  # fmt: skip
    with pytest.raises(local.RankHung) as err:
        local.launch_local(spec, tmp_path)
    text = str(err.value)
    assert text.startswith("rank 1 did not arrive within dist.timeout_s=2 s: last seen in section 'gradient'"), text
    assert "rank 0 gave up waiting in section 'denoiser' of iteration 2" in text
    assert err.value.rank == 0 and err.value.kinds == {0: TIMEOUT}


def test_slurm_reads_the_watchdog_line_from_an_aborted_tasks_log(tmp_path):
    # a SLURM task aborted by the watchdog leaves no result, only submitit's .err log: its line becomes the
    # task's error, a timeout (the echo of the rank that hung), listed after the causes
    from pnpscale.cluster.peer_errors import watchdog_timeouts_in_files
    from pnpscale.cluster.slurm import failure_text

    (tmp_path / "7_0.err").write_text("setup line\n" + WATCHDOG_STDERR)
    (tmp_path / "7_1.err").write_text("no error here\n")
    errors = watchdog_timeouts_in_files({0: tmp_path / "7_0.err", 1: tmp_path / "7_1.err", 2: tmp_path / "none"})
    assert list(errors) == [0] and errors[0].startswith("Watchdog caught collective operation timeout: WorkNCCL(")
    assert is_secondary_error(errors[0])
    text = failure_text("7", "FAILED", {}, {**errors, 2: "ValueError: bad input"}, None)
    assert text.index("rank 2: ValueError") < text.index("rank 0: Watchdog caught")
