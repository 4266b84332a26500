"""``problem=ct``: parallel-beam tomography with the angles split into operators (``conf/problem/ct.yaml``).

The sinogram has ``A = round(params.angles_per_pixel × image_size)`` angles evenly spaced over
[0°, 180°). Operator ``i`` (of ``M = num_operators``) is deepinv's :class:`~deepinv.physics.Tomography`
(parallel beam, radon by rotation + ``grid_sample``, runs on CPU and CUDA; detector = deepinv's default,
the image diagonal ``ceil(√2 N)`` cells) on the **interleaved** angle block ``i, i+M, i+2M, ...``:
every block is a sparse-view scan of the whole half-turn, so blocks are equal in cost and in
conditioning (as the ordered subsets of OS-EM), and the gradient stays balanced while ``M``
operators can be spread over up to ``M`` GPUs. When ``M`` does not divide ``A`` the blocks differ by one angle.

Each block is normalised by deepinv (``normalize=True``: its norm by power iteration from a fixed
seed, identical on every rank and world size), so ``||A_i|| = 1`` and ``L = M`` bounds
``||Σ_i A_iᵀA_i||`` (up to the power iteration's tolerance, 1e-3; the step ``stepsize / L`` with
``stepsize = 1`` stays well inside the ``2 / L`` limit). The adjoint is exact (autograd,
``adjoint_via_backprop=True``). Ground truth: the synthetic phantom of
:func:`~pnpscale.rank.problems.base.synthetic_signal` (ellipses, one channel; no download).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pnpscale.rank.problems.base import POSITIVE, Problem, ProblemError


@dataclass
class Params:
    """``problem.params`` of ct.

    Attributes:
        angles_per_pixel: angles of the sinogram per image pixel (> 0): ``round(angles_per_pixel x image_size)``
            angles evenly spaced over [0, 180).
    """

    angles_per_pixel: float = 1.0


def angle_blocks(num_angles: int, num_operators: int) -> list[list[int]]:
    """Interleaved angle indices of each operator: block ``i`` = ``i, i+M, i+2M, ...``.

    Raises:
        ProblemError: fewer angles than operators (a block would be empty).

    >>> angle_blocks(8, 3)
    [[0, 3, 6], [1, 4, 7], [2, 5]]
    """
    if num_angles < num_operators:
        raise ProblemError("problem.num_operators", num_operators, f"must be <= the number of angles {num_angles}")
    return [list(range(i, num_angles, num_operators)) for i in range(num_operators)]


class ParallelBeamCT(Problem):
    """Parallel-beam CT of a one-channel image, ``M`` interleaved angle blocks (one operator each)."""

    params = Params
    rules = {"angles_per_pixel": POSITIVE}

    @property
    def num_angles(self) -> int:
        ratio = float(self.settings.angles_per_pixel)
        return max(1, round(ratio * self.spec.sizes["image_size"]))

    def check(self) -> None:
        """``num_operators`` <= the number of angles (``params.angles_per_pixel`` is checked by its schema first).

        Raises:
            ProblemError: one line naming the key, the value and what is allowed.
        """
        angle_blocks(self.num_angles, self.num_operators)

    def angles_deg(self) -> torch.Tensor:
        """All ``A`` angles in degrees, evenly spaced over [0, 180)."""
        a = self.num_angles
        return torch.arange(a, dtype=torch.float32) * (180.0 / a)

    def operator(self, index: int, device: torch.device) -> torch.nn.Module:
        from deepinv.physics import Tomography

        block = angle_blocks(self.num_angles, self.num_operators)[index]
        return Tomography(
            angles=self.angles_deg()[block].to(device),
            img_width=int(self.spec.sizes["image_size"]),
            circle=False,
            parallel_computation=True,
            adjoint_via_backprop=True,
            normalize=True,
            device=device,
        )
