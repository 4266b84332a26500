"""A rank's process: its life tied to the launcher's, its one GPU, its environment.

Used by both launchers (the local forkserver's ranks, SLURM tasks) before and around
:func:`pnpscale.rank.worker.rank_main`: a rank dies with its launcher (:func:`die_with_parent`), refuses
to run as a CUDA bad fork (:func:`refuse_bad_fork`), is bound to one GPU before its first CUDA call
(:func:`pnpscale.rank.gpus.bind_gpu`), and runs with the threads and Kineto settings of :func:`rank_environment` /
:func:`kineto_config_env`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pnpscale.rank.gpus import GPU_BINDING_ENV, NODE_GPUS_ENV, bind_gpu

LAUNCH_T0_ENV = "PNPSCALE_LAUNCH_T0"





#: Set by the local launcher to its pid: each rank asks the kernel to kill it when that process dies.
PARENT_PID_ENV = "PNPSCALE_PARENT_PID"



def die_with_parent(parent_pid: int) -> None:
    """No rank outlives its launcher ``parent_pid``, even one killed by SIGKILL.

    Two ties: the kernel SIGKILLs this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; the
    parent of a local rank is the launcher's forkserver), and a daemon thread waits for the launcher
    itself to end (:func:`watch_launcher`) and then ends this process. The second is needed because
    every process the forkserver forks holds the write end of the server's "alive" pipe
    (``multiprocessing.forkserver``): while a rank lives, the server never sees the launcher go, so a
    rank tied to the server alone would keep it, the resource tracker and itself alive forever. Once
    the ranks end, the server and the tracker see their pipes close and exit. Exits at once when
    ``parent_pid`` is already gone.
    """
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the elastic agent still stops the ranks it can
        pass
    parent = os.getppid()
    if parent != parent_pid and parent_of(parent) != parent_pid:  # forked by the launcher's forkserver
        os._exit(1)
    watch_launcher(parent_pid)



#: seconds between two looks at the launcher where the kernel cannot notify (no ``pidfd_open``)
LAUNCHER_POLL_S = 0.5



def watch_launcher(pid: int, on_exit: Callable[[], None] | None = None) -> Any:
    """Start a daemon thread that calls ``on_exit`` (default: ``os._exit(1)``) once process ``pid`` ends.

    Waits on a pidfd (Linux >= 5.3: woken by the kernel, no polling, immune to pid reuse), else polls
    ``kill(pid, 0)`` every :data:`LAUNCHER_POLL_S`. ``pid`` already gone: ``on_exit`` runs in the thread
    at once. Returns the thread.
    """
    import select
    import threading

    def gone() -> None:
        if on_exit is None:
            os._exit(1)
        on_exit()

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by another user
            return True
        return True

    def wait() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            gone()
            return
        except (OSError, AttributeError):  # no pidfd here (old kernel, gVisor, not Linux)
            while alive():
                time.sleep(LAUNCHER_POLL_S)
            gone()
            return
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        gone()

    thread = threading.Thread(target=wait, name=f"pnpscale-watch-{pid}", daemon=True)
    thread.start()
    return thread



def cuda_bad_fork() -> bool:
    """Whether this process was forked from one that had touched CUDA (torch's "bad fork" flag).

    torch marks a child as a bad fork when its parent had called into CUDA (even
    ``torch.cuda.is_available()``); the child's first CUDA call then raises "Cannot re-initialize
    CUDA in forked subprocess". ``False`` on torch builds without CUDA.
    """
    import torch

    return bool(getattr(torch._C, "_cuda_isInBadFork", lambda: False)())



def refuse_bad_fork(rank: int) -> None:
    """Raise when this rank is a bad fork (:func:`cuda_bad_fork`): its CUDA calls would fail later, and
    a CPU run would hide the fault that a GPU run hits.

    Raises:
        RuntimeError: naming the rank, its parent process and the cause.
    """
    if cuda_bad_fork():
        raise RuntimeError(
            f"rank {rank} (pid {os.getpid()}, parent {os.getppid()}) was forked from a process that had called "
            "into CUDA (torch marks it a bad fork: its first CUDA call would fail). The process that starts "
            "ranks must not touch torch.cuda: pnpscale.cluster.local.RANK_PRELOAD must hold only modules "
            "whose import never does (README: How ranks start)"
        )



def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc``), ``None`` when unknown. A rank forked by the launcher's
    forkserver has it as parent: the server exits when the launcher dies, and its ranks with it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None



def threads_per_rank(requested: int | None, ranks: int, cpus: int | None = None) -> int:
    """CPU threads of each rank: ``requested``, else this node's CPUs split evenly (>= 1).

    >>> threads_per_rank(None, 4, cpus=2), threads_per_rank(None, 1, cpus=16), threads_per_rank(3, 4, cpus=2)
    (1, 16, 3)
    """
    if requested:
        return int(requested)
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // max(1, ranks))



#: Kineto's log level for the ranks unless the user set one: 2 = WARNING (Kineto's levels: 0 VERBOSE,
#: 1 INFO, 2 WARNING, 3 ERROR, 4 STAGE), so CUPTI errors and dropped-record warnings reach the rank's
#: stderr; 5 would hide everything.
KINETO_LOG_LEVEL = "2"



def rank_environment(threads: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables every rank runs with, whichever backend started it (local elastic, a SLURM task).

    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` = ``threads`` (elastic does not set them, unlike
    torchrun); ``KINETO_LOG_LEVEL`` (:data:`KINETO_LOG_LEVEL` unless the user set one) and
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (a failed NCCL collective ends the rank) unless set.

    >>> rank_environment(2, {"KINETO_LOG_LEVEL": "0"})["KINETO_LOG_LEVEL"], rank_environment(2, {})["OMP_NUM_THREADS"]
    ('0', '2')
    """
    return {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "KINETO_LOG_LEVEL": environ.get("KINETO_LOG_LEVEL", KINETO_LOG_LEVEL),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }



#: Kineto's CUPTI activity buffer for the ranks, MB. Kineto's default, 128 MB, can fill during one
#: paper-scale 3D iteration on one GPU, and a full buffer stops the trace (refused as lost iterations).
KINETO_GPU_BUFFER_MB = 1024



def kineto_config_text(buffer_mb: int = KINETO_GPU_BUFFER_MB) -> str:
    """The Kineto config file pnpscale gives its ranks (``KINETO_CONFIG``; Kineto's key, ``libkineto/src/Config.cpp``).

    >>> kineto_config_text(512)
    'ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB=512\\n'
    """
    return f"ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB={int(buffer_mb)}\n"



def kineto_config_env(environ: Mapping[str, str], folder: str | None = None) -> dict[str, str]:
    """``{"KINETO_CONFIG": <file>}`` for the ranks, the file (:func:`kineto_config_text`) written in
    ``folder`` (default ``$TMPDIR``) if missing; ``{}`` when the user set ``KINETO_CONFIG`` (kept).

    Kineto reads the file named by ``KINETO_CONFIG`` when a trace is prepared and applies it over its
    defaults (``ActivityProfilerProxy::prepareTrace``), so set it in the rank's environment before
    its profiler starts.
    """
    import tempfile

    if "KINETO_CONFIG" in environ:
        return {}
    text = kineto_config_text()
    path = Path(folder or tempfile.gettempdir()) / f"pnpscale-kineto-{KINETO_GPU_BUFFER_MB}mb.conf"
    try:
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)
    except OSError:  # an unwritable $TMPDIR: Kineto keeps its default buffer
        return {}
    return {"KINETO_CONFIG": str(path)}



