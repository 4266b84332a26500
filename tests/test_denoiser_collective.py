"""``solver.denoiser_collective=all_gather``: same image and same weight gradients as deepinv's all_reduce."""

from __future__ import annotations

import pytest
import torch

from pnpscale.rank.denoiser import core_slices, gather_layout, place_cores
from tests.unrolled import Setting, assert_results_equal, tiling, unrolled_results


@pytest.mark.parametrize(("shape", "patch"), [((1, 3, 20, 20), 8), ((1, 1, 12, 12, 12), 8)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_cores_tile_the_signal_and_place_back(shape, patch, world):
    """Every rank's flat buffer of cores, padded to the longest, places back into the signal exactly."""
    x = torch.randn(shape)
    strategy = tiling(shape, patch, 4)
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


#: 2D: 4 tiles (5 ranks leave one without a tile); 3D: 8 tiles
_CASES = ((2, (1, 3, 20, 20), 16), (3, (1, 1, 16, 16, 16), 8))
_VARIANTS = (("all_reduce",), ("all_gather",))


def _step(st: Setting, variant: tuple):
    """One call of the tiled denoiser, reconciled by ``all_reduce`` (deepinv) or ``all_gather``."""
    from pnpscale.rank.denoiser import tiled_denoiser

    (collective,) = variant
    den = tiled_denoiser(st.net, st.ctx, tiling(st.shape, st.patch, 4), collective=collective, max_batch_size=2)
    return lambda x: den(x, 0.05)


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    """Each world size's rank results (fork-started gloo ranks), keyed by world size."""
    return unrolled_results(tmp_path_factory, _step, {2: _VARIANTS, 3: _VARIANTS}, cases=_CASES, steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dims", [2, 3])
def test_all_gather_equals_all_reduce(gathered, world, dims):
    """Inference image, training image and weight gradients: all_gather == all_reduce to 1e-6 on every rank,
    and both equal the single-process result (5 ranks: one rank holds no 2D tile and sends only padding)."""
    single = gathered[1][0][(dims, "all_reduce")]
    for mine in gathered[world]:
        ar, ag = mine[(dims, "all_reduce")], mine[(dims, "all_gather")]
        assert_results_equal(ag, ar, (world, dims), fields=3)
        assert_results_equal(ag, single, (world, dims, "vs one process"), tol=1e-5, fields=3)
