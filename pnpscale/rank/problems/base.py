"""What a reconstruction problem is: the :class:`Problem` interface and its registry.

A problem is two files: a class (a subclass of :class:`Problem`: ground truth, acquisition
operators, the signal's dtype, and its own parameter schema :attr:`Problem.params`) and
``conf/problem/<name>.yaml`` (its name, ``impl: module:Class``, spatial dimensions, chart line style,
channels, the values of its ``params`` and the ``paper`` / ``small`` size presets). The YAML is what the
Hydra parent reads (sweeps, reports: no torch import there); the class is resolved by :func:`problem_class`
for the point's checks (its ``params`` and rules, before a rank starts) and on the ranks.

Everything a problem builds comes from the run's seed, identically on every rank, without
downloads. Operators are built by a factory ``make(index, device, kwargs)`` so that each rank
builds only its own (deepinv.distributed calls it for the rank's indices, round-robin
``i % world_size``). Measurement ``i`` is ``A_i x + noise_sigma * n_i`` with ``n_i`` drawn from a
generator seeded by ``(seed, i)``: the same on every rank and for every world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pnpscale.core.config import ConfigError, RunSpec
from pnpscale.core.plugins import Rule, check_params, params_values, resolve_impl


class ProblemError(ConfigError):
    """A problem that cannot be resolved or built: ``key=value: what is allowed`` (a :class:`ConfigError`).

    Attributes:
        key, value, allowed: as :class:`~pnpscale.core.config.ConfigError` (``problem.impl``, ...).
    """


@dataclass
class ProblemData:
    """What a rank holds of the problem.

    Attributes:
        x_true: ground truth, shape ``(1, C, *[N]*dims)``.
        factory: operator factory for deepinv.distributed, ``(index, device, kwargs) -> LinearPhysics``.
        num_operators: total operator count ``M``.
        lipschitz: upper bound of ``||sum_i A_i^T A_i||`` used for the step size ``gamma = stepsize / L``.
    """

    x_true: torch.Tensor
    factory: Callable[[int, torch.device, dict | None], torch.nn.Module]
    num_operators: int
    lipschitz: float


class Problem:
    """Base class of a reconstruction problem (subclass it; name it in ``conf/problem/<name>.yaml``).

    Subclasses implement :meth:`operator`; the defaults give a synthetic ground truth
    (:func:`synthetic_signal`), ``L = num_operators`` (every operator of norm <= 1) and float32.
    A problem's own parameters (``problem.params.*``) are the fields of its :attr:`params` dataclass,
    with their defaults (its YAML repeats them) and :attr:`rules`; the point's validation refuses any
    other key, a value of the wrong type or outside its rule, before a rank starts (:meth:`check_params`).

    Args:
        spec: the run's :class:`~pnpscale.core.config.RunSpec` (sizes in ``spec.sizes``, the keys every
            problem has ``spec.channels``, ``spec.noise_sigma``, ..., its own ``spec.params``, dimensions
            ``spec.dims``).
    """

    #: dtype of the reconstructed signal: sets the payload of the image-sized collectives.
    signal_dtype: ClassVar[torch.dtype] = torch.float32
    #: The problem's own keys under ``problem.params``: a dataclass whose fields are the keys (with their
    #: defaults), ``None`` for a problem with none.
    params: ClassVar[type | None] = None
    #: Value rules of those keys beyond their types (``"blur_sigma" -> (ok, allowed)``).
    rules: ClassVar[Mapping[str, Rule]] = {}

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    @property
    def settings(self) -> Any:
        """``problem.params`` as an instance of :attr:`params` (the spec's values over the defaults)."""
        return params_values(type(self).params, self.spec.params)

    def check_params(self) -> None:
        """``problem.params`` against :attr:`params` and :attr:`rules`.

        Raises:
            ConfigError: one line naming ``problem.params.<key>``: unknown (with the problem's keys), of
                the wrong type, or outside its rule.
        """
        cls = type(self)
        check_params("problem.params", cls.params, cls.rules, self.spec.params, f"problem={self.spec.problem}")

    @property
    def num_operators(self) -> int:
        return int(self.spec.sizes["num_operators"])

    def check(self) -> None:
        """Problem-specific rules on the spec across keys (sizes against ``params``...), run before any rank
        starts, after :meth:`check_params`.

        The default accepts everything; override it to refuse values the class cannot use.

        Raises:
            ProblemError: one line naming the key (``problem.params.<name>``, ``problem.<size>``), the
                value and what is allowed.
        """

    def decimation(self) -> int:
        """``problem.factor`` for the problems that decimate (2d, 3d): an integer >= 1 dividing ``image_size``.

        Raises:
            ProblemError: the preset and the command line leave it unset (``null``).
        """
        f = self.spec.sizes.get("factor")
        if f is None:
            raise ProblemError("problem.factor", "null", f"{type(self).__name__} decimates: set an integer >= 1")
        return int(f)

    def ground_truth(self, device: torch.device) -> torch.Tensor:
        """Signal ``(1, C, *[N]*dims)`` of :attr:`signal_dtype` (default: :func:`synthetic_signal`)."""
        s = self.spec
        return synthetic_signal(s.sizes["image_size"], s.channels, s.dims, s.seed, device).to(self.signal_dtype)

    def operator(self, index: int, device: torch.device) -> torch.nn.Module:
        """Acquisition operator ``index`` (0..M-1), a deepinv ``LinearPhysics``, built on ``device``."""
        raise NotImplementedError(f"{type(self).__name__}.operator")

    def lipschitz(self) -> float:
        """Upper bound of ``||sum_i A_i^T A_i||`` (default ``M``: operators of norm <= 1)."""
        return float(self.num_operators)

    def signal_bytes(self) -> int:
        """Bytes of the reconstructed signal, ``C * N^dims * itemsize`` (the main collectives' payload).

        Raises:
            ProblemError: a complex or otherwise sizeless dtype.
        """
        itemsize = torch.empty((), dtype=self.signal_dtype).element_size()
        s = self.spec
        return int(s.channels * s.sizes["image_size"] ** s.dims * itemsize)

    def build(self, device: torch.device) -> ProblemData:
        """Ground truth and operator factory on ``device``."""

        def factory(index: int, dev: torch.device, _kwargs: dict | None = None) -> torch.nn.Module:
            return self.operator(index, dev)

        return ProblemData(self.ground_truth(device), factory, self.num_operators, self.lipschitz())


def problem_class(impl: str) -> type[Problem]:
    """The :class:`Problem` subclass named by ``impl`` (``conf/problem/<name>.yaml``'s ``impl``).

    Raises:
        pnpscale.core.config.ConfigError: not importable, or not a :class:`Problem` subclass.
    """
    return resolve_impl("problem.impl", impl, Problem)


def make_problem(spec: RunSpec) -> Problem:
    """The problem object of a run spec (``spec.problem_impl``)."""
    return problem_class(spec.problem_impl)(spec)


def synthetic_signal(
    size: int, channels: int, dims: int, seed: int, device: torch.device, n_shapes: int = 24
) -> torch.Tensor:
    """Random ellipses (2D) or ellipsoids (3D) per channel on a ``[-1, 1]^dims`` grid.

    Args:
        size: side length in pixels/voxels.
        channels: channel count ``C``.
        dims: 1, 2 or 3.
        seed: parameters are drawn from a CPU generator with this seed (identical on every rank).
        device: where the signal is evaluated (no host-side full-size temporaries).
        n_shapes: shapes per channel.

    Returns:
        float32 tensor ``(1, C, *[size]*dims)`` clamped to [0, 1].
    """
    g = torch.Generator().manual_seed(seed)
    axis = torch.linspace(-1.0, 1.0, size, device=device)
    grids = [axis.view([-1 if d == k else 1 for d in range(dims)]) for k in range(dims)]
    out = torch.zeros((1, channels, *([size] * dims)), device=device)
    for c in range(channels):
        for _ in range(n_shapes):
            centre = (torch.rand(dims, generator=g) * 1.4 - 0.7).tolist()
            radii = (torch.rand(dims, generator=g) * 0.35 + 0.05).tolist()
            amp = float(torch.rand(1, generator=g) * 0.4 + 0.1)
            theta = float(torch.rand(1, generator=g) * math.pi)
            u = [grids[k] - centre[k] for k in range(dims)]
            if dims >= 2:  # rotate in the plane of the last two axes
                a, b = u[-2], u[-1]
                u[-2] = a * math.cos(theta) + b * math.sin(theta)
                u[-1] = -a * math.sin(theta) + b * math.cos(theta)
            r2 = sum((u[k] / radii[k]) ** 2 for k in range(dims))
            out[0, c] += amp * (r2 <= 1.0)
    return out.clamp_(0.0, 1.0)


#: The rule of a blur width (``blur_sigma`` of the problems that blur): a number > 0.
POSITIVE: Rule = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "must be a number > 0")


