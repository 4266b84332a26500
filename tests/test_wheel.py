"""A built wheel runs from anywhere: its configs and stored sweeps are package data (no path climbs out).

The wheel is built from this checkout, installed with ``pip --target`` into a fresh, empty
environment whose only other packages are this environment's dependencies (added as a plain path:
the editable install's finder, which would map ``pnpscale`` back to the checkout, is not loaded), and
a tiny point is run from a folder that is neither the checkout nor the install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY_2D

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(python of a fresh environment holding only the wheel + this env's dependencies, the wheel)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist = tmp / "src", tmp / "dist"
    # a clean copy: a build/ folder left in the checkout by an earlier build could carry stale modules
    skip = (".git", ".venv", "build", "dist", "outputs", "multirun", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip), symlinks=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("pnpscale-*.whl")
    env_dir = tmp / "env"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    py = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # this environment's third-party packages, as a plain path: its .pth files (the editable finder) stay unread
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, wheel


def test_the_wheel_carries_the_configs_and_the_stored_sweeps(installed_wheel):
    _, wheel = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("pnpscale/conf/config.yaml", "pnpscale/conf/problem/2d.yaml", "pnpscale/conf/mode/training.yaml",
                   "pnpscale/conf/cluster/slurm.yaml", "pnpscale/conf/sweeps/comm_inference_2d.yaml",
                   "pnpscale/py.typed", "hydra_plugins/pnpscale_plugins/launcher.py"):  # fmt: skip
        assert needed in names, f"{needed} missing from {wheel.name}"


def test_the_installed_wheel_runs_a_point_from_another_folder(installed_wheel, tmp_path):
    py, _ = installed_wheel
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    where = subprocess.run([str(py), "-c", "import pnpscale; print(pnpscale.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert str(ROOT / "pnpscale") not in where, f"the checkout was imported, not the wheel: {where}"
    helps = subprocess.run([str(py), "-m", "pnpscale", "--help"], cwd=work, env=env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert helps.returncode == 0 and "sweeps: comm_inference_2d" in helps.stdout, helps.stderr
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(py), "-m", "pnpscale", "gpus=1", *TINY_2D, f"hydra.run.dir={run_dir}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "complete"
    assert (run_dir / "sections.parquet").is_file()