def process_info() -> dict[str, Any]:
    """How this rank's process was started, for ``run.json``'s ``processes``: ``pid``, ``cuda_bad_fork``
    (:func:`cuda_bad_fork`, always ``False`` in a run that got this far), ``cuda_visible_devices`` (as
    the rank saw it; ``None`` unset) and ``gpu_binding`` (:func:`pnpscale.rank.gpus.bind_gpu`'s, ``None`` when
    not bound)."""
    return {
        "pid": os.getpid(),
        "cuda_bad_fork": cuda_bad_fork(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_binding": os.environ.get(GPU_BINDING_ENV),
    }



def in_environment(environ: dict[str, str], ours: dict[str, str], entrypoint: Any, *args: Any) -> Any:
    """Run ``entrypoint(*args)`` in the launching process's environment.

    A forked rank inherits the forkserver's environment (of the first launch), not the launcher's:
    ``ours`` (this launch's variables) replace it, the launcher's other variables are added where
    the rank has none (elastic's own, ``RANK``..., are kept). With :data:`pnpscale.rank.gpus.NODE_GPUS_ENV` in
    ``ours`` the rank is then bound to its GPU (:func:`pnpscale.rank.gpus.bind_gpu`, by ``LOCAL_RANK``). Not
    decorated with ``record``: ``entrypoint`` records its own error (one error file per rank, written once).
    """
    for k, v in environ.items():
        os.environ.setdefault(k, v)
    os.environ.update(ours)
    if NODE_GPUS_ENV in ours:  # before anything in this rank calls into CUDA
        # the launcher's CUDA_VISIBLE_DEVICES exactly, not one the forkserver kept from an earlier launch
        if "CUDA_VISIBLE_DEVICES" in environ:
            os.environ["CUDA_VISIBLE_DEVICES"] = environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.pop(GPU_BINDING_ENV, None)
        bind_gpu(int(os.environ.get("LOCAL_RANK", "0")), ours[NODE_GPUS_ENV])
    return entrypoint(*args)
