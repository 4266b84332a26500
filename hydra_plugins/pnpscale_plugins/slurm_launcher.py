"""pnpscale's SLURM launcher: every sweep point is its own SLURM job, with its own shape.

A subclass of hydra-submitit-launcher's ``SlurmLauncher``. The stock launcher resolves
``hydra.launcher`` once and gives every job of a sweep the same resources; this one composes each
point's config, computes its job from ``gpus`` and the point's ``cluster.*`` keys
(:func:`pnpscale.cluster.slurm.executor_parameters`: nodes = ceil(gpus / gpus_per_node), tasks per node =
min(gpus, gpus_per_node), one GPU per rank) and submits one job array per distinct resource set.

Order of work in :meth:`PnpscaleSlurmLauncher.launch`:

1. every point is composed and validated (:func:`validate_points`): a bad value stops the sweep
   with one line per bad point, nothing submitted;
2. points whose run folder already holds a complete run of the same spec are skipped
   (``resume=true``, the default; :func:`pnpscale.sweep.point.complete_run`);
3. SLURM checks every distinct request with ``sbatch --test-only``: an impossible one (more nodes
   than the partition has, an unknown partition, ...) stops the sweep with SLURM's message before
   any job is submitted;
4. each point is checked as the local launcher checks a point before it starts (``_startable``): a
   run folder another live process holds is refused, nothing written; a disk without room for the
   point's status record (32 KiB) fails it in one line; neither is submitted;
5. one job array per resource set; then, with ``cluster.wait=true`` (default), progress is logged
   as jobs start and end. A job that fails, times out or is cancelled is recorded as failed in its
   run folder (SLURM's state, exit code and reason, each rank's error, the log path); one cancelled
   while it waited for nodes never ran and is recorded ``not_run``; the other points are still
   waited for. The sweep report follows, and the command exits non-zero when a point failed or did
   not run, printing the command that resumes the sweep.

A stop signal (Ctrl-C, SIGTERM, SIGHUP) at any moment after validation cancels every unfinished job:
a started one is recorded failed, a pending or unsubmitted one ``not_run`` (``_stopped``, as the local
launcher records the points a stop came before); the summary line, the report and the resume command
follow, and the command exits 128 + the signal number.

Inside a job (:meth:`PnpscaleSlurmLauncher.__call__`, run by every SLURM task), task 0 runs the
Hydra job (``.hydra/``, the job log, :func:`pnpscale.sweep.task.run`) and the other tasks run their rank
directly, writing nothing shared (:func:`pnpscale.cluster.slurm.run_rank`).

Registered as ``hydra/launcher: pnpscale_slurm``; ``conf/cluster/slurm.yaml`` selects it.
"""

import copy
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import DictConfig, open_dict

from hydra_plugins.pnpscale_plugins.launcher import (
    finish_and_end,
    finish_sweep,
    refuse,
    validate_points,
)
from pnpscale import columns as K
from pnpscale.cluster.local import read_progress
from pnpscale.cluster.peer_errors import watchdog_timeouts_in_files
from pnpscale.cluster.slurm import (
    IN_TASK_ENV,
    bind_task_gpu,
    cpus_per_task_warning,
    duration_s,
    error_line,
    executor_parameters,
    failure_text,
    group_points,
    hung_line,
    job_shape,
    never_started,
    ranks_by_cause,
    run_rank,
    sacct_info,
    sbatch_refusal,
    sbatch_test_command,
    state_change_text,
    suspended_iterations,
    task_logs,
    wait_until_ended,
)
from pnpscale.core import layout
from pnpscale.core.config import ConfigError, cfg_variant, plain, resolve_spec, validate
from pnpscale.core.lock import process_gone
from pnpscale.core.record import (
    RecordError,
    clear_rank_failures,
    now_iso,
    read_rank_failures,
    read_record,
    update_record,
)
from pnpscale.core.signals import acknowledge, as_interrupted
from pnpscale.rank.process import LAUNCH_T0_ENV
from pnpscale.sweep.cli import resume_command
from pnpscale.sweep.point import NoSpace, check_room, complete_run, resolve_point
from pnpscale.sweep.task import RunFailed, record_failure_or_say, summary_line

log = logging.getLogger("pnpscale")

#: Seconds between two looks at the jobs while waiting (sacct itself is throttled by submitit).
POLL_S = 2.0


