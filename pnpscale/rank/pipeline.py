"""``solver.overlap=pipelined``: the gradient's all_reduce and the denoiser overlapped, band by band.

deepinv's PnP iteration exchanges the whole image twice, each time blocking: the gradient
``g = Σ_i A_iᵀ(A_i x − y_i)`` is summed over ranks by one image-sized ``all_reduce``, then every rank
denoises its tiles of ``z = x − γ·g`` and the cores are summed by a second one. Both exchanges can be
cut along the tiling's first tiled dimension (tile *rows* in 2D, *slabs* in 3D):

* **bands**: tile row ``b`` (deepinv's tiles are ``itertools.product`` of the per-dimension starts, so
  tile ``i`` lies in row ``i // (tiles per row)``) has the disjoint core rows ``[s_b + trim_b, s_b + p)``
  of the signal (:func:`band_bounds`); ``K = solver.overlap_chunks`` chunks group consecutive bands
  (:func:`chunk_bounds`, as even as possible; ``null`` = one chunk per band).
* **gradient**: each rank's local sum ``Σ_{i local} A_iᵀ(A_i x − y_i)`` (deepinv's
  ``DistributedDataFidelity.grad(..., gather=False)``, with its shape broadcasts) is split into the K
  chunks, each ``dist.all_reduce(async_op=True)``\\ d in order (:class:`ChunkedAllReduce`);
* **denoiser**: the rank walks its tiles chunk by chunk; before a tile's batch it waits only for the
  chunks its window (core + ``overlap``, reflected at the border as deepinv pads) reads
  (:func:`window_rows`), forms ``z_k = x_k − γ·g_k`` for those, and cuts the windows out of them
  (:func:`window`: the same pixels as deepinv's ``F.pad(reflect)`` then slice);
* **reconciliation**: when a rank has denoised its tiles of chunk k it writes their cores into a zero band
  and issues that band's ``all_reduce(async_op=True)`` (:class:`IssueAllReduce`), so band k's exchange
  runs while the later tiles compute; the bands are waited for and concatenated at the end (:class:`Join`).

Every rank issues the same 2K collectives in the same order (a rank without tiles in a chunk sends
zeros), so they match across ranks. Each pixel is the same sum as in the blocking path, so results equal
it to rounding (the summation order inside gloo/NCCL may differ with the message size).

Training (autograd through the async collectives): ``torch.distributed.nn.functional.all_reduce`` is
autograd-aware but synchronous, so the async exchanges are ``torch.autograd.Function``\\ s with its
backward: the adjoint of a sum over ranks is a sum over ranks of the output gradient. To keep the
backward's collectives in the same order on every rank whatever tiles it holds, each exchange has exactly
one backward collective, an image-sized blocking all_reduce as in the blocking path:
:class:`ChunkedAllReduce` is one node for its K chunks; the denoiser's K :class:`IssueAllReduce` nodes pass
their gradient through and the one :class:`Join` node all_reduces the output gradient. Every chunk of
``z`` is linked to the output by a zero term, so a rank whose tiles do not read it still joins the
backward's collectives (deepinv's anchor for rank without work), and deepinv's
``DistributedParameterSync`` still averages the weight gradients at the end of backward.

Sections (inference): the gradient section computes the local sum only; the K gradient chunks are issued
at the start of the denoiser section, where they are waited for and overlapped, so each collective's
blocked and hidden time is measured inside one section (the decomposition clips collectives to their
section). The gradient's transfer therefore appears in the denoiser section: compare the iteration
(sections summed), not the sections one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def band_bounds(strategy: Any) -> list[tuple[int, int]]:
    """Core rows ``[lo, hi)`` of each tile row (band) along the first tiled dimension, in order.

    Args:
        strategy: a deepinv ``TilingStrategy`` (``_metadata``: ``grid_shape``, ``target_slices``).

    Returns:
        ``grid_shape[0]`` disjoint, consecutive ranges covering ``0..D`` (``D`` the signal's size there).
    """
    meta = strategy._metadata
    dim = _row_dim(meta)
    per_row = len(meta["target_slices"]) // meta["grid_shape"][0]
    out = []
    for b in range(meta["grid_shape"][0]):
        s = meta["target_slices"][b * per_row][dim]
        out.append((int(s.start), int(s.stop)))
    return out


def chunk_bounds(bands: Sequence[tuple[int, int]], chunks: int | None) -> list[tuple[int, int]]:
    """``chunks`` groups of consecutive bands, as even as possible (``None``: one chunk per band).

    Returns:
        row ranges ``[lo, hi)`` of the chunks, covering the bands.

    Raises:
        ValueError: ``chunks`` outside ``1..len(bands)``.

    >>> chunk_bounds([(0, 8), (8, 16), (16, 24), (24, 32)], 3), chunk_bounds([(0, 8), (8, 16)], None)
    ([(0, 8), (8, 24), (24, 32)], [(0, 8), (8, 16)])
    """
    n = len(bands) if chunks is None else int(chunks)
    if not 1 <= n <= len(bands):
        raise ValueError(f"solver.overlap_chunks={chunks}: must be an integer in 1..{len(bands)} (the tile rows)")
    cuts = [round(k * len(bands) / n) for k in range(n + 1)]
    return [(bands[cuts[k]][0], bands[cuts[k + 1] - 1][1]) for k in range(n)]


def _row_dim(meta: dict) -> int:
    """Index (into the signal's shape) of the first tiled dimension."""
    d = meta["tiling_dims"][0]
    return d + len(meta["img_size"]) if d < 0 else d


def reflect_index(lo: int, hi: int, pad: int, size: int) -> torch.Tensor:
    """Signal indices of padded positions ``lo..hi-1`` of a dimension padded by ``pad`` with ``reflect``.

    ``F.pad(mode="reflect")`` mirrors about the edge without repeating it: padded ``j`` reads
    ``o = j − pad``, ``−o`` when ``o < 0``, ``2(size−1) − o`` when ``o ≥ size``.

    >>> reflect_index(0, 6, 2, 4).tolist()
    [2, 1, 0, 1, 2, 3]
    >>> reflect_index(4, 8, 2, 4).tolist()
    [2, 3, 2, 1]
    """
    o = torch.arange(lo - pad, hi - pad)
    o = torch.where(o < 0, -o, o)
    return torch.where(o >= size, 2 * (size - 1) - o, o)


def window_rows(strategy: Any, tile: int) -> tuple[int, int]:
    """Signal rows ``[lo, hi)`` (first tiled dimension) that tile ``tile``'s window reads (border reflection in)."""
    meta = strategy._metadata
    dim = _row_dim(meta)
    g = strategy._global_slices[tile][dim]
    pad = pad_of(meta, dim)
    idx = reflect_index(int(g.start), int(g.stop), pad, int(meta["img_size"][dim]))
    return int(idx.min()), int(idx.max()) + 1


def pad_of(meta: dict, dim: int) -> int:
    """Padding (pixels each side) deepinv applies to signal dimension ``dim`` (``global_padding``)."""
    ndim = len(meta["img_size"])
    return int(meta["global_padding"][(ndim - 1 - dim) * 2])


def window_indices(strategy: Any, tile: int) -> list[tuple[int, torch.Tensor]]:
    """``(dim, signal indices)`` per tiled dimension of tile ``tile``'s reflect-padded window."""
    meta = strategy._metadata
    ndim = len(meta["img_size"])
    out = []
    for d in meta["tiling_dims"]:
        dim = d + ndim if d < 0 else d
        g = strategy._global_slices[tile][dim]
        out.append((dim, reflect_index(int(g.start), int(g.stop), pad_of(meta, dim), int(meta["img_size"][dim]))))
    return out


def window(
    strategy: Any,
    tile: int,
    segment: torch.Tensor,
    row0: int,
    indices: list[tuple[int, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Tile ``tile``'s padded window, cut from ``segment`` (the signal's rows ``row0..``, all other dims whole).

    Equal to deepinv's ``F.pad(x, global_padding, mode="reflect")[global_slices[tile]]`` (same pixels, an
    index copy; autograd-friendly).

    Args:
        strategy: the deepinv ``TilingStrategy``.
        tile: global tile index.
        segment: ``x[..., row0:row0 + n, ...]`` along the first tiled dimension, covering :func:`window_rows`.
        row0: the first row of ``segment``.
        indices: :func:`window_indices` of the tile, when already computed.

    Returns:
        ``(B, C, *window_shape)``.
    """
    row_dim = _row_dim(strategy._metadata)
    out = segment
    for dim, idx in indices if indices is not None else window_indices(strategy, tile):
        if dim == row_dim:
            idx = idx - row0
        out = out.index_select(dim, idx.to(segment.device))
    return out


class Pending:
    """The asynchronous works of one exchange, waited for once each (``wait(k)``)."""

    def __init__(self) -> None:
        self.works: list[Any] = []
        self.done: list[bool] = []

    def add(self, work: Any) -> None:
        self.works.append(work)
        self.done.append(False)

    def wait(self, k: int) -> None:
        """Block until chunk ``k`` has arrived (a no-op without a process group or when already waited)."""
        if not self.done[k]:
            if self.works[k] is not None:
                self.works[k].wait()
            self.done[k] = True

    def wait_all(self) -> None:
        for k in range(len(self.works)):
            self.wait(k)


def _issue(t: torch.Tensor, pending: Pending, group: Any) -> torch.Tensor:
    """A contiguous copy of ``t`` with its sum over ranks started asynchronously (the work in ``pending``)."""
    buf = t.detach().clone(memory_format=torch.contiguous_format)
    pending.add(dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True) if _distributed() else None)
    return buf


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Blocking sum over ranks of a copy of ``t`` (the backward of every exchange here)."""
    out = t.clone(memory_format=torch.contiguous_format)
    if _distributed():
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class ChunkedAllReduce(torch.autograd.Function):
    """``x`` split along ``dim`` at ``bounds`` into chunks, each summed over ranks asynchronously (one node).

    Forward: K ``all_reduce(async_op=True)`` in chunk order; the outputs are valid after ``pending.wait(k)``.
    Backward: the K output gradients concatenated and summed over ranks by one blocking all_reduce (the
    adjoint of a sum over ranks; ``torch.distributed.nn.functional.all_reduce``'s backward).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, bounds: list, pending: Pending, group: Any) -> tuple:
        ctx.dim, ctx.group = dim, group
        return tuple(_issue(x.narrow(dim, lo, hi - lo), pending, group) for lo, hi in bounds)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        return _all_reduce_sum(torch.cat(grads, dim=ctx.dim), ctx.group), None, None, None, None


class IssueAllReduce(torch.autograd.Function):
    """One band's sum over ranks, started asynchronously; backward passes the gradient through (the sum's
    adjoint is applied once for all bands by :class:`Join`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: Pending, group: Any) -> torch.Tensor:
        return _issue(x, pending, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


class Join(torch.autograd.Function):
    """Wait for every band of ``pending`` and concatenate them along ``dim``; backward: one blocking all_reduce
    of the output gradient, split back into the bands."""

    @staticmethod
    def forward(ctx: Any, dim: int, pending: Pending, group: Any, *bands: torch.Tensor) -> torch.Tensor:
        pending.wait_all()
        ctx.dim, ctx.group, ctx.sizes = dim, group, [b.shape[dim] for b in bands]
        return torch.cat(bands, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        summed = _all_reduce_sum(grad, ctx.group)
        return (None, None, None, *summed.split(ctx.sizes, dim=ctx.dim))


class PipelinedStep:
    """One PnP step ``x ← D_σ(x − γ·g)`` with the gradient's exchange, the tiles and the reconciliation overlapped.

    Args:
        denoiser: deepinv's ``DistributedProcessing`` (its ``processor``, ``ctx``, ``max_batch_size``); its
            tiling is set up on first use (``_init_shape_and_strategy``).
        chunks: ``solver.overlap_chunks`` (``None``: one per tile row).
    """

    def __init__(self, denoiser: Any, chunks: int | None) -> None:
        if denoiser.strategy is None:
            raise ValueError("solver.overlap=pipelined needs the denoiser's tiling strategy")
        self.den = denoiser
        self.chunks = chunks
        self.strategy = denoiser.strategy
        meta = self.strategy._metadata
        for d in meta["tiling_dims"]:
            dim = d + len(meta["img_size"]) if d < 0 else d
            if pad_of(meta, dim) >= meta["img_size"][dim]:
                raise ValueError(
                    f"problem.overlap={pad_of(meta, dim)}: must be < the signal's size {meta['img_size'][dim]} "
                    "for solver.overlap=pipelined (reflect padding)"
                )
        self.dim = _row_dim(meta)
        self.bounds = chunk_bounds(band_bounds(self.strategy), chunks)
        self.group = None
        n = self.strategy.get_num_patches()
        self.rows = [window_rows(self.strategy, i) for i in range(n)]  # per tile, computed once
        self.indices = [window_indices(self.strategy, i) for i in range(n)]

    def issue_gradient(self, g_local: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Pending]:
        """Start the K chunks' sums over ranks of the local gradient ``g_local`` (``(B, C, *spatial)``)."""
        pending = Pending()
        return ChunkedAllReduce.apply(g_local, self.dim, self.bounds, pending, self.group), pending

    def denoise(
        self,
        x: torch.Tensor,
        gamma: torch.Tensor | float,
        g_chunks: Sequence[torch.Tensor],
        g_pending: Pending,
        sigma: float,
    ) -> torch.Tensor:
        """``D_σ(x − γ·g)`` with ``g``'s chunks still arriving; the output's bands reconciled as they finish.

        Returns:
            the denoised signal, ``x``'s shape, identical on every rank.
        """
        from deepinv.distributed.framework.distributed_utils import DistributedParameterSync

        den, strat, dim = self.den, self.strategy, self.dim
        if den.current_shape != x.shape:
            den._init_shape_and_strategy(x.shape)
            den.current_shape = x.shape
        ctx = den.ctx
        processor = den.processor
        params = (
            [p for p in processor.parameters() if p.requires_grad] if isinstance(processor, torch.nn.Module) else []
        )
        grad_on = torch.is_grad_enabled()
        z: dict[int, torch.Tensor] = {}

        def z_chunk(k: int) -> torch.Tensor:
            if k not in z:
                g_pending.wait(k)
                lo, hi = self.bounds[k]
                zk = x.narrow(dim, lo, hi - lo) - gamma * g_chunks[k]
                if grad_on and params and ctx.use_dist:
                    zk = DistributedParameterSync.apply(zk, ctx, *params)
                z[k] = zk
            return z[k]

        meta = strat._metadata
        crop, target = meta["crop_slices"], meta["target_slices"]
        local = list(den.local_indices)
        by_chunk: list[list[int]] = [[] for _ in self.bounds]
        for i in local:
            row = int(target[i][dim].start)
            by_chunk[next(k for k, (lo, hi) in enumerate(self.bounds) if lo <= row < hi)].append(i)
        batch = den.max_batch_size or max(1, len(local))
        out_pending = Pending()
        bands = []
        for k, (lo, hi) in enumerate(self.bounds):
            band = torch.zeros((*x.shape[:dim], hi - lo, *x.shape[dim + 1 :]), device=x.device, dtype=x.dtype)
            tiles = by_chunk[k]
            for start in range(0, len(tiles), batch):
                group = tiles[start : start + batch]
                rows = [self.rows[i] for i in group]
                need = [c for c, (clo, chi) in enumerate(self.bounds)
                        if clo < max(r[1] for r in rows) and chi > min(r[0] for r in rows)]  # fmt: skip
                segment = torch.cat([z_chunk(c) for c in need], dim=dim) if len(need) > 1 else z_chunk(need[0])
                row0 = self.bounds[need[0]][0]
                windows = torch.cat([window(strat, i, segment, row0, self.indices[i]) for i in group], dim=0)
                result = self._process(windows, sigma, grad_on)
                per = windows.shape[0] // len(group)
                for j, i in enumerate(group):
                    t = list(target[i])
                    t[dim] = slice(int(t[dim].start) - lo, int(t[dim].stop) - lo)
                    band[tuple(t)] = result[j * per : (j + 1) * per][crop[i]]
            if grad_on:  # link every chunk of z to the output (zero): every rank joins the backward's collectives
                band = band + 0 * z_chunk(k).reshape(-1)[0]
            bands.append(IssueAllReduce.apply(band, out_pending, self.group))
        for k in range(len(self.bounds)):
            g_pending.wait(k)  # every gradient chunk is waited for before the step ends
        return Join.apply(dim, out_pending, self.group, *bands)

    def _process(self, windows: torch.Tensor, sigma: float, grad_on: bool) -> torch.Tensor:
        """The processor on one batch of windows (checkpointed in training as deepinv's ``auto`` does for
        several batches: memory only, same values)."""
        den = self.den
        if grad_on and den.checkpoint_batches != "never":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(
                lambda b: den.processor(b, sigma),
                windows,
                use_reentrant=den.checkpoint_use_reentrant,
                preserve_rng_state=den.checkpoint_preserve_rng_state,
            )
        return den.processor(windows, sigma)
