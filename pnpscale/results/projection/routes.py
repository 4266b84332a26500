"""The projection's transfer: the algorithm per node count, the route of each point, the rates (pure functions).

``T(N) = L_s + B_s(N) / R(route)`` (:mod:`pnpscale.results.projection.model` states the model): the route of
an all_reduce on one node is ``intra-node, g GPUs``, across nodes ``inter-node <algorithm>``; the algorithm per
node count is given, else NCCL's log at that node count, else ring (assumed); rates are given, else fitted with
latencies per collective and hop (:func:`pnpscale.results.projection.base.hops`) where the points identify them,
else each route's bytes over its transfer.

Units: seconds, bytes, GB/s = 1e9 B/s. Source: the study "Communication under the hood: transfer vs wait"
(routes, rates), nccl-tests' PERFORMANCE.md (bytes per GPU).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.results.jitter import nonnegative_lstsq
from pnpscale.results.projection.base import (
    INTRA,
    Model,
    hops,
    intra_route,
    row_algorithm,
    row_nodes,
    sent_bytes_of,
)
from pnpscale.results.transfer import GB


def observed_route(model: Model, n: int, nodes: int, section: str, algo: str | None) -> tuple[str, str, str]:
    """(route, algorithm, algorithm source) at N on ``nodes`` nodes."""
    if nodes <= 1:
        return intra_route(n), "ring", "one node"
    if algo is not None:
        return f"inter-node {algo}", algo, "NCCL log"
    chosen, source = algorithm_at(model, nodes, section)
    return f"inter-node {chosen}", chosen, source


def algorithm_at(model: Model, nodes: int, section: str) -> tuple[str, str]:
    """(algorithm, source) of a section's all_reduce on ``nodes`` nodes: given, else NCCL's log at that
    node count, else ring (``assumed``)."""
    if nodes <= 1:
        return "ring", "one node"
    if nodes in model.given_algorithms:
        return model.given_algorithms[nodes], "given"
    if (nodes, section) in model.logged:
        return model.logged[(nodes, section)], "NCCL log"
    return "ring", "assumed"


def fit_transfer(model: Model, pts: pd.DataFrame, given: Mapping[str, float], label: str) -> None:
    """Latency per collective and hop and rate per route: ``T = ℓ_s·n_s·hops(N) + B/R`` (``n_s`` the section's
    collectives; see module doc); fills ``model``."""
    obs = []
    for sm in model.sections:
        s = pts[(pts[K.SECTION] == sm.section) & (pts[K.GPUS] > 1)]
        for _, r in s.iterrows():
            n, nodes = int(r[K.GPUS]), row_nodes(r, model.gpus_per_node)
            route, algo, _ = observed_route(model, n, nodes, sm.section, row_algorithm(r))
            obs.append((sm.section, route, sent_bytes_of(sm.payload_bytes, n, nodes, algo), float(r[K.TRANSFER_S]), n,
                        sm.n_collectives * hops(n, nodes, algo)))  # fmt: skip
    model.fit_routes = {o[1] for o in obs}
    names = [sm.section for sm in model.sections]

    def given_rate(route: str) -> float | None:
        return given.get(route, given.get(INTRA) if route.startswith(INTRA) else None)

    free = sorted({o[1] for o in obs if given_rate(o[1]) is None})
    x = np.zeros((len(obs), len(names) + len(free)))
    y = np.zeros(len(obs))
    for i, (sec, route, b, tr, _, steps) in enumerate(obs):
        x[i, names.index(sec)] = steps
        g = given_rate(route)
        if g is not None:
            y[i] = tr - b / (g * GB)
        else:
            x[i, len(names) + free.index(route)] = b
            y[i] = tr

    def spread(route: str) -> float:  # relative spread of a route's hops per byte: a latency needs >= 20 %
        b = [o[5] / o[2] for o in obs if o[1] == route and o[2] > 0]
        return (max(b) - min(b)) / max(b) if b else 0.0

    single = [r for r in free if spread(r) < 0.2]
    coef, why = None, ""
    if obs and not single:
        w = 1.0 / np.where(np.abs(y) > 0, np.abs(y), 1.0)
        sol, _ = nonnegative_lstsq(x * w[:, None], y * w)
        if (sol[len(names) :] > 0).all():
            coef = sol
        else:
            bad = [r for r, v in zip(free, sol[len(names) :], strict=True) if v <= 0]
            why = f"the joint fit with latencies gave no positive rate for {', '.join(bad)}"
    elif single:
        where = "; ".join(f"{r} at {', '.join(sorted({str(o[4]) for o in obs if o[1] == r}))} GPUs" for r in single)
        why = ("latency not identifiable: route(s) measured at hops per byte within 20 % of each other "
               f"({where})")  # fmt: skip
    notes = []
    for route in sorted(set(given)):
        measured = [o[2] / o[3] / GB for o in obs if o[1] == route and o[3] > 0]
        m_note = f"; measured {float(np.median(measured)):.4g} GB/s" if measured else ""
        notes.append(f"rate {route}: {given[route]:g} GB/s (given{m_note})")
    if coef is not None:
        latencies = dict(zip(names, coef[: len(names)].tolist(), strict=True))
        for r, v in zip(free, coef[len(names) :], strict=True):
            model.rates[r], model.rate_sources[r] = 1.0 / v / GB, "fitted with the latencies"
        notes.append("latency per collective and hop (s, >= 0; x the section's collectives x the algorithm's hops): "
                     + ", ".join(f"{k} {v:.3g}" for k, v in latencies.items()))  # fmt: skip
    else:
        latencies = dict.fromkeys(names, 0.0)
        for route in free:
            pairs = [(b, tr) for _, rr, b, tr, *_ in obs if rr == route and tr > 0 and b > 0]
            if pairs:
                model.rates[route] = sum(b for b, _ in pairs) / sum(tr for _, tr in pairs) / GB
                model.rate_sources[route] = f"its bytes / its transfer, summed over its points; latency 0 ({why})"
    for route, rate in model.rates.items():
        notes.append(f"rate {route}: {rate:.4g} GB/s ({model.rate_sources[route]})")
    for route, rate in given.items():
        model.rates[route], model.rate_sources[route] = rate, "given"
    for sm in model.sections:
        sm.latency_s = latencies[sm.section]
    model.assumptions += notes


def rate_at(model: Model, n: int, route: str) -> tuple[float | None, str]:
    """(GB/s, source) of a route: given or fitted; a one-node GPU count never measured takes the
    nearest measured one's rate (the largest below, else the smallest above; stated)."""
    if route in model.rates:
        return model.rates[route], model.rate_sources[route]
    if route.startswith(INTRA):
        if INTRA in model.rates:
            return model.rates[INTRA], "given (every one-node GPU count)"
        known = sorted(int(r.split(", ")[1].split()[0]) for r in model.rates if r.startswith(INTRA + ","))
        if known:
            below = [g for g in known if g <= n]
            g = below[-1] if below else known[0]
            return model.rates[intra_route(g)], f"not measured on {n} GPUs: the rate of {intra_route(g)} (assumed)"
    return None, ""
