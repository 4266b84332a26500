"""``solver.gradient_collective=reduce_scatter``: the gradient reduce-scattered over the tiles' cores plus a halo
all_gather gives the blocking all_reduce path's image, input gradient and weight gradients (1..5 ranks, 2D and 3D,
inference and training, both reconciliations of the denoiser, both forms of the reduce-scatter)."""

from __future__ import annotations

import os

import pytest
import torch

from pnpscale.rank.gradient import window_layout
from pnpscale.rank.pipeline import window_indices
from tests.helpers import gloo_rank, rank_results, rel_error


def _strategy(shape, patch, overlap):
    from deepinv.distributed.strategies.distributed_strategies import TilingStrategy

    dims = len(shape) - 2
    return TilingStrategy(shape, tiling_dims=tuple(range(-dims, 0)), patch_size=patch, overlap=overlap)


_SHAPES = [((1, 3, 24, 24), 8, 4), ((1, 3, 20, 20), 8, 4), ((1, 1, 16, 16, 16), 8, 4), ((1, 2, 19, 17), 5, 2)]


@pytest.mark.parametrize(("shape", "patch", "overlap"), _SHAPES)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_layout_owns_every_pixel_once_and_holds_every_read_pixel(shape, patch, overlap, world):
    """Owned sets partition the signal; every pixel a rank's windows read is in its known set; a boundary pixel is
    read by a rank other than its owner (and only those are sent)."""
    s = _strategy(shape, patch, overlap)
    lay = window_layout(s, world)
    spatial = shape[2:]
    total = torch.zeros(spatial).numel()
    owned = torch.cat(lay.owned)
    assert len(owned) == total and len(torch.unique(owned)) == total
    reads = [torch.zeros(spatial, dtype=torch.bool) for _ in range(world)]
    for i in range(s.get_num_patches()):
        idx = [torch.arange(d) for d in spatial]
        for dim, ix in window_indices(s, i):
            idx[dim - 2] = ix
        reads[i % world][torch.meshgrid(*idx, indexing="ij")] = True
    for r in range(world):
        assert not (reads[r] & ~lay.known(r)).any(), r  # every read pixel is held
        others = torch.zeros(spatial, dtype=torch.bool)
        for q in range(world):
            if q != r:
                others |= reads[q]
        flat = (others & (lay.owner == r)).reshape(-1)
        assert torch.equal(torch.nonzero(flat).reshape(-1), lay.boundary[r]), r  # exactly what others read
        assert torch.equal(lay.owned[r][lay.boundary_pos[r]], lay.boundary[r])
    if world == 1:
        assert lay.halo == 0


def test_layout_without_overlap_has_no_boundaries():
    lay = window_layout(_strategy((1, 3, 24, 24), 8, 0), 3)
    assert lay.halo == 0 and not lay.read_by_other.any() and sum(len(o) for o in lay.owned) == 24 * 24


def test_layout_refuses_padding_as_large_as_the_signal():
    with pytest.raises(ValueError, match="problem.overlap=12: must be < the signal's size 12"):
        window_layout(_strategy((1, 1, 12, 12), 4, 12), 2)


#: (denoiser reconciliation, reduce-scatter form (None = the blocking all_reduce), tile overlap) per dims: every
#: form in 2D, and overlap 0 (no boundaries: no all_gather); the all_reduce denoiser's in 3D (the slow part)
_VARIANTS = {
    2: [(c, s, 4) for c in ("all_reduce", "all_gather") for s in (None, "reduce_scatter", "all_to_all")]
    + [("all_reduce", None, 0), ("all_reduce", "all_to_all", 0)],
    3: [("all_reduce", s, 4) for s in (None, "reduce_scatter", "all_to_all")],
}


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        _rank_body(rank, world, out_dir)


