"""Shared fixtures; every Python process a test starts runs this checkout's code."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, SHARED_TRACES


def pytest_configure(config: pytest.Config) -> None:
    """Put this checkout first on ``PYTHONPATH`` for every subprocess (``python -m pnpscale ...``), so that a
    second clone tests itself, not whichever ``pnpscale`` happens to be installed."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])


#: Tests that are neither ``slow`` nor ``slurm`` yet take seconds (they start the CLI, a notebook or several
#: Python processes), left out of ``-m quick``: the function's node id without its parameters, or a whole file.
#: Measured with ``--durations=0`` (benchmarks/README.md, "Test suite time"); a new test of a second or more
#: belongs here or under ``@pytest.mark.slow``.
HEAVY: frozenset[str] = frozenset()

#: Groups of tests that run one at a time on one xdist worker (see :func:`pytest_xdist_make_scheduler`): the
#: tests that compare a measurement with a job's own clock or an injected delay ("timing"), and the SLURM
#: tests ("slurm": one localhost cluster).
TIMING = (
    "tests/test_overlap_jobs.py",
    "tests/test_waits.py::test_injected_delay_shows_up_as_uneven_work_not_late_start",
    "tests/test_validate.py::test_suite_passes_on_cpu_ranks_and_fails_when_the_decomposition_is_broken",
    "tests/test_ct.py::test_angle_blocks_keep_the_gradient_balanced_where_two_operators_cannot",
)


def _function_id(item: pytest.Item) -> str:
    return item.nodeid.split("[", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the quick subset (``-m quick``: not slow, not slurm, not :data:`HEAVY`)."""
    for item in items:
        fid, path = _function_id(item), item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("slow") is None and item.get_closest_marker("slurm") is None:
            if fid not in HEAVY and path not in HEAVY:
                item.add_marker(pytest.mark.quick)


def run_group(nodeid: str) -> str | None:
    """The group a test runs in, one at a time with the others of it: ``"slurm"`` (tests/test_slurm.py),
    ``"timing"`` (:data:`TIMING`), else ``None`` (any worker, any time).

    >>> run_group("tests/test_slurm.py::test_x[2]"), run_group("tests/test_overlap_jobs.py::test_y"), run_group("a::b")
    ('slurm', 'timing', None)
    """
    fid, path = nodeid.split("[", 1)[0], nodeid.split("::", 1)[0]
    if path == "tests/test_slurm.py":
        return "slurm"
    return "timing" if any(fid == t or path == t for t in TIMING) else None


if importlib.util.find_spec("xdist") is not None:  # the test extra has it; without it pytest runs in one process

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``--dist load`` with :func:`run_group`'s groups each sent whole to one worker (pytest-xdist's own
        ``--dist loadgroup`` reads ``xdist_group`` marks through a node id that pytest 9 no longer lets it change).
        """
        if config.getvalue("dist") != "load":
            return None  # another --dist asked for: xdist's own
        from xdist.scheduler import LoadScopeScheduling

        class GroupedLoad(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return run_group(nodeid) or nodeid

        return GroupedLoad(config, log)


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The real Kineto traces of ../shared/traces/hta (skipped where that folder is absent)."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not present at {SHARED_TRACES} (../shared/traces is outside the repo)")
    return SHARED_TRACES
