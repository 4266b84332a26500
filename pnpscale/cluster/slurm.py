"""SLURM side of pnpscale: pure builders for the launcher, and the entry point of one SLURM task.

The launcher plugin (``hydra_plugins/pnpscale_plugins/slurm_launcher.py``) turns every sweep point
into one SLURM job through submitit; this module holds what it computes, as plain functions over
plain data (unit-tested against expected dicts in ``tests/test_slurm.py``):

- :func:`job_shape`: nodes = ceil(gpus / gpus_per_node), tasks (ranks) per node =
  min(gpus, gpus_per_node), one GPU per rank;
- :func:`executor_parameters`: the submitit ``AutoExecutor`` parameters of one point (units:
  ``timeout_min`` minutes, ``mem_gb`` GB per node);
- :func:`group_points`: points with identical parameters share one job array;
- :func:`sbatch_test_command`: ``sbatch --test-only`` for the same request, so that SLURM itself
  refuses an impossible request before anything is submitted;
- :func:`task_record`, :func:`parse_sacct`, :func:`failure_text`; the resume command is
  :func:`pnpscale.sweep.cli.resume_command`.

Inside a job every SLURM task is one rank: :func:`run_rank` exports
``submitit.helpers.TorchDistributedEnvironment`` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and calls :func:`pnpscale.rank.worker.rank_main` (which, on nccl, points each
rank's NCCL log at ``nccl/rank<r>.log`` in the run folder). Only rank 0 writes the run folder;
every task's stdout/stderr are submitit's per-task log files, whose paths rank 0 records in
``run.json`` (``slurm.logs``) and links from ``logs/``.

Resume compares fingerprints (:meth:`pnpscale.core.config.RunSpec.fingerprint`). ``scale=auto`` is
resolved on the compute node (paper on CUDA, small on CPU), which the submitting machine cannot
know: :func:`pnpscale.sweep.point.complete_run` resolves the point the way the stored run was resolved (its
``run.json`` ``scale``) and compares that fingerprint with the stored one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pnpscale.cluster.base import Cluster
from pnpscale.cluster.local import RankFailed, failed_times, hung_message
from pnpscale.cluster.peer_errors import echo_kind
from pnpscale.core import layout
from pnpscale.core.config import ConfigError, RunSpec, plain
from pnpscale.core.errors import TIMEOUT
from pnpscale.core.record import update_record
from pnpscale.rank.gpus import bind_gpu, nvml_device_count
from pnpscale.rank.group import MIN_CPUS_PER_GPU_RANK as MIN_CPUS_PER_GPU_TASK
from pnpscale.rank.process import kineto_config_env, rank_environment, threads_per_rank

#: Set (to "1") by the launcher in every SLURM task before pnpscale code runs there.
IN_TASK_ENV = "PNPSCALE_SLURM_TASK"
#: Job names are ``pnpscale-<nodes>x<tasks per node>``, e.g. ``pnpscale-2x4``.
JOB_NAME = "pnpscale"
#: sbatch options pnpscale sets itself; ``cluster.additional_parameters`` may not set them.
RESERVED_SBATCH = {
    "nodes": "set from gpus and cluster.gpus_per_node",
    "ntasks": "set from gpus and cluster.gpus_per_node",
    "ntasks_per_node": "set from gpus and cluster.gpus_per_node",
    "gpus": "set from gpus and cluster.gpus_per_node",
    "gpus_per_node": "use cluster.gpus_per_node",
    "gpus_per_task": "one GPU per rank is set from cluster.gpus_per_node",
    "gres": "GPUs are set from cluster.gpus_per_node",
    "array": "set by the launcher",
    "output": "set by submitit (per-task log files)",
    "error": "set by submitit (per-task log files)",
    "partition": "use cluster.partition",
    "account": "use cluster.account",
    "qos": "use cluster.qos",
    "constraint": "use cluster.constraint",
    "time": "use cluster.timeout_min",
    "cpus_per_task": "use cluster.cpus_per_task",
    "mem": "use cluster.mem_gb",
    "job_name": "set by the launcher",
}
#: submitit (generic) parameter -> sbatch option, for :func:`sbatch_test_command`.
_SBATCH_OF = {
    "nodes": "nodes",
    "tasks_per_node": "ntasks-per-node",
    "gpus_per_node": "gpus-per-node",
    "timeout_min": "time",
    "cpus_per_task": "cpus-per-task",
    "name": "job-name",
    "slurm_partition": "partition",
    "slurm_account": "account",
    "slurm_qos": "qos",
    "slurm_constraint": "constraint",
}


@dataclass(frozen=True)
class JobShape:
    """Nodes and tasks of one point's job; one task (rank) per GPU."""

    nodes: int
    tasks_per_node: int

    @property
    def gpus_per_node(self) -> int:
        """GPUs requested per node: one per rank."""
        return self.tasks_per_node

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node

    def __str__(self) -> str:
        return f"{self.nodes}x{self.tasks_per_node}"


