"""Profiler overhead: the same PnP iterations with and without torch.profiler, side by side.

One rank, in process (no process group: deepinv's single-process path), the small-scale problem
unless overridden. Rounds alternate unprofiled and profiled blocks of iterations so that drift of
the machine hits both alike; each profiled block is one profiler session, as in a real run
(``record_shapes`` off, pnpscale's default since payload bytes come from the collective calls
(:class:`pnpscale.rank.profiling.CollectiveLog`, active here as in a run); on shown for comparison).

    python benchmarks/profiler_overhead.py [--mode inference|training] [--rounds 5] [--iterations 5]

Prints the median iteration time of each variant and its ratio to the unprofiled one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from pnpscale.core.config import resolve_spec  # noqa: E402
from pnpscale.rank.profiling import CollectiveLog, make_profiler  # noqa: E402
from pnpscale.sweep.cli import compose_config  # noqa: E402


def build(mode: str, overrides: list[str]):
    from deepinv.distributed import DistributedContext

    from pnpscale.rank.solver import make_solver

    cfg = compose_config([f"mode={mode}", "scale=small", *overrides])
    spec = resolve_spec(cfg, cuda_available=False)
    for k in ("RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)
    ctx = DistributedContext(device_mode="cpu", cleanup=False).__enter__()
    return spec, make_solver(spec, ctx)


def iteration(solver) -> float:
    t0 = time.perf_counter()
    for name, fn in solver.sections():
        with record_function(name):
            fn()
    solver.after_step()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="inference", choices=["inference", "training"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    spec, solver = build(a.mode, a.overrides)
    iteration(solver)  # warm-up
    times: dict[str, list[float]] = {
        "no profiler": [],
        "profiler (pnpscale default)": [],
        "profiler + record_shapes": [],
    }
    for _ in range(a.rounds):
        times["no profiler"] += [iteration(solver) for _ in range(a.iterations)]
        for label, shapes in (("profiler (pnpscale default)", False), ("profiler + record_shapes", True)):
            with make_profiler(cuda=False, record_shapes=shapes) as prof, CollectiveLog():
                for _ in range(a.iterations):
                    times[label].append(iteration(solver))
                    prof.step()
    base = statistics.median(times["no profiler"])
    print(f"{a.mode}, problem={spec.problem} image={spec.sizes['image_size']} threads={torch.get_num_threads()}, "
          f"{a.rounds} rounds x {a.iterations} iterations per variant")  # fmt: skip
    print(f"{'variant':28s} {'median s/it':>12s} {'ratio':>7s}")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:28s} {med:12.4f} {med / base:7.3f}")


if __name__ == "__main__":
    main()
