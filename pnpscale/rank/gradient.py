"""``solver.gradient_collective=reduce_scatter``: the gradient summed over ranks only where each rank's tiles read it.

deepinv's gradient step sums ``g = Σ_i A_iᵀ(A_i x − y_i)`` over ranks with one image-sized ``all_reduce``
(ring: ``2·P·(n−1)/n`` bytes per GPU), although the denoiser that follows reads ``z = x − γ·g`` on each rank
only inside its tiles' windows (core + ``overlap``, reflected at the border). This module gives each rank
exactly that region, in two collectives whose layout every rank derives from the tiling alone (no message):

1. **reduce-scatter over the cores** (:func:`window_layout`): the tiles' cores are disjoint and cover the
   signal, so they partition it into each rank's *owned* pixels ``O_r`` (tile ``i`` on rank ``i % n``, as
   deepinv assigns tiles). Every rank lays its local gradient out as ``n`` blocks, block ``q`` = its values on
   ``O_q`` (in increasing pixel order, zero-padded to the largest block, ``L`` pixels), and the ranks
   reduce-scatter them: rank ``r`` receives ``Σ_ranks g`` on ``O_r``. nccl-tests' size ``S = n·L·C·B ≈ P``,
   so each GPU moves ``S·(n−1)/n ≈ P·(n−1)/n`` bytes (bus factor ``(n−1)/n``). On NCCL this is
   ``reduce_scatter_tensor``; on gloo, whose ``reduce_scatter_tensor`` is an all_reduce of the whole input
   followed by a copy (``ProcessGroupGloo::reduce_scatter_tensor``, torch 2.x: it would move the all_reduce's
   bytes), it is the equivalent ``all_to_all_single`` of the same blocks summed on arrival (rank order), whose
   bytes are the same ``S·(n−1)/n`` (nccl-tests' alltoall factor ``(n−1)/n``).
2. **halo all_gather**: of its reduced cores, rank ``q`` sends the pixels some other rank's windows read
   (``B_q``, the *boundary*: the overlap bands next to another rank's tiles), zero-padded to the longest rank's;
   an ``all_gather`` of those buffers (``S = n·max|B_q|·C·B``, ``S·(n−1)/n`` per GPU) gives every rank every
   boundary, and rank ``r`` places its own cores and the others' boundaries.

Rank ``r`` then holds ``g`` exactly on ``M_r = O_r ∪ ⋃_{q≠r} B_q``, which contains every pixel its windows read
(a pixel of ``r``'s windows is owned by ``r`` or lies in the owner's boundary); elsewhere its ``g`` is zero,
and nothing reads it there: deepinv's ``DistributedProcessing`` cuts only the rank's own windows out of the
reflect-padded signal, and both reconciliations (``all_reduce``, ``all_gather``) return the full image on every
rank. Each value of ``g`` a window reads is the same sum as in the blocking path, so results equal it to
rounding (the summation order differs).

Bytes per GPU against the blocking all_reduce's ``2·P·(n−1)/n``: ``(S + H)·(n−1)/n`` with ``S ≈ P`` (the blocks)
and ``H = n·max|B_q|`` (the gathered boundaries, times channels and bytes per value). Round-robin tiles put each
tile's left and right neighbours on other ranks, so ``H`` grows with the overlap against the tile: ``0.25·P`` at
the study's tiling (256-pixel tiles, 32-pixel overlap) up to 32 ranks, ``0.43·P`` at 64 (0.62x and 0.72x the
all_reduce's bytes); ``0.44–0.75·P`` at the small preset's (32 and 8). The all_gather gives every boundary to
every rank: an all_to_all with uneven splits sending each rank only the pieces its windows read would come
closer to half from 4 ranks on (0.54x at 4, 0.50x at 64 on the study's tiling: ``benchmarks/windowed_bytes.py``);
not built, since the byte model and the collective log know only even all_to_alls (README, Remedies).

Training: the exchange is one ``torch.autograd.Function`` (:class:`WindowedSum`); ``g_r = M_r ⊙ Σ_q g_q`` is
linear, its adjoint sums ``M_r ⊙ ∂L/∂g_r`` over ranks, by the forward's collectives transposed
(:func:`windowed_sum_adjoint`: a reduce-scatter of the boundaries, then an all_gather of the cores), so the
backward moves the forward's ``(S + H)·(n−1)/n`` bytes, not an all_reduce's. Every rank runs the node, so the
backward's collectives match.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from pnpscale.rank.pipeline import pad_of, window_indices

#: How step 1 is issued: ``reduce_scatter`` (torch's single-tensor reduce-scatter, NCCL) or ``all_to_all``
#: (``dist.all_to_all_single`` and a local sum, gloo); ``None`` in :class:`WindowedSum` picks by backend.
SCATTERS = ("reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class WindowLayout:
    """Who owns and who reads which pixel: every rank's part of the windowed gradient exchange.

    Pixel indices are flat over the spatial dimensions (the signal's shape without its first two, batch and
    channel, dimensions), increasing.

    Attributes:
        world: ranks ``n``.
        owned: per rank ``q``, the pixels of its tiles' cores ``O_q`` (disjoint, covering the signal).
        boundary: per rank ``q``, the pixels of ``O_q`` that another rank's windows read (``B_q``).
        boundary_pos: per rank ``q``, the positions of ``boundary[q]`` inside ``owned[q]``.
        owner: the rank owning each pixel (spatial shape).
        read_by_other: whether a rank other than its owner reads each pixel (spatial shape).
        block: ``L = max_q |O_q|``, pixels per block of the reduce-scatter.
        halo: ``max_q |B_q|``, pixels per rank in the boundary all_gather.
    """

    world: int
    owned: tuple[torch.Tensor, ...]
    boundary: tuple[torch.Tensor, ...]
    boundary_pos: tuple[torch.Tensor, ...]
    owner: torch.Tensor
    read_by_other: torch.Tensor
    block: int
    halo: int

    def known(self, rank: int) -> torch.Tensor:
        """Boolean mask (spatial shape) of ``M_r = O_r ∪ ⋃_{q≠r} B_q``: where rank ``rank`` holds the sum."""
        return (self.owner == rank) | self.read_by_other

    def to(self, device: torch.device | str) -> WindowLayout:
        """The same layout with its index tensors on ``device`` (moved once, not at every exchange)."""

        def move(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(t.to(device) for t in ts)

        return replace(
            self,
            owned=move(self.owned),
            boundary=move(self.boundary),
            boundary_pos=move(self.boundary_pos),
            owner=self.owner.to(device),
            read_by_other=self.read_by_other.to(device),
        )


def window_layout(strategy: Any, world: int) -> WindowLayout:
    """The :class:`WindowLayout` of a deepinv ``TilingStrategy`` on ``world`` ranks (tile ``i`` on rank ``i % world``).

    Args:
        strategy: a deepinv ``TilingStrategy`` (``_metadata``: ``img_size``, ``tiling_dims``, ``target_slices``,
            ``global_padding``; ``_global_slices``).
        world: ranks, ``>= 1``.

    Raises:
        ValueError: ``world < 1``; a tile whose core does not span the batch and channel dimensions whole; cores
            that do not partition the signal; a reflect padding as large as the signal (deepinv would fall back
            to constant padding, whose reads this layout does not model).

    >>> from deepinv.distributed.strategies.distributed_strategies import TilingStrategy
    >>> lay = window_layout(TilingStrategy((1, 1, 8, 8), tiling_dims=(-2, -1), patch_size=4, overlap=2), 2)
    >>> [len(o) for o in lay.owned], [len(b) for b in lay.boundary], lay.block, lay.halo
    ([32, 32], [16, 16], 32, 16)
    """
    if world < 1:
        raise ValueError(f"world={world}: must be >= 1")
    meta = strategy._metadata
    shape = tuple(int(s) for s in meta["img_size"])
    spatial = shape[2:]
    ndim = len(shape)
    for d in meta["tiling_dims"]:
        dim = d + ndim if d < 0 else d
        if pad_of(meta, dim) >= shape[dim]:
            raise ValueError(
                f"problem.overlap={pad_of(meta, dim)}: must be < the signal's size {shape[dim]} "
                "for solver.gradient_collective=reduce_scatter (reflect padding)"
            )
    owner = torch.full(spatial, -1, dtype=torch.int32)
    targets = meta["target_slices"]
    for i, slc in enumerate(targets):
        if any(s.indices(shape[k]) != (0, shape[k], 1) for k, s in enumerate(slc[:2])):
            raise ValueError(f"tile {i}: its core does not span the batch and channel dimensions whole")
        view = owner[tuple(slc[2:])]
        if (view != -1).any():
            raise ValueError(f"tile {i}: its core overlaps another tile's core (cores must partition the signal)")
        view.fill_(i % world)
    if (owner == -1).any():
        raise ValueError("the tiles' cores do not cover the signal")
    # read[p]: some rank other than p's owner reads p (through one of its tiles' windows)
    read_by_other = torch.zeros(spatial, dtype=torch.bool)
    for i in range(len(targets)):
        idx = [torch.arange(s) for s in spatial]
        for dim, ix in window_indices(strategy, i):
            idx[dim - 2] = torch.unique(ix)
        grid = torch.meshgrid(*idx, indexing="ij")
        read_by_other[grid] |= owner[grid] != (i % world)
    flat_owner, flat_other = owner.reshape(-1), read_by_other.reshape(-1)
    owned = tuple(torch.nonzero(flat_owner == q).reshape(-1) for q in range(world))
    boundary = tuple(torch.nonzero((flat_owner == q) & flat_other).reshape(-1) for q in range(world))
    pos = tuple(torch.searchsorted(o, b) for o, b in zip(owned, boundary, strict=True))
    return WindowLayout(
        world=world,
        owned=owned,
        boundary=boundary,
        boundary_pos=pos,
        owner=owner,
        read_by_other=read_by_other,
        block=max(len(o) for o in owned),
        halo=max(len(b) for b in boundary),
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def pick_scatter(group: Any = None) -> str:
    """Step 1's collective for the process group's backend: ``all_to_all`` on gloo, ``reduce_scatter`` otherwise."""
    return "all_to_all" if str(dist.get_backend(group)) == "gloo" else "reduce_scatter"


def _rows(t: torch.Tensor, scatter: str) -> torch.Tensor:
    """``t`` ``(B, C, *spatial)`` as ``(B·C, pixels)`` (a view where it can be), after checking ``scatter``.

    Raises:
        ValueError: ``scatter`` not in :data:`SCATTERS`.
    """
    if scatter not in SCATTERS:
        raise ValueError(f"scatter={scatter!r}: allowed values: {', '.join(SCATTERS)}")
    return t.reshape(t.shape[0] * t.shape[1], -1)


def _reduce_scatter(blocks: torch.Tensor, scatter: str, group: Any) -> torch.Tensor:
    """``Σ_ranks blocks[rank]`` on each rank: ``blocks`` ``(n, bc, m)`` -> ``(bc, m)``, by ``scatter``.

    ``reduce_scatter``: torch's single-tensor reduce-scatter, ``dist.reduce_scatter_single`` where torch has it
    (``reduce_scatter_tensor`` is its deprecated alias there), else ``dist.reduce_scatter_tensor``; both reach
    ProcessGroupNCCL's ``_reduce_scatter_base`` (range ``nccl:_reduce_scatter_base``). ``all_to_all``:
    ``dist.all_to_all_single`` of the blocks, summed on arrival in rank order. Looked up at call time, so
    :class:`~pnpscale.rank.profiling.CollectiveLog`'s wrappers record them.
    """
    if scatter == "reduce_scatter":
        mine = blocks.new_empty((1, *blocks.shape[1:]))
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        rs(mine, blocks, op=dist.ReduceOp.SUM, group=group)
        return mine[0]
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=group)
    return received.sum(0)


def _all_gather(buf: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """Every rank's ``buf`` ``(1, bc, m)`` -> ``(n, bc, m)``: ``dist.all_gather_single`` where torch has it
    (``all_gather_into_tensor`` is its deprecated alias there), else ``dist.all_gather_into_tensor``."""
    gathered = buf.new_empty((n, *buf.shape[1:]))
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ag(gathered, buf, group=group)
    return gathered


def windowed_sum(
    g_local: torch.Tensor, layout: WindowLayout, rank: int, scatter: str, group: Any = None
) -> torch.Tensor:
    """``M_r ⊙ Σ_ranks g_local`` on rank ``rank`` by the two collectives of the module doc (no autograd).

    Args:
        g_local: this rank's local gradient, ``(B, C, *spatial)``.
        layout: :func:`window_layout` of the tiling on the group's ranks.
        rank: this rank.
        scatter: one of :data:`SCATTERS`.
        group: the process group (``None``: the default one).

    Returns:
        ``g_local``'s shape: the sum over ranks on ``layout.known(rank)``, zeros elsewhere.

    Raises:
        ValueError: ``scatter`` not in :data:`SCATTERS`.
    """
    n, flat = layout.world, _rows(g_local.detach(), scatter)
    bc = flat.shape[0]
    blocks = flat.new_zeros((n, bc, layout.block))
    for q, idx in enumerate(layout.owned):
        blocks[q, :, : len(idx)] = flat.index_select(1, idx.to(flat.device))
    reduced = _reduce_scatter(blocks, scatter, group)
    out = torch.zeros_like(flat)
    own = layout.owned[rank].to(flat.device)
    out[:, own] = reduced[:, : len(own)]
    if layout.halo:  # no rank reads another's pixels (overlap 0): every rank skips the all_gather alike
        halo = flat.new_zeros((1, bc, layout.halo))
        pos = layout.boundary_pos[rank].to(flat.device)
        halo[0, :, : len(pos)] = reduced.index_select(1, pos)
        gathered = _all_gather(halo, n, group)
        for q, idx in enumerate(layout.boundary):
            if q != rank:
                out[:, idx.to(flat.device)] = gathered[q, :, : len(idx)]
    return out.reshape(g_local.shape)


def windowed_sum_adjoint(
    grad: torch.Tensor, layout: WindowLayout, rank: int, scatter: str, group: Any = None
) -> torch.Tensor:
    """The adjoint of :func:`windowed_sum`: ``Σ_ranks M_r ⊙ grad_r`` on every rank, by the forward's two
    collectives transposed (the adjoint of an all_gather is a reduce-scatter, and of a reduce-scatter an
    all_gather), in reverse order:

    1. **boundary reduce-scatter** (adjoint of the halo all_gather): rank ``r`` lays out ``grad_r`` on each other
       rank's boundary ``B_q`` as block ``q`` (``halo`` pixels, zero-padded; its own block zero), and the ranks
       reduce-scatter the blocks (``scatter``: ``reduce_scatter`` on NCCL, ``all_to_all`` and a local sum on
       gloo); rank ``q`` adds what it receives to ``grad_q`` at ``B_q``: ``d_q`` on ``O_q`` (``block`` pixels).
    2. **core all_gather** (adjoint of the reduce-scatter over the cores): every rank gathers every ``d_q``
       and places it on ``O_q``.

    Bytes per GPU: ``(H + S)·(n−1)/n``, the forward's, against the blocking all_reduce's ``2·P·(n−1)/n``. A pixel
    of ``O_q`` outside ``B_q`` is in ``M_r`` for ``r = q`` only; a pixel of ``B_q`` is in every ``M_r``: so the
    result is ``Σ_r M_r ⊙ grad_r`` (the sum's order differs from an all_reduce's: equal to rounding).
    With no boundary (``halo == 0``, overlap 0) every rank skips step 1 alike.

    Args:
        grad: this rank's output gradient ``∂L/∂g_r``, ``(B, C, *spatial)``.
        layout, rank, scatter, group: as for :func:`windowed_sum`.

    Returns:
        ``grad``'s shape: ``∂L/∂g_local`` of this rank, the same on every rank.

    Raises:
        ValueError: ``scatter`` not in :data:`SCATTERS`.
    """
    n, flat = layout.world, _rows(grad, scatter)
    bc = flat.shape[0]
    own = layout.owned[rank].to(flat.device)
    mine = flat.new_zeros((1, bc, layout.block))
    mine[0, :, : len(own)] = flat.index_select(1, own)
    if layout.halo:
        blocks = flat.new_zeros((n, bc, layout.halo))
        for q, idx in enumerate(layout.boundary):
            if q != rank:
                blocks[q, :, : len(idx)] = flat.index_select(1, idx.to(flat.device))
        pos = layout.boundary_pos[rank].to(flat.device)
        mine[0, :, pos] += _reduce_scatter(blocks, scatter, group)[:, : len(pos)]
    gathered = _all_gather(mine, n, group)
    out = torch.zeros_like(flat)
    for q, idx in enumerate(layout.owned):
        out[:, idx.to(flat.device)] = gathered[q, :, : len(idx)]
    return out.reshape(grad.shape)


class WindowedSum(torch.autograd.Function):
    """:func:`windowed_sum` with its adjoint (:func:`windowed_sum_adjoint`: the forward's collectives transposed)."""

    @staticmethod
    def forward(
        ctx: Any, g_local: torch.Tensor, layout: WindowLayout, rank: int, scatter: str, group: Any
    ) -> torch.Tensor:
        ctx.layout, ctx.rank, ctx.scatter, ctx.group = layout, rank, scatter, group
        return windowed_sum(g_local, layout, rank, scatter, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out = windowed_sum_adjoint(grad.contiguous(), ctx.layout, ctx.rank, ctx.scatter, ctx.group)
        return out, None, None, None, None


class WindowedGradient:
    """The gradient's sum over ranks restricted to the windows each rank's tiles read (the module doc).

    Args:
        strategy: the denoiser's deepinv ``TilingStrategy``.
        scatter: step 1's collective, one of :data:`SCATTERS`; ``None`` picks by the backend (:func:`pick_scatter`).
        group: the process group (``None``: the default one).

    Without a process group of several ranks the local gradient is the sum: returned as it is.
    """

    def __init__(self, strategy: Any, scatter: str | None = None, group: Any = None) -> None:
        if scatter is not None and scatter not in SCATTERS:
            raise ValueError(f"scatter={scatter!r}: allowed values: {', '.join(SCATTERS)}")
        self.group = group
        self.active = _distributed()
        self.rank = dist.get_rank(group) if self.active else 0
        world = dist.get_world_size(group) if self.active else 1
        self.layout = window_layout(strategy, world)
        self.scatter = scatter if scatter is not None else (pick_scatter(group) if self.active else "reduce_scatter")

    def _on(self, device: torch.device) -> WindowLayout:
        if self.layout.owner.device != device:
            self.layout = self.layout.to(device)
        return self.layout

    def __call__(self, g_local: torch.Tensor) -> torch.Tensor:
        """``Σ_ranks g`` on this rank's windows (``g_local``: ``(B, C, *spatial)``; zeros where no window reads)."""
        if not self.active:
            return g_local
        return WindowedSum.apply(g_local, self._on(g_local.device), self.rank, self.scatter, self.group)
