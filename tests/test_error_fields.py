"""Errors cross processes and stages as fields, never re-read from their text: a rank's failure kind, a
section error's counts, an unreadable file's path, the all-warm-up tables."""

from __future__ import annotations

from pathlib import Path

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


def test_errors_carry_the_facts_their_readers_need_as_fields():
    """Readers decide on fields, not on the words of a message (offline's hints, unreadable folders, warm-up)."""
    import pandas as pd
    import pytest

    from pnpscale import columns as K
    from pnpscale.analysis.events import SectionError
    from pnpscale.analysis.metrics import DecompositionError, NoMeasuredIteration, summarize
    from pnpscale.analysis.section.records import section_records
    from pnpscale.core.errors import UnreadableFile
    from pnpscale.results.runs import read_table

    with pytest.raises(SectionError) as info:
        section_records([], ["forward", "backward"])
    assert info.value.counts == {"forward": 0, "backward": 0}
    warm = pd.DataFrame({K.SECTION: ["gradient"], K.ITERATION: [0], K.WARMUP: [True]})
    with pytest.raises(NoMeasuredIteration):
        summarize(warm, 1)
    assert issubclass(NoMeasuredIteration, DecompositionError)
    with pytest.raises(UnreadableFile) as bad:
        read_table(Path("/nonexistent/ranks.parquet"))
    assert bad.value.path == "/nonexistent/ranks.parquet" and isinstance(bad.value, ValueError)


def test_the_root_cause_is_chosen_on_the_records_before_any_words():
    """pnpscale's own error is a cause whatever its words; a recorded timeout is an echo on SLURM."""
    from pnpscale.cluster.local import root_failure
    from pnpscale.cluster.slurm import ranks_by_cause

    closed = "RuntimeError: [/g/pair.cc:561] Connection closed by peer [127.0.0.1]:5. This is typically caused"
    worded = {0: (5, closed), 1: (6, "InputError: " + closed.split(": ", 1)[1])}
    assert root_failure(worded, 2) == 0 and root_failure(worded, 2, records={1: {"own": True}}) == 1
    errors = {0: "RuntimeError: odd", 1: "InputError: [/g/unbound_buffer.cc:78] Timed out waiting 1000ms for recv"}
    records = {0: {"kind": TIMEOUT, "own": False}, 1: {"kind": "InputError", "own": True}}
    assert ranks_by_cause(errors) == [0, 1]  # by the words alone: rank 1 reads as an echo (gloo's timeout)
    assert ranks_by_cause(errors, records) == [1, 0]  # by the records: rank 0 timed out waiting for rank 1


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_error_comes_back_whole_from_another_process():
    """A SLURM task's result and a rank's error cross processes pickled: a subclass whose ``__init__`` takes
    other arguments than its message (``RunFailed(label, run_dir, error)``) once came back as 'unreadable
    result: RunFailed.__init__() missing 2 required positional arguments', losing rank 0's error."""
    import pickle

    import pnpscale.analysis.offline  # noqa: F401 - the error classes of every stage are defined on import
    import pnpscale.results.projection.command  # noqa: F401
    from pnpscale.cluster.local import RankHung
    from pnpscale.core.errors import PnpscaleError
    from pnpscale.sweep.task import RunFailed

    failed = RankFailed(1, "RuntimeError: x", Path("/logs/rank1.err"), {1: "RuntimeError: x", 2: "echo"})
    failed.kinds = {1: TIMEOUT}
    for exc in (RunFailed("problem=2d gpus=2", "/runs/a", "rank 0 failed: boom"), failed,
                RankHung(1, "rank 1 did not arrive"), InputError("gpus=0: must be in 1..64", key="gpus", path="/c")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.args == exc.args
        assert vars(back) == vars(exc)
    for cls in sorted(_subclasses(PnpscaleError), key=lambda c: c.__qualname__):  # every class, built bare
        exc = cls.__new__(cls, "message")
        exc.args = ("message",)
        assert type(pickle.loads(pickle.dumps(exc))) is cls, cls
