"""One sweep point: resolved and validated once, its label and folder, and the resume rule.

Every launcher (local, SLURM) and the Hydra task go through :func:`resolve_point`: the composed
config is validated (:func:`pnpscale.core.config.validate`), resolved into the frozen
:class:`~pnpscale.core.config.RunSpec` (``scale`` preset, sizes, problem and mode classes),
checked by the cluster backend that will run it (:meth:`pnpscale.cluster.base.Cluster.check`) and
against the run folder it will write (:func:`complete_run`). Nothing starts before this passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pnpscale.cluster import cluster_backend
from pnpscale.cluster.resources import cuda_device_count
from pnpscale.core import layout
from pnpscale.core.config import ConfigError, ModeSizes, RunSpec, cfg_variant, plain, resolve_spec
from pnpscale.core.errors import PnpscaleError
from pnpscale.core.record import RecordError, read_record


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
        """The point as logs and reports name it (:func:`pnpscale.core.layout.point_label`)."""
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


    composed = plain(cfg, resolve=False)
    composed.pop("hydra", None)
    key = (str(Path(run_dir).absolute()), json.dumps(composed, sort_keys=True, default=str), cuda_devices)
    if key in _RESOLVED:
        return _RESOLVED[key]
    backend = cluster_backend(cfg["cluster"])
    backend.check_keys(plain(cfg["cluster"]))  # the backend's own keys and their rules

    devices = cuda_device_count() if cuda_devices is None else cuda_devices
    spec = resolve_spec(cfg, cuda_available=devices > 0)
    _check_problem(spec)  # first: the backend's checks build the problem (its memory estimate)
    _check_mode(spec)
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
    """The problem class's own parameters and rules (:meth:`pnpscale.rank.problems.Problem.check_params`,
    :meth:`~pnpscale.rank.problems.Problem.check`) as a ConfigError.

    Raises:
        ConfigError: ``problem.impl`` cannot be imported, or the class refuses a key or a value.
    """
    from pnpscale.rank.problems import make_problem  # deferred: bad input is refused before torch is imported

    problem = make_problem(spec)
    problem.check_params()
    problem.check()  # a ProblemError is a ConfigError with its own key, value and allowed values


def _check_mode(spec: RunSpec) -> None:
    """The mode's class, sections and own parameters (:func:`pnpscale.rank.solver.check_mode`).

    Raises:
        ConfigError: ``mode.impl`` cannot be imported, its sections differ, or it refuses a ``mode.params`` key.
    """
    from pnpscale.rank.solver import check_mode  # deferred: bad input is refused before torch is imported

    check_mode(spec)


def complete_run(run_dir: Path, cfg: Any, resume: bool = True) -> dict[str, Any] | None:
    """The resume rule: the ``run.json`` of a complete run of the same spec in ``run_dir``, else ``None``
    (also when that run's folder is unreadable as the report reads it,
    :func:`pnpscale.results.runs.unreadable_reason`: it is run again).

    "Same spec" compares fingerprints once ``cfg`` is resolved the way the stored run resolved
    ``scale`` (``scale=auto`` is decided where the ranks run: paper with CUDA, small without).

    Raises:
        ConfigError: ``resume=true`` and the folder holds a complete run of a *different* spec
            (never overwritten silently; ``resume=false`` replaces it).
    """

    if not resume or layout.run_status(run_dir) != layout.STATUS_COMPLETE:
        return None
    try:
        done = read_record(run_dir).to_dict()
    except RecordError:
        return None
    spec = resolve_spec(cfg, cuda_available=done.get("scale") == "paper")
    if done.get("fingerprint") == spec.fingerprint():
        from pnpscale.results.runs import unreadable_reason  # deferred: pandas only when a complete point is resumed

        # a damaged complete run (a truncated table, an edited value) is what the report and load() refuse:
        # skipping it would leave the point unreadable for good; it is run again (and said so by the task)
        return None if unreadable_reason(run_dir) else done
    differ = spec_differences(done.get("spec") or {}, spec.to_dict())
    said = f"{', '.join(differ)}; " if differ else ""
    raise ConfigError(
        "resume",
        True,
        f"{run_dir} holds a complete run of another spec ({said}fingerprint {done.get('fingerprint')}, this point "
        f"{spec.fingerprint()}): use another folder (hydra.sweep.dir / hydra.run.dir), or resume=false to replace it",
    )


def spec_differences(stored: dict[str, Any], asked: dict[str, Any], most: int = 3) -> list[str]:
    """What differs between a stored run's spec and the one asked for, as ``key: stored (stored) vs asked``
    (dotted keys into nested dicts, at most ``most`` of them, then ``...``): the resume refusal names them.

    >>> spec_differences({"iterations": 200, "sizes": {"overlap": 8}}, {"iterations": 5, "sizes": {"overlap": 8}})
    ['iterations: 200 (stored) vs 5']
    """
    out: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}" if key else str(k))
        elif a != b and not (isinstance(a, list | tuple) and isinstance(b, list | tuple) and list(a) == list(b)):
            out.append(f"{key}: {a!r} (stored) vs {b!r}")

    walk(stored, asked, "")
    return out[:most] + (["..."] if len(out) > most else [])


#: Keys that take effect in some modes only: dotted key -> the modes (``mode.name``) whose solver reads it.
#: Each defaults to ``null`` (from the scale preset), so a non-null value was set on purpose (command line,
#: stored sweep); a point of another mode would silently ignore it (:func:`ignored_keys`). Add a key here
#: when a mode's solver reads a key the others do not. (``mode.*`` keys are the mode's own config.)
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "problem.unroll": ("training",),  # K, the unrolled iterations trained as one network
}


def _select(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return None
    return node


def mode_keys_set(cfg: Any, overrides: Sequence[str] = ()) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """The mode-only keys set for a point: those of :data:`MODE_KEYS` not null in the composed ``cfg``, and the
    size presets of one mode given in ``overrides`` (``problem.scales.small.training.image_size=64``: the
    training preset, :class:`~pnpscale.core.config.ModeSizes`).

    Returns:
        key -> (its value, the modes that read it).

    >>> mode_keys_set({"problem": {"unroll": None, "scales": {"small": {"training": {"nb": 2}}}}},
    ...               ["problem.scales.small.training.nb=2", "gpus=2"])
    {'problem.scales.small.training.nb': (2, ('training',))}
    """
    import dataclasses


    out = {key: (v, modes) for key, modes in MODE_KEYS.items() if (v := _select(cfg, key)) is not None}
    preset_modes = {f.name for f in dataclasses.fields(ModeSizes)}
    for ov in overrides:
        key = ov.lstrip("+~").split("=", 1)[0]
        parts = key.split(".")
        if len(parts) >= 5 and parts[:2] == ["problem", "scales"] and parts[3] in preset_modes:
            out[key] = (_select(cfg, key), (parts[3],))
    return out


def ignored_keys(cfg: Any, overrides: Sequence[str] = ()) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """The mode-only keys set for a point (:func:`mode_keys_set`) whose mode does not read them.

    Returns:
        key -> (its value, the modes that read it); empty when every key set has an effect.

    >>> ignored_keys({"mode": {"name": "inference"}, "problem": {"unroll": 3}})
    {'problem.unroll': (3, ('training',))}
    >>> ignored_keys({"mode": {"name": "training"}, "problem": {"unroll": 3}})
    {}
    """
    mode = _select(cfg, "mode.name")
    return {k: vm for k, vm in mode_keys_set(cfg, overrides).items() if mode not in vm[1]}


def mode_key_problems(points: Sequence[tuple[Any, ...]]) -> tuple[dict[str, list[str]], list[str]]:
    """What a sweep's mode-specific keys say, over its points (label, composed config[, overrides]).

    A key set in points none of whose modes read it (a single run of ``mode=inference problem.unroll=3``,
    or a sweep whose points are all inference) is refused: one line naming the key, the modes it applies
    to and the points' mode. A key read by some points and ignored by others (``mode=inference,training
    problem.unroll=3``) is one warning line naming the points that ignore it.

    Returns:
        (refusals: one line each, a :class:`~pnpscale.core.config.ConfigError`'s text -> the labels of the
        points refused; warnings: one line each).

    >>> inf = {"mode": {"name": "inference"}, "problem": {"unroll": 3}}
    >>> print(*mode_key_problems([("gpus=1", inf)])[0])
    problem.unroll=3: takes effect only in mode=training; this point is mode=inference: drop it, or run mode=training
    >>> train = {"mode": {"name": "training"}, "problem": {"unroll": 3}}
    >>> mode_key_problems([("mode=inference", inf), ("mode=training", train)])
    ({}, ['problem.unroll=3 takes effect only in mode=training: ignored by mode=inference'])
    """
    ignored: dict[tuple[str, str], list[str]] = {}
    used: set[str] = set()
    info: dict[tuple[str, str], tuple[Any, tuple[str, ...], set[str]]] = {}
    for label, cfg, *rest in points:
        overrides = rest[0] if rest else ()
        hits = ignored_keys(cfg, overrides)
        used |= set(mode_keys_set(cfg, overrides)) - set(hits)
        for key, (value, modes) in hits.items():
            ident = (key, str(value))
            ignored.setdefault(ident, []).append(label)
            info.setdefault(ident, (value, modes, set()))[2].add(str(_select(cfg, "mode.name")))
    refusals: dict[str, list[str]] = {}
    warnings: list[str] = []
    for (key, _), labels in ignored.items():
        value, modes, theirs = info[(key, _)]
        applies = " or ".join(f"mode={m}" for m in modes)
        if key in used:
            shown = _show_value(value)
            warnings.append(f"{key}={shown} takes effect only in {applies}: ignored by {'; '.join(labels)}")
            continue
        whose = "this point is" if len(points) == 1 else "the sweep's points are"
        refusals[str(ConfigError(
            key, value, f"takes effect only in {applies}; {whose} {', '.join(f'mode={m}' for m in sorted(theirs))}: "
            f"drop it, or run {applies}"))] = labels  # fmt: skip
    return refusals, warnings


def _show_value(value: Any) -> str:
    return str(ConfigError("k", value, "")).removeprefix("k=").removesuffix(": ")


#: Bytes a point's folder needs free before the point starts, so that its end is always recorded: Hydra's
#: ``.hydra/`` (3 files, 4 blocks), its log, the lock and ``run.json`` (2 blocks), in 4 KiB blocks.
MIN_FREE_BYTES = 32 * 1024


class NoSpace(PnpscaleError, OSError):
    """A point's disk has too little room to record its status (ENOSPC): nothing started, exit 1.

    Attributes:
        path: the point's run folder.
    """


def free_bytes(path: Path) -> int | None:
    """Bytes free for this user on the file system of ``path`` (or its nearest existing folder), else ``None``."""
    import os

    p = path.absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_room(run_dir: Path, free: int | None = None) -> None:
    """Refuse a point whose disk cannot hold even its status record (:data:`MIN_FREE_BYTES`).

    Args:
        run_dir: the point's run folder.
        free: bytes free there (default: measured, :func:`free_bytes`).

    Raises:
        NoSpace: one line naming the folder, the room left and the cause (ENOSPC).

    >>> check_room(Path("/r"), 40 * 1024)
    >>> check_room(Path("/r"), 20 * 1024)
    Traceback (most recent call last):
    ...
    pnpscale.sweep.point.NoSpace: /r: 20 KiB free on its disk, fewer than the 32 KiB a point needs to record its \
status (ENOSPC: No space left on device); nothing was started
    """
    free = free_bytes(run_dir) if free is None else free
    if free is not None and free < MIN_FREE_BYTES:
        raise NoSpace(
            f"{run_dir}: {free // 1024} KiB free on its disk, fewer than the {MIN_FREE_BYTES // 1024} KiB a point "
            "needs to record its status (ENOSPC: No space left on device); nothing was started",
            path=str(run_dir),
        )


def writable_dir(path: Path) -> bool:
    """Whether ``path`` is, or can be created as, a folder this process can write into
    (:func:`pnpscale.core.layout.writable_dir`; nothing is created)."""
    return layout.writable_dir(path)
