"""Configuration schema, validation and resolution of the ``scale`` preset.

The Hydra tree under ``conf/`` is backed by the dataclasses below (registered in Hydra's
ConfigStore as ``pnpscale_schema``): a misspelt key fails at compose time. Value rules that
a type cannot express (``gpus`` in 1..64, tile windows a multiple of 8, ...) are checked by
:func:`validate`, which raises :class:`ConfigError` with a one-line message naming the key and
the allowed values. Nothing is launched before :func:`validate` has passed.

:func:`resolve_spec` turns a composed config into a :class:`RunSpec`: the problem sizes of the
chosen ``scale`` preset (``paper`` = the study's sizes, ``small`` = CPU-friendly, ``tiny`` = seconds per
point, what the tests run, ``auto`` = paper on CUDA, small on CPU), overlaid with every size key the user
set explicitly; ``iterations`` left ``null`` is the preset's (:data:`PRESET_ITERATIONS`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from omegaconf import MISSING

from pnpscale.core.errors import InputError

MAX_GPUS = 64
SCALES = ("paper", "small", "tiny", "auto")
#: The presets a problem's YAML holds sizes for (``problem.scales.<preset>.<mode>``); ``auto`` picks one.
PRESETS = ("paper", "small", "tiny")
#: Measured iterations when ``iterations`` is ``null``: 5 (enough for the spread's p10/p90 verdict), 2 at
#: ``scale=tiny`` (a point in seconds; too few for a spread verdict, which the report says).
PRESET_ITERATIONS = {"paper": 5, "small": 5, "tiny": 2}
BACKENDS = ("auto", "gloo", "nccl")
#: How the tiled denoiser reconciles ranks (``solver.denoiser_collective``): ``all_reduce`` (deepinv's: every
#: rank sums a zero image holding its tile cores, ring ``2·P·(n−1)/n`` bytes per GPU) or ``all_gather``
#: (every rank gathers only the cores, ``P·(n−1)/n``; see :mod:`pnpscale.rank.denoiser`).
DENOISER_COLLECTIVES = ("all_reduce", "all_gather")
#: How the gradient's image-sized all_reduce meets the denoiser (``solver.overlap``): ``none`` (deepinv's: the
#: gradient section ends in one blocking all_reduce, then the denoiser starts) or ``pipelined`` (the all_reduce
#: split into row bands of the tiling, issued asynchronously; each tile starts when the bands its window reads
#: have arrived, and the denoiser's reconciliation is issued band by band; see :mod:`pnpscale.rank.pipeline`).
OVERLAPS = ("none", "pipelined")
#: ``profile.operators``: which operators a rank's profiler records (:func:`pnpscale.rank.loop.gated_operators`)
PROFILE_OPERATORS = ("auto", "collectives", "all")
#: How the gradient's sum over ranks is exchanged (``solver.gradient_collective``): ``all_reduce`` (deepinv's:
#: the whole image on every rank, ring ``2·P·(n−1)/n`` bytes per GPU) or ``reduce_scatter`` (each rank receives
#: the sum only where its tiles' windows read it: a reduce-scatter over the ranks' cores and an all_gather of
#: the boundaries, ``(P + H)·(n−1)/n``; see :mod:`pnpscale.rank.gradient`).
GRADIENT_COLLECTIVES = ("all_reduce", "reduce_scatter")
#: DRUNet downsamples three times by 2: tile windows must be a multiple of this.
WINDOW_MULTIPLE = 8


class ConfigError(InputError, ValueError, CompactHydraException):
    """A config value outside its allowed set (Hydra prints it as one line, no traceback).

    ``str(error)`` is one line: ``<key>=<value>: <what is allowed>``.

    Attributes:
        key: the dotted config key, e.g. ``"gpus"`` or ``"problem.patch_size"``.
    """

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}={_show(value)}: {allowed}", key=key)


def _show(value: Any) -> str:
    if value is None:
        return "null"  # as the command line and the YAML spell it
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


# --------------------------------------------------------------------------------------
# Schema (mirrors conf/)
# --------------------------------------------------------------------------------------


@dataclass
class SizeConfig:
    """Problem sizes; ``None`` means "take it from the scale preset".

    Units: ``image_size`` is the side of the square image / cubic volume in pixels (voxels);
    ``patch_size`` and ``overlap`` are pixels per tiled dimension; the denoiser sees windows of
    ``patch_size + 2 * overlap`` pixels, which must be a multiple of 8 (DRUNet's three 2x
    downsamplings).
    """

    image_size: int | None = None
    num_operators: int | None = None
    factor: int | None = None
    patch_size: int | None = None
    overlap: int | None = None
    max_batch_size: int | None = None
    nc: list[int] | None = None
    nb: int | None = None
    unroll: int | None = None


@dataclass
class ModeSizes:
    inference: SizeConfig = field(default_factory=SizeConfig)
    training: SizeConfig = field(default_factory=SizeConfig)


@dataclass
class ScalePresets:
    paper: ModeSizes = field(default_factory=ModeSizes)
    small: ModeSizes = field(default_factory=ModeSizes)
    tiny: ModeSizes = field(default_factory=ModeSizes)


@dataclass
class ProblemConfig(SizeConfig):
    """One reconstruction problem (config group ``problem``; a YAML + a class, see :mod:`pnpscale.rank.problems`).

    ``impl`` names the :class:`~pnpscale.rank.problems.Problem` subclass (``module:Class``);
    ``dims`` the spatial dimensions of the signal (tiling and DRUNet); ``linestyle`` the
    matplotlib line style of the problem in the report's charts; ``params`` the problem's own
    parameters, declared and checked by its class (``Problem.params``, a dataclass, e.g. ``blur_sigma``
    of 2d and 3d). The other keys are what every problem has: ``channels`` (``C`` of the signal, read by
    the ground truth, DRUNet and the payload; no default: each problem states it), ``noise_sigma`` (the
    shared measurement noise of :func:`pnpscale.rank.problems.measurements`), the solver's
    ``denoiser_sigma`` and ``stepsize``, the sizes and their presets.
    """

    name: str = MISSING
    impl: str = MISSING
    dims: int = MISSING
    linestyle: str = "-"
    params: dict[str, Any] = field(default_factory=dict)
    channels: int = MISSING
    noise_sigma: float = 0.01
    denoiser_sigma: float = 0.05
    stepsize: float = 1.0
    scales: ScalePresets = field(default_factory=ScalePresets)


@dataclass
class ModeConfig:
    """Inference loop or unrolled training (config group ``mode``).

    ``impl`` names the solver class (``module:Class``, see :mod:`pnpscale.rank.solver`);
    ``sections`` its section names in execution order (the class checks they match); ``params`` the
    mode's own parameters, declared and checked by its class (``Solver.params``, a dataclass: training's
    ``lr``, ``train_stepsize``).
    """

    name: str = MISSING
    impl: str = MISSING
    sections: list[str] = MISSING
    params: dict[str, Any] = field(default_factory=dict)


#: What every cluster backend's node holds (config group ``cluster``): its option ``name`` and its class
#: ``impl`` (``module:Class``, a :class:`pnpscale.cluster.base.Cluster`). Every other ``cluster.*`` key
#: belongs to the backend, which declares and checks it (``Cluster.params``, ``Cluster.rules``): the
#: shared schema keeps the node open.
CLUSTER_SHARED_KEYS = ("name", "impl")

_PACKAGE = Path(__file__).resolve().parents[1]
#: The app's Hydra config tree: ``conf/`` at the top of a checkout (an editable install, or ``PYTHONPATH``), the
#: source users edit; in a built wheel the same files are the package data ``pnpscale/conf/`` (setup.py maps
#: ``conf/`` there: one tree, no copy kept in step).
CONF_DIR = _PACKAGE / "conf" if any((_PACKAGE / "conf").glob("*.yaml")) else _PACKAGE.parent / "conf"
#: The stored sweeps, config group ``sweeps``: ``sweeps/`` at the top of a checkout; in a wheel the package data
#: ``pnpscale/conf/sweeps/``, inside the tree, where Hydra finds the group itself. Outside it (a checkout)
#: :func:`register_schema` stores each file in Hydra's ConfigStore under that group.
SWEEPS_DIR = CONF_DIR / "sweeps" if (CONF_DIR / "sweeps").is_dir() else _PACKAGE.parent / "sweeps"


@dataclass
class SolverConfig:
    """How the distributed solver communicates (config node ``solver``).

    ``denoiser_collective``: one of :data:`DENOISER_COLLECTIVES`; ``overlap``: one of :data:`OVERLAPS`;
    ``overlap_chunks``: with ``overlap=pipelined``, the number of row bands (slabs in 3D) the exchanges are
    split into, ``1..`` the tiling's tile rows (``null``: one per tile row; ``1``: one piece, the blocking
    exchange issued through the pipelined code, nothing to overlap). ``gradient_collective``: one of
    :data:`GRADIENT_COLLECTIVES` (``reduce_scatter`` not with ``overlap=pipelined``).
    """

    denoiser_collective: str = "all_reduce"
    overlap: str = "none"
    overlap_chunks: int | None = None
    gradient_collective: str = "all_reduce"


@dataclass
class ProfileConfig:
    record_shapes: bool = False
    export_traces: bool = False
    operators: str = "auto"


@dataclass
class DistConfig:
    backend: str = "auto"
    timeout_s: float = 300.0
    threads_per_rank: int | None = 1


@dataclass
class InjectConfig:
    """Known perturbations for validation: a busy delay, or a failure, on one rank."""

    rank: int | None = None
    section: str | None = None
    delay_s: float = 0.0
    fail: bool = False


@dataclass
class OutputConfig:
    root: str = "outputs"
    save_reconstruction: bool = False


@dataclass
class Config:
    """The whole pnpscale configuration (``conf/config.yaml``)."""

    problem: ProblemConfig = field(default_factory=ProblemConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    cluster: dict[str, Any] = field(
        default_factory=lambda: {"name": "local", "impl": "pnpscale.cluster.local:LocalCluster"}
    )
    solver: SolverConfig = field(default_factory=SolverConfig)
    gpus: int = 1
    scale: str = "auto"
    iterations: int | None = None  # None: the scale preset's (PRESET_ITERATIONS)
    warmup: int = 1
    seed: int = 0
    resume: bool = True
    report: bool = True
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def register_schema() -> None:
    """Register :class:`Config` as ``pnpscale_schema`` in Hydra's ConfigStore, and the
    ``pnpscale_variant`` resolver of ``conf/config.yaml``'s run folders, and the stored sweeps of a top-level
    ``sweeps/`` folder as the config group ``sweeps`` (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="pnpscale_schema", node=Config)
    if SWEEPS_DIR.parent != CONF_DIR:
        for name, node, package in stored_sweeps(SWEEPS_DIR):
            ConfigStore.instance().store(group="sweeps", name=name, node=node, package=package)
    if not OmegaConf.has_resolver("pnpscale_variant"):
        OmegaConf.register_new_resolver("pnpscale_variant", variant_subdir)


