"""Local launch: ``gpus`` ranks on this machine with torch.distributed elastic.

Each rank runs :func:`pnpscale.rank.worker.rank_main` in a process forked by a forkserver that
imported the ranks' CUDA-free dependencies once (:data:`RANK_PRELOAD`), bound to one GPU of this
machine before its first CUDA call (:func:`node_gpus`). ``OMP_NUM_THREADS`` is
set per rank (elastic does not, unlike torchrun). A failing rank brings the others down within
seconds (the elastic agent monitors every rank); its exception is re-raised here as
:class:`RankFailed` with the rank's own message.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pnpscale.cluster import resources
from pnpscale.cluster.base import Cluster
from pnpscale.cluster.exits import ExitWatch, RankExit, rank_pids
from pnpscale.cluster.peer_errors import PEER_LOST, echo_kind, watchdog_timeouts
from pnpscale.cluster.resources import check_memory, cuda_device_count
from pnpscale.core import layout
from pnpscale.core.config import CONF_DIR, ConfigError, RunSpec, register_schema, resolve_spec
from pnpscale.core.errors import TIMEOUT, PnpscaleError
from pnpscale.core.record import clear_rank_failures, read_rank_failures
from pnpscale.core.signals import preserved
from pnpscale.rank.gpus import NODE_GPUS_ENV, nvml_free_bytes
from pnpscale.rank.group import shared_gpu_allowed
from pnpscale.rank.process import (
    LAUNCH_T0_ENV,
    PARENT_PID_ENV,
    in_environment,
    kineto_config_env,
    rank_environment,
    threads_per_rank,
    watch_launcher,
)


class RankFailed(PnpscaleError, RuntimeError):
    """A rank of a run raised or died; ``str()`` names the rank and its error.

    Attributes:
        rank: the first rank that failed.
        log: its traceback or stderr log.
        failures: every rank that failed by itself (not stopped by the agent) -> its error line.
    """

    rank: int  # always known here

    def __init__(
        self, rank: int, message: str, log: Path | None = None, failures: dict[int, str] | None = None
    ) -> None:
        self.rank = rank
        self.log = log
        self.failures = failures if failures is not None else {rank: message}
        #: rank -> the kind of its failure, as the rank recorded it (:func:`pnpscale.core.errors.failure_kind`)
        self.kinds: dict[int, str] = {}
        #: rank -> when it failed (Unix time, seconds), as the rank recorded it (``failed_at``); unknown: absent
        self.failed_at: dict[int, float] = {}
        where = f" (log: {log})" if log else ""
        super().__init__(f"rank {rank} failed: {message}{where}")


class RankHung(RankFailed):
    """A collective timed out (``dist.timeout_s``): ``str()`` names the rank(s) that did not arrive,
    where each was last seen (section, iteration) and the rank that gave up waiting."""

    def __init__(self, rank: int, message: str, log: Path | None = None) -> None:
        RuntimeError.__init__(self, message)
        self.rank, self.log, self.failures, self.kinds = rank, log, {rank: message}, {rank: TIMEOUT}


#: Seconds after the first rank gave up within which another timed-out rank counts as waiting in the same collective
#: (its peers' abort reaches it at once); a rank whose error came later was still working: it arrived late.
RELEASED_WITHIN_S = 1.0


def hung_ranks(
    progress: dict[int, dict[str, Any]],
    ranks: int,
    waited: set[int] | frozenset[int] = frozenset(),
    failed_at: Mapping[int, float] | None = None,
) -> list[int]:
    """The ranks the others waited for.

    A rank with no heartbeat or fewer steps (``beat``) than another is behind. When every rank is
    at the same step (the collective sits inside the section), the ranks that did not time out
    waiting themselves (``waited``) had not reached it. A rank's heartbeat says only its section, so a rank that
    spent the timeout working in it before it reached the collective also records a timeout (its peers had gone):
    where the ranks recorded when they failed (``failed_at``), a timed-out rank that failed more than
    :data:`RELEASED_WITHIN_S` after the first one is not a waiter but late.

    Args:
        progress: rank -> its last heartbeat (:class:`pnpscale.rank.loop.Heartbeat`).
        ranks: world size.
        waited: ranks that failed with a timeout (they were waiting in a collective).
        failed_at: rank -> when it failed (Unix time, seconds); ranks not in it count as waiters.

    >>> hung_ranks({0: {"beat": 9}, 1: {"beat": 7}, 2: {"beat": 9}}, 3)
    [1]
    >>> hung_ranks({0: {"beat": 3}}, 2), hung_ranks({0: {"beat": 5}, 1: {"beat": 5}}, 2, waited={0})
    ([1], [1])
    >>> hung_ranks({0: {"beat": 5}, 1: {"beat": 5}}, 2, waited={0, 1}, failed_at={0: 100.0, 1: 115.2})
    [1]
    """
    beats = {r: int(progress[r].get("beat", 0)) if r in progress else -1 for r in range(ranks)}
    low, high = min(beats.values()), max(beats.values())
    if low < high:
        return [r for r, b in beats.items() if b == low]
    times = {r: float(t) for r, t in (failed_at or {}).items() if r in waited}
    if times:
        first = min(times.values())
        waited = {r for r in waited if r not in times or times[r] - first <= RELEASED_WITHIN_S}
    return [r for r in range(ranks) if r not in waited] if waited else []


def failed_times(records: Mapping[int, Mapping[str, Any]]) -> dict[int, float]:
    """rank -> when it failed (``failed_at``, Unix time, seconds) of the failure records that say so.

    >>> failed_times({0: {"kind": "timeout", "failed_at": 12.5}, 1: {"kind": "timeout"}})
    {0: 12.5}
    """
    return {r: float(f["failed_at"]) for r, f in records.items() if isinstance(f.get("failed_at"), int | float)}


def read_progress(run_dir: Path, ranks: int) -> dict[int, dict[str, Any]]:
    """Each rank's last heartbeat (:func:`pnpscale.core.layout.progress_file`); ranks without one are left out."""
    out = {}
    for r in range(ranks):
        try:
            data = json.loads(layout.progress_file(run_dir, r).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[r] = data
    return out


def _where(beat: dict[str, Any] | None) -> str:
    if not beat:
        return "no progress recorded (it never started its first step)"
    it = int(beat.get("iteration", -1))
    return f"section '{beat.get('section')}'" + (f" of iteration {it}" if it >= 0 else " (before the first iteration)")


def hung_message(failed: RankFailed, progress: dict[int, dict[str, Any]], ranks: int, timeout_s: float) -> str | None:
    """The one line for a collective that timed out, naming the rank(s) that did not arrive; ``None``
    when ``failed`` is not a timeout or no rank was behind.

    A timeout is what the ranks recorded (``failed.kinds``, rank -> :func:`pnpscale.core.errors.failure_kind`:
    an error after waiting ``dist.timeout_s`` in one step), never a word in an error message.

    >>> f = RankFailed(0, "RuntimeError: [/src/gloo/pair.cc:534] Timed out waiting 2000ms for recv")
    >>> hung_message(f, {0: {"beat": 5}, 1: {"beat": 4}}, 2, 2.0) is None  # no kind recorded: not a timeout
    True
    >>> f.kinds = {0: "timeout"}
    >>> print(hung_message(f, {0: {"beat": 5, "iteration": 1, "section": "denoiser"},
    ...                        1: {"beat": 4, "iteration": 1, "section": "gradient"}}, 2, 2.0))
    ... # doctest: +NORMALIZE_WHITESPACE
    rank 1 did not arrive within dist.timeout_s=2 s: last seen in section 'gradient' of iteration 1;
    rank 0 gave up waiting in section 'denoiser' of iteration 1
    """
    if failed.kinds.get(failed.rank) != TIMEOUT:
        return None
    hung = hung_ranks(progress, ranks, {r for r, kind in failed.kinds.items() if kind == TIMEOUT}, failed.failed_at)
    if not hung:
        return None
    who = ", ".join(f"rank {r}" for r in hung)
    where = "; ".join(f"rank {r}: {_where(progress.get(r))}" for r in hung) if len(hung) > 1 else (
        f"last seen in {_where(progress.get(hung[0]))}")  # fmt: skip
    return (
        f"{who} did not arrive within dist.timeout_s={timeout_s:g} s: {where}; rank {failed.rank} gave up waiting "
        f"in {_where(progress.get(failed.rank))}"
    )


#: torch's loggers that report a rank's failure (elastic's agent and error files, torch.multiprocessing's
#: "Terminating process ..."): quiet while ranks run, the failure is raised once as :class:`RankFailed`.
QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@contextmanager
def _quiet(prefixes: tuple[str, ...]) -> Iterator[None]:
    """Only CRITICAL records from the loggers named ``prefixes`` and their children (torch sets a level
    on each child logger, so the parent's level alone does not hold them), levels put back on exit."""
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith(tuple(f"{p}." for p in prefixes))]
    loggers = [logging.getLogger(n) for n in (*prefixes, *names)]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, before, strict=True):
            lg.setLevel(level)


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Seconds the elastic agent waits after its SIGTERM before it SIGKILLs a rank when the launcher is
#: stopped (elastic's default: 30 s; it keeps 30 s when a rank failed: see :func:`_resume_stopped_ranks`).
RANK_SHUTDOWN_TIMEOUT_S = 2
#: Seconds between the elastic agent's looks at its ranks: a rank that ended is acted on (the others
#: stopped) within this, so a peer's own error must be written within it to be seen.
MONITOR_INTERVAL_S = 0.1
#: How often :func:`_resume_stopped_ranks` looks for a failed rank, seconds.
STOPPED_POLL_S = 0.25