def job_shape(gpus: int, gpus_per_node: int) -> JobShape:
    """Nodes and tasks per node of a ``gpus``-rank job on nodes of ``gpus_per_node`` GPUs.

    ``nodes = ceil(gpus / gpus_per_node)``, ``tasks_per_node = min(gpus, gpus_per_node)``; a point
    spanning several nodes fills each of them, so ``gpus`` must then be a multiple of
    ``gpus_per_node`` (otherwise the job would have more tasks than ranks).

    Raises:
        ConfigError: ``gpus_per_node`` < 1, or ``gpus`` > ``gpus_per_node`` and not a multiple of it.

    >>> [str(job_shape(g, 4)) for g in (1, 2, 4, 8, 64)]
    ['1x1', '1x2', '1x4', '2x4', '16x4']
    """
    if not (isinstance(gpus_per_node, int) and gpus_per_node >= 1):
        raise ConfigError("cluster.gpus_per_node", gpus_per_node, "must be an integer >= 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ConfigError(
            "gpus",
            gpus,
            f"with cluster.gpus_per_node={gpus_per_node}, allowed: 1..{gpus_per_node} or a multiple of "
            f"{gpus_per_node} (every node runs cluster.gpus_per_node ranks)",
        )
    return JobShape(nodes=math.ceil(gpus / gpus_per_node), tasks_per_node=min(gpus, gpus_per_node))


def _optional_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "must be an integer >= 1, or null")
    return value


def cpus_per_task_warning(cluster: Mapping[str, Any]) -> str | None:
    """A warning when ``cluster.cpus_per_task`` may leave a GPU rank fewer than 4 CPUs, else ``None``.

    ``null`` takes the partition's default, often 1 CPU per task: the rank's main thread, NCCL's
    proxy and watchdog threads and CUPTI then share it, delaying kernel launches (measured as wait).
    The rank repeats the warning with the CPUs it really got.

    >>> cpus_per_task_warning({"cpus_per_task": 8}) is None
    True
    >>> cpus_per_task_warning({"cpus_per_task": None}).startswith("cluster.cpus_per_task=null")
    True
    """

    cpus = cluster.get("cpus_per_task")
    if cpus is not None and int(cpus) >= MIN_CPUS_PER_GPU_TASK:
        return None
    what = "null (the partition's default, often 1 CPU per task)" if cpus is None else f"{cpus}"
    return (
        f"cluster.cpus_per_task={what}: each GPU rank should have >= {MIN_CPUS_PER_GPU_TASK} CPUs (main thread, "
        f"NCCL proxy and watchdog threads, CUPTI); set cluster.cpus_per_task={MIN_CPUS_PER_GPU_TASK} or more"
    )