def stored_sweeps(folder: Path) -> list[tuple[str, Any, str | None]]:
    """The stored sweeps of ``folder`` (``<name>.yaml``) as ``(name, node, package)`` for Hydra's ConfigStore:
    ``package`` is the file's ``# @package`` header (``_global_`` in every stored sweep), ``None`` without one.

    Raises:
        ConfigError: a file is not a YAML mapping (names the file).
    """
    from omegaconf import DictConfig, OmegaConf

    out: list[tuple[str, Any, str | None]] = []
    for path in sorted(folder.glob("*.yaml")):
        text = path.read_text()
        headers = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# @package ") and ln[11:].strip()]
        try:
            node = OmegaConf.create(text)
        except Exception as exc:  # a YAML syntax error: the file and the parser's words
            raise ConfigError("sweeps", path.stem, f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(node, DictConfig):
            raise ConfigError("sweeps", path.stem, f"{path} must hold a YAML mapping")
        out.append((path.stem, node, headers[0] if headers else None))
    return out


#: Keys that make a run a *variant* of its (problem, mode, gpus) point: a sweep may vary them, and the
#: report compares the values side by side (``pnpscale.results.compare``).
VARIANT_KEYS = ("denoiser_collective", "num_operators", "overlap", "overlap_chunks", "gradient_collective")


def variant_parts(
    denoiser_collective: Any = "all_reduce",
    num_operators: Any = None,
    overlap: Any = "none",
    overlap_chunks: Any = None,
    gradient_collective: Any = "all_reduce",
) -> list[str]:
    """A point's variant: ``key=value`` for each :data:`VARIANT_KEYS` key that differs from its default
    (``num_operators`` and ``overlap_chunks`` when set explicitly, not ``null``).

    >>> variant_parts(), variant_parts("all_gather", 2), variant_parts(overlap="pipelined", overlap_chunks=4)
    ([], ['denoiser_collective=all_gather', 'num_operators=2'], ['overlap=pipelined', 'overlap_chunks=4'])
    >>> variant_parts(gradient_collective="reduce_scatter")
    ['gradient_collective=reduce_scatter']
    """
    parts = []
    if denoiser_collective not in (None, "all_reduce"):
        parts.append(f"denoiser_collective={denoiser_collective}")
    if num_operators is not None:
        parts.append(f"num_operators={num_operators}")
    if overlap not in (None, "none"):
        parts.append(f"overlap={overlap}")
    if overlap_chunks is not None:
        parts.append(f"overlap_chunks={overlap_chunks}")
    if gradient_collective not in (None, "all_reduce"):
        parts.append(f"gradient_collective={gradient_collective}")
    return parts


def cfg_variant(cfg: Any) -> str:
    """The variant of a composed config's point (:func:`variant_parts`, space-separated)."""
    solver = cfg["solver"]
    return " ".join(
        variant_parts(
            solver["denoiser_collective"],
            cfg["problem"]["num_operators"],
            solver.get("overlap", "none"),
            solver.get("overlap_chunks"),
            solver.get("gradient_collective", "all_reduce"),
        )
    )


def variant_subdir(
    denoiser_collective: Any = "all_reduce",
    num_operators: Any = None,
    overlap: Any = "none",
    overlap_chunks: Any = None,
    gradient_collective: Any = "all_reduce",
) -> str:
    """The run folder's variant part: ``""`` for the defaults, else ``/key=value`` per non-default key.

    Used as ``problem=.../mode=...${pnpscale_variant:...}/gpus=...`` in ``conf/config.yaml``, so the
    points of a sweep over ``solver.denoiser_collective`` or ``problem.num_operators`` get their own
    folders while default runs keep ``problem=P/mode=M/gpus=N``. ``num_operators`` appears when it
    is set explicitly (not ``null``, i.e. not taken from the scale preset).

    >>> variant_subdir("all_reduce", None), variant_subdir("all_gather", None), variant_subdir("all_reduce", 2)
    ('', '/denoiser_collective=all_gather', '/num_operators=2')
    >>> variant_subdir("all_reduce", None, "pipelined")
    '/overlap=pipelined'
    """
    parts = variant_parts(denoiser_collective, num_operators, overlap, overlap_chunks, gradient_collective)
    return "".join("/" + p for p in parts)


# --------------------------------------------------------------------------------------
# Value rules
# --------------------------------------------------------------------------------------


def _int_in(lo: int, hi: int | None = None) -> tuple[Callable[[Any], bool], str]:
    def ok(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)

    return ok, (f"must be an integer in {lo}..{hi}" if hi is not None else f"must be an integer >= {lo}")


def _one_of(options: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in options), "allowed values: " + ", ".join(options)


def _positive_float() -> tuple[Callable[[Any], bool], str]:
    return (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
        "must be a number > 0",
    )


def _non_negative_float() -> tuple[Callable[[Any], bool], str]:
    return (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
        "must be a number >= 0",
    )


def _impl() -> tuple[Callable[[Any], bool], str]:
    return (
        lambda v: isinstance(v, str) and v.count(":") == 1 and all(v.split(":")),
        "must be 'package.module:Class'",
    )


#: Rules for scalar keys, shared by the command-line pre-check and :func:`validate`.
RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "gpus": _int_in(1, MAX_GPUS),
    "scale": _one_of(SCALES),
    "iterations": (
        lambda v: v is None or _int_in(1)[0](v),
        "must be an integer >= 1, or null (the scale preset's: 5; tiny: 2)",
    ),
    "warmup": _int_in(0),
    "seed": _int_in(0),
    "dist.backend": _one_of(BACKENDS),
    "solver.denoiser_collective": _one_of(DENOISER_COLLECTIVES),
    "solver.overlap": _one_of(OVERLAPS),
    "profile.operators": _one_of(PROFILE_OPERATORS),
    "solver.gradient_collective": _one_of(GRADIENT_COLLECTIVES),
    "solver.overlap_chunks": (lambda v: v is None or _int_in(1)[0](v), "must be an integer >= 1, or null"),
    "dist.timeout_s": _positive_float(),
    "inject.delay_s": _non_negative_float(),
    "dist.threads_per_rank": (lambda v: v is None or _int_in(1)[0](v), "must be an integer >= 1, or null"),
    "problem.channels": _int_in(1),
    "problem.dims": _int_in(1, 3),
    "problem.impl": (
        lambda v: isinstance(v, str) and v.count(":") == 1 and all(v.split(":")),
        "must be 'module:Class'",
    ),
    "mode.impl": (lambda v: isinstance(v, str) and v.count(":") == 1 and all(v.split(":")), "must be 'module:Class'"),
    "problem.noise_sigma": _non_negative_float(),
    "problem.denoiser_sigma": _positive_float(),
    "problem.stepsize": _positive_float(),
    **{
        k: (lambda v: isinstance(v, bool), "must be true or false")
        for k in (
            "resume",
            "report",
            "profile.record_shapes",
            "profile.export_traces",
            "inject.fail",
            "output.save_reconstruction",
        )
    },
    "cluster.impl": (
        lambda v: isinstance(v, str) and v.count(":") == 1 and all(v.split(":")),
        "must be 'module:Class' (a pnpscale.cluster.base.Cluster subclass)",
    ),
}

