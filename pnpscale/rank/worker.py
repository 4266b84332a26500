"""What every rank runs: set up, measure every iteration under the profiler, hand in its tables.

Entry point :func:`rank_main` is used by both launchers (local ``elastic_launch`` and SLURM
tasks). It expects the torch.distributed environment variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). Rank 0 gathers every
rank's tables and writes the run folder (:func:`pnpscale.rank.commit.write_run`); other ranks write
nothing shared.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.errors import record

from pnpscale import layout
from pnpscale.core.errors import PnpscaleError

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec

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
    if parent != parent_pid and _parent_of(parent) != parent_pid:  # forked by the launcher's forkserver
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


#: set by the local launcher: the GPUs of this machine its ranks share out, one per local rank
#: (``CUDA_VISIBLE_DEVICES`` entries, comma-separated; empty: no GPU)
NODE_GPUS_ENV = "PNPSCALE_NODE_GPUS"
#: set in a rank bound to one GPU by :func:`bind_gpu`: the ``CUDA_VISIBLE_DEVICES`` it was given
GPU_BINDING_ENV = "PNPSCALE_GPU_BINDING"


def gpu_binding(local_rank: int, visible: str | None, count: int | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` that binds local rank ``local_rank`` to one GPU, ``None`` to leave it.

    Args:
        local_rank: the rank's index on its node (``LOCAL_RANK``, ``SLURM_LOCALID``).
        visible: the node's ``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-<uuid>`` or MIG names; ``None``: unset).
        count: the node's GPU count, used when ``visible`` is unset (``None``: unknown).

    Returns:
        entry ``local_rank % n`` of the node's GPUs (so ranks sharing one GPU for a structure check
        get the same one), or ``None``: no GPU, or exactly one visible already (bound outside, e.g.
        SLURM's per-task binding).

    >>> gpu_binding(1, "0,1,2,3"), gpu_binding(3, "GPU-a,GPU-b"), gpu_binding(3, None, 2), gpu_binding(1, "0", 1)
    ('1', 'GPU-b', '1', None)
    >>> gpu_binding(0, ""), gpu_binding(0, None, 0), gpu_binding(0, None)
    (None, None, None)
    """
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        gpus = [str(i) for i in range(count or 0)]
    if len(gpus) <= 1 and (visible is not None or not gpus):
        return None
    return gpus[local_rank % len(gpus)]


def bind_gpu(local_rank: int, visible: str | None, count: int | None = None) -> str | None:
    """Bind this process to its GPU (:func:`gpu_binding`) by setting ``CUDA_VISIBLE_DEVICES``; call it
    before the process's first CUDA call (CUDA reads the variable once, at its initialisation:
    :class:`Group` checks that the binding took). Returns the binding, or ``None`` (nothing changed)."""
    binding = gpu_binding(local_rank, visible, count)
    if binding is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = binding
        os.environ[GPU_BINDING_ENV] = binding
    return binding


