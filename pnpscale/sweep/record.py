"""The run record: rank tables -> run folder (decomposition, provenance, atomic write; rank 0 only)."""

from __future__ import annotations

import datetime as _dt
import platform
import traceback
from pathlib import Path
from typing import Any

from pnpscale import layout
from pnpscale.analysis.metrics import decompose, run_metrics
from pnpscale.analysis.tables import frames


def image_bytes(spec: Any) -> int:
    """Bytes of the reconstructed signal: ``channels * image_size^dims * 4`` (float32)."""
    from pnpscale.sweep.config import SPATIAL_DIMS

    return int(spec.channels * spec.sizes["image_size"] ** SPATIAL_DIMS[spec.problem] * 4)


def provenance(backend: str) -> dict[str, Any]:
    """Versions of Python, torch, deepinv, NCCL (when CUDA) and pnpscale."""
    import deepinv
    import torch

    import pnpscale

    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - NCCL absent from this build
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepinv": deepinv.__version__,
        "nccl": nccl,
        "pnpscale": pnpscale.__version__,
        "platform": platform.platform(),
        "backend": backend,
    }


def write_run(
    run_dir: Path,
    spec: Any,
    gathered: list[tuple[dict[str, list[Any]], dict[str, Any]]],
    *,
    backend: str,
    timings: dict[str, Any],
    config: dict[str, Any] | None = None,
    reconstruction: Any = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decompose, then write the tables and ``run.json`` (status ``complete``) atomically.

    ``extra`` adds launcher-specific fields to ``run.json`` (e.g. the ``slurm`` block).
    On a decomposition error, writes ``run.json`` with status ``failed`` and re-raises.

    Returns:
        the ``run.json`` content.
    """
    infos = [info for _, info in gathered]
    base = run_json_base(spec, config)
    base.update(
        {
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
            **(extra or {}),
        }
    )
    try:
        ranks, colls = frames(gathered, image_bytes(spec))
        sections = decompose(ranks, colls)
        base["metrics"] = run_metrics(sections, spec.gpus)
    except Exception as exc:
        base.update(status=layout.STATUS_FAILED, error=_error_text(exc))
        layout.write_json(run_dir / layout.RUN_JSON, base)
        raise
    writers = {
        layout.RANKS: lambda p: ranks.to_parquet(p, index=False),
        layout.COLLECTIVES: lambda p: colls.to_parquet(p, index=False),
        layout.SECTIONS: lambda p: sections.to_parquet(p, index=False),
    }
    if reconstruction is not None:
        import torch

        writers[layout.RECONSTRUCTION] = lambda p: torch.save(reconstruction, p)
    layout.commit_files(run_dir, writers)
    base["status"] = layout.STATUS_COMPLETE
    base["finished_at"] = now_iso()
    base["files"] = sorted(writers)
    layout.write_json(run_dir / layout.RUN_JSON, base)
    return base


def run_json_base(spec: Any, config: dict[str, Any] | None) -> dict[str, Any]:
    """Fields of ``run.json`` known before any rank starts."""
    return {
        "status": layout.STATUS_RUNNING,
        "problem": spec.problem,
        "mode": spec.mode,
        "gpus": spec.gpus,
        "scale": spec.scale,
        "scale_requested": spec.scale_requested,
        "fingerprint": spec.fingerprint(),
        "spec": spec.to_dict(),
        "config": config,
        "error": None,
    }


def write_failure(
    run_dir: Path, spec: Any, config: dict[str, Any] | None, exc: BaseException | str, **extra: Any
) -> None:
    """Record a failed run: ``run.json`` with status ``failed`` and the error; no tables.

    Keeps the fields of an existing ``run.json`` (e.g. written by rank 0 before it failed).
    """
    path = run_dir / layout.RUN_JSON
    try:
        base = layout.read_json(path)
    except (OSError, ValueError):
        base = run_json_base(spec, config)
    base.update(
        status=layout.STATUS_FAILED, error=exc if isinstance(exc, str) else _error_text(exc), finished_at=now_iso()
    )
    base.update(extra)
    layout.write_json(path, base)


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _error_text(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {exc}\n" + "\n".join(tb[-15:])
