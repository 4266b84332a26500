"""``solver.overlap=pipelined``: the banded, asynchronous gradient exchange and denoiser give the blocking path's
image, input gradient and weight gradients (1..5 ranks, 2D and 3D, inference and training)."""

from __future__ import annotations

import os

import pytest
import torch

from pnpscale.rank.pipeline import band_bounds, chunk_bounds, reflect_index, window, window_rows
from tests.helpers import gloo_rank, rank_results, rel_error


def _strategy(shape, patch, overlap):
    from deepinv.distributed.strategies.distributed_strategies import TilingStrategy

    dims = len(shape) - 2
    return TilingStrategy(shape, tiling_dims=tuple(range(-dims, 0)), patch_size=patch, overlap=overlap)


_SHAPES = [((1, 3, 20, 20), 8, 4), ((1, 3, 32, 32), 8, 4), ((1, 1, 12, 12, 12), 8, 4), ((1, 2, 19, 17), 5, 2)]


@pytest.mark.parametrize(("shape", "patch", "overlap"), _SHAPES)
def test_windows_equal_deepinvs_padded_slices(shape, patch, overlap):
    """Every tile's window cut from a band segment = deepinv's reflect-padded slice; bands tile the rows."""
    x = torch.randn(shape)
    s = _strategy(shape, patch, overlap)
    bands = band_bounds(s)
    assert bands[0][0] == 0 and bands[-1][1] == shape[2]
    assert all(a[1] == b[0] for a, b in zip(bands, bands[1:], strict=False))
    padded = dict(s.get_local_patches(x, list(range(s.get_num_patches()))))
    for i, ref in padded.items():
        lo, hi = window_rows(s, i)
        assert torch.equal(window(s, i, x[:, :, lo:hi], lo), ref), i
    for k in range(1, len(bands) + 1):
        cb = chunk_bounds(bands, k)
        assert len(cb) == k and cb[0][0] == 0 and cb[-1][1] == shape[2]


def test_reflect_index_is_torch_reflect():
    v = torch.arange(7.0).view(1, 1, 7)
    ref = torch.nn.functional.pad(v, (3, 3), mode="reflect")[0, 0]
    assert torch.equal(v[0, 0, reflect_index(0, 13, 3, 7)], ref)


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        _rank_body(rank, world, out_dir)


