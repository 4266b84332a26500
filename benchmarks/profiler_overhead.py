"""Profiler overhead: the same PnP iterations with and without torch.profiler, side by side.

One rank, in process (no process group: deepinv's single-process path), the small-scale problem
unless overridden. Rounds alternate unprofiled and profiled blocks of iterations so that drift of
the machine hits both alike; each profiled block is one profiler session, as in a real run
(``record_shapes`` off, pnpscale's default since payload bytes come from the collective calls
(:class:`pnpscale.rank.profiling.CollectiveLog`, active here as in a run); on shown for comparison).

    python benchmarks/profiler_overhead.py [--mode inference|training] [--rounds 5] [--iterations 5]

Prints the median iteration time of each variant and its ratio to the unprofiled one. Each round runs every
variant once, starting one variant later than the round before. "CollectiveLog only" runs no profiler;
"profiler, no range recorded" starts and stops a session per block that records only
``LITE_INTERPRETER`` ranges (the mobile interpreter's: none here; an empty scope set means all scopes to
torch): what a session costs beside its ranges. pnpscale's default on CPU ranks
(``profile.operators=auto``) records operators only around collectives (``CollectiveLog(gate=True)``: one rank
here, no process group, so none inside the sections; a run's collective calls add their few operators) and
leaves out the autograd node ranges (``make_profiler(autograd_ranges=False)``: ``RecordScope.BACKWARD_FUNCTION``);
"every operator" is ``profile.operators=all`` (the default before); "+ autograd node ranges" the one before that
(every scope). "section ranges only" records only
``USER_SCOPE`` (``record_function`` and c10d's ``gloo:*`` ranges, no operator: not enough for the CPU
decomposition; torch's ``_enable_profiler(config, activities, scopes)``, wrapped here for the measurement only)
as the lower bound of what recording costs.
"""

from __future__ import annotations

import argparse
import contextlib
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


def iteration(solver, log: CollectiveLog | None = None) -> float:
    """One iteration's seconds; sections as a run opens them (``log.section``: gated or not), plain
    ``record_function`` ranges without a log."""
    t0 = time.perf_counter()
    for name, fn in solver.sections():
        with log.section(name) if log is not None else record_function(name):
            fn()
    solver.after_step()
    return time.perf_counter() - t0


_ENABLE = autograd_profiler._enable_profiler


def scoped(scopes: set[RecordScope] | None):
    """Make the next profiler sessions record only ``scopes`` (``None``: as torch.profiler asks)."""
    if scopes is None:
        autograd_profiler._enable_profiler = _ENABLE
    else:
        autograd_profiler._enable_profiler = lambda config, activities, *_: _ENABLE(config, activities, scopes)


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
    # (label, make_profiler kwargs or None for no profiler session, scopes, CollectiveLog: None, "all" or "gated")
    variants: list[tuple[str, dict[str, bool] | None, set[RecordScope] | None, str | None]] = [
        ("no profiler", None, None, None),
        ("CollectiveLog only", None, None, "all"),
        ("profiler, no range recorded", {}, {RecordScope.LITE_INTERPRETER}, "all"),
        ("profiler (pnpscale default)", {}, None, "gated"),
        ("profiler + record_shapes", {"record_shapes": True}, None, "gated"),
        ("every operator", {}, None, "all"),
        ("+ autograd node ranges", {"autograd_ranges": True}, None, "all"),
        ("section ranges only", {"autograd_ranges": True}, {RecordScope.USER_SCOPE}, "all"),
    ]
    times: dict[str, list[float]] = {label: [] for label, *_ in variants}
    events: dict[str, int] = {}
    for r in range(a.rounds):
        # each round starts one variant later: no variant always runs first (or after the same one)
        for label, kwargs, scopes, log in variants[r % len(variants):] + variants[: r % len(variants)]:
            if kwargs is None:
                with CollectiveLog() if log else contextlib.nullcontext():
                    times[label] += [iteration(solver) for _ in range(a.iterations)]
                continue
            scoped(scopes)
            try:
                with make_profiler(cuda=False, **kwargs) as prof, CollectiveLog(gate=log == "gated") as clog:
                    for _ in range(a.iterations):
                        times[label].append(iteration(solver, clog))
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
