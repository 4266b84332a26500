"""Write ``rank0.json.gz`` and ``rank1.json.gz`` into OUT (default: this folder): two gloo ranks profiled
with ``schedule=`` and ``prof.step()`` at the end of each of 4 iterations, as a user's job would be.

torch's profiler opens ``ProfilerStep#4`` at the last ``prof.step()`` and closes it when the profiler stops:
that step holds nothing. Run: ``python make_trace.py [OUT]`` (CPU only, a few seconds).
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function, schedule


def rank_main(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=10)) as prof:
        for _ in range(4):
            with record_function("gradient"):
                g = x @ x.T
                if rank == 1:
                    time.sleep(0.002)  # rank 0 waits in the all_reduce
                dist.all_reduce(g)
            with record_function("denoiser"):
                x = torch.tanh(x - 1e-6 * g)
                dist.all_reduce(x)
                x /= 2
            prof.step()
    path = Path(out) / f"rank{rank}.json"
    prof.export_chrome_trace(str(path))
    with path.open("rb") as src, gzip.open(f"{path}.gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    dist.destroy_process_group()


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent)
    Path(target).mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(target, 29731), nprocs=2)
