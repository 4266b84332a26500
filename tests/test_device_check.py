"""scripts/device-check.sh and its helper, as far as a CPU allows (the GPU steps are not run here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pnpscale.validation import device_check as dc
from tests.helpers import ROOT


def test_table_round_trip_and_exit_status():
    results = [
        dc.StepResult("versions", dc.PASS, 1.0, "torch 2.14.1 | CUDA 13.0"),
        dc.StepResult("busy_wait", dc.FAIL, 2.5, "0.31 s for 0.2 s"),
        dc.StepResult("paper_2d_inference", dc.SKIP, 0.0, "paper scale needs a GPU"),
    ]
    text = dc.format_table(results)
    assert dc.parse_table("# title\n\n" + text + "\n") == results
    assert dc.exit_status(results) == 1 and dc.exit_status([results[0], results[2]]) == 0
    assert dc.exit_status([dc.StepResult("x", dc.TIMEOUT, 9.0, "over 9 s")]) == 1


def test_within_ten_percent():
    assert dc.within(0.219, 0.2) and dc.within(0.181, 0.2)
    assert not dc.within(0.221, 0.2) and not dc.within(0.17, 0.2)


def test_a_step_failing_passing_or_skipping_becomes_a_row(monkeypatch, tmp_path, capsys):
    def fail(ctx):
        dc.check(False, "0.31 s for 0.2 s")

    def skip(ctx):
        raise dc.Skipped("needs a GPU")

    monkeypatch.setitem(dc.STEPS, "t_fail", (fail, 1))
    monkeypatch.setitem(dc.STEPS, "t_skip", (skip, 1))
    monkeypatch.setitem(dc.STEPS, "t_pass", (lambda ctx: f"cuda={ctx.cuda}", 1))
    codes = [dc.run_step(n, False, tmp_path, 1.0) for n in ("t_fail", "t_skip", "t_pass")]
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert codes == [1, 3, 0]
    assert [d["detail"] for d in lines] == ["CheckFailed: 0.31 s for 0.2 s", "needs a GPU", "cuda=False"]


def test_run_overrides_are_valid_points():
    from pnpscale.core.config import resolve_spec
    from pnpscale.sweep.cli import compose_config

    for cuda in (True, False):
        for problem, mode in dc.RUNS:
            spec = resolve_spec(compose_config(dc.run_overrides(problem, mode, cuda)), cuda_available=cuda)
            assert spec.gpus == 1 and spec.export_traces


def test_paper_scale_mid_runs_keep_paper_widths():
    # mid scale: the paper's DRUNet and tiles, a smaller image (a GPU check of minutes, not hours)
    assert all("scale=paper" in dc.run_overrides(p, m, cuda=True) for p, m in dc.RUNS)
    assert "scale=small" in dc.run_overrides("2d", "inference", cuda=False)


def test_a_step_past_its_limit_is_killed_with_its_whole_process_group(tmp_path):
    # a step's pnpscale run (and its ranks) must not outlive the step: the group is killed
    pid_file = tmp_path / "pids"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; sleep 60"]
    with pytest.raises(subprocess.TimeoutExpired):
        dc.run_group(cmd, 1.0)
    child = int(pid_file.read_text())
    end = time.monotonic() + 10
    while _alive(child) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_two_ranks_on_one_gpu_need_nccl_2_30():
    assert dc.shared_gpu_refusal((2, 30, 7)) is None and dc.shared_gpu_refusal((2, 31, 0)) is None
    assert "NCCL 2.27.7 refuses two ranks on one GPU" in dc.shared_gpu_refusal((2, 27, 7))
    assert dc.shared_gpu_refusal(None) == "torch has no NCCL"


def test_the_gpu_check_fits_six_minutes():
    # the steps' budget, plus the wheels' install and Python's start, under 6 minutes on the H200
    assert dc.BUDGET_S[True] <= 330 and all(limit <= dc.BUDGET_S[True] for _, limit in dc.STEPS.values())


#: The steps the suite runs through the script in CPU mode: the versions row and one real pnpscale point (its
#: traces exported and read back). The full CPU run of every step (minutes) belongs to the GPU check itself,
#: ``bash scripts/device-check.sh [--cpu]``; each step's own logic is tested above.
SCRIPT_STEPS = ("versions", "run_2d_inference")


def test_every_step_has_a_limit_the_budgets_hold():
    assert set(SCRIPT_STEPS) <= set(dc.STEPS) and list(dc.STEPS)[0] == "versions"
    assert all(0 < limit <= dc.CPU_STEP_LIMIT_S for _, limit in dc.STEPS.values())


@pytest.mark.slow
def test_script_in_cpu_mode_passes_its_steps_and_writes_the_table_under_out(tmp_path):
    # the script's whole path (imports checked, OUT honoured, one row per step, the table written twice, exit
    # status) on the versions step and one real run, through --only
    env = {**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1", "PNPSCALE_PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "device-check.sh"), "--cpu", "--only", ",".join(SCRIPT_STEPS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert (tmp_path / "out" / dc.TABLE_MD).is_file(), proc.stdout + proc.stderr
    rows = dc.parse_table((tmp_path / "out" / dc.TABLE_MD).read_text())
    assert [r.name for r in rows] == list(SCRIPT_STEPS), proc.stdout
    assert [(r.name, r.status) for r in rows if r.status != dc.PASS] == [], proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch" in rows[0].detail and "| versions | pass |" in proc.stdout
    assert [r["status"] for r in json.loads((tmp_path / "out" / dc.TABLE_JSON).read_text())] == [dc.PASS] * len(rows)


@pytest.mark.slow
def test_script_refuses_a_missing_python_and_fails_on_a_spent_budget(tmp_path):
    env = {**os.environ, "PNPSCALE_PYTHON": str(tmp_path / "no-python")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device-check.sh")], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 2 and "set PNPSCALE_PYTHON" in proc.stderr
    results = dc.run_all(tmp_path / "o", cuda=False, budget_s=1.0, names=["versions"])
    assert [(r.name, r.status) for r in results] == [("versions", dc.SKIP)]  # budget spent: not started