_SIZE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "image_size": _int_in(8),
    "num_operators": _int_in(1),
    "factor": _int_in(1),  # checked when set: a problem that decimates reads it (Problem.decimation)
    "patch_size": _int_in(1),
    "overlap": _int_in(0),
    "max_batch_size": _int_in(1),
    "nb": _int_in(1),
    "unroll": _int_in(1),
}


def _or_null(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """The rule ``ok``, or ``null`` (the scale preset's value)."""
    return lambda v: v is None or ok(v)


for _k, _rule in _SIZE_RULES.items():
    RULES[f"problem.{_k}"] = (_or_null(_rule[0]), _rule[1])


def check_value(key: str, value: Any) -> None:
    """Check one scalar ``key=value`` against :data:`RULES` (keys without a rule pass).

    Raises:
        ConfigError: the value is outside the allowed set.
    """
    rule = RULES.get(key)
    if rule is not None and not rule[0](value):
        raise ConfigError(key, value, rule[1])


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, Mapping) else getattr(node, part)
    return node


def cuda_surely_absent(environ: Any = None, dev: str = "/dev") -> bool:
    """Whether this machine surely has no CUDA device for torch, known without importing torch (10-20 s on a
    loaded machine): ``CUDA_VISIBLE_DEVICES`` empty or ``-1``, or no NVIDIA (``nvidia<N>``) nor ROCm
    (``kfd``) device node under ``dev``. ``False`` means "ask torch" (it may still find none).

    >>> cuda_surely_absent({"CUDA_VISIBLE_DEVICES": "-1"}), cuda_surely_absent({}, dev="/nonexistent")
    (True, True)
    """
    import glob
    import os

    env = os.environ if environ is None else environ
    if str(env.get("CUDA_VISIBLE_DEVICES", "x")).strip() in ("", "-1"):
        return True
    return not glob.glob(f"{dev}/nvidia[0-9]*") and not os.path.exists(f"{dev}/kfd")


