"""Shared fixtures; every Python process a test starts runs this checkout's code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import ROOT, SHARED_TRACES


def pytest_configure(config: pytest.Config) -> None:
    """Put this checkout first on ``PYTHONPATH`` for every subprocess (``python -m pnpscale ...``), so that a
    second clone tests itself, not whichever ``pnpscale`` happens to be installed."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The real Kineto traces of ../shared/traces/hta (skipped where that folder is absent)."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not present at {SHARED_TRACES} (../shared/traces is outside the repo)")
    return SHARED_TRACES
