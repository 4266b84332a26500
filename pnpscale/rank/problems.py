"""The reconstruction problems: synthetic ground truth, acquisition operators, measurements.

Everything is built from the run's seed, identically on every rank, without downloads:

* ``2d``: multiframe super-resolution of an RGB image. Operator ``i`` is deepinv's
  :class:`~deepinv.physics.Downsampling` with a Gaussian blur shifted by
  ``(i mod f, (i div f) mod f)`` high-resolution pixels (the sub-pixel phase of frame ``i``
  for a factor ``f``) and widened by 25% for every further round of ``f^2`` frames.
* ``3d``: a volume observed through anisotropic 3D Gaussian blurs at different orientations
  (deepinv :class:`~deepinv.physics.Blur` built on FFTs, circular boundary), optionally decimated
  by ``factor`` along each axis.

Operators are built by a factory ``make(index, device, kwargs)`` so that each rank builds only
its own (deepinv.distributed calls it for the rank's indices). Measurement ``i`` is
``A_i x + noise_sigma * n_i`` with ``n_i`` drawn from a generator seeded by ``(seed, i)``: the
same on every rank and for every world size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pnpscale.sweep.config import SPATIAL_DIMS, RunSpec


@dataclass
class ProblemData:
    """What a rank holds of the problem.

    Attributes:
        x_true: ground truth, shape ``(1, C, *[N]*dims)``, values in [0, 1].
        factory: operator factory for deepinv.distributed.
        num_operators: total operator count.
        lipschitz: upper bound of ``||sum_i A_i^T A_i||`` used for the step size.
    """

    x_true: torch.Tensor
    factory: Callable[[int, torch.device, dict | None], torch.nn.Module]
    num_operators: int
    lipschitz: float


def synthetic_signal(
    size: int, channels: int, dims: int, seed: int, device: torch.device, n_shapes: int = 24
) -> torch.Tensor:
    """Random ellipses (2D) or ellipsoids (3D) per channel on a ``[-1, 1]^dims`` grid.

    Args:
        size: side length in pixels/voxels.
        channels: channel count ``C``.
        dims: 2 or 3.
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
            # rotate in the plane of the last two axes
            a, b = u[-2], u[-1]
            u[-2] = a * math.cos(theta) + b * math.sin(theta)
            u[-1] = -a * math.sin(theta) + b * math.cos(theta)
            r2 = sum((u[k] / radii[k]) ** 2 for k in range(dims))
            out[0, c] += amp * (r2 <= 1.0)
    return out.clamp_(0.0, 1.0)


def _gaussian_filter(sigmas: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """Normalised separable Gaussian, odd support ``2*ceil(3 sigma)+1`` per axis, ``(1,1,*k)``."""
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


def sr_operator_2d(index: int, spec: RunSpec, device: torch.device) -> torch.nn.Module:
    """Frame ``index`` of the 2D multiframe super-resolution problem (see module doc)."""
    from deepinv.physics import Downsampling

    f = spec.sizes["factor"]
    n = spec.sizes["image_size"]
    shift = (index % f, (index // f) % f)
    sigma = spec.blur_sigma * (1.0 + 0.25 * (index // (f * f)))
    filt = _gaussian_filter((sigma, sigma), device)
    filt = torch.nn.functional.pad(filt, (f, f, f, f))
    filt = torch.roll(filt, shifts=shift, dims=(-2, -1))
    return Downsampling(img_size=(spec.channels, n, n), filter=filt, factor=f, padding="circular", device=device)


def blur_operator_3d(index: int, spec: RunSpec, device: torch.device) -> torch.nn.Module:
    """View ``index`` of the 3D problem: an anisotropic Gaussian blur, long along axis ``index mod 3``.

    With ``factor > 1`` the blurred volume is decimated by ``factor`` along every axis.
    """
    from deepinv.physics import Blur, LinearPhysics

    s = spec.blur_sigma
    sig = [s, s, s]
    sig[index % 3] = s * (2.0 + 0.5 * (index // 3))
    blur = Blur(filter=_gaussian_filter(tuple(sig), device), padding="circular", use_fft=True, device=device)
    f = spec.sizes["factor"]
    if f == 1:
        return blur
    dec = LinearPhysics(
        A=lambda x: x[..., ::f, ::f, ::f],
        A_adjoint=lambda y: _upsample_zeros(y, f),
    )
    return dec * blur


def _upsample_zeros(y: torch.Tensor, f: int) -> torch.Tensor:
    shape = (*y.shape[:-3], *(d * f for d in y.shape[-3:]))
    x = torch.zeros(shape, dtype=y.dtype, device=y.device)
    x[..., ::f, ::f, ::f] = y
    return x


def build_problem(spec: RunSpec, device: torch.device) -> ProblemData:
    """Ground truth and operator factory of ``spec.problem`` on ``device``.

    Raises:
        ValueError: unknown problem name.
    """
    dims = SPATIAL_DIMS[spec.problem]
    x = synthetic_signal(spec.sizes["image_size"], spec.channels, dims, spec.seed, device)
    if spec.problem == "2d":
        make_op = sr_operator_2d
    elif spec.problem == "3d":
        make_op = blur_operator_3d
    else:  # pragma: no cover - validated before
        raise ValueError(f"problem={spec.problem!r}: allowed values: 2d, 3d")

    def factory(index: int, dev: torch.device, _kwargs: dict | None = None) -> torch.nn.Module:
        return make_op(index, spec, dev)

    # Normalised blurs and decimation have norm <= 1: ||sum A_i^T A_i|| <= num_operators.
    return ProblemData(x, factory, spec.sizes["num_operators"], float(spec.sizes["num_operators"]))


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
    for phys, i in zip(local_physics, local_indices, strict=True):
        clean = phys.A(x)
        g = torch.Generator(device=x.device).manual_seed(seed * 100_003 + i)
        noise = torch.randn(clean.shape, generator=g, device=x.device, dtype=clean.dtype)
        ys[i] = clean + noise_sigma * noise
    return ys
