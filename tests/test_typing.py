"""mypy is clean on the package and its Hydra plugins (configured in pyproject.toml's [tool.mypy]).

Only the third-party packages that ship no type information are imported as Any (the overrides
there); every typed seam (RunSpec, the Cluster and Solver ABCs, the plugin resolver) is checked.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_mypy_is_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and "Success: no issues found" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