@dataclass
class PnpscaleSlurmLauncherConf:
    _target_: str = "hydra_plugins.pnpscale_plugins.slurm_launcher.PnpscaleSlurmLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="pnpscale_slurm", node=PnpscaleSlurmLauncherConf, provider="pnpscale"
)


@dataclass
class _Point:
    index: int
    overrides: list[str]
    cfg: DictConfig
    run_dir: Path
    label: str
    params: dict[str, Any] | None = None


def _label(cfg: DictConfig) -> str:
    """The point, e.g. ``problem=2d mode=inference gpus=4`` (from the config, whatever the folder layout)."""

    return layout.point_label(str(cfg.problem.name), str(cfg.mode.name), int(cfg.gpus), cfg_variant(cfg))


def _task_cfg(cfg: DictConfig) -> DictConfig:
    """The point's config without its ``hydra`` node (what the task function sees)."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        out.pop("hydra", None)
    return out


def check_point(cfg: DictConfig) -> None:
    """Validate one point for SLURM: config rules, then its job (:func:`pnpscale.cluster.slurm.executor_parameters`).

    Raises:
        pnpscale.core.config.ConfigError: the first broken rule, as one line.
    """

    if cfg.cluster.name != "slurm":
        raise ConfigError("cluster", cfg.cluster.name, "this sweep runs on SLURM: every point must be cluster=slurm")
    validate(cfg)  # scale=auto resolves on the compute node: both presets must be valid
    task_cfg = _task_cfg(cfg)
    run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
    resolve_point(task_cfg, run_dir, cuda_devices=0)  # job shape, and never a silent overwrite (resume rule)


class PnpscaleSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher with one job shape per point (see module doc)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:

        assert self.hydra_context is not None and self.config is not None
        config = self.config
        if shutil.which("sbatch") is None:  # before any warning: one line, nothing composed or submitted
            raise refuse("cluster=slurm: sbatch not found; run where SLURM's commands are")
        composed = validate_points(self.hydra_context.config_loader, config, job_overrides, check_point)
        warning = cpus_per_task_warning(plain(config.cluster))
        if warning:
            log.warning(warning)
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        points = [
            _Point(
                index=initial_job_idx + i,
                overrides=list(ov),
                cfg=cfg,
                run_dir=sweep_dir / str(cfg.hydra.sweep.subdir),
                label=_label(cfg),
                params=executor_parameters(int(cfg.gpus), plain(cfg.cluster)),
            )
            for i, (ov, cfg) in enumerate(zip(job_overrides, composed, strict=True))
        ]
        rets: dict[int, JobReturn] = {}
        self._not_run: dict[int, str] = {}  # points that never started without a stop (a job cancelled pending)
        todo = []
        for p in points:
            done = self._completed(p)
            if done is not None:
                log.info("%s: skipped, complete run in %s (resume=true)", p.label, p.run_dir)
                rets[p.index] = JobReturn(
                    overrides=p.overrides, working_dir=str(p.run_dir), status=JobStatus.COMPLETED, _return_value=done
                )
            else:
                todo.append(p)
        jobs: list[tuple[_Point, Any]] = []
        try:
            self._preflight(self._groups(todo))
            for p in todo:  # a killed launcher's jobs still hold their folders: cancelled, then run again
                cancel_orphan_job(p.label, p.run_dir)
            todo = self._startable(todo, rets)  # a folder in use, or too full for a record: failed, not sent
            sweep_dir.mkdir(parents=True, exist_ok=True)
            folder = str(self.params.get("submitit_folder") or sweep_dir / ".submitit" / "%j")
            self._submit(self._groups(todo), folder, rets, jobs)
            if jobs and not bool(config.cluster.wait):
                self._print_later(jobs, sweep_dir)
                return []
            self._wait(jobs, folder, rets)
        except KeyboardInterrupt as exc:
            self._stopped(exc, points, jobs, rets)
            raise
        ran = [rets[p.index] for p in points if p.index not in self._not_run]
        not_run = [self._not_run[p.index] for p in points if p.index in self._not_run]
        finish_and_end(config, ran, self._resume_command(sweep_dir), total=len(points), not_run=not_run)
        return [rets[p.index] for p in points]

    # ---------------------------------------------------------------------------------- steps

    @staticmethod
    def _groups(todo: list[_Point]) -> list[tuple[list[_Point], dict[str, Any]]]:
        """One group per distinct job request (:func:`pnpscale.cluster.slurm.group_points`): one job array each."""

        shapes = group_points([p.params or {} for p in todo])
        return [([todo[i] for i in members], params) for params, members in shapes]

    @staticmethod
    def _startable(todo: list[_Point], rets: dict[int, JobReturn]) -> list[_Point]:
        """The points that may be submitted, checked as the local launcher checks each point before it starts:
        a run folder another live process holds is refused with one line naming the holder, nothing written
        (:func:`hydra_plugins.pnpscale_plugins.launcher.refuse_busy`); a disk without room for the point's status
        record (:func:`pnpscale.sweep.point.check_room`) fails it with one line, recorded when a block is left
        (:func:`hydra_plugins.pnpscale_plugins.launcher.fail_unwritable`). Neither is submitted (``rets`` gets
        their FAILED returns); the others are returned, in order."""
        from hydra_plugins.pnpscale_plugins.launcher import fail_unwritable, refuse_busy

        kept = []
        for p in todo:
            refused = refuse_busy(p.overrides, p.cfg, p.run_dir, cuda_devices=0)
            if refused is not None:
                rets[p.index] = refused
                continue
            try:
                check_room(p.run_dir)
            except NoSpace as exc:
                rets[p.index] = fail_unwritable(p.overrides, p.cfg, p.run_dir, exc, cuda_devices=0)
                continue
            kept.append(p)
        return kept

    def _stopped(
        self, exc: KeyboardInterrupt, points: list[_Point], jobs: list[tuple[_Point, Any]], rets: dict[int, JobReturn]
    ) -> None:
        """A stop signal (Ctrl-C, SIGTERM) during the sweep: every unfinished job is cancelled; a job that had
        started is recorded failed (``cancelled: the sweep was interrupted (SIGINT) ...``), a point whose job
        never started (cancelled while pending) or that was never submitted is recorded ``not_run``
        (:func:`hydra_plugins.pnpscale_plugins.launcher.record_not_run_points`, as the local launcher does);
        then the summary line, the report of what completed, and the resume command."""
        from hydra_plugins.pnpscale_plugins.launcher import ReportFailed, record_not_run_points

        stop = as_interrupted(exc)
        acknowledge()  # handled here: the report of what completed may be published
        pending = [(p, job) for p, job in jobs if p.index not in rets]
        for _, job in pending:
            try:
                job.cancel(check=False)
            except Exception:  # noqa: BLE001 - a job that already ended cannot be cancelled
                pass
        never = []
        for p, job in pending:
            wait_until_ended(job.job_id, timeout_s=30.0)  # its tasks gone before its folder is written
            if never_started(sacct_info(job.job_id)):
                never.append(p)
            else:
                rets[p.index] = self._record_failure(p, f"cancelled: the sweep was {stop}; SLURM job {job.job_id}", {})
        submitted = {p.index for p, _ in jobs}
        never += [p for p in points if p.index not in rets and p.index not in submitted]
        never.sort(key=lambda p: p.index)
        said = record_not_run_points(
            [(p.overrides, p.cfg) for p in never], f"not run: the sweep was {stop} before this point started", 0
        )
        not_run = [f"{label}{'' if s == layout.STATUS_NOT_RUN else f' ({s})'}" for label, s in said]
        log.error(
            "%s: %d unfinished SLURM job(s) cancelled, %d recorded as failed; %d sweep point(s) not run%s",
            stop, len(pending), len(pending) - sum(p in never for p, _ in pending), len(not_run),
            f": {'; '.join(not_run)}" * bool(not_run),
        )  # fmt: skip
        ran = [rets[p.index] for p in points if p.index in rets]
        try:
            finish_sweep(self.config, ran, total=len(points), not_run=not_run)
        except ReportFailed:
            pass  # logged; the stop decides the exit code
        finally:
            sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
            log.error("to resume (complete points are skipped): %s", self._resume_command(sweep_dir))

    @staticmethod
    def _completed(p: _Point) -> dict[str, Any] | None:

        return complete_run(p.run_dir, _task_cfg(p.cfg), bool(p.cfg.resume))

    def _preflight(self, groups: list[tuple[list[_Point], dict[str, Any]]]) -> None:
        """``sbatch --test-only`` for every distinct request; SLURM's refusals stop the sweep."""

        problems = []
        for members, params in groups:
            shape = job_shape(int(members[0].cfg.gpus), int(members[0].cfg.cluster.gpus_per_node))
            try:
                proc = subprocess.run(sbatch_test_command(params), capture_output=True, text=True, timeout=120)
            except FileNotFoundError:
                raise refuse("cluster=slurm: sbatch not found; run where SLURM's commands are") from None
            if proc.returncode != 0:
                where = "; ".join(p.label for p in members)
                problems.append(
                    f"{where}: SLURM refused {shape} (nodes x tasks): {sbatch_refusal(proc.stderr + proc.stdout)}"
                )
        if problems:
            raise refuse("SLURM refused the sweep, nothing was submitted:\n" + "\n".join(problems))

    def _submit(
        self,
        groups: list[tuple[list[_Point], dict[str, Any]]],
        folder: str,
        rets: dict[int, JobReturn],
        jobs: list[tuple[_Point, Any]],
    ) -> None:
        """Submit one job array per group, appending each (point, job) to ``jobs`` as it is submitted (a stop
        signal between two arrays leaves ``jobs`` naming what SLURM has)."""
        import submitit

        for members, params in groups:
            executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=0)
            executor.update_parameters(**params)
            now = time.time()
            args = [(p.overrides, "hydra.sweep.dir", p.index, f"job_id_for_{p.index}", Singleton.get_state(), now)
                    for p in members]  # fmt: skip

            for p in members:  # an earlier attempt's failure records never speak for this job
                clear_rank_failures(p.run_dir, int(p.cfg.gpus))
            try:
                submitted = executor.map_array(self, *zip(*args, strict=True))
            except Exception as exc:  # noqa: BLE001 - sbatch refused: record the points, submit the others

                for p in members:
                    rets[p.index] = self._record_failure(p, f"sbatch refused the job: {sbatch_refusal(str(exc))}", {})
                continue
            for p, job in zip(members, submitted, strict=True):  # first: a launcher killed from here leaves ids
                record_job(p.run_dir, str(job.job_id))
            for p, job in zip(members, submitted, strict=True):
                log.info(
                    "%s: SLURM job %s submitted (%s nodes x %s tasks, %s GPU(s) per node)",
                    p.label, job.job_id, params["nodes"], params["tasks_per_node"], params["gpus_per_node"],
                )  # fmt: skip
                jobs.append((p, job))

    def _wait(self, jobs: list[tuple[_Point, Any]], folder: str, rets: dict[int, JobReturn]) -> None:
        """Wait for every job (submitit's states), recording each as it ends; logs progress."""
        pending = dict(enumerate(jobs))
        seen: dict[int, str] = {}
        total, failed = len(jobs), 0
        while pending:  # a stop signal: the launch's handler cancels and records what is pending (_stopped)
            for key, (p, job) in list(pending.items()):
                if job.done() and not job_on_hold(job):
                    try:
                        ret = self._collect(p, job, folder)
                    except Exception as exc:  # noqa: BLE001 - one job's trouble never stops the others
                        ret = self._record_failure(p, f"SLURM job {job.job_id}: result unreadable: {exc}", {})
                    rets[p.index] = ret
                    del pending[key]
                    failed += ret.status == JobStatus.FAILED and p.index not in self._not_run
                    log.info(
                        "%s: %s (%d/%d jobs done, %d failed)",
                        p.label, self._outcome(p, ret), total - len(pending), total, failed,
                    )  # fmt: skip
                    continue
                state = job.state
                if state not in ("UNKNOWN", seen.get(key)):
                    log.info("%s: %s", p.label, state_change_text(str(job.job_id), seen.get(key), state))
                    seen[key] = state
            if pending:
                time.sleep(POLL_S)

    def _outcome(self, p: _Point, ret: JobReturn) -> str:
        if p.index in self._not_run:
            return str(ret._return_value.error)
        if ret.status == JobStatus.COMPLETED:

            try:
                return "complete: " + summary_line(read_record(p.run_dir).to_dict())
            except RecordError:
                return "complete"
        return f"FAILED: {ret._return_value}"

    def _collect(self, p: _Point, job: Any, folder: str) -> JobReturn:
        """The JobReturn of a finished job: rank 0's, or a failure recorded from SLURM's state."""
        from submitit.core.utils import pickle_load


        state = job.state
        ret0, task_errors = None, {}
        for t in range(job.num_tasks):
            path = job.task(t).paths.result_pickle
            if not path.exists():
                continue
            try:
                outcome, value = pickle_load(path)
            except Exception as exc:  # noqa: BLE001 - unreadable result: record it
                task_errors[t] = f"unreadable result {path}: {exc}"
                continue
            if outcome == "error":
                task_errors[t] = error_line(value)
            elif t == 0:
                ret0 = value
        if ret0 is None and 0 not in task_errors and state.startswith("COMPLETED"):
            try:  # a slow shared file system: submitit waits a little for the result file
                ret0 = job.task(0).result()
            except Exception as exc:  # noqa: BLE001
                task_errors[0] = error_line(str(exc))
        if isinstance(ret0, JobReturn) and ret0.status == JobStatus.COMPLETED:
            flag_suspended(p.label, p.run_dir, str(job.job_id))
            return ret0
        if isinstance(ret0, JobReturn):  # rank 0 ran the task and recorded its own error
            err = ret0._return_value
            task_errors[0] = err.error if isinstance(err, RunFailed) else error_line(str(err))
        state = self._final_state(job)
        wait_until_ended(job.job_id)  # no task may write into the run folder after the failure is recorded
        # a task aborted by torch's NCCL watchdog (SIGABRT) left no result: its stderr says it timed out waiting
        silent = {t: job.task(t).paths.stderr for t in range(job.num_tasks) if t not in task_errors}
        watchdog = watchdog_timeouts_in_files(silent)
        task_errors.update(watchdog)
        if ret0 is None and not task_errors:
            if never_started(sacct_info(job.job_id)):  # cancelled while pending (scancel): the point never ran
                return self._record_not_run(p, f"not run: SLURM job {job.job_id} {state} before it started")
        return self._record_failure(p, None, task_errors, job=job, folder=folder, state=state, watchdog=list(watchdog))

    def _record_not_run(self, p: _Point, reason: str) -> JobReturn:
        """A point whose job never started without a stop signal: ``run.json`` says ``not_run`` with ``reason``
        (:func:`hydra_plugins.pnpscale_plugins.launcher.record_not_run_points`); the sweep names it at its end."""
        from hydra_plugins.pnpscale_plugins.launcher import record_not_run_points

        ((label, said),) = record_not_run_points([(p.overrides, p.cfg)], reason, 0)
        self._not_run[p.index] = label + ("" if said == layout.STATUS_NOT_RUN else f" ({said})")
        ret = JobReturn(overrides=p.overrides, working_dir=str(p.run_dir), status=JobStatus.FAILED)
        ret.return_value = RunFailed(p.label, p.run_dir, reason)
        return ret

    @staticmethod
    def _final_state(job: Any, timeout_s: float = 60.0) -> str:
        """SLURM's final state of a job whose tasks have all ended (sacct lags behind the result files)."""
        end = time.monotonic() + timeout_s
        state = job.state
        while time.monotonic() < end:
            state = job.get_info(mode="force").get("State") or state
            if state.split()[0] not in ("RUNNING", "PENDING", "COMPLETING", "REQUEUED", "UNKNOWN"):
                break
            time.sleep(1.0)
        return state

    def _record_failure(
        self,
        p: _Point,
        message: str | None,
        task_errors: dict[int, str],
        job: Any = None,
        folder: str | None = None,
        state: str | None = None,
        watchdog: list[int] | None = None,
    ) -> JobReturn:
        """Write the point's ``run.json`` as failed (written here: the job itself could not). A collective that
        timed out (a rank's record, or torch's NCCL watchdog on the ranks in ``watchdog``) is said first, naming
        the rank(s) the others waited for from the ranks' heartbeats (:func:`pnpscale.cluster.slurm.hung_line`)."""

        try:
            previous = read_record(p.run_dir)
        except RecordError:
            previous = None
        block: dict[str, Any] = dict((previous.slurm if previous else None) or {})
        if job is not None:
            info = sacct_info(job.job_id)
            logs = task_logs(folder or str(p.run_dir), job.job_id, job.num_tasks)
            records = read_rank_failures(p.run_dir, int(p.cfg.gpus))  # each rank's failure kind, as it recorded it
            first = ranks_by_cause(task_errors, records)[0] if task_errors else 0
            message = failure_text(job.job_id, state or "UNKNOWN", info, task_errors, logs[first]["stderr"], records)
            gpus = int(p.cfg.gpus)
            hung = hung_line(records, watchdog or [], read_progress(p.run_dir, gpus), gpus, float(p.cfg.dist.timeout_s))
            if hung is not None:
                message = f"{hung}; {message}"
            block.update(
                job_id=job.job_id,
                state=state,
                exit_code=info.get("exit_code"),
                reason=info.get("reason"),
                elapsed=info.get("elapsed"),
                logs=block.get("logs") or logs,
            )
        block["task_errors"] = {str(k): v for k, v in sorted(task_errors.items())}
        task_cfg = _task_cfg(p.cfg)
        detail = previous.error if previous and previous.status == layout.STATUS_FAILED else None
        text = (message or "") + (f"\n{detail}" if detail and detail != message else "")
        spec = resolve_spec(task_cfg, cuda_available=False)  # a disk too full even for it: one line on stderr
        record_failure_or_say(p.run_dir, spec, plain(task_cfg), text, p.label, slurm=block)
        ret = JobReturn(overrides=p.overrides, working_dir=str(p.run_dir), status=JobStatus.FAILED)
        ret.return_value = RunFailed(p.label, p.run_dir, message or "failed")
        return ret

    def _resume_command(self, sweep_dir: Path) -> str:

        ov = self.config.hydra.overrides
        return resume_command(list(ov.task), list(ov.hydra), sweep_dir)

    def _print_later(self, jobs: list[tuple[_Point, Any]], sweep_dir: Path) -> None:
        ids = ",".join(sorted({str(job.job_id).split("_")[0] for _, job in jobs}))
        log.info("cluster.wait=false: %d job(s) submitted, not waiting. Follow them: sacct -j %s", len(jobs), ids)
        log.info("when they have ended, build the report: python -m pnpscale.report %s", sweep_dir)
        log.info("and re-run failed or missing points (complete ones are skipped): %s", self._resume_command(sweep_dir))

    # ------------------------------------------------------------------------------ in a task

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
        submitted_at: float | None = None,
    ) -> JobReturn | None:
        """Run by every SLURM task of a point's job: task 0 runs the Hydra job, the others their rank."""
        import signal

        import submitit


        bind_task_gpu(os.environ)  # first: before anything in this task calls into CUDA
        # submitit ignores SIGTERM (for requeue on preemption); a pnpscale run cannot be resumed
        # midway, so scancel and SLURM's time limit end it at once instead of after KillWait.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ[IN_TASK_ENV] = "1"
        if submitted_at is not None:
            os.environ[LAUNCH_T0_ENV] = repr(submitted_at)  # timings.launch_s: submission to rank start
        if submitit.JobEnvironment().global_rank == 0:
            return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        self._other_rank(sweep_overrides, singleton_state)
        return None

    def _other_rank(self, sweep_overrides: list[str], singleton_state: dict[type, Singleton]) -> None:
        """A task other than 0: same composed config, no Hydra output (``.hydra/`` and logs are rank 0's)."""

        assert self.hydra_context is not None and self.config is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(sweep_overrides))
        run_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        run_rank(resolve_point(_task_cfg(cfg), run_dir).spec, run_dir, None)
        return None