def _candidate_scales(scale: str, cuda_available: bool | None) -> tuple[str, ...]:
    if scale == "auto" and cuda_available is None:
        return ("paper", "small")
    return (choose_scale(scale, bool(cuda_available)),)


def validate(cfg: Any, cuda_available: bool | None = None) -> None:
    """Check every value rule of a composed config; nothing is launched before this passes.

    Args:
        cfg: a composed config (OmegaConf ``DictConfig`` or nested mappings) with the layout of
            :class:`Config`.
        cuda_available: whether the ranks will have CUDA, when known: ``scale=auto`` is then
            checked as the preset it resolves to; ``None`` (e.g. SLURM, decided on the compute
            node) checks both presets.

    Raises:
        ConfigError: the first rule broken, as one line naming the key and the allowed values:
            ``gpus`` outside 1..64, an unknown ``problem``/``mode``/``scale``/``dist.backend``, a
            negative iteration count, a tile window ``patch_size + 2*overlap`` that is not a
            multiple of 8, a tile larger than the image, ``unroll`` < 1 in training, an
            ``inject.rank`` outside ``0..gpus-1``, an ``inject.section`` the mode lacks, an
            injection missing the rank (or, for a delay, the section) it applies to, or an unsupported
            ``solver`` combination (``overlap_chunks`` without ``pipelined``, ``pipelined`` with the all_gather
            denoiser or with ``gradient_collective=reduce_scatter``).
    """
    _check_mandatory(cfg)
    for key in RULES:
        check_value(key, _get(cfg, key))
    sections = tuple(cfg["mode"]["sections"])
    if not sections or len(set(sections)) != len(sections) or not all(isinstance(s, str) and s for s in sections):
        raise ConfigError("mode.sections", list(sections), "must be a list of distinct section names")
    for scale in _candidate_scales(cfg["scale"], cuda_available):
        _validate_sizes(cfg, scale)
    inj = cfg["inject"]
    if inj["rank"] is not None and not (isinstance(inj["rank"], int) and 0 <= inj["rank"] < cfg["gpus"]):
        raise ConfigError("inject.rank", inj["rank"], f"must be a rank in 0..{cfg['gpus'] - 1}")
    if inj["section"] is not None and inj["section"] not in sections:
        raise ConfigError("inject.section", inj["section"], "allowed values: " + ", ".join(sections))
    if (inj["delay_s"] or inj["fail"]) and inj["rank"] is None:
        what = "inject.delay_s" if inj["delay_s"] else "inject.fail"
        raise ConfigError(what, inj["delay_s"] or inj["fail"], f"needs inject.rank (a rank in 0..{cfg['gpus'] - 1})")
    if inj["delay_s"] and inj["section"] is None:
        raise ConfigError("inject.delay_s", inj["delay_s"], "needs inject.section: " + ", ".join(sections))
    _validate_overlap(cfg, cuda_available)