def executor_parameters(gpus: int, cluster: Mapping[str, Any]) -> dict[str, Any]:
    """submitit ``AutoExecutor(cluster="slurm")`` parameters of one point.

    Args:
        gpus: ranks of the point.
        cluster: the ``cluster`` config (keys of :class:`SlurmParams`):
            ``timeout_min`` in minutes, ``mem_gb`` in GB per node, ``cpus_per_task`` CPUs per rank,
            ``setup`` shell lines run before the ranks start, ``additional_parameters`` extra sbatch
            options (``{"exclusive": True}`` becomes ``--exclusive``).

    Returns:
        generic submitit keys (``nodes``, ``tasks_per_node``, ``gpus_per_node``, ``timeout_min``, ...)
        and ``slurm_``-prefixed ones; unset optional keys are left out.

    Raises:
        ConfigError: see :func:`job_shape`; ``cpus_per_task``/``mem_gb`` not a positive integer;
            ``timeout_min`` < 1; an ``additional_parameters`` key pnpscale sets itself.

    >>> p = executor_parameters(8, {"gpus_per_node": 4, "timeout_min": 30, "partition": "gpu"})
    >>> p["nodes"], p["tasks_per_node"], p["gpus_per_node"], p["timeout_min"], p["slurm_partition"]
    (2, 4, 4, 30, 'gpu')
    """
    shape = job_shape(gpus, cluster.get("gpus_per_node", 4))
    timeout_min = cluster.get("timeout_min", 60)
    if isinstance(timeout_min, bool) or not isinstance(timeout_min, int) or timeout_min < 1:
        raise ConfigError("cluster.timeout_min", timeout_min, "must be an integer >= 1 (minutes)")
    params: dict[str, Any] = {
        "name": f"{JOB_NAME}-{shape}",
        "nodes": shape.nodes,
        "tasks_per_node": shape.tasks_per_node,
        "gpus_per_node": shape.gpus_per_node,
        "timeout_min": timeout_min,
    }
    cpus = _optional_int("cluster.cpus_per_task", cluster.get("cpus_per_task"))
    mem = _optional_int("cluster.mem_gb", cluster.get("mem_gb"))
    if cpus is not None:
        params["cpus_per_task"] = cpus
    if mem is not None:
        params["mem_gb"] = mem
    for key in ("partition", "account", "qos", "constraint"):
        value = cluster.get(key)
        if value is not None and str(value) != "":
            params[f"slurm_{key}"] = str(value)
    setup = [str(line) for line in (cluster.get("setup") or [])]
    if setup:
        params["slurm_setup"] = setup
    extra = dict(cluster.get("additional_parameters") or {})
    for key in extra:
        norm = str(key).replace("-", "_")
        if norm in RESERVED_SBATCH:
            raise ConfigError(f"cluster.additional_parameters.{key}", extra[key], RESERVED_SBATCH[norm])
    if extra:
        params["slurm_additional_parameters"] = extra
    return params


