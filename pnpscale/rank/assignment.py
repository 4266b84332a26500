"""Who computes what: operators and denoiser tiles per rank (pure functions).

deepinv.distributed assigns both acquisition operators and denoiser tiles round-robin
(item ``i`` goes to rank ``i % world_size``), keeping each item whole. The busiest rank's count
sets a section's critical path (the study: "a section's critical path is set by the busiest
GPU's operator count").
"""

from __future__ import annotations

import math


def round_robin(num_items: int, world_size: int) -> list[list[int]]:
    """Items of each rank under deepinv's round-robin rule ``i % world_size == rank``.

    Raises:
        ValueError: ``num_items < 0`` or ``world_size < 1``.

    >>> round_robin(5, 2)
    [[0, 2, 4], [1, 3]]
    >>> round_robin(2, 4)
    [[0], [1], [], []]
    """
    if num_items < 0 or world_size < 1:
        raise ValueError(f"need num_items >= 0 and world_size >= 1, got {num_items}, {world_size}")
    return [list(range(r, num_items, world_size)) for r in range(world_size)]


def tiles_per_dim(size: int, patch_size: int) -> int:
    """Tiles along one dimension of deepinv's ``TilingStrategy`` (stride = patch): ``ceil(size/patch)``.

    Raises:
        ValueError: ``patch_size >= size`` (deepinv refuses a tile as large as the signal).

    >>> tiles_per_dim(128, 32), tiles_per_dim(100, 32)
    (4, 4)
    """
    if patch_size >= size:
        raise ValueError(f"patch_size={patch_size} must be smaller than the size {size}")
    return math.ceil(size / patch_size)


def num_tiles(size: int, patch_size: int, dims: int) -> int:
    """Tiles of a cubic signal of side ``size`` tiled over ``dims`` dimensions.

    >>> num_tiles(512, 64, 3)
    512
    """
    return tiles_per_dim(size, patch_size) ** dims


def work_per_rank(num_operators: int, tiles: int, world_size: int) -> dict[str, list[int]]:
    """Operator and tile counts per rank.

    >>> work_per_rank(8, 16, 16)["operators_per_rank"][:9]
    [1, 1, 1, 1, 1, 1, 1, 1, 0]
    """
    return {
        "operators_per_rank": [len(x) for x in round_robin(num_operators, world_size)],
        "tiles_per_rank": [len(x) for x in round_robin(tiles, world_size)],
    }


#: The work a section's compute is made of (the study's solver): the gradient applies the rank's
#: operators, the denoiser runs on its tiles, training's forward and backward do both.
SECTION_WORK: dict[str, tuple[str, ...]] = {
    "gradient": ("operators",),
    "denoiser": ("tiles",),
    "forward": ("operators", "tiles"),
    "backward": ("operators", "tiles"),
}


def section_work(section: str) -> tuple[str, ...]:
    """Work units of a section: ``operators``, ``tiles`` or both (any other section name: both).

    >>> section_work("gradient"), section_work("step")
    (('operators',), ('operators', 'tiles'))
    """
    return SECTION_WORK.get(section, ("operators", "tiles"))