#: Keys without a default (``???``): each option's YAML states them (``problem.channels``, ``mode.sections``...).
MANDATORY_KEYS = tuple(
    f"{node}.{f.name}" for node, cls in (("problem", ProblemConfig), ("mode", ModeConfig))
    for f in dataclasses.fields(cls) if f.default is MISSING
)  # fmt: skip


def _check_mandatory(cfg: Any) -> None:
    """Every key of :data:`MANDATORY_KEYS` is set in the composed config.

    Raises:
        ConfigError: ``<key>=???: must be set: the option's YAML (conf/<group>/<name>.yaml) states it``.
    """
    from omegaconf import OmegaConf

    for key in MANDATORY_KEYS:
        node, _, leaf = key.partition(".")
        parent = cfg[node]
        if OmegaConf.is_missing(parent, leaf) if OmegaConf.is_config(parent) else parent.get(leaf, MISSING) == MISSING:
            raise ConfigError(key, "???", f"must be set: the option's YAML (conf/{node}/<name>.yaml) states it")


def tile_rows(image_size: int, patch_size: int, overlap: int) -> int:
    """Tile rows (2D) or slabs (3D) of deepinv's ``tiling_splitting_strategy`` along one dimension.

    Windows of ``patch_size + 2·overlap`` start every ``patch_size`` pixels of the signal padded by ``overlap``
    on both sides; the last one is moved to end at the padded edge (deepinv 0.5,
    ``deepinv/distributed/strategies/utils.py``).

    >>> tile_rows(32, 8, 4), tile_rows(20, 16, 4), tile_rows(8192, 1016, 4)
    (4, 2, 9)
    """
    window, padded = patch_size + 2 * overlap, image_size + 2 * overlap
    starts = [0]
    while starts[-1] + window < padded:
        starts.append(starts[-1] + patch_size)
    starts[-1] = padded - window
    return len(set(starts))


