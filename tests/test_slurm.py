"""SLURM mode: pure builders (always run), and real sweeps on the localhost cluster (marker ``slurm``).

The ``slurm`` tests need a SLURM cluster that answers ``sinfo``: ``scripts/slurm-up.sh`` starts a
throw-away one (two emulated nodes n1, n2 with 4 fake GPUs each, accounting). Without one they
skip, unless ``PNPSCALE_SLURM_REQUIRED=1`` (set by ``.ci/run``), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from pnpscale.cluster.slurm import (
    error_line,
    executor_parameters,
    failure_text,
    group_points,
    job_shape,
    parse_sacct,
    sbatch_refusal,
    sbatch_test_command,
    task_record,
)
from pnpscale.core import layout
from pnpscale.core.config import ConfigError, register_schema, resolve_spec
from pnpscale.sweep.cli import CONF, resume_command
from tests.helpers import TINY_2D, read_run, run_cli

CLUSTER_DEFAULTS = {
    "name": "slurm",
    "partition": None,
    "account": None,
    "qos": None,
    "constraint": None,
    "gpus_per_node": 4,
    "cpus_per_task": None,
    "mem_gb": None,
    "timeout_min": 60,
    "setup": [],
    "additional_parameters": {},
    "wait": True,
}

# --------------------------------------------------------------------------------------
# Pure builders
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "per_node", "shape"),
    [(1, 4, (1, 1)), (2, 4, (1, 2)), (3, 4, (1, 3)), (4, 4, (1, 4)), (8, 4, (2, 4)), (64, 4, (16, 4)),
     (8, 8, (1, 8)), (16, 8, (2, 8)), (5, 1, (5, 1))],
)  # fmt: skip
def test_job_shape(gpus, per_node, shape):
    s = job_shape(gpus, per_node)
    assert (s.nodes, s.tasks_per_node) == shape
    assert s.ranks == gpus and s.gpus_per_node == shape[1] and str(s) == f"{shape[0]}x{shape[1]}"


def test_job_shape_refuses_partial_nodes_and_bad_gpus_per_node():
    with pytest.raises(ConfigError) as e:
        job_shape(6, 4)
    assert str(e.value) == (
        "gpus=6: with cluster.gpus_per_node=4, allowed: 1..4 or a multiple of 4 "
        "(every node runs cluster.gpus_per_node ranks)"
    )
    with pytest.raises(ConfigError, match=r"^cluster.gpus_per_node=0: must be an integer >= 1$"):
        job_shape(2, 0)


def test_executor_parameters_minimal_golden():
    assert executor_parameters(2, CLUSTER_DEFAULTS) == {
        "name": "pnpscale-1x2",
        "nodes": 1,
        "tasks_per_node": 2,
        "gpus_per_node": 2,
        "timeout_min": 60,
    }


def test_executor_parameters_every_key_golden():
    cluster = {
        **CLUSTER_DEFAULTS,
        "partition": "gpu",
        "account": "abc",
        "qos": "high",
        "constraint": "a100",
        "cpus_per_task": 8,
        "mem_gb": 64,
        "timeout_min": 30,
        "setup": ["module load cuda/12.4", "export NCCL_IB_DISABLE=0"],
        "additional_parameters": {"exclusive": True, "reservation": "bench"},
    }
    assert executor_parameters(8, cluster) == {
        "name": "pnpscale-2x4",
        "nodes": 2,
        "tasks_per_node": 4,
        "gpus_per_node": 4,
        "timeout_min": 30,
        "cpus_per_task": 8,
        "mem_gb": 64,
        "slurm_partition": "gpu",
        "slurm_account": "abc",
        "slurm_qos": "high",
        "slurm_constraint": "a100",
        "slurm_setup": ["module load cuda/12.4", "export NCCL_IB_DISABLE=0"],
        "slurm_additional_parameters": {"exclusive": True, "reservation": "bench"},
    }


def test_executor_parameters_are_accepted_by_submitit(tmp_path):
    """submitit (with its mocked ``srun``) accepts every parameter and renders the sbatch script."""
    import submitit
    from submitit.slurm.test_slurm import mocked_slurm

    cluster = {**CLUSTER_DEFAULTS, "partition": "gpu", "mem_gb": 16, "setup": ["module load x"],
               "additional_parameters": {"exclusive": True}}  # fmt: skip
    with mocked_slurm():
        executor = submitit.AutoExecutor(folder=tmp_path / "%j", cluster="slurm", slurm_max_num_timeout=0)
        executor.update_parameters(**executor_parameters(8, cluster))
        text = executor._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=60", "#SBATCH --mem=16GB",
                 "#SBATCH --job-name=pnpscale-2x4", "#SBATCH --exclusive", "module load x"):  # fmt: skip
        assert line in text.splitlines(), line


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"cpus_per_task": 0}, "cluster.cpus_per_task=0: must be an integer >= 1, or null"),
        ({"mem_gb": -1}, "cluster.mem_gb=-1: must be an integer >= 1, or null"),
        ({"timeout_min": 0}, "cluster.timeout_min=0: must be an integer >= 1 (minutes)"),
        ({"additional_parameters": {"nodes": 3}}, "cluster.additional_parameters.nodes=3: set from gpus and"),
        ({"additional_parameters": {"ntasks-per-node": 3}}, "cluster.additional_parameters.ntasks-per-node=3"),
        ({"additional_parameters": {"time": 5}}, "cluster.additional_parameters.time=5: use cluster.timeout_min"),
    ],
)
def test_executor_parameters_refuse_bad_cluster_keys(cluster, message):
    with pytest.raises(ConfigError) as e:
        executor_parameters(2, {**CLUSTER_DEFAULTS, **cluster})
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_group_points_one_array_per_resource_set():
    params = [executor_parameters(g, CLUSTER_DEFAULTS) for g in (1, 2, 4, 8, 2, 8)]
    groups = group_points(params)
    assert [(p["nodes"], p["tasks_per_node"], members) for p, members in groups] == [
        (1, 1, [0]),
        (1, 2, [1, 4]),
        (1, 4, [2]),
        (2, 4, [3, 5]),
    ]
    # a key that differs (here the time limit) splits a resource set
    other = executor_parameters(2, {**CLUSTER_DEFAULTS, "timeout_min": 5})
    assert len(group_points([params[1], other])) == 2


def test_sbatch_test_command_golden():
    params = executor_parameters(
        8,
        {**CLUSTER_DEFAULTS, "partition": "gpu", "account": "abc", "cpus_per_task": 4, "mem_gb": 32,
         "setup": ["module load x"], "additional_parameters": {"exclusive": True, "mail_type": "END"}},
    )  # fmt: skip
    assert sbatch_test_command(params) == [
        "sbatch", "--test-only", "--job-name=pnpscale-2x4", "--nodes=2", "--ntasks-per-node=4",
        "--gpus-per-node=4", "--time=60", "--cpus-per-task=4", "--mem=32GB", "--partition=gpu", "--account=abc",
        "--exclusive", "--mail-type=END", "--output=/dev/null", "--wrap=true",
    ]  # fmt: skip


def test_sbatch_refusal_keeps_slurms_reason():
    assert sbatch_refusal("sbatch: error: Batch job submission failed: Node count specification invalid\n") == (
        "Batch job submission failed: Node count specification invalid"
    )
    assert sbatch_refusal("allocation failure: Node count specification invalid\n") == (
        "allocation failure: Node count specification invalid"
    )


def test_task_record_plain_job_golden():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_PARTITION": "debug",
        "SUBMITIT_FOLDER": "/o/s/.submitit/%j",
    }
    assert task_record(env, "n1", 31337) == {
        "job_id": "42",
        "raw_job_id": "42",
        "partition": "debug",
        "nodes": 1,
        "tasks_per_node": 2,
        "num_tasks": 2,
        "nodelist": "n1",
        "master": "n1:31337",
        "logs": [
            {"rank": 0, "stdout": "/o/s/.submitit/42/42_0_log.out", "stderr": "/o/s/.submitit/42/42_0_log.err"},
            {"rank": 1, "stdout": "/o/s/.submitit/42/42_1_log.out", "stderr": "/o/s/.submitit/42/42_1_log.err"},
        ],
    }


def test_sacct_parsing_and_failure_text():
    info = parse_sacct("12_1|TIMEOUT|0:0|TimeLimit|00:30:02|n[1-2]\n")
    assert info == {
        "job_id": "12_1", "state": "TIMEOUT", "exit_code": "0:0", "reason": "TimeLimit", "elapsed": "00:30:02",
        "nodelist": "n[1-2]",
    }  # fmt: skip
    assert parse_sacct("") == {}
    assert failure_text("12_1", "TIMEOUT", info, {}, "/o/12_1_0_log.err") == (
        "SLURM job 12_1 TIMEOUT (reason: TimeLimit); log: /o/12_1_0_log.err"
    )
    text = failure_text("9", "FAILED", {"exit_code": "1:0", "reason": "None"}, {1: "ValueError: x", 0: "E: y"}, None)
    assert text == "SLURM job 9 FAILED (exit code 1:0); rank 0: E: y; rank 1: ValueError: x"
    assert error_line("Traceback (most recent call last):\n  File 'x'\nRuntimeError: boom\n\n") == "RuntimeError: boom"


def test_resume_command_reuses_the_sweep_dir_and_quotes():
    cmd = resume_command(
        ["gpus=1,2,4,8", "cluster=slurm", "problem.nc=[4,8,8,8]", "resume=false"],
        ["hydra.mode=MULTIRUN", "hydra.sweep.dir=/old", "hydra.verbose=true"],
        "/o/2026-01-01_00-00-00",
    )
    assert cmd == (
        "python -m pnpscale -m gpus=1,2,4,8 cluster=slurm 'problem.nc=[4,8,8,8]' hydra.verbose=true "
        "hydra.sweep.dir=/o/2026-01-01_00-00-00"
    )


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    register_schema()
    import hydra_plugins.pnpscale_plugins.launcher  # noqa: F401 - registers the launchers
    import hydra_plugins.pnpscale_plugins.slurm_launcher  # noqa: F401

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_cluster_slurm_selects_the_launcher_and_multirun():
    cfg = _compose("cluster=slurm", "cluster.partition=gpu")
    assert cfg.hydra.launcher._target_ == "hydra_plugins.pnpscale_plugins.slurm_launcher.PnpscaleSlurmLauncher"
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert cfg.cluster.name == "slurm" and cfg.cluster.partition == "gpu" and cfg.cluster.wait is True
    local = _compose()
    assert local.cluster.name == "local"
    assert local.hydra.launcher._target_.endswith("PnpscaleBasicLauncher")


def test_completed_run_matches_on_the_stored_resolution_of_scale_auto(tmp_path):
    """The one resume rule (local and SLURM): same spec -> skip; another spec -> refused, never overwritten."""
    from omegaconf import OmegaConf

    from pnpscale.sweep.point import complete_run as completed_run

    cfg = _compose("cluster=slurm", "gpus=2")
    task_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    assert task_cfg.scale == "auto"
    # the compute node had CUDA: auto -> paper; the submitting machine cannot know it
    spec = resolve_spec(task_cfg, cuda_available=True)
    stored = {"status": "complete", "scale": spec.scale, "fingerprint": spec.fingerprint()}
    from tests.test_report import fake_run  # a readable complete run (a damaged one is run again)

    fake_run(tmp_path, "2d", "inference", {"gradient": [(1.0, 0.0)] * 2})
    layout.write_json(tmp_path / layout.RUN_JSON, {**layout.read_json(tmp_path / layout.RUN_JSON), **stored})
    assert {k: completed_run(tmp_path, task_cfg)[k] for k in stored} == stored
    with pytest.raises(ConfigError, match="holds a complete run of another spec"):
        completed_run(tmp_path, OmegaConf.merge(task_cfg, {"iterations": 7}))
    assert completed_run(tmp_path, OmegaConf.merge(task_cfg, {"iterations": 7}), resume=False) is None
    layout.write_json(tmp_path / layout.RUN_JSON, {**layout.read_json(tmp_path / layout.RUN_JSON), "status": "failed"})
    assert completed_run(tmp_path, task_cfg) is None
    assert completed_run(tmp_path / "missing", task_cfg) is None


def test_bad_slurm_points_stop_before_anything_is_submitted(tmp_path):
    """Needs no cluster: every point is validated before SLURM is asked anything."""
    proc = run_cli("-m", "gpus=2,6", "cluster=slurm", "cluster.gpus_per_node=4", root=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "gpus=6: with cluster.gpus_per_node=4, allowed: 1..4 or a multiple of 4" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("run.json"))


def test_slurm_points_in_use_or_without_room_are_refused_before_submission(tmp_path, monkeypatch):
    """Needs no cluster: the local launcher's checks before a point starts, on the SLURM path. A run folder another
    process holds is refused naming the holder, nothing written into it; a disk under 32 KiB free fails the point
    with the room line, recorded in its run.json; neither is submitted."""
    from hydra.core.utils import JobStatus

    from hydra_plugins.pnpscale_plugins.slurm_launcher import PnpscaleSlurmLauncher, _label, _Point
    from pnpscale.core.lock import FolderLock
    from pnpscale.sweep import point as point_module

    points = []
    for i, gpus in enumerate((1, 2, 4)):
        cfg = _compose("cluster=slurm", f"gpus={gpus}", *TINY_2D, f"hydra.sweep.dir={tmp_path}",
                       f"output.root={tmp_path}")  # fmt: skip
        points.append(_Point(i, [f"gpus={gpus}"], cfg, tmp_path / str(cfg.hydra.sweep.subdir), _label(cfg)))
    monkeypatch.setattr(point_module, "free_bytes", lambda path: 20 * 1024 if "gpus=2" in str(path) else None)
    rets: dict = {}
    with FolderLock(points[2].run_dir):
        kept = PnpscaleSlurmLauncher._startable(points, rets)
    assert kept == [points[0]] and sorted(rets) == [1, 2]
    assert rets[2].status == JobStatus.FAILED
    assert rets[2]._return_value.error.startswith(f"refused, {points[2].run_dir} is in use by pid {os.getpid()} ")
    assert sorted(p.name for p in points[2].run_dir.iterdir()) == []  # the holder's folder: nothing written
    full = read_run(points[1].run_dir)
    assert rets[1].status == JobStatus.FAILED and full["status"] == "failed", full
    assert full["error"] == (
        f"cannot write its run folder: {points[1].run_dir}: 20 KiB free on its disk, fewer than the 32 KiB a point "
        "needs to record its status (ENOSPC: No space left on device); nothing was started"
    )
    assert not (points[1].run_dir / layout.LOCK).exists()


# --------------------------------------------------------------------------------------
# Real SLURM (localhost cluster of scripts/slurm-up.sh)
# --------------------------------------------------------------------------------------


def _sinfo_problem() -> str | None:
    if shutil.which("sinfo") is None:
        return "sinfo not found"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P %D %T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if proc.returncode != 0:
        return "sinfo failed: " + " ".join(proc.stderr.split())[:200]
    return None


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    problem = _sinfo_problem()
    if problem is None:
        return
    why = f"no SLURM cluster answers ({problem}); start the localhost one with: bash scripts/slurm-up.sh"
    if os.environ.get("PNPSCALE_SLURM_REQUIRED") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _sacct_steps(job_id: str) -> list[dict[str, str]]:
    out = subprocess.run(
        ["sacct", "-j", job_id, "-n", "--parsable2", "-o", "JobID,NNodes,NTasks,State,AllocTRES"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    keys = ("job_id", "nodes", "ntasks", "state", "tres")
    return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines() if line.strip()]


def _slurm_args(root: Path, *extra: str) -> list[str]:
    return ["cluster=slurm", *TINY_2D, f"hydra.sweep.dir={root / 'outputs' / 'sweep'}", *extra]


def _point_dirs(root: Path) -> dict[int, Path]:
    return {read_run(p.parent)["gpus"]: p.parent for p in (root / "outputs" / "sweep").glob("problem=*/**/run.json")}


@pytest.fixture(scope="module")
def slurm_sweep(slurm_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    t0 = time.monotonic()
    # one GPU (no backend), one node of several tasks, two nodes: each job shape once (a 4-rank point would hold
    # the 8-rank one back until it ends: ~20 s of the suite for a shape the 2-rank point already has)
    proc = run_cli("-m", "gpus=1,2,8", *_slurm_args(root, "cluster.gpus_per_node=4"), root=root, timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"slurm sweep gpus=1,2,8: {elapsed:.1f} s", file=sys.stderr)
    return root, proc, _point_dirs(root)


@pytest.mark.slurm
def test_sweep_jobs_have_one_shape_per_point(slurm_sweep):
    _, _, dirs = slurm_sweep
    assert set(dirs) == {1, 2, 8}
    expected = {1: ("1", "1"), 2: ("1", "2"), 8: ("2", "8")}
    for gpus, d in dirs.items():
        run = read_run(d)
        assert run["status"] == "complete" and run["world_size"] == gpus
        assert run["backend"] == ("gloo" if gpus > 1 else "none")
        steps = {s["job_id"].split(".")[-1]: s for s in _sacct_steps(run["slurm"]["job_id"])}
        step = steps["0"]  # srun's step: one task per rank
        assert (step["nodes"], step["ntasks"]) == expected[gpus], (gpus, steps)
        assert f"gres/gpu={gpus}" in step["tres"], step
        assert run["slurm"]["nodes"] == job_shape(gpus, 4).nodes
        assert run["slurm"]["tasks_per_node"] == job_shape(gpus, 4).tasks_per_node
        # issue 19: no rank is a bad fork (CUDA touched before its process was forked), and a rank
        # that sees GPUs sees one: bound by SLURM_LOCALID before its first CUDA call
        procs = run["processes"]
        assert [p["rank"] for p in procs] == list(range(gpus)) and not any(p["cuda_bad_fork"] for p in procs)
        assert all("," not in (p["cuda_visible_devices"] or "") for p in procs), procs


@pytest.mark.slurm
def test_slurm_run_folders_match_a_local_run(slurm_sweep, tmp_path):
    root, proc, dirs = slurm_sweep
    local = run_cli("gpus=2", *TINY_2D, "report=false", root=tmp_path, timeout=240)
    assert local.returncode == 0, local.stderr[-3000:]
    (local_dir,) = [p.parent for p in (tmp_path / "outputs").glob("**/run.json")]
    slurm_dir = dirs[2]
    local_run, slurm_run = read_run(local_dir), read_run(slurm_dir)
    assert set(local_run) | {"slurm"} == set(slurm_run)
    assert local_run["fingerprint"] == slurm_run["fingerprint"] and local_run["spec"] == slurm_run["spec"]
    for name in (*layout.TABLES, layout.RUN_JSON, ".hydra", layout.LOGS_DIR):
        assert (slurm_dir / name).exists(), name
    for table in layout.TABLES:
        local_df, slurm_df = pd.read_parquet(local_dir / table), pd.read_parquet(slurm_dir / table)
        assert list(local_df.columns) == list(slurm_df.columns) and len(local_df) == len(slurm_df), table
    # .hydra/ once, by rank 0; every rank's log linked from logs/
    assert sorted(p.name for p in (slurm_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    for r in range(2):
        for suffix in ("out", "err"):
            assert (slurm_dir / layout.LOGS_DIR / f"rank{r}.{suffix}").resolve().is_file()
    rank0, rank1 = ((slurm_dir / "logs" / f"rank{r}.out").read_text() for r in range(2))
    assert "iteration 3/3" in rank0 and "rank(s), run folder" in rank0
    assert "iteration" not in rank1 and "run folder" not in rank1  # other ranks: no Hydra job, no progress
    # the sweep report, as after a local sweep
    report = root / "outputs" / "sweep" / layout.REPORT_DIR
    try:
        import pnpscale.results.report  # noqa: F401
    except ImportError:
        pytest.skip("pnpscale.report not available")
    assert report.is_dir(), proc.stderr[-2000:]


@pytest.mark.slurm
def test_killed_job_is_reported_failed_and_a_rerun_completes_only_it(slurm_cluster, tmp_path):
    # rank 0 sleeps 2 s per section "gradient": each job runs long enough to be cancelled mid-run
    args = _slurm_args(tmp_path, "inject.rank=0", "inject.section=gradient", "inject.delay_s=2", "report=false")
    cmd = [sys.executable, "-m", "pnpscale", "-m", "gpus=1,2", *args, f"output.root={tmp_path / 'outputs'}"]
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as sweep:
        # its own job, by the id the launcher logged (a shared cluster may run other pnpscale-1x2 jobs)
        _sweep_lines(sweep, lambda ls: 2 in _submitted(ls), lines)
        job_id = _submitted(lines)[2]
        deadline = time.monotonic() + 180
        while _squeue_state(job_id) != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _squeue_state(job_id) == "RUNNING", "the gpus=2 job never ran"
        time.sleep(2)
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        t_cancel = time.monotonic()
        out = "".join(lines) + sweep.communicate(timeout=180)[0]
        reported_s = time.monotonic() - t_cancel
    assert sweep.returncode != 0, out[-3000:]
    assert reported_s < 60, reported_s
    point = "problem=2d mode=inference num_operators=4 gpus=2"
    assert f"gpus=2: FAILED: {point} failed: SLURM job {job_id} CANCELLED" in out
    assert "to re-run only the failed points: python -m pnpscale -m gpus=1,2" in out
    dirs = _point_dirs(tmp_path)
    failed, done = read_run(dirs[2]), read_run(dirs[1])
    assert done["status"] == "complete"
    assert failed["status"] == "failed" and failed["slurm"]["state"].startswith("CANCELLED")
    assert f"SLURM job {job_id} CANCELLED" in failed["error"]
    assert failed["slurm"]["logs"][0]["stderr"] in failed["error"]
    assert not any((dirs[2] / t).exists() for t in layout.TABLES)
    # the same command again, into the same sweep folder: only the missing point runs
    rerun = run_cli("-m", "gpus=1,2", *args, root=tmp_path, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = rerun.stdout + rerun.stderr
    assert "gpus=1: skipped, complete run in" in said
    assert said.count("submitted (") == 1 and "gpus=2: SLURM job" in said
    assert read_run(dirs[2])["status"] == "complete"
    assert read_run(dirs[1])["finished_at"] == done["finished_at"]


@pytest.mark.slurm
def test_impossible_request_fails_at_submission_with_slurms_message(slurm_cluster, tmp_path):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
    # 12 ranks on nodes of 4 GPUs = 3 nodes; the partition has 2
    proc = run_cli("-m", "gpus=1,12", *_slurm_args(tmp_path, "cluster.gpus_per_node=4"), root=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "SLURM refused the sweep, nothing was submitted" in proc.stderr
    assert "gpus=12: SLURM refused 3x4 (nodes x tasks):" in proc.stderr
    assert "Node count specification invalid" in proc.stderr  # SLURM's own words
    assert "Traceback" not in proc.stderr
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
    assert set(after) <= set(before)
    sweep = tmp_path / "outputs" / "sweep"
    assert not sweep.exists() or not any(sweep.rglob("*.pkl"))
    assert json.dumps(list(sweep.rglob("run.json")) if sweep.exists() else []) == "[]"


@pytest.mark.slurm
def test_validation_suite_runs_as_one_slurm_job(slurm_cluster, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "validate"
    proc = subprocess.run(
        [sys.executable, "-m", "pnpscale.validate", "--slurm", "--out", str(out), "--iterations", "3",
         "--payloads", "16384,262144,4194304,33554432", "cluster.timeout_min=10"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "validation submitted as SLURM job" in proc.stdout and "PASSED" in proc.stdout
    assert (out / "validate.json").is_file() and list((out / ".submitit").glob("*_log.out"))


def _sweep_lines(proc: subprocess.Popen, until, lines: list[str], timeout_s: float = 240) -> None:
    """Read the sweep's merged output into ``lines`` until ``until(lines)`` holds (fails after ``timeout_s``)."""
    end = time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line)
        if until(lines):
            return
        if time.monotonic() > end:
            break
    pytest.fail("the sweep never got there:\n" + "".join(lines)[-4000:])