def gaussian_filter(sigmas: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """Normalised separable Gaussian, odd support ``2*ceil(3 sigma)+1`` per axis, shape ``(1, 1, *k)``."""
    axes = []
    for s in sigmas:
        half = max(1, math.ceil(3 * s))
        t = torch.arange(-half, half + 1, dtype=torch.float32, device=device)
        axes.append(torch.exp(-0.5 * (t / s) ** 2))
    filt = axes[0]
    for ax in axes[1:]:
        filt = filt.unsqueeze(-1) * ax
    filt = filt / filt.sum()
    return filt.view(1, 1, *filt.shape)


def measurements(
    problem: ProblemData, local_physics: list[torch.nn.Module], local_indices: list[int], noise_sigma: float, seed: int
) -> list[torch.Tensor]:
    """Noisy measurements for every operator index (deepinv's data fidelity wants the full list).

    Entries of operators held by other ranks are empty placeholders: deepinv's
    ``DistributedDataFidelity`` only reads the rank's own entries.

    Returns:
        list of length ``problem.num_operators``.
    """
    x = problem.x_true
    ys: list[torch.Tensor] = [torch.empty(0, device=x.device) for _ in range(problem.num_operators)]
    phys: Any
    for phys, i in zip(local_physics, local_indices, strict=True):
        clean = phys.A(x)
        g = torch.Generator(device=x.device).manual_seed(seed * 100_003 + i)
        noise = torch.randn(clean.shape, generator=g, device=x.device, dtype=clean.dtype)
        ys[i] = clean + noise_sigma * noise
    return ys