def group_points(parameters: Sequence[Mapping[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """Group point indexes by identical executor parameters (one job array per group).

    Groups come in the order of their first point; indexes keep the sweep order.

    >>> group_points([{"nodes": 1}, {"nodes": 2}, {"nodes": 1}])
    [({'nodes': 1}, [0, 2]), ({'nodes': 2}, [1])]
    """
    groups: dict[str, tuple[dict[str, Any], list[int]]] = {}
    for i, params in enumerate(parameters):
        key = json.dumps(params, sort_keys=True, default=str)
        groups.setdefault(key, (dict(params), []))[1].append(i)
    return list(groups.values())


def _sbatch_flag(key: str, value: Any) -> str:
    key = str(key).replace("_", "-")
    return f"--{key}" if value is True else f"--{key}={value}"


def sbatch_test_command(parameters: Mapping[str, Any]) -> list[str]:
    """``sbatch --test-only`` command for the request of :func:`executor_parameters`.

    SLURM checks the request against its partitions and limits and answers without submitting
    (exit code 1 and its reason, e.g. ``Node count specification invalid``, when impossible).

    >>> sbatch_test_command({"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4, "timeout_min": 30,
    ...                      "mem_gb": 16, "slurm_additional_parameters": {"exclusive": True}})
    ['sbatch', '--test-only', '--nodes=2', '--ntasks-per-node=4', '--gpus-per-node=4', '--time=30', '--mem=16GB', \
'--exclusive', '--output=/dev/null', '--wrap=true']
    """
    cmd = ["sbatch", "--test-only"]
    for key, value in parameters.items():
        if key in _SBATCH_OF:
            cmd.append(_sbatch_flag(_SBATCH_OF[key], value))
        elif key == "mem_gb":
            cmd.append(f"--mem={value}GB")
        elif key == "slurm_additional_parameters":
            cmd.extend(_sbatch_flag(k, v) for k, v in value.items())
    return [*cmd, "--output=/dev/null", "--wrap=true"]


def sbatch_refusal(output: str) -> str:
    """SLURM's own reason from ``sbatch`` output (its ``error:`` lines, joined), else the output.

    >>> sbatch_refusal("sbatch: error: Batch job submission failed: Node count specification invalid\\n")
    'Batch job submission failed: Node count specification invalid'
    """
    lines = [ln.split("error:", 1)[1].strip() for ln in output.splitlines() if "error:" in ln]
    return "; ".join(lines) if lines else " ".join(output.split())


def task_logs(folder: str, job_id: str, num_tasks: int) -> list[dict[str, Any]]:
    """submitit's stdout/stderr files of every task of a job (``folder`` may hold ``%j``).

    >>> task_logs("/s/.submitit/%j", "7_2", 2)[1]
    {'rank': 1, 'stdout': '/s/.submitit/7_2/7_2_1_log.out', 'stderr': '/s/.submitit/7_2/7_2_1_log.err'}
    """
    from submitit.core.utils import JobPaths

    out = []
    for t in range(num_tasks):
        paths = JobPaths(folder, job_id=job_id, task_id=t)
        out.append({"rank": t, "stdout": str(paths.stdout), "stderr": str(paths.stderr)})
    return out


def task_record(env: Mapping[str, str], master_addr: str, master_port: int) -> dict[str, Any]:
    """The ``slurm`` block of ``run.json``, from a task's environment (SLURM and submitit variables).

    >>> env = {"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2", "SLURM_NTASKS": "8",
    ...        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_PARTITION": "debug",
    ...        "SUBMITIT_FOLDER": "/s/.submitit/%j"}
    >>> r = task_record(env, "n1", 29500)
    >>> r["job_id"], r["nodes"], r["tasks_per_node"], r["master"], r["logs"][7]["stderr"]
    ('7_2', 2, 4, 'n1:29500', '/s/.submitit/7_2/7_2_7_log.err')
    """
    array_id, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_id}_{array_task}" if array_id else env.get("SLURM_JOB_ID", "")
    ntasks = int(env.get("SLURM_NTASKS", "1"))
    nodes = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    folder = env.get("SUBMITIT_FOLDER")
    return {
        "job_id": job_id,
        "raw_job_id": env.get("SLURM_JOB_ID"),
        "partition": env.get("SLURM_JOB_PARTITION"),
        "nodes": nodes,
        "tasks_per_node": ntasks // max(1, nodes),
        "num_tasks": ntasks,
        "nodelist": env.get("SLURM_JOB_NODELIST"),
        "master": f"{master_addr}:{master_port}",
        "logs": task_logs(folder, job_id, ntasks) if folder else [],
    }


def parse_sacct(text: str) -> dict[str, str]:
    """First row of ``sacct --parsable2 --noheader -X -o JobID,State,ExitCode,Reason,Elapsed,NodeList``.

    >>> parse_sacct("7_2|CANCELLED by 0|0:15|None|00:00:12|n1\\n")
    {'job_id': '7_2', 'state': 'CANCELLED by 0', 'exit_code': '0:15', 'reason': 'None', 'elapsed': '00:00:12', \
'nodelist': 'n1'}
    """
    names = ("job_id", "state", "exit_code", "reason", "elapsed", "nodelist", "suspended")
    for line in text.splitlines():
        if line.strip():
            return dict(zip(names, (v.strip() for v in line.split("|")), strict=False))
    return {}


SACCT_FORMAT = "JobID,State,ExitCode,Reason,Elapsed,NodeList,Suspended"


def duration_s(text: str | None) -> float | None:
    """Seconds of a SLURM duration (``[DD-][HH:]MM:SS[.fff]``, sacct's ``Elapsed``/``Suspended``); ``None``
    for an empty or unreadable one.

    >>> duration_s("00:00:25"), duration_s("1-02:00:00"), duration_s("05:07.5"), duration_s(""), duration_s("x")
    (25.0, 93600.0, 307.5, None, None)
    """
    if not text or not text.strip():
        return None
    days, _, rest = text.strip().rpartition("-")
    try:
        parts = [float(x) for x in rest.split(":")]
        seconds = float(int(days)) * 86400 if days else 0.0
    except ValueError:
        return None
    if not 1 <= len(parts) <= 3:
        return None
    clock = 0.0
    for value in parts:
        clock = clock * 60 + value
    return seconds + clock


#: An iteration touched by a suspension is longer than the median of the others by at least this share of
#: the suspended time (sacct says how long a job was suspended, not when).
SUSPENDED_SHARE = 0.5


def suspended_iterations(iteration_s: Mapping[int, float], suspended_s: float) -> list[int]:
    """The measured iterations a suspension of ``suspended_s`` seconds (sacct's ``Suspended``) touched: those
    whose wall time exceeds the median of the others by at least :data:`SUSPENDED_SHARE` x ``suspended_s``
    (the wall-vs-iteration check). With one measured iteration nothing tells: it is returned. An empty
    list: the suspension fell outside the measured iterations (setup, warm-up, the writes).

    Args:
        iteration_s: measured iteration -> its wall time, seconds.
        suspended_s: the job's suspended time, seconds (> 0).

    >>> suspended_iterations({1: 12.0, 2: 37.0, 3: 12.1}, 25.0), suspended_iterations({1: 12.0, 2: 12.2}, 25.0)
    ([2], [])
    >>> suspended_iterations({1: 40.0}, 25.0)
    [1]
    """
    import statistics

    if len(iteration_s) < 2:
        return sorted(iteration_s)
    out = []
    for it, wall in iteration_s.items():
        others = [w for i, w in iteration_s.items() if i != it]
        if wall - statistics.median(others) >= SUSPENDED_SHARE * suspended_s:
            out.append(it)
    return sorted(out)


#: SLURM states of a job waiting to run again after it ran (``scontrol requeue``, preemption, a node failure).
REQUEUE_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")
#: SLURM states of a job that holds its nodes (it has started).
STARTED_STATES = ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "STOPPED")


def state_change_text(job_id: str, previous: str | None, state: str) -> str:
    """The log text for a job whose state went from ``previous`` to ``state``: a job that had started and is
    pending again (or ``REQUEUED``) is said to be requeued; a suspension says so, and that its iterations are
    checked; else ``SLURM job <id> <STATE>``.

    >>> state_change_text("7", "RUNNING", "PENDING")
    'SLURM job 7 requeued (RUNNING, now PENDING): the point runs again from its start in its run folder'
    >>> state_change_text("7", "REQUEUED", "PENDING")
    'SLURM job 7 PENDING (requeued: waits to run again)'
    >>> state_change_text("7", "PENDING", "RUNNING"), state_change_text("7", None, "PENDING")
    ('SLURM job 7 RUNNING', 'SLURM job 7 PENDING')
    """
    head = (previous or "").split()[0] if previous else ""
    now = state.split()[0] if state else state
    if now.startswith("REQUEUE") or (head in STARTED_STATES and now in REQUEUE_STATES):
        return f"SLURM job {job_id} requeued ({previous}, now {state}): the point runs again from its start in its " \
               "run folder"  # fmt: skip
    if head.startswith("REQUEUE") and now == "PENDING":
        return f"SLURM job {job_id} PENDING (requeued: waits to run again)"
    if now == "SUSPENDED":
        return (f"SLURM job {job_id} SUSPENDED: the iterations it touches are flagged when it ends (sacct's "
                "Suspended time)")  # fmt: skip
    return f"SLURM job {job_id} {state}"


def sacct_info(job_id: str) -> dict[str, str]:
    """SLURM's accounting record of one job (state, exit code, reason); ``{}`` when sacct fails."""
    import subprocess

    try:
        out = subprocess.run(
            ["sacct", "-X", "-n", "--parsable2", "-o", SACCT_FORMAT, "-j", job_id],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_sacct(out)


#: sacct's ``NodeList`` of a job that was never given a node (cancelled while pending).
NO_NODE = "None assigned"


def never_started(sacct: Mapping[str, str]) -> bool:
    """Whether SLURM's accounting record (:func:`sacct_info`) says the job never ran: no node was ever
    allocated to it (``NodeList`` ``None assigned``: cancelled while pending) and no time elapsed.
    ``False`` when it cannot tell (no record: sacct failed): such a job is taken as started, recorded failed.

    (sacct's ``Start`` of a job cancelled while pending is the time of the cancel, not ``None``: SLURM 22.05.)

    >>> never_started({"state": "CANCELLED by 0", "elapsed": "00:00:00", "nodelist": "None assigned"})
    True
    >>> never_started({"state": "CANCELLED by 0", "elapsed": "00:00:03", "nodelist": "n1"})
    False
    >>> never_started({})
    False
    """
    return sacct.get("nodelist") == NO_NODE and sacct.get("elapsed", "00:00:00") in ("00:00:00", "0:00")


def wait_until_ended(job_id: str, timeout_s: float = 90.0, poll_s: float = 1.0) -> bool:
    """Wait while SLURM still lists the job as COMPLETING (its processes are being killed).

    A cancelled or timed-out job is reported ``CANCELLED``/``TIMEOUT`` by sacct (submitit's state)
    as soon as SLURM decides it, while its tasks may live on for up to ``KillWait`` seconds; sacct
    does not show that, ``squeue -t COMPLETING`` does. Returns ``False`` if still completing after
    ``timeout_s``.
    """
    import subprocess
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            out = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-t", "COMPLETING", "-o", "%i"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return False
        if not out.strip():
            return True
        time.sleep(poll_s)
    return False


def failure_text(
    job_id: str,
    state: str,
    sacct: Mapping[str, str],
    task_errors: Mapping[int, str],
    log: str | None,
    records: Mapping[int, Mapping[str, Any]] | None = None,
) -> str:
    """One line for a failed job: SLURM's state, exit code and reason, each failed rank's error, the log.

    >>> failure_text("7_2", "CANCELLED by 0", {"exit_code": "0:15", "reason": "None"}, {}, "/s/7_2_0_log.err")
    'SLURM job 7_2 CANCELLED by 0 (exit code 0:15); log: /s/7_2_0_log.err'
    >>> failure_text("7_3", "FAILED", {}, {0: "NCCL communicator was aborted on rank 0. ", 1: "E: x"}, None)
    'SLURM job 7_3 FAILED; rank 1: E: x; rank 0: NCCL communicator was aborted on rank 0. '

    Ranks whose error is the echo of another's (:func:`is_secondary_error`, on their failure ``records``) come last.
    """
    details = []
    if sacct.get("exit_code") and sacct["exit_code"] != "0:0":
        details.append(f"exit code {sacct['exit_code']}")
    if sacct.get("reason") and sacct["reason"] not in ("None", ""):
        details.append(f"reason: {sacct['reason']}")
    text = f"SLURM job {job_id} {state}" + (f" ({', '.join(details)})" if details else "")
    for rank in ranks_by_cause(task_errors, records)[:4]:
        text += f"; rank {rank}: {task_errors[rank]}"
    if log:
        text += f"; log: {log}"
    return text


def hung_line(
    records: Mapping[int, Mapping[str, Any]], watchdog: Sequence[int], progress: Mapping[int, Mapping[str, Any]],
    ranks: int, timeout_s: float,
) -> str | None:
    """The line naming the rank(s) a failed job's ranks waited for when a collective timed out, as the local
    launcher says it (:func:`pnpscale.cluster.local.hung_message`); ``None`` when no rank timed out or none was
    behind.

    Args:
        records: rank -> its failure record (:func:`pnpscale.core.record.read_rank_failures`; ``kind`` as the
            rank recorded it, :data:`pnpscale.core.errors.TIMEOUT` for a wait past ``dist.timeout_s``).
        watchdog: ranks that torch's NCCL watchdog aborted on a timeout (their stderr,
            :func:`pnpscale.cluster.peer_errors.watchdog_timeouts_in_files`: they wrote no record).
        progress: rank -> its last heartbeat (:func:`pnpscale.cluster.local.read_progress`).
        ranks: the job's ranks; timeout_s: ``dist.timeout_s``.

    >>> hung_line({0: {"kind": "timeout"}}, [], {0: {"beat": 9, "iteration": 2, "section": "denoiser"},
    ...           1: {"beat": 7, "iteration": 2, "section": "gradient"}}, 2, 10.0)  # doctest: +NORMALIZE_WHITESPACE
    "rank 1 did not arrive within dist.timeout_s=10 s: last seen in section 'gradient' of iteration 2; rank 0 gave
    up waiting in section 'denoiser' of iteration 2"
    >>> hung_line({}, [1], {0: {"beat": 4, "iteration": 0, "section": "gradient"},
    ...           1: {"beat": 5, "iteration": 0, "section": "denoiser"}}, 2, 10.0)  # doctest: +NORMALIZE_WHITESPACE
    "rank 0 did not arrive within dist.timeout_s=10 s: last seen in section 'gradient' of iteration 0; rank 1 gave
    up waiting in section 'denoiser' of iteration 0"
    >>> hung_line({0: {"kind": "RuntimeError"}}, [], {0: {"beat": 4}, 1: {"beat": 5}}, 2, 10.0) is None
    True
    """
    kinds = {r: str(rec.get("kind")) for r, rec in records.items()}
    kinds.update({r: TIMEOUT for r in watchdog})
    waited = sorted(r for r, kind in kinds.items() if kind == TIMEOUT)
    if not waited:
        return None
    failed = RankFailed(waited[0], "timed out")
    failed.kinds = kinds
    failed.failed_at = failed_times(records)
    return hung_message(failed, {r: dict(beat) for r, beat in progress.items()}, ranks, timeout_s)


def is_secondary_error(message: str, record: Mapping[str, Any] | None = None) -> bool:
    """Whether a rank's error is the echo of another rank's failure (a lost peer or a timeout), decided by
    :func:`pnpscale.cluster.peer_errors.echo_kind`: on the rank's failure record when it wrote one
    (:func:`pnpscale.core.record.read_rank_failures`: pnpscale's own error or one of a class no transport
    raises is a cause, a recorded timeout an echo, whatever the words), else on gloo's and NCCL's exact texts.

    >>> is_secondary_error("RuntimeError: [/g/pair.cc:561] Connection closed by peer [10.0.0.2]:7")
    True
    >>> is_secondary_error("ValueError: x"), is_secondary_error("ValueError: connection closed by peer")
    (False, False)
    >>> is_secondary_error("InputError: dist.timeout_s", {"kind": "InputError", "own": True})
    False
    >>> is_secondary_error("RuntimeError: odd", {"kind": "timeout", "own": False})
    True
    """
    return echo_kind(message, record) is not None


def ranks_by_cause(task_errors: Mapping[int, str], records: Mapping[int, Mapping[str, Any]] | None = None) -> list[int]:
    """Failed ranks, likely root causes first (then by rank); ``records``: rank -> its failure record.

    >>> ranks_by_cause({0: "RuntimeError: [/g/pair.cc:561] Connection closed by peer [10.0.0.2]:7", 3: "ValueError: x",
    ...                 1: "KeyError: y"})
    [1, 3, 0]
    """
    recs = records or {}
    return sorted(task_errors, key=lambda r: (is_secondary_error(task_errors[r], recs.get(r)), r))


def error_line(trace: str) -> str:
    """The exception line of a formatted traceback (its last non-empty line).

    >>> error_line("Traceback (most recent call last):\\n  File ...\\nValueError: bad\\n")
    'ValueError: bad'
    """
    lines = [ln.strip() for ln in str(trace).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------------------
# Inside a SLURM task
# --------------------------------------------------------------------------------------


@dataclass
class SlurmParams:
    """The SLURM backend's own keys under ``cluster.`` (``conf/cluster/slurm.yaml`` repeats the
    defaults): sbatch's ``--partition``, ``--account``, ``--qos``, ``--constraint``; ``gpus_per_node``
    GPUs (= ranks) per node; ``cpus_per_task`` CPUs per rank; ``mem_gb`` memory per node in GB;
    ``timeout_min`` each job's time limit in minutes; ``setup`` shell lines run before the ranks;
    ``additional_parameters`` other sbatch options; ``wait`` whether the command waits for the jobs."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int = 4
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    timeout_min: int = 60
    setup: list[str] = field(default_factory=list)
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    wait: bool = True


def _int_at_least_1(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


class SlurmCluster(Cluster):
    """``cluster=slurm``: each point is a SLURM job, each task one rank (see the module doc).

    The launcher (``hydra_plugins/pnpscale_plugins/slurm_launcher.py``) validates, skips complete
    points and submits; inside the job, task 0 runs the Hydra task, which calls :meth:`run`.
    """

    name = "slurm"
    resumes_in_task = False  # the launcher skipped complete points before submitting
    params = SlurmParams
    rules = {
        "gpus_per_node": (_int_at_least_1, "must be an integer >= 1"),
        "timeout_min": (_int_at_least_1, "must be an integer >= 1 (minutes)"),
        "cpus_per_task": (lambda v: v is None or _int_at_least_1(v), "must be an integer >= 1, or null"),
        "mem_gb": (lambda v: v is None or _int_at_least_1(v), "must be an integer >= 1, or null"),
        "wait": (lambda v: isinstance(v, bool), "must be true or false"),
        "setup": (lambda v: isinstance(v, (list, tuple)), "must be a list of shell lines"),
        "additional_parameters": (lambda v: isinstance(v, Mapping), "must be a mapping of sbatch options"),
    }
    open_keys = ("additional_parameters",)

    def check(self, cfg: Mapping[str, Any], spec: RunSpec, cuda_devices: int) -> None:
        """The point's job must be expressible (:func:`executor_parameters`).

        Raises:
            ConfigError: e.g. ``gpus`` above ``cluster.gpus_per_node`` and not a multiple of it.
        """
        executor_parameters(int(cfg["gpus"]), plain(cfg["cluster"]))

    def enter(self, cfg: Mapping[str, Any]) -> None:
        if not in_slurm_task():
            raise ConfigError(
                "cluster",
                self.name,
                "runs every point as a SLURM job through the pnpscale SLURM launcher: keep hydra.mode=MULTIRUN "
                "(set by cluster=slurm) and use cluster=slurm for the whole sweep",
            )

    def run(self, spec: RunSpec, run_dir: Path, config: dict[str, Any] | None) -> None:
        run_rank(spec, run_dir, config)  # this process is task 0 of the point's SLURM job: rank 0


def bind_task_gpu(environ: Any) -> str | None:
    """Bind this SLURM task (one rank) to one GPU of its node before its first CUDA call.

    SLURM gives every task of a job the node's GPUs (``CUDA_VISIBLE_DEVICES=0,1,2,3`` with
    ``--gpus-per-node``): task ``SLURM_LOCALID`` keeps entry ``SLURM_LOCALID mod n``
    (:func:`pnpscale.rank.gpus.bind_gpu`); a task SLURM bound to one GPU already keeps it; without
    ``CUDA_VISIBLE_DEVICES`` the node's GPUs are counted by NVML (no CUDA initialisation). Returns the
    binding, ``None`` when nothing changed.
    """

    visible = environ.get("CUDA_VISIBLE_DEVICES")
    count = nvml_device_count() if visible is None else None
    return bind_gpu(int(environ.get("SLURM_LOCALID", "0")), visible, count)


def in_slurm_task() -> bool:
    """True inside a task started by the pnpscale SLURM launcher."""
    return os.environ.get(IN_TASK_ENV) == "1"


def _link_logs(run_dir: Path, logs: Sequence[Mapping[str, Any]]) -> None:
    """``logs/rank<r>.out|.err`` -> submitit's per-task files (relative links)."""
    log_dir = run_dir / layout.LOGS_DIR
    log_dir.mkdir(parents=True, exist_ok=True)
    for entry in logs:
        for stream, suffix in (("stdout", "out"), ("stderr", "err")):
            link = layout.rank_log_link(run_dir, int(entry["rank"]), suffix)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath(entry[stream], log_dir))


def run_rank(spec: RunSpec, run_dir: Path, config: dict[str, Any] | None) -> None:
    """Run this SLURM task as one rank of ``spec`` (see the module doc); raises what the rank hit.

    Exports the torch.distributed variables of ``TorchDistributedEnvironment`` (the task was bound to
    its GPU when it started, :func:`bind_task_gpu`, so it sees that one GPU: the backend is chosen
    from every rank's GPU UUID, see :func:`pnpscale.rank.group.choose_backend`; on nccl the worker
    sets each rank's NCCL diagnostics), then calls :func:`pnpscale.rank.worker.rank_main`.
    Rank 0 adds the ``slurm`` block to ``run.json`` (kept by the final write) and links every task's
    log from ``logs/``.

    Args:
        spec: the point, resolved on this node.
        run_dir: the run folder (shared; only rank 0 writes into it).
        config: the resolved Hydra config (rank 0), ``None`` elsewhere.

    Every rank writes its heartbeat into the run folder (shared), so that the launcher names a rank that hung
    (:func:`hung_line`).
    """
    from submitit.helpers import TorchDistributedEnvironment

    from pnpscale.rank.worker import rank_main  # deferred: torch only in the SLURM task that runs a rank

    # the GPU binding was done when the task started (bind_task_gpu, by entry, not by index: submitit's
    # would set CUDA_VISIBLE_DEVICES=<local rank>, wrong when SLURM gave the job e.g. GPUs 2,3)
    dist_env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    rank = dist_env.rank
    threads = threads_per_rank(spec.threads_per_rank, dist_env.local_world_size)
    os.environ.update(rank_environment(threads, os.environ))
    os.environ.update(kineto_config_env(os.environ))
    record = task_record(os.environ, dist_env.master_addr, dist_env.master_port)
    if rank == 0:  # in run.json from the start, so that a failure record names the job too
        _link_logs(run_dir, record["logs"])

        update_record(run_dir, slurm=record)
    rank_main(spec.to_dict(), str(run_dir), config, extra={"slurm": record}, heartbeat=True)
