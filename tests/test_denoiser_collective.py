"""``solver.denoiser_collective=all_gather``: same image and same weight gradients as deepinv's all_reduce."""

from __future__ import annotations

import os

import pytest
import torch

from pnpscale.rank.denoiser import core_slices, gather_layout, place_cores
from tests.helpers import gloo_rank, rank_results, rel_error


def _strategy(shape, patch, overlap):
    from deepinv.distributed.strategies.distributed_strategies import TilingStrategy

    dims = len(shape) - 2
    return TilingStrategy(shape, tiling_dims=tuple(range(-dims, 0)), patch_size=patch, overlap=overlap)


@pytest.mark.parametrize(("shape", "patch"), [((1, 3, 20, 20), 8), ((1, 1, 12, 12, 12), 8)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_cores_tile_the_signal_and_place_back(shape, patch, world):
    """Every rank's flat buffer of cores, padded to the longest, places back into the signal exactly."""
    x = torch.randn(shape)
    strategy = _strategy(shape, patch, 4)
    slices = core_slices(strategy)
    counts = gather_layout(shape, slices, world)
    assert sum(map(sum, counts)) == x.numel()  # the cores are disjoint and cover the signal
    longest = max(map(sum, counts))
    rows = []
    for r in range(world):
        flat = [x[slices[i]].reshape(-1) for i in range(r, len(slices), world)]
        buf = torch.cat(flat) if flat else torch.zeros(0)
        rows.append(torch.cat([buf, torch.zeros(longest - buf.numel())]))
    out = place_cores(torch.zeros(shape), torch.stack(rows), slices, counts)
    assert torch.equal(out, x)


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        _rank_body(rank, out_dir)


def _rank_body(rank: int, out_dir: str) -> None:
    from deepinv.distributed import DistributedContext
    from deepinv.models import DRUNet

    from pnpscale.rank.denoiser import tiled_denoiser

    results = {}
    with DistributedContext(backend="gloo", cleanup=False, device_mode="cpu") as ctx:
        # 2D: 4 tiles (5 ranks leave one without a tile); 3D: 8 tiles
        for dims, shape, patch in ((2, (1, 3, 20, 20), 16), (3, (1, 1, 16, 16, 16), 8)):
            g = torch.Generator().manual_seed(dims)
            x = torch.rand(shape, generator=g)
            target = torch.rand(shape, generator=g)
            for collective in ("all_reduce", "all_gather"):
                torch.manual_seed(0)
                net = DRUNet(shape[1], shape[1], nc=(4, 8, 8, 8), nb=1, pretrained=None, device="cpu", dim=dims)
                den = tiled_denoiser(net, ctx, _strategy(shape, patch, 4), collective=collective, max_batch_size=2)
                with torch.no_grad():
                    inference = den(x, 0.05)
                out = den(x, 0.05)  # training: gradients through the collective
                loss = ((out - target) ** 2).mean()
                loss.backward()
                grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                results[(dims, collective)] = (inference, out.detach(), grads)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """Each world size's rank results (fork-started gloo ranks), keyed by world size."""
    return rank_results(_rank, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dims", [2, 3])
def test_all_gather_equals_all_reduce(gathered, world, dims):
    """Inference image, training image and weight gradients: all_gather == all_reduce to 1e-6 on every rank,
    and both equal the single-process result (5 ranks: one rank holds no 2D tile and sends only padding)."""
    single = gathered[1][0][(dims, "all_reduce")]
    for mine in gathered[world]:
        ar, ag = mine[(dims, "all_reduce")], mine[(dims, "all_gather")]
        for k, what in enumerate(("inference image", "training image", "weight gradients")):
            assert rel_error(ag[k], ar[k]) <= 1e-6, (world, dims, what)
            assert rel_error(ag[k], single[k]) <= 1e-5, (world, dims, what, "vs one process")
        assert ag[2].abs().sum() > 0  # the gradients are not trivially zero
