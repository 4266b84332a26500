"""The tiled denoiser and how it reconciles ranks (``solver.denoiser_collective``).

deepinv's :class:`~deepinv.distributed.framework.DistributedProcessing` splits the signal into
tiles with :class:`~deepinv.distributed.strategies.distributed_strategies.TilingStrategy` (each
tile padded by ``overlap``), gives tile ``i`` to rank ``i % n``, denoises the tiles, keeps each
tile's *core* (the window minus its halo, and minus what the previous tile already covers: the
cores are disjoint and cover the signal), writes the cores into a zero image and ``all_reduce``\\ s
it. That moves the whole image: a ring all_reduce of ``P`` bytes sends ``2·P·(n−1)/n`` bytes per GPU.

``all_gather`` (:class:`GatherTiledProcessing`) moves only the cores: each rank flattens its cores
(in increasing tile order) into one buffer, zero-padded to the largest rank's length ``L_max``
(known to every rank from the tiling alone: no extra message), the ranks ``all_gather`` the
buffers, and every rank writes every rank's cores into the image. nccl-tests' size of that
all_gather is ``S = n·L_max ≈ P``, so each GPU moves ``S·(n−1)/n ≈ P·(n−1)/n`` bytes: half the
all_reduce's. Each pixel is written by exactly one core in both paths, so the results are equal
(bit for bit: the all_reduce adds zeros).

Training: the gather goes through deepinv's autograd-aware ``DistributedContext.all_gather``
(``torch.distributed.nn.functional.all_gather``, whose backward is a reduce_scatter on NCCL, an
all-to-all emulated by scatters on gloo), and deepinv's parameter sync still averages the weight
gradients; the weight gradients equal those of the all_reduce path (tested on 1..4 ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pnpscale.core.config import DENOISER_COLLECTIVES


def core_slices(strategy: Any) -> list[tuple[slice, ...]]:
    """Target slices (into the signal) of every tile's core, in tile order.

    Args:
        strategy: a deepinv ``TilingStrategy`` (its ``_metadata["target_slices"]``).
    """
    return list(strategy._metadata["target_slices"])


def core_shape(signal_shape: Sequence[int], slc: tuple[slice, ...]) -> tuple[int, ...]:
    """Shape of ``signal[slc]`` for a signal of ``signal_shape`` (no tensor needed).

    >>> core_shape((1, 3, 10, 10), (slice(None), slice(None), slice(2, 5), slice(0, 10)))
    (1, 3, 3, 10)
    """
    return tuple(len(range(*s.indices(d))) for s, d in zip(slc, signal_shape, strict=True))


def gather_layout(signal_shape: Sequence[int], slices: Sequence[tuple[slice, ...]], world: int) -> list[list[int]]:
    """Core element counts of each rank's tiles (round-robin, tile ``i`` on rank ``i % world``).

    Returns:
        ``counts[r]``: the element counts of rank ``r``'s cores, in increasing tile order; the
        buffer of rank ``r`` holds ``sum(counts[r])`` elements, padded to the largest rank's sum.

    >>> shape = (1, 1, 4, 4)
    >>> full = (slice(None), slice(None))
    >>> sl = [(*full, slice(0, 2), slice(0, 4)), (*full, slice(2, 4), slice(0, 4))]
    >>> gather_layout(shape, sl, 2), gather_layout(shape, sl, 3)
    ([[8], [8]], [[8], [8], []])
    """
    counts: list[list[int]] = [[] for _ in range(world)]
    for i, slc in enumerate(slices):
        n = 1
        for d in core_shape(signal_shape, slc):
            n *= d
        counts[i % world].append(n)
    return counts


def place_cores(
    out: torch.Tensor, gathered: torch.Tensor, slices: Sequence[tuple[slice, ...]], counts: list[list[int]]
) -> torch.Tensor:
    """Write every rank's gathered cores into ``out`` (in place; autograd-friendly slice copies).

    Args:
        out: the signal, ``(B, C, *spatial)``, zeros.
        gathered: ``(world, L_max)``, row ``r`` = rank ``r``'s flat core buffer.
        slices: core target slices per tile (:func:`core_slices`).
        counts: :func:`gather_layout` of the same tiling and world size.

    Returns:
        ``out``.
    """
    world = len(counts)
    for r in range(world):
        offset = 0
        for k, n in enumerate(counts[r]):
            slc = slices[r + k * world]
            out[slc] = gathered[r, offset : offset + n].view(core_shape(out.shape, slc))
            offset += n
    return out


def _gathering_class() -> type:
    from deepinv.distributed.framework import DistributedProcessing

    class GatherTiledProcessing(DistributedProcessing):
        """deepinv's tiled processing, with the cores all_gathered instead of the image all_reduced.

        Everything up to the reconciliation is deepinv's (``_apply_op(..., gather=False)``: tiles,
        batching, checkpointing, the weight-gradient sync); only the collective differs.
        """

        def _apply_op(self, x: torch.Tensor, *args: Any, gather: bool = True, **kwargs: Any) -> torch.Tensor:
            local = super()._apply_op(x, *args, gather=False, **kwargs)
            if not gather or not self.ctx.use_dist:
                return local
            world, rank = self.ctx.world_size, self.ctx.rank
            slices = core_slices(self._strategy)
            counts = gather_layout(local.shape, slices, world)
            longest = max(sum(c) for c in counts)
            mine = [local[slices[i]].reshape(-1) for i in self.local_indices]
            pad = longest - sum(counts[rank])
            if pad:
                # zeros, linked to ``local`` so that a rank without tiles still joins the backward's collectives
                mine.append((local.reshape(-1)[:1] * 0).expand(pad))
            buffer = torch.cat(mine)
            gathered = self.ctx.all_gather(buffer)
            return place_cores(torch.zeros_like(local), gathered, slices, counts)

    return GatherTiledProcessing


def tiled_denoiser(
    net: torch.nn.Module,
    ctx: Any,
    strategy: Any,
    *,
    collective: str,
    max_batch_size: int | None,
) -> torch.nn.Module:
    """The DRUNet ``net`` on ``strategy``'s tiles across ``ctx``'s ranks, reconciled by ``collective``.

    Args:
        net: the denoiser ``(B, C, *window) -> (B, C, *window)``.
        ctx: deepinv's ``DistributedContext``.
        strategy: deepinv's ``TilingStrategy`` of the signal's shape.
        collective: ``all_reduce`` (deepinv's own ``DistributedProcessing``) or ``all_gather``
            (:class:`GatherTiledProcessing`).
        max_batch_size: tiles per DRUNet call.

    Raises:
        ValueError: ``collective`` is not one of :data:`pnpscale.core.config.DENOISER_COLLECTIVES`.
    """
    from deepinv.distributed.framework import DistributedProcessing

    if collective not in DENOISER_COLLECTIVES:
        raise ValueError(f"solver.denoiser_collective={collective}: allowed values: {', '.join(DENOISER_COLLECTIVES)}")
    cls = DistributedProcessing if collective == "all_reduce" else _gathering_class()
    return cls(ctx, net, strategy=strategy, max_batch_size=max_batch_size)
