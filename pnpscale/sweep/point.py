"""One sweep point: resolved and validated once, its label and folder, and the resume rule.

Every launcher (local, SLURM) and the Hydra task go through :func:`resolve_point`: the composed
config is validated (:func:`pnpscale.core.config.validate`), resolved into the frozen
:class:`~pnpscale.core.config.RunSpec` (``scale`` preset, sizes, problem and mode classes),
checked by the cluster backend that will run it (:meth:`pnpscale.cluster.base.Cluster.check`) and
against the run folder it will write (:func:`complete_run`). Nothing starts before this passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnpscale import layout
from pnpscale.core.config import ConfigError, RunSpec, cfg_variant, plain, resolve_spec


@dataclass(frozen=True)
class Point:
    """One sweep point, resolved.

    Attributes:
        spec: the resolved measurement (what the ranks receive).
        cluster: the cluster backend's name (``local``, ``slurm``, ...).
        run_dir: the point's run folder.
        resume: skip the point when ``run_dir`` already holds a complete run of the same spec.
        done: that complete run's ``run.json`` (``resume=true``), else ``None``.
        variant: the point's variant keys that differ from their defaults
            (:func:`pnpscale.core.config.variant_parts`, space-separated), as its folder names them.
    """

    spec: RunSpec
    cluster: str
    run_dir: Path
    resume: bool
    done: dict[str, Any] | None = None
    variant: str = ""

    @property
    def label(self) -> str:
        """The point as logs and reports name it (:func:`pnpscale.layout.point_label`)."""
        return layout.point_label(self.spec.problem, self.spec.mode, self.spec.gpus, self.variant)


_RESOLVED: dict[tuple[str, str, int | None], Point] = {}


def resolve_point(cfg: Any, run_dir: Path | str, cuda_devices: int | None = None) -> Point:
    """Validate and resolve one composed config into a :class:`Point` (the only place this happens).

    A launcher resolves every point of a sweep before the first runs; the Hydra task of the same
    process then gets the same :class:`Point` back (memoised on the config and folder), so each
    point is validated once.

    Args:
        cfg: the point's composed config (``DictConfig`` or nested mappings).
        run_dir: its run folder.
        cuda_devices: CUDA devices of the machine deciding ``scale=auto`` (default: this one's).
            Backends that resolve on the compute node (SLURM) check both presets instead.

    Raises:
        ConfigError: a broken value rule, a point this cluster backend cannot run, an unwritable
            run folder (``output.root`` when the folder is under it, else the ``hydra.*.dir`` that names
            it; an explicit ``hydra.sweep.dir`` / ``hydra.run.dir`` needs no writable ``output.root``),
            or (``resume=true``) a folder holding a complete run of another spec.
    """
    import json

    from pnpscale.cluster import cluster_backend

    composed = plain(cfg, resolve=False)
    composed.pop("hydra", None)
    key = (str(Path(run_dir).absolute()), json.dumps(composed, sort_keys=True, default=str), cuda_devices)
    if key in _RESOLVED:
        return _RESOLVED[key]
    backend = cluster_backend(cfg["cluster"])
    backend.check_keys(plain(cfg["cluster"]))  # the backend's own keys and their rules
    from pnpscale.cluster.resources import cuda_device_count

    devices = cuda_device_count() if cuda_devices is None else cuda_devices
    spec = resolve_spec(cfg, cuda_available=devices > 0)
    _check_problem(spec)  # first: the backend's checks build the problem (its memory estimate)
    backend.check(cfg, spec, devices)
    _check_run_dir(Path(run_dir), Path(str(cfg["output"]["root"])))
    resume = bool(cfg["resume"])
    done = complete_run(Path(run_dir), cfg, resume)
    point = Point(spec, backend.name, Path(run_dir), resume, done, cfg_variant(cfg))
    _RESOLVED[key] = point
    return point


def _check_run_dir(run_dir: Path, root: Path) -> None:
    """The point's folder must be creatable and writable; ``output.root`` matters only when the folder
    is under it (Hydra's default ``hydra.sweep.dir`` / ``hydra.run.dir``).

    Raises:
        ConfigError: naming ``output.root`` (the folder is under it), else the folder itself.
    """
    if writable_dir(run_dir):
        return
    if run_dir.absolute().is_relative_to(root.absolute()):
        raise ConfigError("output.root", str(root), "must be a folder this user can create and write")
    raise ConfigError("hydra.sweep.dir/hydra.run.dir", str(run_dir), "must be a folder this user can create and write")


def _check_problem(spec: RunSpec) -> None:
    """The problem class's own rules (:meth:`pnpscale.rank.problems.Problem.check`) as a ConfigError.

    Raises:
        ConfigError: ``problem.impl`` cannot be imported, or the class refuses a value.
    """
    from pnpscale.rank.problems import make_problem

    make_problem(spec).check()  # a ProblemError is a ConfigError with its own key, value and allowed values


def complete_run(run_dir: Path, cfg: Any, resume: bool = True) -> dict[str, Any] | None:
    """The resume rule: the ``run.json`` of a complete run of the same spec in ``run_dir``, else ``None``.

    "Same spec" compares fingerprints once ``cfg`` is resolved the way the stored run resolved
    ``scale`` (``scale=auto`` is decided where the ranks run: paper with CUDA, small without).

    Raises:
        ConfigError: ``resume=true`` and the folder holds a complete run of a *different* spec
            (never overwritten silently; ``resume=false`` replaces it).
    """
    from pnpscale.core.record import RecordError, read_record

    if not resume or layout.run_status(run_dir) != layout.STATUS_COMPLETE:
        return None
    try:
        done = read_record(run_dir).to_dict()
    except RecordError:
        return None
    spec = resolve_spec(cfg, cuda_available=done.get("scale") == "paper")
    if done.get("fingerprint") == spec.fingerprint():
        return done
    raise ConfigError(
        "resume",
        True,
        f"{run_dir} holds a complete run of another spec (fingerprint {done.get('fingerprint')}, this point "
        f"{spec.fingerprint()}): use another folder (hydra.sweep.dir / hydra.run.dir), or resume=false to replace it",
    )


def writable_dir(path: Path) -> bool:
    """Whether ``path`` is, or can be created as, a folder this process can write into
    (:func:`pnpscale.layout.writable_dir`; nothing is created)."""
    return layout.writable_dir(path)
