"""``solver.overlap=pipelined``: the banded, asynchronous gradient exchange and denoiser give the blocking path's
image, input gradient and weight gradients (1..5 ranks, 2D and 3D, inference and training)."""

from __future__ import annotations

import pytest
import torch

from pnpscale.rank.pipeline import band_bounds, chunk_bounds, reflect_index, window, window_rows
from tests.unrolled import Setting, assert_results_equal, cli_remedy_runs, tiling, unrolled_results

_SHAPES = [((1, 3, 20, 20), 8, 4), ((1, 3, 32, 32), 8, 4), ((1, 1, 12, 12, 12), 8, 4), ((1, 2, 19, 17), 5, 2)]


@pytest.mark.parametrize(("shape", "patch", "overlap"), _SHAPES)
def test_windows_equal_deepinvs_padded_slices(shape, patch, overlap):
    """Every tile's window cut from a band segment = deepinv's reflect-padded slice; bands tile the rows."""
    x = torch.randn(shape)
    s = tiling(shape, patch, overlap)
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


#: (overlap, chunks): the blocking path, then pipelined with one chunk per tile row, one chunk, two chunks
_VARIANTS = (("none", None), ("pipelined", None), ("pipelined", 1), ("pipelined", 2))


def _step(st: Setting, variant: tuple):
    """A PnP step with the rank's local gradient ``weights[r]·x``: blocking, or pipelined in ``chunks`` bands."""
    from pnpscale.rank.denoiser import tiled_denoiser
    from pnpscale.rank.pipeline import PipelinedStep

    overlap, chunks = variant
    den = tiled_denoiser(st.net, st.ctx, tiling(st.shape, st.patch, 4), collective="all_reduce", max_batch_size=2)
    pipe = PipelinedStep(den, chunks) if overlap == "pipelined" else None

    def step(x):
        g_local = st.weights[st.rank] * x
        if pipe is None:
            return den(x - 0.5 * st.ctx.all_reduce(g_local), 0.05)
        parts, pending = pipe.issue_gradient(g_local)
        return pipe.denoise(x, 0.5, parts, pending, 0.05)

    return step


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """Each world size's rank results (fork-started gloo ranks), keyed by world size."""
    return unrolled_results(tmp_path_factory, _step, {2: _VARIANTS, 3: _VARIANTS})


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dims", [2, 3])
def test_pipelined_equals_blocking(pipelined, world, dims):
    """Inference image, training image, weight gradients and input gradient: pipelined (one chunk per tile row,
    one chunk, two chunks) == the blocking path to 1e-6 on every rank, identical across ranks."""
    for mine in pipelined[world]:
        base = mine[(dims, "none", None)]
        for chunks in (None, 1, 2):
            assert_results_equal(mine[(dims, "pipelined", chunks)], base, (world, dims, chunks))
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

    runs = cli_remedy_runs(tmp_path, "overlap", ("none", "pipelined"))
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