def nvml_device_count() -> int | None:
    """GPUs on this node by NVML (``libnvidia-ml``), without initialising CUDA; ``None`` without NVML."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None
    return int(count.value) if ok else None


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (``/proc``), ``None`` when unknown. A rank forked by the launcher's
    forkserver has it as parent: the server exits when the launcher dies, and its ranks with it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Heartbeat:
    """Where this rank is: ``{"rank", "beat", "iteration", "section", "t", "pid"}`` rewritten in place in
    :func:`pnpscale.layout.progress_file` at each step (outside the timed sections).

    ``beat`` counts the steps; every rank takes the same steps in the same order, so the rank with
    the lowest ``beat`` is the one the others wait for (:func:`pnpscale.cluster.local.hung_ranks`).
    ``iteration`` is -1 before the first iteration; ``section`` is a solver section or a phase
    (``init``, ``setup``, ``barrier``, ``gather``, ``write``, ``done``). A no-op without a path.
    """

    def __init__(self, path: Path | None, rank: int) -> None:
        self.rank, self.beat = rank, 0
        self.iteration, self.section, self.since = -1, "init", time.monotonic()
        self.fd: int | None = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError:
                self.fd = None

    def __call__(self, iteration: int, section: str, advance: bool = True) -> None:
        """Record the step; ``advance=False`` for a step only some ranks take (rank 0 writing)."""
        self.iteration, self.section, self.since = iteration, section, time.monotonic()
        if self.fd is None:
            return
        import json

        self.beat += advance
        data = json.dumps(
            {"rank": self.rank, "beat": self.beat, "iteration": iteration, "section": section, "t": time.time(),
             "pid": os.getpid()}
        ).encode()  # fmt: skip
        try:
            os.pwrite(self.fd, data, 0)
            os.ftruncate(self.fd, len(data))
        except OSError:
            pass


class InjectedFailure(PnpscaleError, RuntimeError):
    """Raised on purpose by ``inject.fail=true`` (tests of failure handling)."""


def threads_per_rank(requested: int | None, ranks: int, cpus: int | None = None) -> int:
    """CPU threads of each rank: ``requested``, else this node's CPUs split evenly (>= 1).

    >>> threads_per_rank(None, 4, cpus=2), threads_per_rank(None, 1, cpus=16), threads_per_rank(3, 4, cpus=2)
    (1, 16, 3)
    """
    if requested:
        return int(requested)
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // max(1, ranks))


#: NCCL refuses ranks sharing a GPU unless this variable is ``1`` (then timings are meaningless).
SHARED_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
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


def shared_gpu_allowed(requested: str, env: Any) -> bool:
    """Whether ranks may share a GPU: ``dist.backend=nccl`` with ``NCCL_MULTI_RANK_GPU_ENABLE=1``.

    Only for structure checks (collectives, payloads, NCCL logs): ranks sharing a GPU time-slice it.

    >>> shared_gpu_allowed("nccl", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}), shared_gpu_allowed("auto", {})
    (True, False)
    """
    return requested == "nccl" and str(env.get(SHARED_GPU_ENV, "")) == "1"


def cuda_device_index(local_rank: int, visible: int) -> int | None:
    """The CUDA device of a local rank, by deepinv 0.5's ``DistributedContext`` rule.

    No visible device: ``None``; one visible device (isolation done outside, e.g. SLURM binding one
    GPU per task, or ``CUDA_VISIBLE_DEVICES``): ``0``; else ``local_rank % visible``.

    >>> cuda_device_index(3, 0), cuda_device_index(3, 1), cuda_device_index(3, 4), cuda_device_index(5, 4)
    (None, 0, 3, 1)
    """
    if visible < 1:
        return None
    return 0 if visible == 1 else local_rank % visible


def choose_backend(requested: str, devices: Sequence[tuple[str, str | None]], shared_ok: bool = False) -> str:
    """Process-group backend from every rank's GPU: ``nccl`` when each rank has its own GPU.

    Decided from the same list on every rank, so all ranks agree. GPUs are compared by UUID (unique
    per physical device): ranks on one node that see one device each (SLURM's per-task binding),
    or all of them (local ranks mapped ``local_rank % visible``), are told apart correctly, unlike
    a count of visible devices against ``LOCAL_WORLD_SIZE``.

    Args:
        requested: ``auto``, ``gloo`` or ``nccl``.
        devices: per rank (index = rank), ``(host, GPU UUID)``, UUID ``None`` when that rank has
            no CUDA device.
        shared_ok: ranks may share a GPU (:func:`shared_gpu_allowed`; ``nccl`` only).

    Returns:
        ``"nccl"`` or ``"gloo"``.

    Raises:
        RuntimeError: ``nccl`` requested while some rank has no GPU; or two ranks share a GPU with
            ``auto``/``nccl`` (NCCL 2.30 refuses that; timings would be meaningless anyway), naming
            the ranks, host and GPU.

    >>> choose_backend("auto", [("n1", None), ("n1", None)]), choose_backend("gloo", [("n1", "G0")])
    ('gloo', 'gloo')
    >>> choose_backend("auto", [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-c")])
    'nccl'
    """
    if requested == "gloo":
        return "gloo"
    missing = [r for r, (_, uuid) in enumerate(devices) if not uuid]
    if missing:
        if requested == "nccl":
            raise RuntimeError(
                f"dist.backend=nccl: rank(s) {_ranks(missing)} have no CUDA device (host "
                f"{devices[missing[0]][0]}); allowed: dist.backend=gloo, or run where each rank has a GPU"
            )
        return "gloo"
    owner: dict[str, int] = {}
    for r, (host, uuid) in enumerate(devices):
        first = owner.setdefault(str(uuid), r)
        if first != r and not shared_ok:
            raise RuntimeError(
                f"dist.backend={requested}: ranks {first} and {r} share the GPU {uuid} on host {host}; NCCL "
                "refuses ranks sharing a GPU and their timings would be meaningless. Give each rank its own "
                "GPU (fewer gpus, or SLURM with one GPU per task), or use dist.backend=gloo for CPU ranks; "
                f"for a structure check only: dist.backend=nccl with {SHARED_GPU_ENV}=1"
            )
    return "nccl"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")


def device_uuid(index: int | None) -> str | None:
    """UUID of CUDA device ``index`` (``None`` when ``index`` is ``None``); PCI address when no UUID."""
    if index is None:
        return None
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid
    return "pci:{}:{}:{}".format(*(getattr(props, k, "?") for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")))


def exchange_devices(store: Any, rank: int, world: int, mine: tuple[str, str | None], attempt: int = 0) -> list:
    """Every rank's ``(host, GPU UUID)`` through the rendezvous store (a ``torch.distributed.Store``).

    Each rank sets ``pnpscale/device/<attempt>/<rank>`` and reads all ``world`` keys (``get`` waits
    for a missing key up to the store's timeout).

    Returns:
        list indexed by rank of ``(host, uuid)`` (``uuid`` ``None`` for a rank without GPU).
    """
    import json

    prefix = f"pnpscale/device/{attempt}/"
    store.set(f"{prefix}{rank}", json.dumps(list(mine)))
    out = []
    for r in range(world):
        raw = store.get(f"{prefix}{r}")
        host, uuid = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        out.append((str(host), uuid))
    return out


#: fewest CPUs a GPU rank should have (see :func:`cpu_warning`).
MIN_CPUS_PER_GPU_RANK = 4


def cpu_warning(cpus: int, backend: str, rank: int) -> str | None:
    """A warning when a CUDA rank has fewer than 4 CPUs, else ``None``.

    The main thread, NCCL's proxy and watchdog threads and CUPTI's buffer handling all need a CPU;
    with one or two they delay kernel launches and inflate the measured wait.

    >>> cpu_warning(8, "nccl", 0) is None, cpu_warning(1, "gloo", 0) is None
    (True, True)
    >>> cpu_warning(1, "nccl", 3).split(":")[0]
    'rank 3'
    """
    if backend != "nccl" or cpus >= MIN_CPUS_PER_GPU_RANK:
        return None
    return (
        f"rank {rank}: warning: {cpus} CPU(s) for a GPU rank (main thread, NCCL proxy and watchdog, CUPTI "
        f"share them; launch delays show up as wait): give each GPU task >= {MIN_CPUS_PER_GPU_RANK} CPUs "
        "(SLURM: cluster.cpus_per_task)"
    )


def nccl_log_file(run_dir: Path, rank: int, tmp_dir: str | None = None) -> Path:
    """Node-local file a rank's NCCL log is written to while it runs (copied to the run folder after).

    NCCL's rank 0 prints a TUNING line per collective, from inside measured sections: on a shared
    file system each of those writes could stall the rank. The file is in ``tmp_dir`` (default
    :func:`tempfile.gettempdir`, i.e. ``$TMPDIR``, node-local on most clusters), named after the run
    folder, the rank and the process.

    >>> nccl_log_file(Path("/r/run-a"), 3, "/tmp").name.startswith("pnpscale-nccl-run-a-rank3-")
    True
    """
    import tempfile

    base = Path(tmp_dir or tempfile.gettempdir())
    return base / f"pnpscale-nccl-{run_dir.name}-rank{rank}-{os.getpid()}.log"


def nccl_debug_env(log_file: Path, current: Any) -> dict[str, str]:
    """NCCL diagnostics for the transfer analysis, unless the user set them already.

    ``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING`` (topology, ring/tree graphs and the
    algorithm chosen per collective size) and ``NCCL_DEBUG_FILE=<log_file>`` (see
    :func:`nccl_log_file`; :func:`collect_nccl_log` moves it to ``<run_dir>/nccl/rank<r>.log``).

    >>> nccl_debug_env(Path("/tmp/x.log"), {})["NCCL_DEBUG_FILE"]
    '/tmp/x.log'
    >>> nccl_debug_env(Path("/tmp/x.log"), {"NCCL_DEBUG": "WARN"}).get("NCCL_DEBUG") is None
    True
    """
    wanted = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING",
        "NCCL_DEBUG_FILE": str(log_file),
    }
    return {k: v for k, v in wanted.items() if k not in current}


def collect_nccl_log(log_file: Path, run_dir: Path, rank: int) -> Path | None:
    """Move a rank's node-local NCCL log to ``<run_dir>/nccl/rank<r>.log``; ``None`` if it has none."""
    import shutil

    if not log_file.is_file():
        return None
    dest = layout.nccl_log(run_dir, rank)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.copyfile(log_file, tmp)
    os.replace(tmp, dest)
    log_file.unlink(missing_ok=True)
    return dest


class Group:
    """The ranks of a run, their backend and this rank's device.

    A 1-rank run has no process group (deepinv's single-process path): with one rank nothing is
    distributed, so its sections hold no collectives at all: the study's 1-GPU baseline, with
    zero transfer and zero wait by construction.

    With several ranks: rendezvous through ``env://`` (the store ``init_process_group`` would
    create), exchange every rank's GPU UUID through that store, choose the backend from them
    (:func:`choose_backend`), then on ``nccl`` ``torch.cuda.set_device`` and
    ``init_process_group(..., device_id=...)`` so that NCCL communicators are created (and fail)
    at init, not at the first collective.

    Args:
        requested: ``auto``, ``gloo`` or ``nccl`` (``dist.backend``).
        timeout_s: process-group timeout, seconds.
        before_init: called with the chosen backend before the process group starts (e.g. to set
            NCCL's environment).

    Attributes:
        backend: ``nccl`` (each rank has its own CUDA device; also a 1-rank CUDA run) or ``gloo``.
        device: this rank's ``torch.device`` (``cuda:<i>`` by :func:`cuda_device_index`, or cpu).

    Raises:
        RuntimeError: see :func:`choose_backend`.
    """

    def __init__(self, requested: str, timeout_s: float, before_init: Callable[[str], None] | None = None) -> None:
        import torch
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        visible = torch.cuda.device_count() if requested != "gloo" and torch.cuda.is_available() else 0
        check_binding(os.environ.get(GPU_BINDING_ENV), visible, int(os.environ.get("RANK", "0")))
        index = cuda_device_index(int(os.environ.get("LOCAL_RANK", "0")), visible)
        mine = (socket.gethostname(), device_uuid(index))
        timeout = timedelta(seconds=timeout_s)
        if self.world > 1:
            store, self.rank, self.world = next(dist.rendezvous("env://", timeout=timeout))
            store.set_timeout(timeout)
            if requested == "gloo":
                devices = [mine] * self.world
            else:
                attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                devices = exchange_devices(store, self.rank, self.world, mine, attempt)
        else:
            store, self.rank, devices = None, 0, [mine]
        self.backend = choose_backend(requested, devices, shared_gpu_allowed(requested, os.environ))
        cuda = self.backend == "nccl"
        self.device = torch.device("cuda", index) if cuda and index is not None else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if before_init is not None:
            before_init(self.backend)
        if self.world > 1:
            dist.init_process_group(
                backend=self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=timeout,
                device_id=self.device if cuda else None,
            )
            if dist.get_backend() != self.backend:
                raise RuntimeError(f"process group backend is {dist.get_backend()}, expected {self.backend}")

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def context(self, cuda: bool) -> Iterator[Any]:
        """deepinv's ``DistributedContext`` on this group (single-process when 1 rank)."""
        from deepinv.distributed import DistributedContext

        hidden = {} if self.distributed else {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
        try:
            with DistributedContext(backend=self.backend, cleanup=False, device_mode="gpu" if cuda else "cpu") as ctx:
                yield ctx
        finally:
            os.environ.update(hidden)


def check_binding(binding: str | None, visible: int, rank: int) -> None:
    """Refuse a rank bound to one GPU (:func:`bind_gpu`) that sees several: CUDA had been initialised in
    the process before the binding, so it opens a context on every GPU (or fails on GPUs in
    exclusive-process mode).

    >>> check_binding("2", 1, 0), check_binding(None, 4, 0)
    (None, None)

    Raises:
        RuntimeError: ``binding`` is set and ``visible > 1``.
    """
    if binding is not None and visible > 1:
        raise RuntimeError(
            f"rank {rank}: bound to GPU {binding} (CUDA_VISIBLE_DEVICES) but sees {visible} GPUs: CUDA was "
            "initialised in this process before the binding (something called torch.cuda first)"
        )


def process_info() -> dict[str, Any]:
    """How this rank's process was started, for ``run.json``'s ``processes``: ``pid``, ``cuda_bad_fork``
    (:func:`cuda_bad_fork`, always ``False`` in a run that got this far), ``cuda_visible_devices`` (as
    the rank saw it; ``None`` unset) and ``gpu_binding`` (:func:`bind_gpu`'s, ``None`` when not bound)."""
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
    the rank has none (elastic's own, ``RANK``..., are kept). With :data:`NODE_GPUS_ENV` in ``ours``
    the rank is then bound to its GPU (:func:`bind_gpu`, by ``LOCAL_RANK``). Not decorated with ``record``:
    ``entrypoint`` records its own error (one error file per rank, written once).
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


@record
def rank_main(
    spec_dict: dict[str, Any], run_dir: str, config: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
) -> None:
    """Run one rank of a measurement (see module doc). Raises whatever the rank hit.

    Args:
        spec_dict: :meth:`pnpscale.core.config.RunSpec.to_dict` of the run.
        run_dir: the run folder (shared by all ranks; only rank 0 writes into it).
        config: the resolved Hydra config, stored in ``run.json``.
        extra: launcher fields added to ``run.json`` by rank 0 (e.g. ``{"slurm": {...}}``).
    """
    import torch

    from pnpscale.core.config import RunSpec

    if PARENT_PID_ENV in os.environ:
        die_with_parent(int(os.environ[PARENT_PID_ENV]))
    refuse_bad_fork(int(os.environ.get("RANK", "0")))
    spec = RunSpec(**spec_dict)
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = threads_per_rank(spec.threads_per_rank, local_ws)
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    t_start = time.time()
    rank = int(os.environ.get("RANK", "0"))
    nccl_log = nccl_log_file(Path(run_dir), rank)
    staged = False

    def before_init(backend: str) -> None:
        nonlocal staged
        if backend == "nccl":
            env = nccl_debug_env(nccl_log, os.environ)
            staged = "NCCL_DEBUG_FILE" in env
            os.environ.update(env)
        warning = cpu_warning(len(os.sched_getaffinity(0)), backend, rank)
        if warning:
            print(warning, file=sys.stderr)

    beat = Heartbeat(layout.progress_file(run_dir, rank) if PARENT_PID_ENV in os.environ else None, rank)
    beat(-1, "init")
    try:
        group = Group(spec.backend, spec.timeout_s, before_init)
        try:
            _measure_and_report(spec, Path(run_dir), group, threads, t_start, config, extra, beat)
        finally:
            group.close()
            if staged:
                collect_nccl_log(nccl_log, Path(run_dir), rank)
    except BaseException as exc:  # its kind crosses to the launcher as a field, decided here
        from pnpscale.core.errors import failure_kind
        from pnpscale.core.record import write_rank_failure

        waited = time.monotonic() - beat.since
        world = int(os.environ.get("WORLD_SIZE", "1"))
        kind = failure_kind(exc, waited, spec.timeout_s, world)
        write_rank_failure(run_dir, rank, kind, type(exc).__name__, iteration=beat.iteration, section=beat.section,
                           waited_s=round(waited, 3))  # fmt: skip
        raise


def _measure_and_report(
    spec: RunSpec,
    run_dir: Path,
    group: Group,
    threads: int,
    t_start: float,
    config: dict[str, Any] | None,
    extra: dict[str, Any] | None,
    beat: Heartbeat,
) -> None:
    import torch

    rank, cuda = group.rank, group.backend == "nccl"
    if not cuda and spec.backend == "auto" and torch.cuda.is_available():
        print(f"rank {rank}: warning: CUDA is available but the run uses gloo", file=sys.stderr)
    with group.context(cuda) as ctx:
        if ctx.device != group.device:
            raise RuntimeError(f"rank {rank}: deepinv chose {ctx.device}, the process group {group.device}")
        t_setup0 = time.time()
        from pnpscale.rank.solver import make_solver

        beat(-1, "setup")
        solver = make_solver(spec, ctx)
        _sync(ctx.device)
        beat(-1, "barrier")
        group.barrier()
        t_measure0 = time.time()
        peaks, prof, calls, reserved = _run_iterations(spec, solver, ctx.device, group, beat)
        t_measure1 = time.time()
        from pnpscale.analysis.events import SectionError, rank_rows, section_records
        from pnpscale.rank.profiling import check_trace_complete, export_trace, profiler_events

        if spec.export_traces:
            export_trace(prof, layout.trace_file(run_dir, rank))
        from pnpscale.analysis.anomalies import Anomalies

        anomalies = Anomalies()
        try:
            events = profiler_events(prof, anomalies, rank, calls)
            sections = section_records(events, spec.sections, anomalies, rank, require_gpu=cuda, cpu_start=cuda)
        except SectionError as exc:
            error = SectionError(f"rank {rank}: {exc}", rank=rank)
            error.counts = exc.counts
            raise error from exc
        check_trace_complete(sections, spec.sections, spec.warmup + spec.iterations, cuda, rank)
        table = {**rank_rows(rank, sections, spec.warmup, peaks), "anomalies": anomalies.records()}
        info = {
            "rank": rank,
            "host": socket.gethostname(),
            "device": _device_name(ctx.device),
            "threads": threads,
            "local_operators": list(solver.physics.local_indexes),
            "local_tiles": len(solver.denoiser.local_indices),
            "num_tiles": solver.num_tiles,
            "solver": solver.summary(),
            "process": process_info(),
            "peak_reserved_bytes": reserved,
        }
        beat(spec.warmup + spec.iterations - 1, "gather")
        gathered = group.gather((table, info))
        if rank == 0:
            assert gathered is not None  # rank 0 holds every rank's tables
            beat(spec.warmup + spec.iterations - 1, "write", advance=False)
            from pnpscale.rank.commit import write_run

            timings = {
                "launch_s": (t_start - float(os.environ[LAUNCH_T0_ENV])) if LAUNCH_T0_ENV in os.environ else None,
                "init_s": t_setup0 - t_start,
                "setup_s": t_measure0 - t_setup0,
                "measure_s": t_measure1 - t_measure0,
            }
            recon = solver.result().cpu() if spec.save_reconstruction else None
            write_run(
                run_dir,
                spec,
                gathered,
                backend=group.backend if group.distributed else "none",
                timings=timings,
                config=config,
                reconstruction=recon,
                extra=extra,
            )
        beat(spec.warmup + spec.iterations - 1, "barrier")
        group.barrier()
        beat(spec.warmup + spec.iterations - 1, "done")


def _device_name(device: Any) -> str:
    """CUDA device name, or the CPU model (``/proc/cpuinfo``), or the machine type."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inject(spec: RunSpec, rank: int, section: str, measured: bool, device: Any) -> None:
    inj = spec.inject
    if inj["rank"] != rank or inj["section"] not in (None, section):
        return
    if inj["fail"] and measured:
        raise InjectedFailure(f"rank {rank}: injected failure in section {section!r} (inject.fail=true)")
    if inj["delay_s"] and (inj["section"] == section):
        busy_wait(float(inj["delay_s"]), device)


#: cycles per second of ``torch.cuda._sleep`` per CUDA device index, measured once (:func:`sleep_rate_hz`).
_SLEEP_RATE_HZ: dict[int, float] = {}


def sleep_cycles(seconds: float, rate_hz: float) -> int:
    """Cycles to pass to ``torch.cuda._sleep`` for ``seconds`` at ``rate_hz`` cycles per second.

    >>> sleep_cycles(0.2, 1.5e9)
    300000000
    """
    if seconds < 0 or rate_hz <= 0:
        raise ValueError(f"sleep of {seconds} s at {rate_hz} Hz")
    return round(seconds * rate_hz)


def sleep_rate_hz(device: Any, cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Measured rate of ``torch.cuda._sleep`` on ``device`` (cycles per second), once per device.

    The sleep kernel spins on the SM clock, which runs below the maximum clock
    (``clock_rate``) most of the time, so converting with the maximum makes delays longer than
    asked. Measured with CUDA events around ``_sleep(cycles)`` (after one warm-up call); the median
    of ``repeats``. Call it before the profiler starts, so its kernels are not traced.

    Raises:
        RuntimeError: the events measured no time.
    """
    import statistics

    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _SLEEP_RATE_HZ:
        return _SLEEP_RATE_HZ[index]
    rates = []
    with torch.cuda.device(index):
        torch.cuda._sleep(cycles)  # warm-up: clocks up, module loaded
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            ms = float(start.elapsed_time(end))
            if ms <= 0:
                raise RuntimeError(f"cuda:{index}: a sleep of {cycles} cycles measured {ms} ms")
            rates.append(cycles / (ms * 1e-3))
    _SLEEP_RATE_HZ[index] = statistics.median(rates)
    return _SLEEP_RATE_HZ[index]


def busy_wait(seconds: float, device: Any) -> None:
    """Keep the rank busy for ``seconds``: a CPU spin, or on CUDA a GPU sleep kernel of
    ``seconds x`` :func:`sleep_rate_hz` cycles (launched asynchronously, like any kernel)."""
    if device.type == "cuda":
        import torch

        torch.cuda._sleep(sleep_cycles(seconds, sleep_rate_hz(device)))
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _run_iterations(
    spec: RunSpec, solver: Any, device: Any, group: Group, beat: Heartbeat | None = None
) -> tuple[dict[tuple[int, str], int], Any, list[tuple[str, int | None]], int | None]:
    """Profiled iterations: (peak bytes per (iteration, section), profiler, collective calls in order,
    the highest CUDA ``max_memory_reserved`` of a section in bytes: ``None`` on CPU)."""
    from torch.profiler import record_function

    from pnpscale.rank.profiling import CollectiveLog, PeakMemory, make_profiler

    total = spec.warmup + spec.iterations
    peak = PeakMemory(device)
    peaks: dict[tuple[int, str], int] = {}
    rank = group.rank
    progress = _progress(total, spec.warmup, rank)
    beat = beat or Heartbeat(None, rank)
    if device.type == "cuda" and spec.inject["rank"] == rank and spec.inject["delay_s"]:
        sleep_rate_hz(device)  # calibrated before the profiler starts
    # an exported trace is read offline, where only input shapes give payload bytes
    shapes = spec.record_shapes or spec.export_traces
    with make_profiler(cuda=device.type == "cuda", record_shapes=shapes) as prof, CollectiveLog() as log:
        for it in range(total):
            t0 = time.perf_counter()
            measured = it >= spec.warmup
            for name, fn in solver.sections():
                beat(it, name)
                with peak.track() as box:
                    with record_function(name):
                        _inject(spec, rank, name, measured, device)
                        fn()
                        _sync(device)
                peaks[(it, name)] = box[0]
            solver.after_step()
            _sync(device)
            beat(it, "barrier")
            group.barrier()
            prof.step()
            progress(it + 1, time.perf_counter() - t0)
    return peaks, prof, log.calls, peak.reserved_max


def _progress(total: int, warmup: int, rank: int) -> Any:
    """Rank 0 prints one progress line per iteration (done / total) to stdout."""
    if rank != 0:
        return lambda done, seconds: None

    def update(done: int, seconds: float) -> None:
        tag = " (warm-up)" if done <= warmup else ""
        print(f"[pnpscale] iteration {done}/{total}{tag}: {seconds:.3f} s", flush=True)

    return update
