"""Rank 0's last step of a live run: decompose the gathered rank tables and write the run folder.

The tables are staged and renamed together (:func:`pnpscale.core.layout.commit_files`), ``run.json``
(:mod:`pnpscale.core.record`) last; the invariants are checked before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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
