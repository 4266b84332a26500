"""The ranks of a run: rendezvous, the backend chosen from every rank's GPU, NCCL's diagnostics.

:class:`Group` is the process group a rank measures in (none for one rank), with deepinv's
``DistributedContext`` on it; :func:`choose_backend` decides nccl or gloo from every rank's GPU UUID, the
same on every rank; :func:`nccl_debug_env` / :func:`collect_nccl_log` give each rank its NCCL log.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from pnpscale.core import layout
from pnpscale.rank.gpus import GPU_BINDING_ENV, check_binding

#: NCCL refuses ranks sharing a GPU unless this variable is ``1`` (then timings are meaningless).
SHARED_GPU_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"



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
