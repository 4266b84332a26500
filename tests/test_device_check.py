"""scripts/device-check.sh and its helper, as far as a CPU allows (the GPU steps are not run here).

The whole CPU mode (every step, about 6 minutes on 2 loaded cores) is a documented command, not a test:
``OUT=/tmp/dc bash scripts/device-check.sh --cpu`` (docs/validation.md); the slow test here runs its first two
steps through the script, which covers the orchestration, the NCCL probe's code on gloo and what comes back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from pnpscale.core import layout
from pnpscale.validation import device_check as dc
from tests.helpers import ROOT

H200 = dc.Machine(cuda=True, gpus=1, nccl=(2, 28, 9), torch=(2, 11))


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
    cut = dc.StepResult("paper_2d_inference", dc.CUT, 0.0, "12 s of the 330 s budget left")
    assert dc.exit_status([results[0], cut]) == 3 and dc.exit_status([results[1], cut]) == 1


def test_summary_line_names_the_steps_the_budget_cut():
    results = [dc.StepResult("a", dc.PASS, 1, ""), dc.StepResult("b", dc.FAIL, 1, ""),
               dc.StepResult("c", dc.CUT, 0, ""), dc.StepResult("d", dc.CUT, 0, "")]  # fmt: skip
    line = dc.summary_line(results, 330)
    assert line.startswith("1 of 4 steps passed, 0 skipped, 1 failed (b), 0 timed out")
    assert line.endswith("cut by the 330 s budget (not run, no defect found): c, d")


def test_within_ten_percent():
    assert dc.within(0.219, 0.2) and dc.within(0.181, 0.2)
    assert not dc.within(0.221, 0.2) and not dc.within(0.17, 0.2)


def test_plan_on_the_h200_runs_a_two_rank_nccl_step_within_six_minutes(capsys):
    rows = {r.name: r for r in dc.plan(H200, dc.BUDGET_S[True])}
    assert list(rows) == list(dc.STEPS)
    assert rows["nccl_probe"].action == "run" and rows["nccl_two_ranks"].action == "run"
    assert rows["two_gpus"].action == "skip" and "has 1" in rows["two_gpus"].reason
    assert [n for n, r in rows.items() if r.action == "cut"] == []
    assert dc.main(["--plan", "--gpus", "1", "--nccl", "2.28.9", "--torch", "2.11"]) == 0
    out = capsys.readouterr().out
    two = next(line for line in out.splitlines() if line.startswith("nccl_two_ranks"))
    assert two.split()[1] == "run" and "[two ranks on one GPU by: hostid]" in two
    total = out.splitlines()[-1]
    steps, whole = int(total.split()[1]), int(total.split(" = ")[1].split()[0])
    assert steps <= 330 and whole <= 360 and steps == sum(r.limit_s for r in rows.values() if r.action == "run")


def test_every_step_limit_adds_up_within_the_budget_even_with_two_gpus():
    # with two GPUs every step runs: their limits together still fit the steps' budget
    assert sum(s.limit_s for s in dc.STEPS.values()) <= dc.BUDGET_S[True] <= 330
    assert dc.BUDGET_S[True] + dc.SETUP_S <= 360
    rows = dc.plan(dc.Machine(True, 2, (2, 28, 9), (2, 11)), dc.BUDGET_S[True])
    assert all(r.action == "run" for r in rows)


def test_plan_skips_nccl_steps_without_nccl_and_cuts_past_the_budget():
    rows = {r.name: r for r in dc.plan(dc.Machine(True, 1, None, (2, 11)), 330)}
    assert rows["nccl_probe"].action == "skip" and rows["nccl_probe"].reason == "torch has no NCCL"
    cut = dc.plan(H200, 100)
    assert [r.action for r in cut][:3] == ["run", "run", "cut"]  # 10 + 30 s run, 65 s more would pass 100 s
    assert "> the 100 s budget" in cut[2].reason
    cpu = {r.name: r.action for r in dc.plan(dc.Machine(False, 0), dc.BUDGET_S[False])}
    assert cpu["nccl_two_ranks"] == "run" and cpu["two_gpus"] == "skip"  # CPU mode: the same point on gloo


def test_versions_parse_and_the_shared_gpu_methods():
    assert dc.parse_version("2.28.9") == (2, 28, 9) and dc.parse_version("2.11.0+cu130") == (2, 11, 0)
    assert dc.shared_gpu_methods((2, 28, 9)) == ["hostid"] and dc.shared_gpu_methods((2, 30, 7))[0] == "multi_rank"
    env = dc.shared_gpu_env("hostid")
    assert env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "PNPSCALE_NCCL_HOSTID_PER_RANK": "1"}
    assert dc.shared_gpu_env("multi_rank") == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    a, b = (dc.probe_rank_env("hostid", r, Path(f"/w/{r}.log")) for r in (0, 1))
    assert a["NCCL_HOSTID"] != b["NCCL_HOSTID"] and a["NCCL_IB_DISABLE"] == "1" and b["NCCL_DEBUG_FILE"] == "/w/1.log"


def test_each_rank_gets_its_own_nccl_host_id_only_when_asked():
    from pnpscale.rank.gpus import NCCL_HOSTID_PER_RANK_ENV, per_rank_nccl_env

    asked = {NCCL_HOSTID_PER_RANK_ENV: "1"}
    assert per_rank_nccl_env(0, asked, "h")["NCCL_HOSTID"] != per_rank_nccl_env(1, asked, "h")["NCCL_HOSTID"]
    assert per_rank_nccl_env(0, {}, "h") == {}
    assert "NCCL_SOCKET_IFNAME" not in per_rank_nccl_env(0, {**asked, "NCCL_SOCKET_IFNAME": "eth0"}, "h")


def test_a_step_failing_passing_or_skipping_becomes_a_row(monkeypatch, tmp_path, capsys):
    def fail(ctx):
        dc.check(False, "0.31 s for 0.2 s")

    def skip(ctx):
        raise dc.Skipped("needs a GPU")

    monkeypatch.setitem(dc.STEPS, "t_fail", dc.Step("t_fail", fail, 1, ""))
    monkeypatch.setitem(dc.STEPS, "t_skip", dc.Step("t_skip", skip, 1, ""))
    monkeypatch.setitem(dc.STEPS, "t_pass", dc.Step("t_pass", lambda ctx: f"cuda={ctx.cuda}", 1, ""))
    codes = [dc.run_step(n, False, tmp_path, 1.0) for n in ("t_fail", "t_skip", "t_pass")]
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert codes == [1, 3, 0] and [d["code"] for d in lines] == [1, 3, 0]
    assert [d["detail"] for d in lines] == ["CheckFailed: 0.31 s for 0.2 s", "needs a GPU", "cuda=False"]
    assert dc._step_lines("noise\n" + json.dumps(lines[2]) + "\n")["t_pass"]["detail"] == "cuda=False"


def test_warm_steps_share_one_process():
    rows = dc.plan(H200, dc.BUDGET_S[True])
    groups = [[r.name for r in g] for g in dc._groups([r for r in rows if r.action == "run"])]
    assert ["busy_wait", "kineto"] in groups and ["versions"] in groups


@pytest.mark.slow  # five Hydra composes, about 4 s
def test_run_overrides_and_two_rank_points_are_valid_points():
    # the GPU sizes (the CPU mode's are run by the CPU check); a mode changes no size, so inference only
    from pnpscale.core.config import resolve_spec
    from pnpscale.sweep.cli import compose_config

    for problem in ("2d", "3d"):
        over = dc.run_overrides(problem, "inference", True)
        spec = resolve_spec(compose_config(over), cuda_available=True)
        assert spec.gpus == 1 and spec.export_traces and "scale=paper" in over
    for problem in ("2d", "3d"):  # the CPU mode: the tests' tiny preset, resolved as the tests resolve it
        over = dc.run_overrides(problem, "training", False)
        spec = resolve_spec(compose_config(over), cuda_available=False)
        assert "scale=tiny" in over and spec == resolve_spec(compose_config(
            [f"problem={problem}", "mode=training", "gpus=1", "iterations=3", "warmup=1", "profile.export_traces=true",
             "report=false", "scale=tiny"]), cuda_available=False)  # fmt: skip
    for _, over, runs in dc.TWO_RANK_POINTS:
        key, _, values = over[0].partition("=")
        points = [[f"{key}={v}"] for v in values.split(",")] if runs > 1 else [over]
        assert len(points) == runs
        for point in points:
            spec = resolve_spec(compose_config([*dc.two_rank_base(True), *point]), cuda_available=True)
            assert spec.gpus == 2 and spec.backend == "nccl"


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


def test_what_comes_back_fits_eight_files_and_16_mib(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    runs = work / "runs"
    (work / layout.LOGS_DIR).mkdir(parents=True)
    (work / layout.LOGS_DIR / "versions.log").write_text("torch 2.11\n")
    nccl = runs / "two_ranks_blocking_and_pipelined" / "t" / "gpus=2" / layout.NCCL_DIR
    nccl.mkdir(parents=True)
    (nccl / "rank0.log").write_bytes(b"NCCL INFO head\n" + os.urandom(5 * 2**20) + b"\nNCCL INFO tail\n")
    (nccl.parent / layout.RUN_JSON).write_text('{"status": "complete"}')
    big = runs / "run_2d" / "traces"
    big.mkdir(parents=True)
    for i in range(30):  # bulky, incompressible: must stay in the work folder
        (big / f"rank{i}.log").write_bytes(os.urandom(2**20))
    layout.write_json(runs / dc.PROBE_JSON, {"method": "hostid"})
    written = dc.bring_back(work, out, "# table\n", "[]\n")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert files == sorted(written) and len(files) <= dc.OUT_MAX_FILES
    assert sum(p.stat().st_size for p in files) <= dc.OUT_MAX_BYTES
    assert {p.name for p in files} == {layout.DEVICE_CHECK_MD, layout.DEVICE_CHECK_JSON, layout.DEVICE_CHECK_PROBE,
                                       layout.DEVICE_CHECK_NCCL_LOG, layout.DEVICE_CHECK_LOGS}  # fmt: skip
    log = (out / layout.DEVICE_CHECK_NCCL_LOG).read_bytes()
    assert log.startswith(b"NCCL INFO head") and log.endswith(b"NCCL INFO tail\n") and b"bytes left out" in log
    with tarfile.open(out / layout.DEVICE_CHECK_LOGS) as tar:
        names = tar.getnames()
        manifest = tar.extractfile("MANIFEST").read().decode()
    assert "logs/versions.log" in names and "MANIFEST" in names
    assert f"work folder: {work}" in manifest


def test_head_tail_keeps_short_data_whole():
    assert dc.head_tail(b"abc", 10) == b"abc"
    cut = dc.head_tail(b"x" * 100 + b"y" * 100, 50)
    assert cut.startswith(b"x" * 25) and cut.endswith(b"y" * 25) and b"150 bytes left out" in cut


def test_a_spent_budget_cuts_every_step_without_starting_one(tmp_path):
    results = dc.run_all(tmp_path / "o", cuda=False, budget_s=1.0, names=["versions", "nccl_probe"])
    assert [(r.name, r.status) for r in results] == [("versions", dc.CUT), ("nccl_probe", dc.CUT)]
    assert dc.exit_status(results) == 3


@pytest.mark.slow
def test_script_in_cpu_mode_runs_the_probe_step_and_brings_back_only_the_small_files(tmp_path):
    # the orchestration end to end, through the script: the NCCL probe's code on 2 gloo ranks, what comes back
    # (the whole CPU mode, every step, is the documented command of docs/validation.md, not a test)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1", "PNPSCALE_PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "device-check.sh"), "--cpu", "--only", "nccl_probe", "--work", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[2].startswith("torch ")  # the header: the one import check of the script
    rows = dc.parse_table((out / dc.TABLE_MD).read_text())
    assert [(r.name, r.status) for r in rows] == [("nccl_probe", dc.PASS)], proc.stdout
    assert "all_reduce, all_gather, reduce_scatter, send_recv correct on 2 ranks" in rows[0].detail
    assert "| nccl_probe | pass |" in proc.stdout and "1 of 1 steps passed" in proc.stdout
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= dc.OUT_MAX_FILES and sum(p.stat().st_size for p in files) <= dc.OUT_MAX_BYTES
    probe = json.loads((out / layout.DEVICE_CHECK_PROBE).read_text())
    assert probe["method"] == "gloo" and [r["ok"] for r in probe["attempts"][0]["ranks"]] == [True, True]
    assert (work / "runs" / "probe").is_dir() and not (out / "runs").exists()  # the bulky part stays in work
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "device-check.sh")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PNPSCALE_PYTHON": str(tmp_path / "no-python")})  # fmt: skip
    assert bad.returncode == 2 and "set PNPSCALE_PYTHON" in bad.stderr


def test_the_two_rank_step_is_not_run_when_the_probe_found_no_way(tmp_path):
    layout.write_json(tmp_path / dc.PROBE_JSON, {"method": None, "attempts": [
        {"method": "hostid", "error": "rank 1: DistBackendError: ncclInvalidUsage"}]})  # fmt: skip
    with pytest.raises(dc.Skipped, match=r"found no way .*hostid: rank 1: DistBackendError: ncclInvalidUsage"):
        dc.step_nccl_two_ranks(dc.Ctx(True, tmp_path, 60.0, H200))
