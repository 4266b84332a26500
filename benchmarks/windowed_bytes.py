"""Bytes per GPU of the gradient's exchange: all_reduce, the windowed exchange, and an uneven all_to_all.

Computed from the tiling alone (no run): for ``solver.gradient_collective=reduce_scatter``
(:mod:`pnpscale.rank.gradient`) step 1 reduce-scatters ``S = n·L`` pixels (``L`` the largest rank's cores) and
step 2 all_gathers ``H = n·max_q |B_q|`` (every boundary to every rank). The alternative asked about sends, in
step 2, each rank only the boundary pixels its own windows read: an ``all_to_all`` with uneven splits, rank
``q`` sending ``|O_q ∩ R_r|`` pixels to each ``r ≠ q`` (``R_r`` the pixels of ``r``'s windows). Its time is set
by the busiest rank, so the table gives its bytes as the largest rank's send (``max``) and the mean.

    python benchmarks/windowed_bytes.py [--preset study|small|both] [--gpus 2,4,8,16,32,64]

Ratios are to the ring all_reduce's ``2·P·(n−1)/n`` (``P`` the image's pixels; channels and bytes per value
cancel). The study's 2D inference (8192², tiles of 256 + 32 overlap) is computed on its 1/8 copy (1024², 32 + 4:
the same tiling, in tiles).
"""

from __future__ import annotations

import argparse

import torch
from deepinv.distributed.strategies.distributed_strategies import TilingStrategy

from pnpscale.rank.gradient import window_layout
from pnpscale.rank.pipeline import window_indices

PRESETS = {"study": (1024, 32, 4), "small": (256, 32, 8)}


def reads_per_rank(strategy: TilingStrategy, world: int) -> list[torch.Tensor]:
    """Per rank ``r`` (tile ``i`` on rank ``i % world``), the boolean mask of the pixels its windows read."""
    spatial = tuple(int(s) for s in strategy._metadata["img_size"])[2:]
    reads = [torch.zeros(spatial, dtype=torch.bool) for _ in range(world)]
    for i in range(strategy.get_num_patches()):
        idx = [torch.arange(s) for s in spatial]
        for dim, ix in window_indices(strategy, i):
            idx[dim - 2] = torch.unique(ix)
        reads[i % world][torch.meshgrid(*idx, indexing="ij")] = True
    return reads


def exchange_pixels(size: int, patch: int, overlap: int, world: int) -> dict[str, float]:
    """Pixels per GPU (times ``(n−1)/n`` where a ring collective applies) of each way to sum the gradient.

    Returns:
        ``all_reduce`` ``2·P·(n−1)/n``; ``windowed`` ``(S + H)·(n−1)/n``; ``uneven_max`` / ``uneven_mean``
        ``S·(n−1)/n`` plus the largest / mean rank's uneven all_to_all send ``Σ_{r≠q} |O_q ∩ R_r|``.
    """
    strategy = TilingStrategy((1, 1, size, size), tiling_dims=(-2, -1), patch_size=patch, overlap=overlap)
    lay = window_layout(strategy, world)
    reads = reads_per_rank(strategy, world)
    sends = []
    for q in range(world):
        owned = lay.owner == q
        sends.append(sum(int((owned & reads[r]).sum()) for r in range(world) if r != q))
    f = (world - 1) / world
    s, h = world * lay.block, world * lay.halo
    return {
        "all_reduce": 2 * size * size * f,
        "windowed": (s + h) * f,
        "uneven_max": s * f + max(sends),
        "uneven_mean": s * f + sum(sends) / world,
        "boundary_share": h / (size * size),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=(*PRESETS, "both"), default="both")
    p.add_argument("--gpus", default="2,4,8,16,32,64")
    args = p.parse_args()
    presets = list(PRESETS) if args.preset == "both" else [args.preset]
    print("| preset | GPUs | H / P | windowed (now) | uneven all_to_all, busiest rank | mean rank |")
    print("|:--|--:|--:|--:|--:|--:|")
    for name in presets:
        size, patch, overlap = PRESETS[name]
        for n in (int(g) for g in args.gpus.split(",")):
            px = exchange_pixels(size, patch, overlap, n)
            ar = px["all_reduce"]
            print(
                f"| {name} ({size}², {patch} + {overlap}) | {n} | {px['boundary_share']:.2f} | "
                f"{px['windowed'] / ar:.3f}x | {px['uneven_max'] / ar:.3f}x | {px['uneven_mean'] / ar:.3f}x |"
            )


if __name__ == "__main__":
    main()