def _rank_pids(log_dir: Path) -> list[int]:
    """The pids of this launcher's ranks, from their heartbeats in ``log_dir``
    (:func:`pnpscale.cluster.exits.rank_pids`)."""

    return list(rank_pids(log_dir).values())


def _stopped_with_sigterm_pending(pid: int) -> bool:
    """Whether ``pid`` is stopped (state ``T``) with a SIGTERM waiting (``/proc/<pid>/status``'s
    ``ShdPnd``/``SigPnd``): the agent asked it to end, and it cannot until it continues."""
    import signal

    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        pending = int(fields["ShdPnd"].strip(), 16) | int(fields["SigPnd"].strip(), 16)
        return fields["State"].split()[0] in ("T", "t") and bool(pending & (1 << (signal.SIGTERM - 1)))
    except (OSError, KeyError, ValueError, IndexError):
        return False


@contextmanager
def _resume_stopped_ranks(log_dir: Path) -> Iterator[None]:
    """Once a rank failed (an ``error.json`` in ``log_dir``), send SIGCONT to every rank stopped by
    SIGSTOP (or a terminal's SIGTSTP) that the elastic agent's SIGTERM waits for: a stopped process only
    receives it when it continues, so the agent waited its 30 s before its SIGKILL (a rank stopped under
    ``dist.timeout_s=5`` was named after 36 s). Only then: continued earlier, the rank would time out in
    its own collective and no longer look like the one that did not arrive. A background thread."""
    import signal
    import threading

    done = threading.Event()

    def watch() -> None:
        while not done.wait(STOPPED_POLL_S):
            if not any(log_dir.glob("**/error.json")):
                continue
            for pid in _rank_pids(log_dir):
                if _stopped_with_sigterm_pending(pid):  # not before: a continued rank would time out too
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass

    thread = threading.Thread(target=watch, name="pnpscale-resume-stopped-ranks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


class LocalCluster(Cluster):
    """``cluster=local``: every rank on this machine (gloo on CPU, nccl on CUDA)."""

    name = "local"
    resumes_in_task = True

    def check(self, cfg: Mapping[str, Any], spec: RunSpec, cuda_devices: int) -> None:
        """Refuse a point this machine cannot hold: ``dist.backend=nccl`` without a CUDA device, more
        local ranks than CUDA devices on a CUDA machine (unless gloo is asked for, or a structure check
        on a shared GPU: ``dist.backend=nccl`` with ``NCCL_MULTI_RANK_GPU_ENABLE=1``), or more memory
        than is available
        (:func:`pnpscale.cluster.resources.check_memory` with :func:`rank_footprint`: an estimate, made before
        anything starts).

        Raises:
            ConfigError: one line naming the estimate, the limit and the way out.
        """

        if spec.backend == "nccl" and not cuda_devices:
            raise ConfigError(
                "dist.backend", "nccl", "this machine has no CUDA device: allowed here: auto, gloo (nccl needs a "
                "GPU per rank; cluster=slurm for GPU nodes)",
            )  # fmt: skip
        shared = shared_gpu_allowed(spec.backend, os.environ)  # a structure check on one GPU
        if cuda_devices and spec.backend != "gloo" and spec.gpus > cuda_devices and not shared:
            raise ConfigError(
                "gpus",
                spec.gpus,
                f"this machine has {cuda_devices} CUDA device(s): allowed 1..{cuda_devices} locally "
                "(or cluster=slurm, or dist.backend=gloo for CPU ranks; a structure check only: "
                "dist.backend=nccl with NCCL_MULTI_RANK_GPU_ENABLE=1)",
            )
        refusal = check_memory(spec, cuda_devices, rank_footprint())
        if refusal is None and cuda_devices:  # the GPUs' free memory (NVML: no CUDA context in this process)
            free = nvml_free_bytes(os.environ.get("CUDA_VISIBLE_DEVICES"))
            refusal = resources.check_gpu_memory(spec, cuda_devices, free)
        if refusal is not None:
            raise ConfigError("gpus", spec.gpus, refusal)

    def cpu_contention(self, spec: RunSpec) -> tuple[int, int] | None:

        return spec.gpus * threads_per_rank(spec.threads_per_rank, spec.gpus), len(os.sched_getaffinity(0))

    def run(self, spec: RunSpec, run_dir: Path, config: dict[str, Any] | None) -> None:
        launch_local(spec, run_dir, config)


def launch_local(spec: RunSpec, run_dir: Path, config: dict[str, Any] | None = None) -> None:
    """Run ``spec.gpus`` ranks of :func:`pnpscale.rank.worker.rank_main` here and wait for them.

    Per-rank stdout/stderr go to ``run_dir/logs/``; rank 0's stdout is also shown on the console;
    each rank's heartbeat to ``logs/rank<r>.progress``.

    Raises:
        RankHung: a collective timed out; names the rank(s) that did not arrive (from the heartbeats).
        RankFailed: a rank raised (its message) or died (its exit code).
    """
    from pnpscale.rank.worker import rank_main  # deferred: torch only in the process that runs a rank

    threads = threads_per_rank(spec.threads_per_rank, spec.gpus)
    clear_rank_failures(run_dir, spec.gpus)  # an earlier attempt's records in this folder never speak for this one
    try:
        run_ranks(spec.gpus, rank_main, (spec.to_dict(), str(run_dir), config), run_dir / layout.LOGS_DIR, threads)
    except RankFailed as exc:
        records = read_rank_failures(run_dir, spec.gpus)
        exc.kinds = {**exc.kinds, **{r: f["kind"] for r, f in records.items()}}
        exc.failed_at = failed_times(records)
        hung = hung_message(exc, read_progress(run_dir, spec.gpus), spec.gpus, spec.timeout_s)
        if hung is not None:
            raise RankHung(exc.rank, hung, exc.log) from None
        raise


def run_ranks(nprocs: int, entrypoint: Any, args: tuple[Any, ...], log_dir: Path, threads: int) -> dict[int, Any]:
    """Spawn ``nprocs`` local ranks of ``entrypoint(*args)`` (torch elastic, c10d rendezvous on a free port).

    Args:
        nprocs: ranks (processes) on this machine.
        entrypoint: importable function decorated with ``torch...errors.record``.
        args: picklable arguments.
        log_dir: per-rank logs.
        threads: ``OMP_NUM_THREADS`` of each rank.

    Returns:
        each local rank's return value.

    torch elastic installs its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers while the ranks run (a
    signal then stops every rank and raises its ``SignalException``); the handlers in place before
    are put back on return, whatever happened (:func:`pnpscale.core.signals.preserved`). Each rank
    dies with this process, even a SIGKILL of it (:data:`PARENT_PID_ENV`,
    :func:`pnpscale.rank.process.die_with_parent`), and the forkserver and resource tracker with them.
    Local rank ``r`` is bound to GPU ``r mod n`` of the ``n`` this process sees (:func:`node_gpus`).

    Raises:
        RankFailed: a rank raised (its message) or died (its exit code).
        SignalException: torch elastic's, for a signal received while the ranks ran (every rank stopped).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch


    log_dir.mkdir(parents=True, exist_ok=True)
    launch_cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"pnpscale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        shutdown_timeout=RANK_SHUTDOWN_TIMEOUT_S,
        start_method=rank_start_method(),
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.OUT}),
        log_line_prefix_template="[rank${rank}] ",
    )
    env = {
        **rank_environment(threads, os.environ),
        LAUNCH_T0_ENV: repr(time.time()),
        PARENT_PID_ENV: str(os.getpid()),
        NODE_GPUS_ENV: node_gpus(os.environ),
        **kineto_config_env(os.environ),
    }

    watch = ExitWatch(log_dir, nprocs)  # how each rank ended, as this process saw it
    try:  # the rank's error is re-raised below, once: torch's own log lines about it are held back
        with _quiet(QUIET_LOGGERS), _environ(**env), preserved(), _resume_stopped_ranks(log_dir), watch:
            return elastic_launch(launch_cfg, in_environment)(dict(os.environ), env, entrypoint, *args)
    except ChildFailedError as exc:
        # elastic reports the first rank seen to exit; the others' error files and exits may name the cause
        seen = {r: (f.timestamp, _failure_message(f)) for r, f in exc.failures.items()}
        recorded = _recorded_errors(log_dir)
        known = {**recorded, **seen}
        records = dict(read_rank_failures(log_dir.parent, nprocs))
        exits = watch.exits()
        # a rank aborted by torch's NCCL watchdog (SIGABRT) raised nothing: its stderr says it timed out waiting
        aborted = watchdog_timeouts({r: _stderr_tail(log_dir, r) for r in range(nprocs) if r not in recorded})
        for r, line in aborted.items():
            known[r] = (known[r][0] if r in known else int(time.time()), line)
            records[r] = {"kind": TIMEOUT, "own": False, "error_type": "DistBackendError"}
        rank = root_failure(known, nprocs, exits, records)
        message = known[rank][1] if rank in known else silent_death(exits.get(rank))
        failures = {r: m for r, (_, m) in known.items()} | ({} if rank in known else {rank: message})
        failed = RankFailed(rank, message, _rank_log(log_dir, rank), failures)
        failed.kinds = dict.fromkeys(aborted, TIMEOUT)
        raise failed from None
    except json.JSONDecodeError:  # elastic could not read a failed rank's error file: cut short (a full disk)
        rank, path = next(iter(_unreadable_error_files(log_dir).items()), (0, None))
        full = " (no space left on its disk)" if _disk_full(log_dir) else ""
        message = f"its error file {path} is empty or cut short{full}: see its stderr log"
        raise RankFailed(rank, message, _rank_log(log_dir, rank, "stderr.log")) from None
    finally:
        watch.close()


# --- how ranks start: from a forkserver that imported what they need ------------------------------

#: modules every rank imports, loaded once by the forkserver that forks the ranks; the server lives as
#: long as this process, so the points of a sweep after the first start without importing them again.
#: Only modules whose import never calls into ``torch.cuda``: torch marks every process forked after
#: any CUDA call (``torch.cuda.is_available()`` included) as a *bad fork*, whose first CUDA call
#: raises. ``deepinv`` is not one (its import runs ``Trainer``'s class body, ``get_device()`` ->
#: ``torch.cuda.is_available()``, and on a GPU machine ``mem_get_info`` on every GPU): each rank
#: imports it itself, after its GPU binding (0.13 s with these preloaded). Checked by
#: ``tests/test_gpu_path.py`` (a fork after importing these is not a bad fork) and by every rank
#: (:func:`pnpscale.rank.process.refuse_bad_fork`). ``pnpscale.rank.forkserver`` comes first (standard library
#: only): it ends the server as soon as the launcher is gone and ignores SIGINT while the heavy modules import,
#: and keeps a rank that cannot start because the launcher is gone silent; ``pnpscale.rank.preloaded`` comes
#: last and hands the watch over to the server's own loop.
RANK_PRELOAD = (
    "pnpscale.rank.forkserver",
    "torch", "torch.distributed", "torchvision", "h5py", "requests", "natsort", "tqdm", "pandas", "pyarrow",
    "pnpscale.rank.worker", "pnpscale.rank.solver", "pnpscale.rank.profiling", "pnpscale.core.record",
    "pnpscale.rank.preloaded",
)  # fmt: skip


def stop_rank_servers() -> list[int]:
    """End this process's forkserver (SIGKILL, then reaped): registered with ``atexit`` by
    :func:`rank_start_method`, so the ~790 MB server never outlives the launcher's exit, whatever ended it (a
    return, a failure, a stop signal's ``SystemExit``). The resource tracker is left to end by itself when this
    process's pipe to it closes (a small process, at once): stopped here, before multiprocessing's own
    finalisers, it unlinked the ranks' semaphores under them (a ``FileNotFoundError`` traceback each). A
    SIGKILL of the launcher runs no ``atexit``: the server then gets the kernel's SIGKILL
    (:func:`pnpscale.rank.forkserver.die_with_launcher`).

    Returns:
        the pids ended (none when no server was started).
    """
    import multiprocessing.forkserver as mp_forkserver
    import signal

    server = getattr(mp_forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if not isinstance(pid, int) or pid <= 0:
        return []
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        return []
    return [pid]


_SERVERS_STOPPED_AT_EXIT: list[bool] = []


def rank_start_method() -> str:
    """``forkserver`` (preloading :data:`RANK_PRELOAD`) where the platform has it, else ``spawn``.

    The forkserver is started by exec, not fork: whatever this process did with CUDA, the server
    starts clean and imports only :data:`RANK_PRELOAD`. It ends with this process
    (:func:`stop_rank_servers` at exit).
    """
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(list(RANK_PRELOAD))
    if not _SERVERS_STOPPED_AT_EXIT:
        import atexit

        atexit.register(stop_rank_servers)
        _SERVERS_STOPPED_AT_EXIT.append(True)
    return "forkserver"


def node_gpus(environ: Any) -> str:
    """The GPUs this machine's ranks share out (:data:`pnpscale.rank.gpus.NODE_GPUS_ENV`): this
    process's ``CUDA_VISIBLE_DEVICES`` when set, else ``0..n-1`` for the ``n`` CUDA devices torch sees
    (``""`` without CUDA). Local rank ``r`` is then bound to entry ``r mod n``
    (:func:`pnpscale.rank.gpus.bind_gpu`), so each rank opens a context on its own GPU only."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return ",".join(g.strip() for g in visible.split(",") if g.strip())

    return ",".join(str(i) for i in range(cuda_device_count()))


#: The error of a rank that left no error behind while its peers lost their connection to it.
SILENT_DEATH = (
    "died without recording an error while the other ranks lost their connection to it (killed by a signal: "
    "SIGKILL, the OOM killer, a crash)"
)


def silent_death(end: RankExit | None) -> str:
    """The error of the rank :func:`root_failure` blames without an error of its own: how it ended, when the
    launcher saw it (its status, first to end), else :data:`SILENT_DEATH`.

    >>> silent_death(RankExit(0, 9))  # doctest: +ELLIPSIS
    'Signal 9 (SIGKILL): it ended first of the ranks, without recording an error (killed: SIGKILL, the OOM ...'
    """
    if end is None:
        return SILENT_DEATH
    how = end.text()
    first = "ended first of the ranks" if end.order == 0 else "ended before its peers failed"
    cause = "killed: SIGKILL, the OOM killer, a crash" if how is None or how.startswith("Signal") else "a crash"
    return (f"{how + ': it' if how else 'it'} {first}, without recording an error ({cause}); the other ranks "
            "then lost their connection to it or were stopped")  # fmt: skip


def root_failure(
    failures: dict[int, tuple[int, str]],
    world: int | None = None,
    exits: dict[int, RankExit] | None = None,
    records: Mapping[int, Mapping[str, Any]] | None = None,
) -> int:
    """The rank whose failure caused the others.

    The rule, in order:

    1. a rank whose error is not the echo of a lost peer (:func:`pnpscale.cluster.peer_errors.echo_kind`: on its
       failure record first, pnpscale's own error or an error of a class no transport raises being a cause
       whatever its words; a transport error's words, or those of a rank without a record, against gloo's and
       NCCL's exact texts), the earliest (by the error's timestamp, then the order in which the ranks ended,
       then the rank); a timeout is such a cause (:func:`hung_message` then names the rank that did not
       arrive);
    2. else the rank that ended first as the launcher saw it (``exits``: :class:`pnpscale.cluster.exits.ExitWatch`)
       without recording an error: killed (SIGKILL, the OOM killer) or crashed; its peers failed with a lost
       peer after it, and the ranks the agent stopped ended after them (a rank that exited 0 is not one);
    3. else (exits unknown: an older kernel, a rank gone before its heartbeat) the one rank of ``world``
       that recorded no error, when exactly one did (torch elastic reports only the first rank it sees exit);
    4. else the earliest failure.

    Args:
        failures: rank -> (timestamp in s, message), every failure known (error files, torch elastic's report).
        world: the ranks of the run (``0..world-1``), when known.
        exits: rank -> how it ended, as the launcher saw it, when known.
        records: rank -> its failure record (:func:`pnpscale.core.record.read_rank_failures`), when it wrote one.

    gloo's words for a lost peer (``GLOO_ERROR_MSG`` of ``gloo/transport/tcp/pair.cc``, as a rank records them):

    >>> closed = "RuntimeError: [/g/pair.cc:561] Connection closed by peer [127.0.0.1]:5. This is typically caused"
    >>> reset = ("RuntimeError: [/g/pair.cc:545] Read error [127.0.0.1]:4: Connection reset by peer. This is "
    ...          "typically caused by a remote worker hanging or bugs in the application. ")
    >>> root_failure({0: (5, closed), 1: (5, "InjectedFailure: x")}), root_failure({0: (5, closed), 1: (6, "exit 1")})
    (1, 1)
    >>> root_failure({2: (7, reset), 3: (6, closed)}), root_failure({0: (5, reset)}, 2)
    (3, 1)

    Four ranks, rank 2 killed; ranks 0 and 3 lose their peer, rank 1 is stopped by the agent (two ranks silent):

    >>> lost = {0: (5, reset), 3: (5, closed)}
    >>> root_failure(lost, 4), root_failure(lost, 4, {2: RankExit(0, 9), 0: RankExit(1, 256), 3: RankExit(1, 256),
    ...                                                1: RankExit(2, 15)})
    (0, 2)
    >>> words = {0: (5, closed), 1: (6, "InputError: " + reset)}
    >>> root_failure(words, 2), root_failure(words, 2, records={1: {"kind": "InputError", "own": True}})
    (0, 1)
    """
    ends = exits or {}
    late = max((e.order for e in ends.values()), default=0) + 1

    def when(r: int) -> tuple[int, int, int]:
        return failures[r][0], ends[r].order if r in ends else late, r

    order = sorted(failures, key=when)
    recs = records or {}
    cause = next((r for r in order if echo_kind(failures[r][1], recs.get(r)) != PEER_LOST), None)
    if cause is not None:
        return cause
    ended = {r: e for r, e in ends.items() if not e.clean}
    if ended:
        first = min(e.order for e in ended.values())
        silent = sorted(r for r, e in ended.items() if e.order == first and r not in failures)
        if silent:
            return silent[0]
    silent = [r for r in range(world or 0) if r not in failures]
    return silent[0] if len(silent) == 1 else order[0]


def _failure_message(failure: Any) -> str:
    """The rank's exception line (from ``@record``'s error file), else its exit code."""
    msg = failure.message
    if isinstance(msg, dict):
        inner = msg.get("message", msg)
        text = str(inner.get("message", inner)) if isinstance(inner, dict) else str(inner)
    else:
        text = str(msg or "")
    if not text.strip() or text.startswith("To enable traceback"):
        return f"exit code {failure.exitcode} (no Python exception recorded; see the rank's log)"
    return text.strip().splitlines()[0]


def _recorded_errors(log_dir: Path) -> dict[int, tuple[int, str]]:
    """rank -> (timestamp s, first line of the exception) from the error files ranks wrote (``@record``)."""
    out: dict[int, tuple[int, str]] = {}
    for f in sorted(log_dir.glob("**/error.json")):
        try:
            msg = json.loads(f.read_text())["message"]
            rank = int(f.parent.name)
            text = str(msg.get("message", "")).strip().splitlines()[0]
            out[rank] = (int(msg.get("extraInfo", {}).get("timestamp", 0)), text)
        except (OSError, ValueError, KeyError, IndexError, AttributeError):
            continue
    return out


def _stderr_tail(log_dir: Path, rank: int, limit: int = 64 * 1024) -> str:
    """The last ``limit`` bytes of a rank's stderr log (``""`` when it has none)."""
    path = _rank_log(log_dir, rank, "stderr.log")
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _unreadable_error_files(log_dir: Path) -> dict[int, Path]:
    """rank -> its ``error.json`` that is not JSON (empty or cut short: written on a full disk)."""
    out: dict[int, Path] = {}
    for f in sorted(log_dir.glob("**/error.json")):
        try:
            json.loads(f.read_text())
        except (OSError, ValueError):
            if f.parent.name.isdigit():
                out.setdefault(int(f.parent.name), f)
    return out


def _disk_full(folder: Path) -> bool:
    """Whether the file system of ``folder`` has no block left for this user."""
    try:
        return os.statvfs(folder).f_bavail == 0
    except OSError:
        return False


def _rank_log(log_dir: Path, rank: int, *names: str) -> Path | None:
    """The failed rank's traceback (``error.json`` written by ``@record``), else its stderr log."""
    for name in names or ("error.json", "stderr.log"):
        hits = sorted(log_dir.glob(f"**/{rank}/{name}"))
        if hits:
            return hits[-1]
    return None


# --- the rank footprint: measured on ranks started the way this launcher starts them ---


def _compose(overrides: Sequence[str]) -> Any:
    """pnpscale's composed config for ``overrides`` (Hydra's compose API on the package's config tree)."""
    from hydra import compose, initialize_config_dir


    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


#: Ranks of the footprint probe's point (at least 2: a real process group, as in a multi-rank point).
PROBE_RANKS = 2
#: How the footprint is measured; part of the cache key, so a new rule measures again.
PROBE_VERSION = 2


#: The point the footprint probe runs: a real 2-rank point, tiny (its tensors are negligible).
PROBE_OVERRIDES = (
    f"gpus={PROBE_RANKS}", "scale=small", "problem=2d", "mode=inference", "problem.image_size=32",
    "problem.num_operators=2", "problem.patch_size=8", "problem.overlap=4", "problem.max_batch_size=4",
    "problem.nc=[4,8,8,8]", "problem.nb=1", "iterations=1", "warmup=1", "dist.backend=gloo",
)  # fmt: skip


def _probe_rank(spec_dict: dict[str, Any], run_dir: str) -> None:
    """One probe rank: the real rank (:func:`pnpscale.rank.worker.rank_main`), then its memory into
    ``run_dir/probe-rank<r>.json``: its private bytes and the bytes it shares with the forkserver."""
    from pnpscale.rank.worker import rank_main  # deferred: torch only in the process that runs a rank

    rank_main(spec_dict, run_dir)
    try:
        mine = resources.smaps_rollup()
    except OSError as exc:  # neither smaps_rollup nor smaps: the reason goes back to rank_footprint
        Path(run_dir, f"probe-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"error": str(exc)}))
        return
    private = mine.get("Private_Clean", 0) + mine.get("Private_Dirty", 0)
    parent = os.getppid()
    try:  # forked from a server: its resident pages are what the ranks share
        shared = resources.smaps_rollup(parent)["Rss"] if parent != int(os.environ[PROBE_PID_ENV]) else None
    except (OSError, KeyError):
        shared = None
    out = {"private": private, "shared": mine["Rss"] - private if shared is None else shared}
    Path(run_dir, f"probe-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(out))


PROBE_PID_ENV = "PNPSCALE_PROBE_PID"


#: The command that started the footprint probe (:func:`rank_footprint`): the probe ends when it does.
PROBE_LAUNCHER_ENV = "PNPSCALE_PROBE_LAUNCHER"


def probe_footprint() -> tuple[int, int, str]:
    """Run the probe point (:data:`PROBE_OVERRIDES`) the launcher's way and measure its ranks (see the
    module doc); run it in a fresh process (:func:`rank_footprint` does).

    Returns:
        ``(per_rank, once, start_method)``: a rank's private bytes (rank 1: it does what every rank
        does), and the bytes counted once: the shared pages plus what rank 0 holds beyond a rank's
        (it gathers the tables and writes the run folder).
    """
    import tempfile


    if os.environ.get(PROBE_LAUNCHER_ENV, "").isdigit():  # ends with the command, and its forkserver and ranks
        watch_launcher(int(os.environ[PROBE_LAUNCHER_ENV]))
    spec = resolve_spec(_compose(PROBE_OVERRIDES), cuda_available=False)
    os.environ[PROBE_PID_ENV] = str(os.getpid())
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(PROBE_RANKS, _probe_rank, (spec.to_dict(), tmp), Path(tmp) / "logs", 1)
        got = [json.loads(Path(tmp, f"probe-rank{r}.json").read_text()) for r in range(PROBE_RANKS)]
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise OSError(errors[0])
    per_rank = max(g["private"] for g in got[1:])
    once = max(g["shared"] for g in got) + max(0, got[0]["private"] - per_rank)
    return per_rank, once, rank_start_method()


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")

    return base / "pnpscale" / layout.RANK_FOOTPRINT


def _versions_key() -> str:
    import platform

    import torch

    return (
        f"python {platform.python_version()} torch {torch.__version__} {platform.machine()} probe {PROBE_VERSION} "
        f"preload {','.join(RANK_PRELOAD)}"
    )


_PROBE = """
from pnpscale.cluster.local import probe_footprint
try:
    print('footprint', *probe_footprint())
except OSError as exc:
    print('footprint-failed', ' '.join(str(exc).split()))
"""


def rank_footprint(measure: bool = True) -> tuple[int, int] | None:
    """``(per_rank, shared)`` bytes: one rank's own memory before it holds any data, and the memory
    every rank shares (counted once); measured once, then kept (see the module doc).

    Returns:
        the kept values for this machine and these versions; measured now (a few seconds, once)
        when absent and ``measure``; ``None`` when they cannot be measured.
    """
    path, key = _cache_file(), _versions_key()
    try:
        kept = json.loads(path.read_text())
        failed = resources.footprint_failure(kept, key)
        if failed is not None:  # measured before, and it could not be: not again at every point
            resources.say_memory_check_skipped(failed, path)
            return None
        if kept.get("key") == key and int(kept["per_rank_bytes"]) > 0:
            return int(kept["per_rank_bytes"]), int(kept["shared_bytes"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if not measure:
        return None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1", PROBE_LAUNCHER_ENV: str(os.getpid())},
        )  # fmt: skip
        line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("footprint"))
        if line.startswith("footprint-failed "):
            reason = line.split(" ", 1)[1]
            try:
                layout.write_json(path, {"key": key, "failed": reason})
            except OSError:
                pass
            resources.say_memory_check_skipped(reason, path)
            return None
        _, per_text, shared_text, method = line.split()
        per_rank, shared = int(per_text), int(shared_text)
    except (OSError, ValueError, StopIteration, subprocess.TimeoutExpired):
        return None
    try:

        layout.write_json(path, {"key": key, "per_rank_bytes": per_rank, "shared_bytes": shared,
                                 "start_method": method, "how": "pnpscale.cluster.local.probe_footprint: a "
                                 f"{PROBE_RANKS}-rank point's private pages per rank, shared pages and rank 0's "
                                 "extra once (/proc/<pid>/smaps_rollup)"})  # fmt: skip
    except OSError:
        pass
    return per_rank, shared