def _validate_overlap(cfg: Any, cuda_available: bool | None) -> None:
    """``solver.overlap`` / ``overlap_chunks`` against each other, the denoiser's collective, the mode and the
    tiling (the tile rows of every candidate scale preset); ``solver.gradient_collective`` against ``overlap`` and
    the tiling's reflect padding."""
    solver = cfg["solver"]
    overlap, chunks = solver.get("overlap", "none"), solver.get("overlap_chunks")
    if overlap != "none" and solver.get("gradient_collective", "all_reduce") != "all_reduce":
        raise ConfigError(
            "solver.gradient_collective",
            solver["gradient_collective"],
            f"needs solver.overlap=none (solver.overlap={overlap} pipelines the all_reduce's row bands; "
            "a pipelined reduce_scatter is not built)",
        )
    if solver.get("gradient_collective", "all_reduce") != "all_reduce":
        for scale in _candidate_scales(cfg["scale"], cuda_available):
            sizes = resolve_sizes(cfg, scale)
            if sizes["overlap"] >= sizes["image_size"]:
                raise ConfigError(
                    "problem.overlap",
                    sizes["overlap"],
                    f"must be < image_size={sizes['image_size']} for solver.gradient_collective="
                    f"{solver['gradient_collective']} (reflect padding; scale={scale})",
                )
    if overlap == "none":
        if chunks is not None:
            raise ConfigError("solver.overlap_chunks", chunks, "needs solver.overlap=pipelined (or null)")
        return
    if solver["denoiser_collective"] != "all_reduce":
        raise ConfigError(
            "solver.overlap",
            overlap,
            "needs solver.denoiser_collective=all_reduce (a pipelined all_gather is not built)",
        )
    if chunks is None:
        return
    for scale in _candidate_scales(cfg["scale"], cuda_available):
        sizes = resolve_sizes(cfg, scale)
        rows = tile_rows(sizes["image_size"], sizes["patch_size"], sizes["overlap"])
        if chunks > rows:
            raise ConfigError(
                "solver.overlap_chunks",
                chunks,
                f"must be an integer in 1..{rows} (the tile rows of image_size={sizes['image_size']}, "
                f"patch_size={sizes['patch_size']}, overlap={sizes['overlap']}; scale={scale}), or null",
            )


def _validate_sizes(cfg: Any, scale: str) -> None:
    sizes = resolve_sizes(cfg, scale)
    where = f" (scale={scale})"
    for name, (ok, allowed) in _SIZE_RULES.items():
        if name == "unroll" and cfg["mode"]["name"] != "training":
            continue
        if name == "factor" and sizes[name] is None:  # only the problems that decimate need it
            continue
        if not ok(sizes[name]):
            raise ConfigError(f"problem.{name}", sizes[name], allowed + where)
    nc = sizes["nc"]
    if not (isinstance(nc, (list, tuple)) and len(nc) == 4 and all(isinstance(c, int) and c > 0 for c in nc)):
        raise ConfigError("problem.nc", nc, "must be a list of 4 positive integers (DRUNet widths)" + where)
    window = sizes["patch_size"] + 2 * sizes["overlap"]
    if window % WINDOW_MULTIPLE:
        raise ConfigError(
            "problem.patch_size",
            sizes["patch_size"],
            f"tile window patch_size+2*overlap={window} must be a multiple of {WINDOW_MULTIPLE}"
            f" (overlap={sizes['overlap']}){where}",
        )
    if sizes["overlap"] >= sizes["patch_size"]:  # a halo as wide as the tile: neighbours' halos cross tiles
        raise ConfigError(
            "problem.overlap",
            sizes["overlap"],
            f"must be < problem.patch_size={sizes['patch_size']} (the halo of a tile is narrower than the tile)"
            f"{where}",
        )
    if sizes["patch_size"] >= sizes["image_size"]:
        raise ConfigError(
            "problem.patch_size",
            sizes["patch_size"],
            f"must be < problem.image_size={sizes['image_size']} (a tile must be smaller than the signal){where}",
        )
    if sizes["factor"] is not None and sizes["image_size"] % sizes["factor"]:
        raise ConfigError(
            "problem.factor",
            sizes["factor"],
            f"must divide problem.image_size={sizes['image_size']}{where}",
        )


_SIZE_KEYS = tuple(f.name for f in dataclasses.fields(SizeConfig))