def _rank_body(rank: int, world: int, out_dir: str) -> None:
    from deepinv.distributed import DistributedContext
    from deepinv.models import DRUNet

    from pnpscale.rank.denoiser import tiled_denoiser
    from pnpscale.rank.gradient import WindowedGradient

    results = {}
    with DistributedContext(backend="gloo", cleanup=False, device_mode="cpu") as ctx:
        # 2D: 3x3 tiles of 8 (5 ranks: uneven); 3D: 2x2x2 tiles
        for dims, shape, patch in ((2, (1, 3, 24, 24), 8), (3, (1, 1, 16, 16, 16), 8)):
            g = torch.Generator().manual_seed(dims)
            x0 = torch.rand(shape, generator=g)
            target = torch.rand(shape, generator=g)
            weights = torch.rand((world, *shape), generator=g)  # rank r's local gradient: weights[r] * x
            for collective, scatter, overlap in _VARIANTS[dims]:
                torch.manual_seed(0)
                net = DRUNet(shape[1], shape[1], nc=(4, 8, 8, 8), nb=1, pretrained=None, device="cpu", dim=dims)
                strategy = _strategy(shape, patch, overlap)
                den = tiled_denoiser(net, ctx, strategy, collective=collective, max_batch_size=2)
                windowed = WindowedGradient(strategy, scatter) if scatter is not None else None

                def run(x, den=den, rank=rank, weights=weights, windowed=windowed):
                    g_local = weights[rank] * x * x  # nonlinear in x: the input gradient crosses the exchange
                    g = ctx.all_reduce(g_local) if windowed is None else windowed(g_local)
                    return den(x - 0.5 * g, 0.05)

                with torch.no_grad():
                    inference = run(run(x0.clone()))  # two PnP steps
                x = x0.clone().requires_grad_(True)
                out = run(run(x))  # training: two unrolled steps, gradients through the exchange
                ((out - target) ** 2).mean().backward()
                grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                results[(dims, collective, scatter, overlap)] = (inference, out.detach(), grads, x.grad.clone())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def scattered(tmp_path_factory):
    """Each world size's rank results (fork-started gloo ranks), keyed by world size."""
    return rank_results(_rank, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dims", [2, 3])
def test_reduce_scatter_equals_all_reduce(scattered, world, dims):
    """Inference image, training image, weight gradients and input gradient: the windowed exchange (reduce_scatter,
    all_to_all) == the blocking all_reduce to 1e-6 on every rank, with either denoiser reconciliation; ranks agree."""
    for mine in scattered[world]:
        for collective, scatter, overlap in _VARIANTS[dims]:
            base = mine[(dims, collective, None, overlap)]
            if scatter is not None:
                got = mine[(dims, collective, scatter, overlap)]
                for k, what in enumerate(("inference image", "training image", "weight gradients", "input gradient")):
                    assert rel_error(got[k], base[k]) <= 1e-6, (world, dims, collective, scatter, overlap, what)
            assert base[2].abs().sum() > 0 and base[3].abs().sum() > 0
    first = scattered[world][0][(dims, "all_reduce", "all_to_all", 4)]
    for mine in scattered[world][1:]:
        assert rel_error(mine[(dims, "all_reduce", "all_to_all", 4)][0], first[0]) <= 1e-6


@pytest.mark.slow
def test_cli_reduce_scatter_gives_the_blocking_image_and_logs_its_bytes(tmp_path):
    """``python -m pnpscale -m gpus=2 mode=inference,training solver.gradient_collective=all_reduce,reduce_scatter``:
    the same image (and training's losses and weight-gradient norms) to 1e-6 with deepinv's real data fidelity; the
    gradient section issues the blocks (all_to_all on gloo) and the boundaries' all_gather, both with their payload
    and flagged main, and the bytes per GPU are the model's."""
    import pandas as pd

    from pnpscale.rank.gradient import window_layout
    from tests.helpers import TINY_2D, read_run, run_cli, run_dirs

    proc = run_cli(
        "-m", "gpus=2", "mode=inference,training", "solver.gradient_collective=all_reduce,reduce_scatter", *TINY_2D,
        "output.save_reconstruction=true", "report=false", root=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(read_run(d)["mode"], read_run(d)["spec"]["gradient_collective"]): d for d in run_dirs(tmp_path)}
    assert set(runs) == {(m, g) for m in ("inference", "training") for g in ("all_reduce", "reduce_scatter")}
    for mode in ("inference", "training"):
        base, rs = runs[(mode, "all_reduce")], runs[(mode, "reduce_scatter")]
        assert "gradient_collective=reduce_scatter" in str(rs) and "gradient_collective=" not in str(base)
        a, b = torch.load(rs / "reconstruction.pt"), torch.load(base / "reconstruction.pt")
        assert rel_error(a, b) <= 1e-6, mode
        assert not read_run(rs).get("anomalies"), read_run(rs)["anomalies"]  # every payload matched its range
        if mode == "training":
            for key in ("losses", "grad_norms"):
                got, want = torch.tensor(read_run(rs)["solver"][key]), torch.tensor(read_run(base)["solver"][key])
                assert rel_error(got, want) <= 1e-6, key
    colls = pd.read_parquet(runs[("inference", "reduce_scatter")] / "collectives.parquet")
    per = colls[(colls["rank"] == 0) & (colls["iteration"] == 1) & (colls["section"] == "gradient")]
    main = per[per["main"]]
    lay = window_layout(_strategy((1, 3, 32, 32), 8, 4), 2)
    assert main["collective"].tolist() == ["all_to_all", "all_gather"]
    assert main["payload_bytes"].tolist() == [2 * 3 * lay.block * 4, 3 * lay.halo * 4]
    assert (per[~per["main"]]["payload_bytes"] < 3 * 32 * 32 * 4).all()  # deepinv's small collectives
