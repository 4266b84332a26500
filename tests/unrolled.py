"""Multi-rank equality runs of the remedies (test support, not part of the package).

Each remedy (``solver.denoiser_collective=all_gather``, ``solver.overlap=pipelined``,
``solver.gradient_collective=reduce_scatter``) must give the blocking all_reduce path's numbers to 1e-6. One
rank body (:func:`unrolled_results`) runs every variant of a remedy on fork-started gloo ranks through
deepinv's ``DistributedContext``: per case (2D and 3D), a narrow DRUNet from seed 0, ``steps`` PnP steps of the
variant's step function under ``no_grad`` (inference), then the same steps from an input that requires grad,
the MSE loss against a random target and its backward (training). Each variant's result is
``(inference image, training image, weight gradients, input gradient)`` (:data:`FIELDS`), keyed
``(dims, *variant)``; :func:`assert_results_equal` compares two of them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.helpers import gloo_rank, rank_results, rel_error

#: What each variant's result holds, in order.
FIELDS = ("inference image", "training image", "weight gradients", "input gradient")

#: ``(dims, shape, patch)``: 2D 3x3 tiles of 8 (5 ranks: uneven), 3D 2x2x2 tiles.
CASES = ((2, (1, 3, 24, 24), 8), (3, (1, 1, 16, 16, 16), 8))


def tiling(shape: Sequence[int], patch: int, overlap: int) -> Any:
    """deepinv's ``TilingStrategy`` of ``shape`` over its spatial dimensions (tiles of ``patch`` + ``overlap``)."""
    from deepinv.distributed.strategies.distributed_strategies import TilingStrategy

    dims = len(shape) - 2
    return TilingStrategy(tuple(shape), tiling_dims=tuple(range(-dims, 0)), patch_size=patch, overlap=overlap)


@dataclass(frozen=True)
class Setting:
    """What a variant's step function is built from on one rank and case.

    Attributes:
        ctx: deepinv's ``DistributedContext``. net: the case's DRUNet (seed 0). shape, patch: the case.
        rank: this rank. weights: ``(world, *shape)``, rank ``r``'s local gradient is built from ``weights[r]``.
    """

    ctx: Any
    net: torch.nn.Module
    shape: tuple[int, ...]
    patch: int
    rank: int
    weights: torch.Tensor


#: ``make_step(setting, variant) -> step``, ``step(x) -> x`` one PnP step (or one denoiser call)
MakeStep = Callable[[Setting, tuple], Callable[[torch.Tensor], torch.Tensor]]


def _unrolled_rank(
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    make_step: MakeStep,
    variants: Mapping[int, Sequence[tuple]],
    cases: Sequence[tuple[int, tuple[int, ...], int]],
    steps: int,
) -> None:
    with gloo_rank(rank, world, port):
        from deepinv.distributed import DistributedContext
        from deepinv.models import DRUNet

        results = {}
        with DistributedContext(backend="gloo", cleanup=False, device_mode="cpu") as ctx:
            for dims, shape, patch in cases:
                g = torch.Generator().manual_seed(dims)
                x0 = torch.rand(shape, generator=g)
                target = torch.rand(shape, generator=g)
                weights = torch.rand((world, *shape), generator=g)
                for variant in variants[dims]:
                    torch.manual_seed(0)
                    net = DRUNet(shape[1], shape[1], nc=(4, 8, 8, 8), nb=1, pretrained=None, device="cpu", dim=dims)
                    step = make_step(Setting(ctx, net, shape, patch, rank, weights), variant)
                    with torch.no_grad():
                        inference = x0.clone()
                        for _ in range(steps):
                            inference = step(inference)
                    x = x0.clone().requires_grad_(True)
                    out = x
                    for _ in range(steps):  # training: gradients through every exchange
                        out = step(out)
                    ((out - target) ** 2).mean().backward()
                    grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                    results[(dims, *variant)] = (inference, out.detach(), grads, x.grad.clone())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def unrolled_results(
    tmp_path_factory: Any,
    make_step: MakeStep,
    variants: Mapping[int, Sequence[tuple]],
    cases: Sequence[tuple[int, tuple[int, ...], int]] = CASES,
    steps: int = 2,
) -> dict[int, list[dict]]:
    """Every variant's :data:`FIELDS` on 1..5 ranks: world size -> [rank 0's ``{(dims, *variant): result}``, ...].

    Args:
        tmp_path_factory: pytest's, for each world size's folder of rank results.
        make_step: builds a variant's step function (see :data:`MakeStep`).
        variants: per dims, the variants (tuples) to run.
        cases: ``(dims, shape, patch)`` per case.
        steps: PnP steps per run.
    """
    body = functools.partial(_unrolled_rank, make_step=make_step, variants=variants, cases=cases, steps=steps)
    return rank_results(body, tmp_path_factory)


def assert_results_equal(
    got: Sequence[torch.Tensor], base: Sequence[torch.Tensor], context: tuple, tol: float = 1e-6, fields: int = 4
) -> None:
    """The first ``fields`` of :data:`FIELDS` of ``got`` within ``tol`` (relative, Frobenius) of ``base``'s, and
    ``base``'s gradients among them not zero. ``fields=3`` leaves out the input gradient: where no exchange
    precedes the denoiser (a denoiser call alone) it is each rank's own tiles' share, zero on a rank without one."""
    for k, what in enumerate(FIELDS[:fields]):
        assert rel_error(got[k], base[k]) <= tol, (*context, what)
    assert all(base[k].abs().sum() > 0 for k in range(2, fields)), (*context, "zero gradients")


def cli_remedy_runs(tmp_path: Any, key: str, values: tuple[str, str], *overrides: str) -> dict[tuple[str, str], Any]:
    """``python -m pnpscale -m gpus=2 mode=inference,training solver.KEY=BASE,OTHER`` on ``TINY_2D``: checks the
    exit code, the four runs, that only OTHER's folder names ``KEY=OTHER``, and that its image (and training's
    losses and weight-gradient norms) equal BASE's to 1e-6 with deepinv's real data fidelity.

    Returns:
        ``(mode, value) -> run folder``.
    """
    from tests.helpers import TINY_2D, read_run, run_cli, run_dirs

    base, other = values
    proc = run_cli(
        "-m", "gpus=2", "mode=inference,training", f"solver.{key}={base},{other}", *TINY_2D,
        "output.save_reconstruction=true", *overrides, root=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(read_run(d)["mode"], read_run(d)["spec"][key]): d for d in run_dirs(tmp_path)}
    assert set(runs) == {(m, v) for m in ("inference", "training") for v in values}
    for mode in ("inference", "training"):
        mine, ref = runs[(mode, other)], runs[(mode, base)]
        assert f"{key}={other}" in str(mine) and f"{key}=" not in str(ref)
        a, b = torch.load(mine / "reconstruction.pt"), torch.load(ref / "reconstruction.pt")
        assert rel_error(a, b) <= 1e-6, mode
        if mode == "training":
            for name in ("losses", "grad_norms"):
                got, want = torch.tensor(read_run(mine)["solver"][name]), torch.tensor(read_run(ref)["solver"][name])
                assert rel_error(got, want) <= 1e-6, name
    return runs