def resolve_sizes(cfg: Any, scale: str) -> dict[str, Any]:
    """Sizes of ``scale``'s preset for the config's mode, overlaid with explicit size keys.

    Args:
        cfg: composed config.
        scale: one of :data:`PRESETS` (``"auto"`` must be resolved first, see :func:`choose_scale`).

    Returns:
        dict with every :class:`SizeConfig` field (``nc`` as a list).

    Raises:
        ConfigError: ``scale`` is not a preset name, or the problem's YAML has no such preset for the mode.
    """
    if scale not in PRESETS:
        raise ConfigError("scale", scale, f"allowed presets: {', '.join(PRESETS)}")
    problem, mode = cfg["problem"], cfg["mode"]["name"]
    presets = problem["scales"]
    if scale not in presets or mode not in presets[scale] or all(v is None for v in presets[scale][mode].values()):
        raise ConfigError("scale", scale, f"problem={problem['name']} has no preset problem.scales.{scale}.{mode} "
                          f"(conf/problem/{problem['name']}.yaml): add one, or choose another scale")
    preset = presets[scale][mode]
    out: dict[str, Any] = {}
    for key in _SIZE_KEYS:
        explicit = problem[key]
        value = explicit if explicit is not None else preset[key]
        out[key] = list(value) if value is not None and key == "nc" else value
    return out


def choose_scale(scale: str, cuda_available: bool) -> str:
    """Resolve ``auto``: ``paper`` on CUDA, ``small`` on CPU; other values pass through.

    >>> choose_scale("auto", cuda_available=False), choose_scale("paper", cuda_available=False)
    ('small', 'paper')
    """
    if scale == "auto":
        return "paper" if cuda_available else "small"
    return scale


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs, as plain data (picklable, JSON-able).

    Built by :func:`resolve_spec` after :func:`validate`; stored whole in ``run.json``.
    """

    problem: str
    mode: str
    gpus: int
    dims: int
    problem_impl: str
    mode_impl: str
    sections: tuple[str, ...]
    linestyle: str
    params: dict[str, Any]
    scale: str
    scale_requested: str
    sizes: dict[str, Any]
    channels: int
    noise_sigma: float
    denoiser_sigma: float
    stepsize: float
    iterations: int
    warmup: int
    seed: int
    backend: str
    timeout_s: float
    threads_per_rank: int | None
    record_shapes: bool
    export_traces: bool
    inject: dict[str, Any]
    save_reconstruction: bool
    denoiser_collective: str = "all_reduce"
    overlap: str = "none"
    overlap_chunks: int | None = None
    gradient_collective: str = "all_reduce"
    #: ``profile.operators`` (:data:`PROFILE_OPERATORS`)
    operators: str = "auto"
    #: the mode's own parameters (``mode.params``, checked by its class: :attr:`pnpscale.rank.solver.Solver.params`)
    mode_params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hex digest identifying the measurement (same point + same sizes = same digest).

        Digested in the layout runs were recorded in before the plugins owned their keys, so that a run
        recorded then keeps its digest (the resume rule): the keys of :data:`MOVED_KEYS` back at the top
        (``blur_sigma`` out of ``params``, ``1.0`` when the problem has none, as its YAML had; ``lr`` and
        ``train_stepsize`` out of ``mode_params``, their old defaults when the mode has none), and
        ``overlap`` / ``overlap_chunks``, ``gradient_collective`` and ``operators`` left out at their defaults (runs
        recorded before those keys; ``operators`` changes what the profiler records, not what is measured).
        """
        d = self.to_dict()
        if d["overlap"] == "none" and d["overlap_chunks"] is None:  # runs recorded before these keys: same digest
            del d["overlap"], d["overlap_chunks"]
        if d["gradient_collective"] == "all_reduce":  # runs recorded before this key: same digest
            del d["gradient_collective"]
        if d["operators"] == "auto":  # runs recorded before this key (every operator then: the same numbers)
            del d["operators"]
        params, mode = dict(d["params"]), dict(d.pop("mode_params"))
        d["blur_sigma"] = float(params.pop("blur_sigma", 1.0))
        d["params"] = params
        d["lr"] = float(mode.pop("lr", 1e-4))
        d["train_stepsize"] = bool(mode.pop("train_stepsize", False))
        if mode:  # a mode's parameter that did not exist then
            d["mode_params"] = mode
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def resolve_spec(cfg: Any, cuda_available: bool) -> RunSpec:
    """Validate ``cfg`` and turn it into a :class:`RunSpec` for a machine with/without CUDA.

    Raises:
        ConfigError: see :func:`validate`.
    """
    validate(cfg, cuda_available)
    scale = choose_scale(cfg["scale"], cuda_available)
    p, m, d = cfg["problem"], cfg["mode"], cfg["dist"]
    return RunSpec(
        problem=p["name"],
        mode=m["name"],
        gpus=int(cfg["gpus"]),
        dims=int(p["dims"]),
        problem_impl=str(p["impl"]),
        mode_impl=str(m["impl"]),
        sections=tuple(str(s) for s in m["sections"]),
        linestyle=str(p["linestyle"]),
        params=plain(p["params"]),
        scale=scale,
        scale_requested=cfg["scale"],
        sizes=resolve_sizes(cfg, scale),
        channels=int(p["channels"]),
        noise_sigma=float(p["noise_sigma"]),
        denoiser_sigma=float(p["denoiser_sigma"]),
        stepsize=float(p["stepsize"]),
        iterations=int(PRESET_ITERATIONS[scale] if cfg["iterations"] is None else cfg["iterations"]),
        warmup=int(cfg["warmup"]),
        seed=int(cfg["seed"]),
        backend=d["backend"],
        timeout_s=float(d["timeout_s"]),
        threads_per_rank=d["threads_per_rank"],
        record_shapes=bool(cfg["profile"]["record_shapes"]),
        export_traces=bool(cfg["profile"]["export_traces"]),
        inject=dict(cfg["inject"]),
        save_reconstruction=bool(cfg["output"]["save_reconstruction"]),
        denoiser_collective=str(cfg["solver"]["denoiser_collective"]),
        overlap=str(cfg["solver"].get("overlap", "none")),
        overlap_chunks=cfg["solver"].get("overlap_chunks"),
        gradient_collective=str(cfg["solver"].get("gradient_collective", "all_reduce")),
        operators=str(cfg["profile"].get("operators", "auto")),
        mode_params=plain(m.get("params")),
    )