# ------------------------------------------------------------------ the launcher's own faults


def record_job(run_dir: Path, job_id: str) -> None:
    """Record the point's SLURM job in its run folder (:data:`pnpscale.core.layout.SLURM_JOB`: job id, this
    launcher's pid and host, when) as soon as sbatch returned it, so that a resume after this launcher was
    killed finds the job (:func:`cancel_orphan_job`). A folder that cannot take it (a full disk) is logged."""
    import socket

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        layout.write_json(run_dir / layout.SLURM_JOB, {"job_id": job_id, "launcher_pid": os.getpid(),
                                                       "host": socket.gethostname(), "submitted_at": now_iso()})
    except OSError as exc:
        log.warning("%s: SLURM job %s not recorded in %s (%s)", run_dir, job_id, run_dir, exc.strerror or exc)


#: SLURM states of a job that has not ended (it holds, or will hold, its run folder).
LIVE_STATES = ("PENDING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", "COMPLETING",
               "RESIZING", "STOPPED", "SIGNALING")  # fmt: skip


def cancel_orphan_job(label: str, run_dir: Path) -> str | None:
    """A resume's look at the job an earlier launcher recorded for this point (:func:`record_job`): when that
    launcher is gone (killed, SIGKILL included) and SLURM still lists the job as not ended, the job is
    cancelled (``scancel``) and waited for (its tasks hold the run folder's lock), so the point runs again;
    one line says so. A job whose launcher lives is left alone (the folder is then refused as in use).

    Returns:
        the job id cancelled, else ``None``.
    """
    import subprocess

    try:
        doc = layout.read_json(run_dir / layout.SLURM_JOB)
        job_id, pid, host = str(doc["job_id"]), int(doc["launcher_pid"]), str(doc["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not process_gone(pid, host):
        return None
    state = (sacct_info(job_id).get("state") or "").split()
    if not state or state[0] not in LIVE_STATES:
        return None
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    end = time.monotonic() + 90
    while time.monotonic() < end:  # sacct's state first, then the tasks themselves (COMPLETING)
        now = (sacct_info(job_id).get("state") or "").split()
        if now and now[0] not in LIVE_STATES[:5]:
            break
        time.sleep(1.0)
    wait_until_ended(job_id)
    log.warning("%s: SLURM job %s of a launcher that is gone (pid %d on %s) was %s: cancelled, the point runs "
                "again", label, job_id, pid, host, state[0])  # fmt: skip
    return job_id


def iteration_walls(run_dir: Path) -> dict[int, float]:
    """Measured iteration -> its wall time (seconds: the sum of its sections' ``section_s``, the mean over ranks)
    from the run's ``sections.parquet``; ``{}`` when it cannot be read."""
    import pandas as pd

    try:
        t = pd.read_parquet(run_dir / layout.SECTIONS, columns=[K.ITERATION, K.SECTION, K.WARMUP, K.SECTION_S])
    except Exception:  # noqa: BLE001 - no table: nothing to check against
        return {}
    t = t[~t[K.WARMUP].astype(bool) & (t[K.SECTION] != "all")]
    return {int(i): float(v) for i, v in t.groupby(K.ITERATION)[K.SECTION_S].sum().items()}


def flag_suspended(label: str, run_dir: Path, job_id: str) -> list[int] | None:
    """A completed job that SLURM suspended for a while (sacct's ``Suspended``): its wall-clock times include
    the suspension, so the measured iterations it touched (:func:`pnpscale.cluster.slurm.suspended_iterations`)
    are flagged in ``run.json``: an ``anomalies`` entry of kind ``slurm_suspended`` (listed by the report)
    and ``slurm.suspended_s`` / ``slurm.suspended_iterations``; one warning line.

    Returns:
        the iterations flagged, or ``None`` when the job was never suspended (or sacct does not say).
    """
    suspended = duration_s(sacct_info(job_id).get("suspended"))
    if not suspended:
        return None
    walls = iteration_walls(run_dir)
    touched = suspended_iterations(walls, suspended)
    where = (", ".join(f"iteration {i}: {walls[i]:.3g} s" for i in touched) + " against a median "
             f"{sorted(walls.values())[len(walls) // 2]:.3g} s") if touched else "no measured iteration stands out"
    entry = {"kind": "slurm_suspended", "rank": None, "count": len(touched),
             "example": f"SLURM job {job_id} suspended {suspended:g} s (sacct Suspended); {where}",
             "action": "flagged: these iterations' times include the suspension (run the point again)"}  # fmt: skip
    try:
        record = read_record(run_dir)
        kept = [a for a in (record.extra.get("anomalies") or []) if a.get("kind") != "slurm_suspended"]
        slurm = {**(record.slurm or {}), "suspended_s": suspended, "suspended_iterations": touched}
        update_record(run_dir, anomalies=[*kept, entry], slurm=slurm)
    except (RecordError, OSError) as exc:
        log.warning("%s: the suspension could not be recorded in %s (%s)", label, run_dir, exc)
    log.warning("%s: %s: %s", label, entry["example"], entry["action"])
    return touched


def job_on_hold(job: Any) -> bool:
    """Whether submitit says ``done`` of a job SLURM only holds: suspended (``scontrol suspend``, a
    preemption by suspension) or stopped, with no result yet. submitit's watcher takes every state but a few
    running ones as ended; such a job was recorded failed while it went on, and wrote its folder after."""
    if job.paths.result_pickle.exists():
        return False
    return str(job.state).split()[0] in ("SUSPENDED", "STOPPED", "REQUEUED", "REQUEUE_HOLD", "RESIZING")
