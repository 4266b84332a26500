"""Operator and tile assignment match deepinv.distributed's own (pnpscale.assignment)."""

from __future__ import annotations

import warnings

import pytest

from pnpscale.rank.assignment import num_tiles, round_robin, work_per_rank


@pytest.mark.parametrize(("items", "world"), [(8, 1), (8, 3), (8, 16), (2, 4), (0, 2)])
def test_round_robin_matches_deepinv_local_indices(items, world):
    from deepinv.distributed import DistributedContext

    ctx = DistributedContext()
    ctx.world_size = world
    expected = []
    for rank in range(world):
        ctx.rank = rank
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected.append(ctx.local_indices(items))
    assert round_robin(items, world) == expected


@pytest.mark.parametrize(
    ("size", "patch", "overlap", "dims"), [(32, 8, 4, 2), (100, 32, 8, 2), (256, 32, 8, 2), (24, 8, 4, 3)]
)
def test_tile_count_matches_deepinv_tiling(size, patch, overlap, dims):
    from deepinv.distributed.strategies.distributed_strategies import TilingStrategy

    shape = (1, 1, *([size] * dims))
    strategy = TilingStrategy(shape, tiling_dims=tuple(range(-dims, 0)), patch_size=patch, overlap=overlap)
    assert num_tiles(size, patch, dims) == strategy.get_num_patches()


def test_work_per_rank_shows_idle_ranks_past_the_operator_count():
    work = work_per_rank(num_operators=2, tiles=512, world_size=4)
    assert work["operators_per_rank"] == [1, 1, 0, 0]
    assert work["tiles_per_rank"] == [128] * 4
    with pytest.raises(ValueError):
        num_tiles(8, 8, 2)
