"""A problem defined outside pnpscale, through the registry only (tests/data/conf/problem/toy.yaml + this class).

One-channel 2D deconvolution: operator ``i`` is a plain convolution with a Gaussian of width
``blur_sigma * (1 + i/2) * width`` (deepinv ``Blur``, circular boundary), norm <= 1 so ``L = M``. Its own
parameters (``problem.params``): :class:`Params`, next to the class, as a problem of pnpscale's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from pnpscale.rank.problems import Problem
from pnpscale.rank.problems.base import gaussian_filter


@dataclass
class Params:
    width: float = 1.0
    blur_sigma: float = 1.0


class ToyDeconvolution(Problem):
    """Deconvolution of a one-channel image from ``M`` differently blurred copies."""

    params = Params

    def operator(self, index: int, device: torch.device) -> torch.nn.Module:
        from deepinv.physics import Blur

        sigma = self.settings.blur_sigma * (1.0 + 0.5 * index) * self.settings.width
        return Blur(filter=gaussian_filter((sigma, sigma), device), padding="circular", device=device)


@record
def noop_rank() -> None:
    """A rank that does nothing (tests of the launcher itself)."""


@record
def probe_rank() -> dict:
    """A rank that reports how it was started (tests of the launcher): its process info
    (:func:`pnpscale.rank.process.process_info`: bad fork, CUDA binding), whether deepinv was already
    imported when it started, and its parent pid."""
    import os
    import sys

    from pnpscale.rank.process import process_info

    return {**process_info(), "deepinv_preloaded": "deepinv" in sys.modules, "ppid": os.getppid()}


@record
def sleepy_rank(seconds: float, pid_file: str) -> None:
    """A rank that writes its pid to ``pid_file.<LOCAL_RANK>`` and sleeps (tests of process lifetime)."""
    import os
    import time
    from pathlib import Path

    from pnpscale.rank.process import PARENT_PID_ENV, die_with_parent

    die_with_parent(int(os.environ[PARENT_PID_ENV]))
    Path(f"{pid_file}.{os.environ['LOCAL_RANK']}").write_text(str(os.getpid()))
    time.sleep(seconds)


@record
def dying_rank(victim: int, raisers: list[int], log_dir: str) -> None:
    """A rank of a gloo group in which rank ``victim`` kills itself (SIGKILL) once every rank is connected,
    ranks ``raisers`` then fail in a real gloo ``recv`` from it (the lost peer), and the others sleep until
    the agent stops them (tests of who is blamed)."""
    import datetime
    import os
    import signal
    import time
    from pathlib import Path

    import torch.distributed as dist

    from pnpscale.rank.loop import Heartbeat
    from pnpscale.rank.process import PARENT_PID_ENV, die_with_parent

    die_with_parent(int(os.environ[PARENT_PID_ENV]))
    rank = int(os.environ["RANK"])
    Heartbeat(Path(log_dir) / f"rank{rank}.progress", rank)(-1, "init")  # its pid, for the launcher
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == victim:
        time.sleep(1.0)  # every rank is past the barrier and in its recv or sleep
        os.kill(os.getpid(), signal.SIGKILL)
    if rank in raisers:
        dist.recv(torch.zeros(1), src=victim)
    time.sleep(120)
