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


def _fresh_env(where: Path) -> tuple[Path, Path]:
    """(python, purelib) of a new venv without pip whose only other packages are this environment's
    dependencies, added as a plain path: its .pth files (the editable finder of another checkout) stay unread."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    py = where / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, site


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout copied without build outputs (a build/ folder left by an earlier build could carry stale
    modules), once for both installs."""
    src = tmp_path_factory.mktemp("checkout") / "src"
    skip = (".git", ".venv", "build", "dist", "outputs", "multirun", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip), symlinks=True)
    return src


@pytest.fixture(scope="module")
def installed_wheel(clean_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(python of a fresh environment holding only the wheel + this env's dependencies, the wheel, the folder of
    its console scripts)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
         str(clean_copy)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("pnpscale-*.whl")
    py, site = _fresh_env(tmp / "env")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return py, wheel, site / "bin"


def test_the_wheel_carries_the_configs_and_the_stored_sweeps(installed_wheel):
    _, wheel, _ = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    # the top-level conf/ and sweeps/, mapped by setup.py into the package; the console commands declared
    for needed in ("pnpscale/conf/config.yaml", "pnpscale/conf/problem/2d.yaml", "pnpscale/conf/mode/training.yaml",
                   "pnpscale/conf/cluster/slurm.yaml", "pnpscale/conf/sweeps/comm_inference_2d.yaml",
                   "pnpscale/py.typed", "hydra_plugins/pnpscale_plugins/launcher.py"):  # fmt: skip
        assert needed in names, f"{needed} missing from {wheel.name}"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    commands = zipfile.ZipFile(wheel).read(entry_points).decode()
    for command in ("pnpscale", "pnpscale-analyze", "pnpscale-report", "pnpscale-project", "pnpscale-validate"):
        assert f"\n{command} = " in commands, commands
    assert not any(n.startswith(("conf/", "sweeps/", "tests/")) for n in names), "a top-level folder in the wheel"


def test_the_installed_wheel_runs_a_point_from_another_folder(installed_wheel, tmp_path):
    py, _, scripts = installed_wheel
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    where = subprocess.run([str(py), "-c", "import pnpscale; print(pnpscale.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert str(ROOT / "pnpscale") not in where, f"the checkout was imported, not the wheel: {where}"
    # the console command `pnpscale` (pip wrote its script beside the install; run by the fresh env's python)
    script = scripts / "pnpscale"
    helps = subprocess.run([str(py), str(script), "--help"], cwd=work, env=env, capture_output=True, text=True,
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


def test_an_editable_install_runs_the_top_level_conf_and_sweeps(clean_copy, tmp_path):
    """``pip install -e``: the checkout's own ``conf/`` and ``sweeps/`` drive the run; a stored sweep added to
    ``sweeps/`` is an option at once and runs (its ``# @package _global_`` keys and ``hydra.sweeper``)."""
    py, site = _fresh_env(tmp_path / "env")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--prefix", str(tmp_path / "env"), "-e", str(clean_copy)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (clean_copy / "sweeps" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /problem: 2d\nscale: tiny\nreport: false\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      gpus: 1\n"
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    probe = "import pnpscale.core.config as c; print(c.CONF_DIR, c.SWEEPS_DIR, sep='\\n')"
    where = subprocess.run([str(py), "-c", probe], cwd=work, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.split() == [str(clean_copy / "conf"), str(clean_copy / "sweeps")], where.stdout
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [str(py), "-m", "pnpscale", "sweeps=mine", f"hydra.sweep.dir={sweep}", f"output.root={tmp_path / 'out'}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_json,) = sweep.glob("**/run.json")
    record = json.loads(run_json.read_text())
    assert record["status"] == "complete" and record["spec"]["scale"] == "tiny" and record["spec"]["iterations"] == 2
