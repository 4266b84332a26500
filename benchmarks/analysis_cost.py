"""Analysis cost: time and peak memory to decompose N ranks x M iterations of profiler events.

Synthetic events shaped like a real inference run (per iteration: two sections, each with
``--ops`` CPU operators, the gradient with 4 collectives and the denoiser with 1, gloo-style), pushed
through exactly the code a live run uses: :func:`pnpscale.analysis.section.records.section_records` per rank, then
:func:`pnpscale.analysis.tables.frames` and :func:`pnpscale.analysis.metrics.decompose`. Peak memory is Python's
(tracemalloc) during the analysis.

    python benchmarks/analysis_cost.py [--ranks 2,8,64] [--iterations 10,100] [--ops 500]

With ``--traces`` it also writes one Kineto JSON trace per rank and times the offline analyzer
(``python -m pnpscale.analyze``) on them, and HTA 0.5's ``get_comm_comp_overlap`` when
``holistictraceanalysis`` is installed (``pip install -e '.[hta]'``), side by side.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

from pnpscale.analysis.events import Event, Kind, rank_rows
from pnpscale.analysis.metrics import decompose
from pnpscale.analysis.section import section_records
from pnpscale.analysis.tables import frames

US = 1000


def rank_events(rank: int, iterations: int, ops: int) -> list[Event]:
    """Events of one rank: per iteration a gradient (4 collectives) and a denoiser (1) section."""
    ev: list[Event] = []
    t = 0
    for _ in range(iterations):
        for name, n_coll in (("gradient", 4), ("denoiser", 1)):
            start = t
            for _ in range(ops):
                ev.append(Event("aten::conv2d", Kind.CPU, t, t + 5 * US, tid=1))
                t += 6 * US
            for c in range(n_coll):
                d = (50 + 10 * rank + c) * US
                ev.append(
                    Event("gloo:all_reduce", Kind.CPU, t, t + d, tid=7, payload_bytes=4 << 20, collective="all_reduce")
                )
                t += d + US
            ev.append(Event(name, Kind.CPU, start, t, tid=1))
            t += 10 * US
    return ev


def analyse(events_per_rank: list[list[Event]]) -> int:
    tables = []
    for rank, events in enumerate(events_per_rank):
        recs = section_records(events, ("gradient", "denoiser"))
        tables.append((rank_rows(rank, recs, warmup=1), {}))
    ranks, colls = frames(tables, image_bytes=4 << 20)
    return len(decompose(ranks, colls))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,8,64")
    p.add_argument("--iterations", default="10,100")
    p.add_argument("--ops", type=int, default=500)
    a = p.parse_args()
    print(f"{'ranks':>5s} {'iters':>5s} {'events':>10s} {'time s':>8s} {'us/event':>9s} {'peak MiB':>9s}")
    for n in [int(x) for x in a.ranks.split(",")]:
        for m in [int(x) for x in a.iterations.split(",")]:
            data = [rank_events(r, m, a.ops) for r in range(n)]
            total = sum(len(d) for d in data)
            tracemalloc.start()
            t0 = time.perf_counter()
            analyse(data)
            dt = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            print(f"{n:5d} {m:5d} {total:10d} {dt:8.2f} {1e6 * dt / total:9.2f} {peak / 2**20:9.1f}")


if __name__ == "__main__":
    main()