def _rank_body(rank: int, world: int, out_dir: str) -> None:
    from deepinv.distributed import DistributedContext
    from deepinv.models import DRUNet

    from pnpscale.rank.denoiser import tiled_denoiser
    from pnpscale.rank.pipeline import PipelinedStep

    results = {}
    with DistributedContext(backend="gloo", cleanup=False, device_mode="cpu") as ctx:
        # 2D: 3x3 tiles of 8 (5 ranks: uneven); 3D: 2x2x2 tiles
        for dims, shape, patch in ((2, (1, 3, 24, 24), 8), (3, (1, 1, 16, 16, 16), 8)):
            g = torch.Generator().manual_seed(dims)
            x0 = torch.rand(shape, generator=g)
            target = torch.rand(shape, generator=g)
            weights = torch.rand((world, *shape), generator=g)  # rank r's local gradient: weights[r] * x
            for overlap, chunks in (("none", None), ("pipelined", None), ("pipelined", 1), ("pipelined", 2)):
                torch.manual_seed(0)
                net = DRUNet(shape[1], shape[1], nc=(4, 8, 8, 8), nb=1, pretrained=None, device="cpu", dim=dims)
                den = tiled_denoiser(net, ctx, _strategy(shape, patch, 4), collective="all_reduce", max_batch_size=2)
                step = PipelinedStep(den, chunks) if overlap == "pipelined" else None

                def run(x, step=step, den=den, rank=rank, weights=weights):
                    g_local = weights[rank] * x
                    if step is None:
                        return den(x - 0.5 * ctx.all_reduce(g_local), 0.05)
                    parts, pending = step.issue_gradient(g_local)
                    return step.denoise(x, 0.5, parts, pending, 0.05)

                with torch.no_grad():
                    inference = run(run(x0.clone()))  # two PnP steps
                x = x0.clone().requires_grad_(True)
                out = run(run(x))  # training: two unrolled steps, gradients through the async exchanges
                ((out - target) ** 2).mean().backward()
                grads = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                results[(dims, overlap, chunks)] = (inference, out.detach(), grads, x.grad.clone())
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """Each world size's rank results (fork-started gloo ranks), keyed by world size."""
    return rank_results(_rank, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dims", [2, 3])
def test_pipelined_equals_blocking(pipelined, world, dims):
    """Inference image, training image, weight gradients and input gradient: pipelined (one chunk per tile row,
    one chunk, two chunks) == the blocking path to 1e-6 on every rank, identical across ranks."""
    for mine in pipelined[world]:
        base = mine[(dims, "none", None)]
        for chunks in (None, 1, 2):
            got = mine[(dims, "pipelined", chunks)]
            for k, what in enumerate(("inference image", "training image", "weight gradients", "input gradient")):
                assert rel_error(got[k], base[k]) <= 1e-6, (world, dims, chunks, what)
        assert base[2].abs().sum() > 0 and base[3].abs().sum() > 0
    first = pipelined[world][0][(dims, "pipelined", None)]
    for mine in pipelined[world][1:]:
        assert torch.equal(mine[(dims, "pipelined", None)][0], first[0])


@pytest.mark.slow
def test_cli_pipelined_gives_the_blocking_image_and_the_report_compares_them(tmp_path):
    """``python -m pnpscale -m gpus=2 mode=inference,training solver.overlap=none,pipelined``: the same image (and
    training's losses and weight-gradient norms) to 1e-6; the band chunks are issued in the denoiser section; the
    report compares exposed transfer and hidden time side by side."""
    import json

    import pandas as pd

    from tests.helpers import TINY_2D, read_run, run_cli, run_dirs

    proc = run_cli(
        "-m", "gpus=2", "mode=inference,training", "solver.overlap=none,pipelined", *TINY_2D,
        "output.save_reconstruction=true", root=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {(read_run(d)["mode"], read_run(d)["spec"]["overlap"]): d for d in run_dirs(tmp_path)}
    assert set(runs) == {(m, o) for m in ("inference", "training") for o in ("none", "pipelined")}
    for mode in ("inference", "training"):
        base, pipe = runs[(mode, "none")], runs[(mode, "pipelined")]
        assert "overlap=pipelined" in str(pipe) and "overlap=" not in str(base)
        a, b = torch.load(pipe / "reconstruction.pt"), torch.load(base / "reconstruction.pt")
        assert rel_error(a, b) <= 1e-6, mode
        if mode == "training":
            for key in ("losses", "grad_norms"):
                got, want = torch.tensor(read_run(pipe)["solver"][key]), torch.tensor(read_run(base)["solver"][key])
                assert rel_error(got, want) <= 1e-6, key
    colls = pd.read_parquet(runs[("inference", "pipelined")] / "collectives.parquet")
    per = colls[(colls["rank"] == 0) & (colls["iteration"] == 1)]
    image = 3 * 32 * 32 * 4
    den = per[(per["section"] == "denoiser") & (per["collective"] == "all_reduce")]
    assert len(den) == 2 * 4 and den["payload_bytes"].sum() == 2 * image  # 4 tile rows: 4 gradient + 4 output bands
    assert den["main"].all()  # the bands carry the image together
    grad = per[per["section"] == "gradient"]
    assert (grad["payload_bytes"] < image).all()  # the gradient section keeps only deepinv's small collectives
    report = next((tmp_path / "outputs").glob("*/report"))
    readme = (report / "README.md").read_text()
    assert "## Side by side: overlap" in readme and "hidden s" in readme and "exposed transfer s" in readme
    cmp = pd.read_parquet(report / "compare.parquet")
    assert {"hidden_s", "hidden_share", "transfer_s"} <= set(cmp.columns)
    inf = cmp[(cmp["mode"] == "inference")].set_index("series")
    assert inf.loc["2d overlap=none", "hidden_s"] == 0  # blocking: nothing in flight while computing
    assert json.loads((runs[("inference", "pipelined")] / "run.json").read_text())["spec"]["overlap_chunks"] is None
    # the bands' collectives are in flight together: their hidden slices spread over threads that each nest,
    # and every trace keeps the Trace Event Format and Perfetto importer's rules (tests/trace_event_format.py)
    from tests.trace_event_format import check_trace

    for d in runs.values():
        assert check_trace((d / "timeline.json").read_text(encoding="utf-8"))[1] == [], d
