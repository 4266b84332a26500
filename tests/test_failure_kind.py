"""A rank's failure crosses to the launcher as a kind decided in the rank, never re-read from its text."""

from __future__ import annotations

from pnpscale.cluster.local import RankFailed, hung_message
from pnpscale.core.errors import TIMEOUT, InputError, failure_kind
from pnpscale.core.record import read_rank_failures, write_rank_failure

PROGRESS = {
    0: {"beat": 5, "iteration": 1, "section": "denoiser"},
    1: {"beat": 4, "iteration": 1, "section": "gradient"},
}


def test_the_kind_comes_from_the_clock_and_the_class_not_the_words():
    assert failure_kind(RuntimeError("Application timeout caused pair closure"), 0.2, 10.0, 2) == "RuntimeError"
    assert failure_kind(RuntimeError("[pair.cc:534] Connection closed"), 10.0, 10.0, 2) == TIMEOUT
    assert failure_kind(InputError("dist.timeout_s=0: must be > 0"), 50.0, 10.0, 2) == "InputError"
    assert failure_kind(RuntimeError("stuck"), 50.0, 10.0, 1) == "RuntimeError"  # one rank waits for no one


def test_the_launcher_names_a_hung_rank_by_the_recorded_kind_only(tmp_path):
    write_rank_failure(tmp_path, 0, TIMEOUT, "RuntimeError", iteration=1, section="denoiser", waited_s=10.4)
    write_rank_failure(tmp_path, 1, "InjectedFailure", "InjectedFailure")
    (tmp_path / "logs" / "rank2.failure").write_text("{cut sho")  # unreadable: no kind known
    kinds = {r: f["kind"] for r, f in read_rank_failures(tmp_path, 3).items()}
    assert kinds == {0: TIMEOUT, 1: "InjectedFailure"}
    silent = RankFailed(0, "RuntimeError: something odd")  # no word of a timeout in the text
    silent.kinds = {0: TIMEOUT}
    assert hung_message(silent, PROGRESS, 2, 10.0).startswith("rank 1 did not arrive within dist.timeout_s=10 s")
    worded = RankFailed(0, "ConfigError: dist.timeout_s=300 timed out timeout")  # the words, not the kind
    worded.kinds = {0: "ConfigError"}
    assert hung_message(worded, PROGRESS, 2, 10.0) is None
