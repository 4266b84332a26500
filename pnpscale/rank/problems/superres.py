"""``problem=2d``: multiframe super-resolution of an RGB image (``conf/problem/2d.yaml``).

Operator ``i`` is deepinv's :class:`~deepinv.physics.Downsampling` with a Gaussian blur shifted by
``(i mod f, (i div f) mod f)`` high-resolution pixels (the sub-pixel phase of frame ``i`` for a
factor ``f``) and widened by 25% for every further round of ``f^2`` frames. Normalised blurs and
decimation have norm <= 1, so ``L = M``. Its own parameter: ``problem.params.blur_sigma`` (:class:`Params`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pnpscale.rank.problems.base import POSITIVE, Problem, gaussian_filter


@dataclass
class Params:
    """``problem.params`` of 2d.

    Attributes:
        blur_sigma: the Gaussian blur of frame 0, high-resolution pixels (> 0; widened by 25 % per round
            of ``f^2`` frames).
    """

    blur_sigma: float = 1.0


class SuperResolution2D(Problem):
    """Multiframe super-resolution (2D, ``C`` channels, ``M`` frames of factor ``f``)."""

    params = Params
    rules = {"blur_sigma": POSITIVE}

    def check(self) -> None:
        self.decimation()

    def operator(self, index: int, device: torch.device) -> torch.nn.Module:
        from deepinv.physics import Downsampling

        spec = self.spec
        f = self.decimation()
        n = spec.sizes["image_size"]
        shift = (index % f, (index // f) % f)
        sigma = float(self.settings.blur_sigma) * (1.0 + 0.25 * (index // (f * f)))
        filt = gaussian_filter((sigma, sigma), device)
        filt = torch.nn.functional.pad(filt, (f, f, f, f))
        filt = torch.roll(filt, shifts=shift, dims=(-2, -1))
        return Downsampling(img_size=(spec.channels, n, n), filter=filt, factor=f, padding="circular", device=device)
