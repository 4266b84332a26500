"""Rank 0's last step of a live run: decompose the gathered rank tables and write the run folder.

The tables are staged and renamed together (:func:`pnpscale.core.layout.commit_files`), ``run.json``
(:mod:`pnpscale.core.record`) last; the invariants are checked before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.metrics import check_invariants, decompose, run_metrics
from pnpscale.analysis.tables import frames, table_writers
from pnpscale.core import layout
from pnpscale.core.record import (
    RecordError,
    error_text,
    now_iso,
    peak_memory,
    provenance,
    read_record,
    start_record,
    write_record,
)
from pnpscale.rank.problems import make_problem

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec


def image_bytes(spec: RunSpec) -> int:
    """Bytes of the reconstructed signal (the problem class's :meth:`~pnpscale.rank.problems.Problem.signal_bytes`)."""

    return make_problem(spec).signal_bytes()


def time_sharing(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether a run's ranks time-shared CPU cores or GPUs: ``run.json``'s ``time_shared`` and ``cores``.

    Per host, the usable cores are the union of its ranks' CPU affinities (``info["cpus"]``: core ids) and the
    demand is the sum of its ranks' threads (``info["threads"]``); the ranks time-share when the demand exceeds
    the cores on some host, or when two ranks of a host ran on one GPU (``info["gpu"]``, a physical GPU id).
    A point whose ranks time-share measures contention, not scaling (compute and communication both wait
    for a core).

    Args:
        infos: one per rank, as gathered by rank 0 (keys ``host``, ``threads``, optionally ``cpus``, ``gpu``).

    Returns:
        ``{"time_shared": bool | None, "cores": int | None}``: ``cores`` is the usable cores of the host with
        the highest demand per core; ``None`` for both when a rank did not say its cores (an older rank).

    >>> infos = [{"host": "a", "threads": 1, "cpus": [0, 1], "gpu": None} for _ in range(4)]
    >>> time_sharing(infos[:2]), time_sharing(infos)
    ({'time_shared': False, 'cores': 2}, {'time_shared': True, 'cores': 2})
    >>> time_sharing([{"host": "a", "threads": 1, "cpus": [0], "gpu": "GPU-1"}, {"host": "a", "threads": 1,
    ...               "cpus": [1], "gpu": "GPU-1"}])["time_shared"]
    True
    """
    if not infos or any("cpus" not in i for i in infos):
        return {"time_shared": None, "cores": None}
    hosts: dict[str, tuple[set[int], int]] = {}
    gpus: dict[tuple[str, str], int] = {}
    for i in infos:
        cores, demand = hosts.get(i["host"], (set(), 0))
        hosts[i["host"]] = (cores | {int(c) for c in i["cpus"]}, demand + int(i["threads"]))
        if i.get("gpu") is not None:
            gpus[(i["host"], str(i["gpu"]))] = gpus.get((i["host"], str(i["gpu"])), 0) + 1
    host = max(hosts, key=lambda h: hosts[h][1] / max(1, len(hosts[h][0])))
    cores, demand = hosts[host]
    shared = demand > len(cores) or any(n > 1 for n in gpus.values())
    return {"time_shared": bool(shared), "cores": len(cores)}


def node_gpus(infos: list[dict[str, Any]]) -> int | None:
    """The GPUs a run's hosts hold: the fewest any rank's host showed (``info["node_gpus"]``, NVML's device count;
    inside a SLURM device cgroup the job's GPUs of that node, so a lower bound), ``run.json``'s ``node_gpus``.

    ``None`` when a rank did not say (CPU ranks, no NVML, an older rank): the node size is then unknown.

    >>> node_gpus([{"node_gpus": 8}, {"node_gpus": 8}]), node_gpus([{"node_gpus": 8}, {"node_gpus": None}])
    (8, None)
    >>> node_gpus([{"host": "a"}])
    """
    counts = [i.get("node_gpus") for i in infos]
    known = [int(c) for c in counts if c is not None]
    return min(known) if known and len(known) == len(counts) else None


def write_run(
    run_dir: Path,
    spec: RunSpec,
    gathered: list[tuple[dict[str, list[Any]], dict[str, Any]]],
    *,
    backend: str,
    timings: dict[str, Any],
    config: dict[str, Any] | None = None,
    reconstruction: Any = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decompose, then write the tables and ``run.json`` (status ``complete``) atomically.

    ``extra`` adds launcher-specific fields to ``run.json`` (e.g. the ``slurm`` block). The ranks'
    ``anomalies`` (``table["anomalies"]``, see :mod:`pnpscale.analysis.anomalies`) are merged into
    ``anomalies``; the invariants are checked before anything is written
    (:func:`pnpscale.analysis.metrics.check_invariants`). On a decomposition or invariant error,
    writes ``run.json`` with status ``failed`` and re-raises.

    Returns:
        the ``run.json`` content.
    """
    infos = [info for _, info in gathered]
    base = start_record(spec, config)
    fields = dict(
        **{
            "versions": provenance(backend),
            "backend": backend,
            "world_size": len(gathered),
            # SLURM's node count when the job has one (emulated nodes can share a host name)
            "nodes": int((extra or {}).get("slurm", {}).get("nodes") or len({i["host"] for i in infos})),
            "hosts": sorted({i["host"] for i in infos}),
            "device_names": [i["device"] for i in infos],
            "threads_per_rank": infos[0]["threads"],
            **time_sharing(infos),
            "node_gpus": node_gpus(infos),
            "assignment": {
                "operators_per_rank": [len(i["local_operators"]) for i in infos],
                "tiles_per_rank": [i["local_tiles"] for i in infos],
                "num_tiles": infos[0]["num_tiles"],
            },
            "solver": {**infos[0]["solver"], "weights_sha256_per_rank": [i["solver"]["weights_sha256"] for i in infos]},
            "timings": dict(timings),
            "processes": [{"rank": r, **i["process"]} for r, i in enumerate(infos) if "process" in i] or None,
        },
        **(extra or {}),
    )
    try:
        previous = read_record(run_dir)
        base.started_at, base.pid, base.host = previous.started_at, previous.pid, previous.host
    except RecordError:
        pass
    base.set(**fields)
    anomalies = Anomalies()
    for table, _ in gathered:
        anomalies.extend(table.get("anomalies", []))
    base.set(anomalies=anomalies.records())  # an extra key: [] none; absent in runs written before
    try:
        ranks, colls = frames(gathered, image_bytes(spec))
        sections = decompose(ranks, colls)
        sections[K.TIME_SHARED] = pd.array([fields["time_shared"]] * len(sections), dtype="boolean")
        check_invariants(ranks, sections)
        base.metrics = run_metrics(sections, spec.gpus)
        base.peak_memory = peak_memory(
            ranks, [i["device"] for i in infos], [i.get("peak_reserved_bytes") for i in infos]
        )
    except Exception as exc:
        base.status, base.error, base.finished_at = layout.STATUS_FAILED, error_text(exc), now_iso()
        write_record(run_dir, base)
        raise
    writers = table_writers(ranks, colls, sections)
    if reconstruction is not None:
        import torch

        writers[layout.RECONSTRUCTION] = lambda p: torch.save(reconstruction, p)
    layout.commit_files(run_dir, writers)
    base.status, base.finished_at, base.files = layout.STATUS_COMPLETE, now_iso(), sorted(writers)
    write_record(run_dir, base)
    return base.to_dict()