def _submitted(lines: list[str]) -> dict[int, str]:
    """gpus -> SLURM job id, from the launcher's ``<point> gpus=N: SLURM job ID submitted`` lines."""
    import re

    found = (re.search(r"gpus=(\d+): SLURM job (\S+) submitted", line) for line in lines)
    return {int(m.group(1)): m.group(2) for m in found if m}


def _sweep_acted_on(cmd: list[str], cwd: Path, act) -> tuple[int, str, dict[int, str]]:
    """Run the sweep ``cmd``; once two jobs are submitted, call ``act(proc, ids)`` (ids: gpus -> SLURM job id);
    returns (exit code, merged output, ids). The sweep is killed if the test fails before it ends."""
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            _sweep_lines(proc, lambda ls: len(_submitted(ls)) == 2, lines)
            ids = _submitted(lines)
            act(proc, ids)
            out = "".join(lines) + proc.communicate(timeout=240)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, out, ids


def _squeue_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout.strip()  # fmt: skip


@pytest.mark.slurm
def test_a_stopped_slurm_sweep_records_its_pending_point_not_run(slurm_cluster, tmp_path):
    """Ctrl-C while one job runs and the other waits for nodes (gpus=8 needs both nodes' 4 GPUs, gpus=1 holds
    one): both are cancelled; the running one is recorded failed (cancelled), the pending one ``not_run`` (as
    the local launcher records a point a stop came before), the summary and the resume command are logged;
    exit 130, no traceback, no job left in SLURM."""
    sweep = tmp_path / "outputs" / "sweep"
    args = _slurm_args(tmp_path, "cluster.gpus_per_node=4", "inject.rank=0", "inject.section=gradient",
                       "inject.delay_s=20", "report=false")  # fmt: skip
    cmd = [sys.executable, "-m", "pnpscale", "-m", "gpus=1,8", *args, f"output.root={tmp_path / 'outputs'}"]
    states: dict[int, str] = {}

    def stop_when_one_runs_and_one_waits(proc: subprocess.Popen, ids: dict[int, str]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states.update({g: _squeue_state(j) for g, j in ids.items()})
            if sorted(states.values()) == ["PENDING", "RUNNING"]:
                break
            time.sleep(0.5)
        assert sorted(states.values()) == ["PENDING", "RUNNING"], states
        time.sleep(1)
        proc.send_signal(signal.SIGINT)

    code, out, ids = _sweep_acted_on(cmd, tmp_path, stop_when_one_runs_and_one_waits)
    assert code == 130, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    (ran,) = [g for g, s in states.items() if s == "RUNNING"]
    (waited,) = [g for g, s in states.items() if s == "PENDING"]
    dirs = {read_run(p.parent)["gpus"]: p.parent for p in sweep.glob("problem=*/**/run.json")}
    failed, not_run = read_run(dirs[ran]), read_run(dirs[waited])
    assert failed["status"] == "failed", failed
    assert failed["error"].startswith(f"cancelled: the sweep was interrupted (SIGINT); SLURM job {ids[ran]}")
    assert not_run["status"] == layout.STATUS_NOT_RUN, not_run
    assert not_run["error"] == "not run: the sweep was interrupted (SIGINT) before this point started"
    assert not any((dirs[g] / t).exists() for g in dirs for t in layout.TABLES)
    label = f"problem=2d mode=inference num_operators=4 gpus={waited}"
    assert f"interrupted (SIGINT): 2 unfinished SLURM job(s) cancelled, 1 recorded as failed; 1 sweep point(s) " \
           f"not run: {label}" in out, out[-4000:]  # fmt: skip
    assert f"2 sweep point(s): 0 complete, 1 failed, 1 not run ({label})" in out
    assert "to resume (complete points are skipped): python -m pnpscale -m gpus=1,8" in out
    assert all(_squeue_state(j) == "" for j in ids.values())


@pytest.mark.slurm
def test_a_hung_rank_of_a_slurm_job_is_named_with_the_timeout_that_fired(slurm_cluster, tmp_path):
    """Rank 1 sleeps 20 s inside its first denoiser; rank 0's collective times out after dist.timeout_s=5: the
    failed point names rank 1 and where its heartbeat (in the shared run folder) last saw it, as a local launch
    does, before SLURM's own account of the job."""
    args = _slurm_args(tmp_path, "gpus=2", "inject.rank=1", "inject.section=denoiser", "inject.delay_s=20",
                       "dist.timeout_s=5", "report=false")  # fmt: skip
    proc = run_cli(*args, root=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = "rank 1 did not arrive within dist.timeout_s=5 s: last seen in section 'denoiser' of iteration 0"
    assert said in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    (d,) = _point_dirs(tmp_path).values()
    run = read_run(d)
    assert run["status"] == "failed" and run["error"].startswith(said), run["error"][:500]
    assert "SLURM job" in run["error"].splitlines()[0]


@pytest.mark.slurm
def test_a_slurm_job_cancelled_while_pending_is_not_run_and_a_point_without_room_fails(slurm_cluster, tmp_path):
    """One sweep, two faults. scancel of a job still waiting for nodes (gpus=8 needs both nodes' 4 GPUs, gpus=1
    holds one; SLURM's record: no node ever allocated): its point never ran, so ``run.json`` says ``not_run``, not
    a failure. The local launcher's room check (32 KiB) on the SLURM path: the gpus=2 folder is a full disk, so
    that point fails with the local launcher's one line naming it, the folder and ENOSPC, and is not submitted.
    gpus=1 completes; the last line names both; exit 1."""
    from tests.test_faults import full_point_folder

    sweep = tmp_path / "outputs" / "sweep"
    with full_point_folder(sweep) as (full, filler):
        args = _slurm_args(tmp_path, "cluster.gpus_per_node=4", "inject.rank=0", "inject.section=gradient",
                           "inject.delay_s=3", "report=false")  # fmt: skip
        cmd = [sys.executable, "-m", "pnpscale", "-m", "gpus=1,2,8", *args, f"output.root={tmp_path / 'outputs'}"]

        def cancel_the_pending_one(proc: subprocess.Popen, ids: dict[int, str]) -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and _squeue_state(ids[1]) != "RUNNING":
                time.sleep(0.5)
            assert (_squeue_state(ids[1]), _squeue_state(ids[8])) == ("RUNNING", "PENDING")
            subprocess.run(["scancel", ids[8]], check=True, timeout=30)

        code, out, ids = _sweep_acted_on(cmd, tmp_path, cancel_the_pending_one)
        assert code == 1, out[-4000:]
        assert "Traceback" not in out and "Logging error" not in out, out[-4000:]
        assert set(ids) == {1, 8} and out.count("submitted (") == 2  # gpus=2: never submitted
        said = [line for line in out.splitlines() if line.startswith("pnpscale: error: ")]
        assert said[0] == (f"pnpscale: error: problem=2d mode=inference num_operators=4 gpus=2: no status record "
                           f"could be written in {full} (ENOSPC: No space left on device); the point failed"), out
        assert sorted(p.name for p in full.iterdir()) == [filler.name]  # nothing half-written, no lock left
        dirs = {read_run(p.parent)["gpus"]: p.parent for p in sweep.glob("problem=*/**/run.json")}
        assert set(dirs) == {1, 8} and read_run(dirs[1])["status"] == "complete"
        not_run = read_run(dirs[8])
        assert not_run["status"] == layout.STATUS_NOT_RUN, not_run
        assert not_run["error"].startswith(f"not run: SLURM job {ids[8]} CANCELLED"), not_run["error"]
        assert not_run["error"].endswith("before it started"), not_run["error"]
        label = "problem=2d mode=inference num_operators=4 gpus=8"
        assert f"3 sweep point(s): 1 complete, 1 failed, 1 not run ({label})" in out, out[-4000:]
        assert len(said) == 2 and said[1].startswith("pnpscale: error: 1 of 3 sweep point(s) failed (gpus=2 "), said
        assert f"; 1 of 3 sweep point(s) not run ({label}); each run.json under {sweep} says why; to re-run only " \
               "the points not complete: python -m pnpscale -m gpus=1,2,8" in said[1], said  # fmt: skip


# ------------------------------------------------------ issue 36: the SLURM path survives its own faults

#: A point of ~12 s of measured iterations (0.5 s of busy delay each), long enough to act on while it runs.
_SLOW_POINT = ["gpus=1", "iterations=24", "inject.rank=0", "inject.section=gradient", "inject.delay_s=0.5"]


def _at_iteration(sweep: Path, job_id: str, n: int, timeout_s: float = 300) -> None:
    """Wait until rank 0 of ``job_id`` logged its iteration ``n`` (its submitit log)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        logs = list(sweep.glob(f".submitit/{job_id}/*_0_log.out"))
        if logs and f"iteration {n}/" in logs[0].read_text(errors="replace"):
            return
        time.sleep(0.2)
    pytest.fail(f"SLURM job {job_id} never reached iteration {n}")


def _first_job(proc: subprocess.Popen, lines: list[str]) -> str:
    _sweep_lines(proc, lambda ls: bool(_submitted(ls)), lines)
    return next(iter(_submitted(lines).values()))


def _slow_sweep(tmp_path: Path, iterations: int = 24) -> tuple[Path, list[str], dict[str, str]]:
    """The sweep folder, command and environment of the one-point SLURM sweep slow enough to act on mid-run
    (``iterations`` of at least 0.5 s each: rank 0 sleeps 0.5 s in each gradient section)."""
    from tests.helpers import ROOT

    point = [f"iterations={iterations}" if a.startswith("iterations=") else a for a in _SLOW_POINT]
    cmd = [sys.executable, "-m", "pnpscale", "-m", *_slurm_args(tmp_path, *point)]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}
    return tmp_path / "outputs" / "sweep", cmd, env


@pytest.mark.slurm
def test_a_suspended_iteration_is_flagged_and_the_job_waited_for(slurm_cluster, tmp_path):
    """``scontrol suspend`` for 8 s during a measured iteration: the job is not taken as ended (submitit's
    watcher did: recorded failed while it went on); once it completes, sacct's Suspended time flags that
    iteration in run.json (anomaly ``slurm_suspended``), the report lists it."""
    sweep, cmd, env = _slow_sweep(tmp_path)
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:  # fmt: skip
        try:
            job = _first_job(proc, lines)
            _at_iteration(sweep, job, 6)
            subprocess.run(["scontrol", "suspend", job], check=True, timeout=30)
            time.sleep(8)
            subprocess.run(["scontrol", "resume", job], check=True, timeout=30)
            out = "".join(lines) + proc.communicate(timeout=300)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-4000:]
    # sacct's whole seconds of suspension: 8 s of sleep between two scontrol calls on a loaded machine read 8-10
    # (the SUSPENDED line: only when submitit's throttled sacct sees the state within the 8 s)
    assert re.search(rf"SLURM job {job} suspended (8|9|10) s \(sacct Suspended\)", out), out[-4000:]
    (run,) = _point_dirs(tmp_path).values()
    doc = read_run(run)
    assert doc["status"] == "complete"
    (flag,) = [a for a in doc["anomalies"] if a["kind"] == "slurm_suspended"]
    assert flag["count"] >= 1 and doc["slurm"]["suspended_s"] >= 7, doc["slurm"]
    walls = pd.read_parquet(run / layout.SECTIONS).query("not warmup").groupby("iteration")["section_s"].sum()
    for it in doc["slurm"]["suspended_iterations"]:
        assert walls[it] > walls.median() + 4  # the flagged iteration holds the suspension
    assert "anomaly slurm_suspended" in (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()


@pytest.mark.slurm
def test_a_resume_after_a_killed_launcher_cancels_its_job_and_runs_the_point(slurm_cluster, tmp_path):
    """SIGKILL of the launcher while its job runs: the job id was recorded in the run folder as sbatch
    returned, so the resume cancels that job (the folder used to be refused as in use) and runs the point.
    48 iterations: with 24, the job once ended (21 x 0.5 s after iteration 3) before the resume, started on a
    loaded machine, looked at it."""
    sweep, cmd, env = _slow_sweep(tmp_path, iterations=48)
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:  # fmt: skip
        job = _first_job(proc, lines)
        _at_iteration(sweep, job, 3)
        proc.kill()
    assert _squeue_state(job) == "RUNNING"
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert f"SLURM job {job} of a launcher that is gone" in out and "cancelled, the point runs again" in out, out
    assert _squeue_state(job) == ""
    (run,) = _point_dirs(tmp_path).values()
    assert read_run(run)["status"] == "complete" and read_run(run)["slurm"]["job_id"] != job
