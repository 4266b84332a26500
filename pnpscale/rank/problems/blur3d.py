"""``problem=3d``: a volume behind anisotropic 3D Gaussian blurs (``conf/problem/3d.yaml``).

View ``i`` is deepinv's :class:`~deepinv.physics.Blur` (FFT-based, circular boundary) with a
Gaussian long along axis ``i mod 3`` (sigma ``2 + 0.5 (i div 3)`` times the short one), decimated by
``factor`` along every axis when ``factor > 1``. Norms <= 1, so ``L = M``. Its own parameter:
``problem.params.blur_sigma`` (:class:`Params`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pnpscale.rank.problems.base import POSITIVE, Problem, gaussian_filter


@dataclass
class Params:
    """``problem.params`` of 3d.

    Attributes:
        blur_sigma: the short-axis sigma of every view, voxels (> 0; the long axis is ``2 + 0.5 (i div 3)``
            times it).
    """

    blur_sigma: float = 1.0


def _upsample_zeros(y: torch.Tensor, f: int) -> torch.Tensor:
    shape = (*y.shape[:-3], *(d * f for d in y.shape[-3:]))
    x = torch.zeros(shape, dtype=y.dtype, device=y.device)
    x[..., ::f, ::f, ::f] = y
    return x


class AnisotropicBlur3D(Problem):
    """Anisotropic 3D blurs at different orientations (one channel volume, ``M`` views)."""

    params = Params
    rules = {"blur_sigma": POSITIVE}

    def check(self) -> None:
        self.decimation()

    def operator(self, index: int, device: torch.device) -> torch.nn.Module:
        from deepinv.physics import Blur, LinearPhysics

        s = float(self.settings.blur_sigma)
        sig = [s, s, s]
        sig[index % 3] = s * (2.0 + 0.5 * (index // 3))
        blur = Blur(filter=gaussian_filter(tuple(sig), device), padding="circular", use_fft=True, device=device)
        f = self.decimation()
        if f == 1:
            return blur
        dec = LinearPhysics(A=lambda x: x[..., ::f, ::f, ::f], A_adjoint=lambda y: _upsample_zeros(y, f))
        return dec * blur
