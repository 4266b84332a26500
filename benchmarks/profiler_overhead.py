"""Profiler overhead: the same PnP iterations with and without torch.profiler, side by side.

One rank, in process (no process group: deepinv's single-process path), the small-scale problem
unless overridden. Rounds alternate unprofiled and profiled blocks of iterations so that drift of
the machine hits both alike; each profiled block is one profiler session, as in a real run
(``record_shapes`` off, pnpscale's default since payload bytes come from the collective calls
(:class:`pnpscale.rank.profiling.CollectiveLog`, active here as in a run); on shown for comparison).

    python benchmarks/profiler_overhead.py [--mode inference|training] [--rounds 5] [--iterations 5]

Prints the median iteration time of each variant and its ratio to the unprofiled one. Two more
variants show where the profiler's cost is, by the ``RecordFunction`` scopes the session records
(torch's ``_enable_profiler(config, activities, scopes)``, called by ``torch.autograd.profiler`` without
scopes, i.e. all; wrapped here for the measurement only, pnpscale does not do this):

* ``no autograd node ranges``: every scope but ``BACKWARD_FUNCTION`` (the
  ``autograd::engine::evaluate_function: ...Backward`` ranges; the backward's operators stay);
* ``section ranges only``: ``USER_SCOPE`` alone (``record_function`` ranges and c10d's ``gloo:*`` work
  ranges; no operator at all, so no CPU compute spans for :mod:`pnpscale.analysis.overlap`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.autograd.profiler as autograd_profiler  # noqa: E402
from torch._C._profiler import RecordScope  # noqa: E402
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


_ENABLE = autograd_profiler._enable_profiler
_ALL_SCOPES = set(RecordScope.__members__.values())
SCOPED = {
    "no autograd node ranges": _ALL_SCOPES - {RecordScope.BACKWARD_FUNCTION},
    "section ranges only": {RecordScope.USER_SCOPE},
}


def scoped(scopes: set[RecordScope] | None):
    """Make the next profiler sessions record only ``scopes`` (``None``: all, torch's default)."""
    if scopes is None:
        autograd_profiler._enable_profiler = _ENABLE
    else:
        autograd_profiler._enable_profiler = lambda config, activities: _ENABLE(config, activities, scopes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="inference", choices=["inference", "training"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    spec, solver = build(a.mode, a.overrides)
    print(f"load average before: {os.getloadavg()}")
    iteration(solver)  # warm-up
    times: dict[str, list[float]] = {
        "no profiler": [],
        "profiler (pnpscale default)": [],
        "profiler + record_shapes": [],
        **{label: [] for label in SCOPED},
    }
    events: dict[str, int] = {}
    variants = [("profiler (pnpscale default)", False, None), ("profiler + record_shapes", True, None)]
    variants += [(label, False, scopes) for label, scopes in SCOPED.items()]
    for _ in range(a.rounds):
        times["no profiler"] += [iteration(solver) for _ in range(a.iterations)]
        for label, shapes, scopes in variants:
            scoped(scopes)
            try:
                with make_profiler(cuda=False, record_shapes=shapes) as prof, CollectiveLog():
                    for _ in range(a.iterations):
                        times[label].append(iteration(solver))
                        prof.step()
            finally:
                scoped(None)
            events[label] = sum(1 for _ in prof.profiler.kineto_results.events()) // a.iterations
    base = statistics.median(times["no profiler"])
    print(f"{a.mode}, problem={spec.problem} image={spec.sizes['image_size']} threads={torch.get_num_threads()}, "
          f"{a.rounds} rounds x {a.iterations} iterations per variant")  # fmt: skip
    print(f"{'variant':28s} {'median s/it':>12s} {'ratio':>7s} {'events/it':>10s}")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:28s} {med:12.4f} {med / base:7.3f} {events.get(label, 0):10d}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