# --------------------------------------------------------------------------------------
# Key lookup for the command-line pre-check
# --------------------------------------------------------------------------------------


def plain(node: Any, resolve: bool = True) -> dict[str, Any]:
    """A config mapping node as a plain ``dict`` (an OmegaConf container converted, interpolations
    resolved unless ``resolve=False``; a ``dict`` or other mapping copied; ``None`` is ``{}``).

    Raises:
        TypeError: ``node`` is not a mapping (a list or a scalar node).

    >>> plain({"a": 1})
    {'a': 1}
    """
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(node, resolve=resolve) if OmegaConf.is_config(node) else dict(node or {})
    if not isinstance(out, dict):
        raise TypeError(f"expected a mapping config node, got {type(out).__name__}")
    return {str(k): v for k, v in out.items()}


def schema_keys(cls: type = Config, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema (leaves and inner nodes).

    >>> "problem.patch_size" in set(schema_keys())
    True
    """
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        yield key
        ftype = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        sub = type(default) if dataclasses.is_dataclass(default) else ftype
        if sub is not None and dataclasses.is_dataclass(sub):
            yield from schema_keys(sub, key + ".")


def open_keys() -> tuple[str, ...]:
    """Schema keys whose children are free-form (dicts): the plugins' own parameters, checked by their class."""
    return ("problem.params", "mode.params")


#: Keys the shared schema held before each plugin owned its own (schema history): old key -> where it is
#: now. A command line or config file that still sets one is refused in one line naming the new place.
MOVED_KEYS: dict[str, str] = {
    "problem.blur_sigma": "problem.params.blur_sigma (a parameter of the problems that blur: 2d, 3d)",
    "mode.lr": "mode.params.lr (a parameter of mode=training)",
    "mode.train_stepsize": "mode.params.train_stepsize (a parameter of mode=training)",
}


def moved_key_error(key: str, value: Any) -> ConfigError | None:
    """The one-line refusal of a key :data:`MOVED_KEYS` names, else ``None``.

    >>> print(moved_key_error("mode.lr", 0.001))
    mode.lr=0.001: moved to mode.params.lr (a parameter of mode=training)
    >>> moved_key_error("gpus", 2) is None
    True
    """
    where = MOVED_KEYS.get(key)
    return None if where is None else ConfigError(key, value, f"moved to {where}")


def schema_types(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every typed leaf of a schema dataclass and its annotation (``{"gpus": int, "problem.nc": list[int] |
    None, ...}``); free-form dict nodes (``cluster``, ``problem.params``) are not leaves.

    >>> schema_types()["problem.scales.small.inference.nc"]
    list[int] | None
    """
    import typing

    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.update(schema_types(hint, key + "."))
        elif typing.get_origin(hint) is not dict:
            out[key] = hint
    return out


def type_text(hint: Any) -> str:
    """A schema annotation in words: ``int | None`` -> ``an integer or null``.

    >>> type_text(list[int] | None), type_text(bool), type_text(float)
    ('a list of integers or null', 'a boolean (true or false)', 'a number')
    """
    import types
    import typing

    words = {int: "an integer", float: "a number", bool: "a boolean (true or false)", str: "a string"}
    plural = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        text = " or ".join(type_text(a) for a in args if a is not type(None))
        return text + (" or null" if type(None) in args else "")
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return f"a list of {plural.get(item, str(item))}"
    return words.get(hint, str(hint))


def check_type(key: str, value: Any, schema: type = Config) -> None:
    """Whether OmegaConf can convert ``value`` to the type ``schema`` gives ``key`` (what Hydra does when it
    merges the override; keys of free-form nodes and keys not in the schema pass).

    Raises:
        ConfigError: ``<key>=<value>: expected <type>, got <value>`` (one line).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    hint = schema_types(schema).get(key)
    if hint is None:
        return
    *parents, leaf = key.split(".")
    node: Any = OmegaConf.structured(schema)
    for part in parents:
        node = node[part]
    try:
        node[leaf] = value
    except (OmegaConfBaseException, ValueError, TypeError):
        got = "null" if value is None else repr(value)
        raise ConfigError(key, value, f"expected {type_text(hint)}, got {got}") from None
