"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SHARED_TRACES


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The real Kineto traces of ../shared/traces/hta (skipped where that folder is absent)."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not present at {SHARED_TRACES} (../shared/traces is outside the repo)")
    return SHARED_TRACES
