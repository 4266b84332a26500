"""``solver.gradient_collective=reduce_scatter``: the gradient reduce-scattered over the tiles' cores plus a halo
all_gather gives the blocking all_reduce path's image, input gradient and weight gradients (1..5 ranks, 2D and 3D,
inference and training, both reconciliations of the denoiser, both forms of the reduce-scatter)."""

from __future__ import annotations

import pytest
import torch

from pnpscale.rank.gradient import window_layout
from pnpscale.rank.pipeline import window_indices
from tests.helpers import rel_error
from tests.unrolled import Setting, assert_results_equal, cli_remedy_runs, tiling, unrolled_results

_SHAPES = [((1, 3, 24, 24), 8, 4), ((1, 3, 20, 20), 8, 4), ((1, 1, 16, 16, 16), 8, 4), ((1, 2, 19, 17), 5, 2)]


@pytest.mark.parametrize(("shape", "patch", "overlap"), _SHAPES)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_layout_owns_every_pixel_once_and_holds_every_read_pixel(shape, patch, overlap, world):
    """Owned sets partition the signal; every pixel a rank's windows read is in its known set; a boundary pixel is
    read by a rank other than its owner (and only those are sent)."""
    s = tiling(shape, patch, overlap)
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
    lay = window_layout(tiling((1, 3, 24, 24), 8, 0), 3)
    assert lay.halo == 0 and not lay.read_by_other.any() and sum(len(o) for o in lay.owned) == 24 * 24


def test_layout_refuses_padding_as_large_as_the_signal():
    with pytest.raises(ValueError, match="problem.overlap=12: must be < the signal's size 12"):
        window_layout(tiling((1, 1, 12, 12), 4, 12), 2)


#: (denoiser reconciliation, reduce-scatter form (None = the blocking all_reduce), tile overlap) per dims: every
#: form in 2D, and overlap 0 (no boundaries: no all_gather); the all_reduce denoiser's in 3D (the slow part)
_VARIANTS = {
    2: [(c, s, 4) for c in ("all_reduce", "all_gather") for s in (None, "reduce_scatter", "all_to_all")]
    + [("all_reduce", None, 0), ("all_reduce", "all_to_all", 0)],
    3: [("all_reduce", s, 4) for s in (None, "reduce_scatter", "all_to_all")],
}


def _step(st: Setting, variant: tuple):
    """A PnP step with the rank's local gradient ``weights[r]·x²`` (nonlinear in x: the input gradient crosses
    the exchange), summed by deepinv's all_reduce (``scatter`` None) or the windowed exchange."""
    from pnpscale.rank.denoiser import tiled_denoiser
    from pnpscale.rank.gradient import WindowedGradient

    collective, scatter, overlap = variant
    strategy = tiling(st.shape, st.patch, overlap)
    den = tiled_denoiser(st.net, st.ctx, strategy, collective=collective, max_batch_size=2)
    windowed = WindowedGradient(strategy, scatter) if scatter is not None else None

    def step(x):
        g_local = st.weights[st.rank] * x * x
        g = st.ctx.all_reduce(g_local) if windowed is None else windowed(g_local)
        return den(x - 0.5 * g, 0.05)

    return step


@pytest.fixture(scope="module")
def scattered(tmp_path_factory):
    """Each world size's rank results (fork-started gloo ranks), keyed by world size."""
    return unrolled_results(tmp_path_factory, _step, _VARIANTS)


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
                assert_results_equal(got, base, (world, dims, collective, scatter, overlap))
    first = scattered[world][0][(dims, "all_reduce", "all_to_all", 4)]
    for mine in scattered[world][1:]:
        assert rel_error(mine[(dims, "all_reduce", "all_to_all", 4)][0], first[0]) <= 1e-6


@pytest.mark.slow
def test_cli_reduce_scatter_gives_the_blocking_image_and_logs_its_bytes(tmp_path):
    """``python -m pnpscale -m gpus=2 mode=inference,training solver.gradient_collective=all_reduce,reduce_scatter``:
    the same image (and training's losses and weight-gradient norms) to 1e-6 with deepinv's real data fidelity; the
    gradient section issues the blocks (all_to_all on gloo) and the boundaries' all_gather, both with their payload
    and flagged main; training's backward issues their adjoint (the boundaries' all_to_all, then the cores'
    all_gather, flagged main) in place of the gradient's image-sized all_reduces."""
    import pandas as pd

    from pnpscale.rank.gradient import window_layout
    from tests.helpers import read_run

    runs = cli_remedy_runs(tmp_path, "gradient_collective", ("all_reduce", "reduce_scatter"), "report=false")
    for mode in ("inference", "training"):
        assert not read_run(runs[(mode, "reduce_scatter")]).get("anomalies")  # every payload matched its range
    lay = window_layout(tiling((1, 3, 32, 32), 8, 4), 2)
    image, blocks, cores = 3 * 32 * 32 * 4, 2 * 3 * lay.block * 4, 3 * lay.block * 4
    boundaries, halo = 2 * 3 * lay.halo * 4, 3 * lay.halo * 4

    def rank0(mode, value, section):
        colls = pd.read_parquet(runs[(mode, value)] / "collectives.parquet")
        return colls[(colls["rank"] == 0) & (colls["iteration"] == 1) & (colls["section"] == section)]

    per = rank0("inference", "reduce_scatter", "gradient")
    main = per[per["main"]]
    assert main["collective"].tolist() == ["all_to_all", "all_gather"]
    assert main["payload_bytes"].tolist() == [blocks, halo]
    assert (per[~per["main"]]["payload_bytes"] < image).all()  # deepinv's small collectives
    fwd = rank0("training", "reduce_scatter", "forward")
    pairs = fwd[fwd["collective"].isin(["all_to_all", "all_gather"])]
    unrolled = len(pairs) // 2
    assert unrolled >= 2 and pairs["payload_bytes"].tolist() == [blocks, halo] * unrolled and pairs["main"].all()
    bwd, ref = rank0("training", "reduce_scatter", "backward"), rank0("training", "all_reduce", "backward")
    adjoint = bwd[bwd["collective"].isin(["all_to_all", "all_gather"])]
    # every unrolled step but the first, whose gradient is of the back-projection (no weight reaches it)
    assert adjoint["payload_bytes"].tolist() == [boundaries, cores] * (unrolled - 1) and adjoint["main"].all()

    def image_all_reduces(rows):
        return int(((rows["collective"] == "all_reduce") & (rows["payload_bytes"] == image)).sum())

    assert image_all_reduces(bwd) == image_all_reduces(ref) - (unrolled - 1)  # the gradient's all_reduces are gone


# --- the NCCL path on a CPU: ranks as threads of one process behind torch.distributed's own names -------------


class _ThreadRanks:
    """``n`` ranks as threads of this process: torch.distributed's single-tensor collectives over shared buffers
    and a barrier, with ProcessGroupNCCL's preconditions (``_reduce_scatter_base``: "input tensor must be the
    same size as output size times world size"; contiguous tensors of one dtype). ``calls`` lists
    ``(rank, name, output shape, input shape)``."""

    def __init__(self, n: int, backend: str) -> None:
        import threading

        self.n, self.backend = n, backend
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n
        self.calls: list = []
        self.local = threading.local()

    def _exchange(self, name, output, input):
        r = self.local.rank
        assert output.is_contiguous() and input.is_contiguous() and output.dtype == input.dtype, name
        self.calls.append((r, name, tuple(output.shape), tuple(input.shape)))
        self.slots[r] = input.detach().clone().reshape(-1)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return r, got

    def reduce_scatter_single(self, output, input, op=None, group=None, async_op=False):
        assert input.numel() == output.numel() * self.n, "input must be output x world size"
        r, got = self._exchange("reduce_scatter_single", output, input)
        k = output.numel()
        output.view(-1).copy_(sum(g[r * k : (r + 1) * k] for g in got))

    def all_gather_single(self, output, input, group=None, async_op=False):
        assert output.numel() == input.numel() * self.n, "output must be input x world size"
        _, got = self._exchange("all_gather_single", output, input)
        output.view(-1).copy_(torch.cat(got))

    def all_to_all_single(self, output, input, group=None, async_op=False):
        assert output.numel() == input.numel() and input.numel() % self.n == 0
        r, got = self._exchange("all_to_all_single", output, input)
        k = input.numel() // self.n
        output.view(-1).copy_(torch.cat([g[r * k : (r + 1) * k] for g in got]))

    def get_backend(self, group=None):
        return self.backend

    def run(self, fn):
        """``[fn(rank) for rank]``, each on its own thread (exceptions re-raised)."""
        import threading

        out, errors = [None] * self.n, []

        def body(r):
            self.local.rank = r
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return out


@pytest.fixture
def thread_ranks(monkeypatch):
    """A factory of :class:`_ThreadRanks` installed as ``torch.distributed``'s functions (and c10d's), so that
    pnpscale's code and :class:`CollectiveLog` see them under torch's names. ``single=False``: a torch without
    the ``*_single`` names (< 2.14): ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` only."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def make(n: int, backend: str, single: bool = True) -> _ThreadRanks:
        fake = _ThreadRanks(n, backend)
        fns = {
            "reduce_scatter_tensor": fake.reduce_scatter_single,
            "all_gather_into_tensor": fake.all_gather_single,
            "all_to_all_single": fake.all_to_all_single,
            "get_backend": fake.get_backend,
        }
        for module in (dist, c10d):
            for name, fn in fns.items():
                monkeypatch.setattr(module, name, fn)
            for name, fn in (("reduce_scatter_single", fake.reduce_scatter_single),
                             ("all_gather_single", fake.all_gather_single)):  # fmt: skip
                if single:
                    monkeypatch.setattr(module, name, fn)
                else:
                    monkeypatch.delattr(module, name, raising=False)
        return fake

    return make


@pytest.mark.parametrize(("shape", "patch", "overlap"), [((1, 3, 24, 24), 8, 4), ((1, 1, 16, 16, 16), 8, 4)])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize(("backend", "single"), [("nccl", True), ("nccl", False), ("gloo", True)])
def test_windowed_exchange_and_its_adjoint_on_thread_ranks(thread_ranks, shape, patch, overlap, world, backend, single):
    """The NCCL branch picks the single-tensor reduce_scatter (``(n, bc, L)`` in, ``(1, bc, L)`` out) and the
    boundaries' all_gather; gloo's the all_to_all; the forward gives ``Σ g`` on each rank's known set, the
    backward (the adjoint: a reduce-scatter of the boundaries, then an all_gather of the cores, never an
    all_reduce) ``Σ_r M_r ⊙ h_r``; ``<forward(g), h> = <g, adjoint(h)>`` summed over ranks; CollectiveLog logs
    every call with its payload, whose bytes per GPU under the ring model are ``(S + H)·(n−1)/n`` both ways."""
    from pnpscale.rank.gradient import pick_scatter, windowed_sum, windowed_sum_adjoint
    from pnpscale.rank.profiling import CollectiveLog
    from pnpscale.results.transfer import bytes_per_gpu, nccl_tests_size

    ranks = thread_ranks(world, backend, single)
    lay = window_layout(tiling(shape, patch, overlap), world)
    scatter = pick_scatter()
    assert scatter == ("reduce_scatter" if backend == "nccl" else "all_to_all")
    gen = torch.Generator().manual_seed(world)
    g = torch.rand((world, *shape), generator=gen, dtype=torch.float64)
    h = torch.rand((world, *shape), generator=gen, dtype=torch.float64)
    with CollectiveLog() as log:
        fwd = ranks.run(lambda r: windowed_sum(g[r], lay, r, scatter))
        bwd = ranks.run(lambda r: windowed_sum_adjoint(h[r], lay, r, scatter))
    masks = [lay.known(r).expand(shape) for r in range(world)]
    for r in range(world):
        assert torch.allclose(fwd[r], torch.where(masks[r], g.sum(0), 0.0), rtol=1e-12, atol=0), r
        assert torch.allclose(bwd[r], sum(m * h[q] for q, m in enumerate(masks)), rtol=1e-12, atol=0), r
    lhs = sum((fwd[r] * h[r]).sum() for r in range(world))
    assert torch.isclose(lhs, sum((g[r] * bwd[r]).sum() for r in range(world)), rtol=1e-12)
    bc, L, halo = shape[0] * shape[1], lay.block, lay.halo
    rs = "reduce_scatter_single" if backend == "nccl" else "all_to_all_single"  # the fake's name for either alias
    ag = "all_gather_single"

    def scattered(m):  # (output, input) shapes of the reduce-scatter of n blocks of m pixels
        return (1 if backend == "nccl" else world, bc, m), (world, bc, m)  # all_to_all: n blocks back

    want = [(rs, *scattered(L)), (ag, (world, bc, halo), (1, bc, halo))]  # forward
    want += [(rs, *scattered(halo)), (ag, (world, bc, L), (1, bc, L))]  # backward: the same, transposed
    for r in range(world):
        assert [c[1:] for c in ranks.calls if c[0] == r] == want, r
    kind = "reduce_scatter" if backend == "nccl" else "all_to_all"
    item = g.element_size()
    logged = sorted(log.calls)
    assert logged == sorted([(kind, world * bc * L * item), ("all_gather", bc * halo * item),
                             (kind, world * bc * halo * item), ("all_gather", bc * L * item)] * world)  # fmt: skip

    def ring(coll, payload):  # bytes per GPU of a logged payload: nccl-tests' size, then the ring model
        return bytes_per_gpu(coll, nccl_tests_size(coll, payload, world), world, 1, "ring")

    moved = {
        d: ring(kind, world * bc * m1 * item) + ring("all_gather", bc * m2 * item)
        for d, (m1, m2) in {"forward": (L, halo), "backward": (halo, L)}.items()
    }
    assert moved["forward"] == moved["backward"] == (world * L + world * halo) * bc * item * (world - 1) / world


@pytest.mark.parametrize(
    "name", ["nccl:_reduce_scatter_base", "nccl:_all_gather_base", "nccl:all_to_all", "gloo:all_to_all"]
)
def test_the_windowed_exchanges_ranges_are_typed_and_sized_as_their_calls(name):
    """ProcessGroupNCCL's ``_reduce_scatter_base`` / ``reduce_scatter_single`` (which ``reduce_scatter_tensor``
    and ``reduce_scatter_single`` reach) records the range ``nccl:_reduce_scatter_base`` and a
    ``record_param_comms`` whose ``In msg nelems`` is the output's numel x world size = the input's; the
    all_gather ``nccl:_all_gather_base``, ``In msg nelems`` one rank's input: pnpscale's Kineto reader types them
    as the logged calls and reads the logged payload from either the descriptor or the range's first input."""
    from pnpscale.analysis.kineto import collective_type, comm_fields

    coll = {"nccl:_reduce_scatter_base": "reduce_scatter", "nccl:_all_gather_base": "all_gather"}.get(
        name, "all_to_all"
    )
    descriptor = {"reduce_scatter": ["_reduce_scatter_base", "reduce_scatter_single"],
                  "all_gather": ["_allgather_base", "all_gather_into_tensor"],
                  "all_to_all": ["all_to_all", "all_to_allv"]}[coll]  # fmt: skip
    n, bc, m = 4, 3, 50
    # the input each call passes: (n, bc, m) for the scatters, (1, bc, m) for the all_gather
    nelems = (1 if coll == "all_gather" else n) * bc * m
    assert collective_type(name) == coll
    for col in descriptor:
        got = comm_fields("record_param_comms", {"Collective name": col, "In msg nelems": nelems, "dtype": "Float"})
        assert (got["collective"], got["payload_bytes"]) == (coll, nelems * 4), col
    dims = [[1 if coll == "all_gather" else n, bc, m], [n if coll == "all_gather" else 1, bc, m]]
    got = comm_fields(name, {"Input Dims": dims, "Input type": ["float", "float"]})
    assert (got["collective"], got["payload_bytes"]) == (coll, nelems * 4)


def test_installed_torch_records_the_names_pnpscale_types():
    """The installed torch (2.14.1): ``libtorch_cuda.so`` holds ProcessGroupNCCL's profiling titles
    ``nccl:_reduce_scatter_base`` and ``nccl:_all_gather_base`` (no other title for a single-tensor reduce-scatter
    or all_gather), ``libtorch_cpu.so`` the c10d op ``c10d::_reduce_scatter_base_``; its
    ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` are deprecated aliases of the ``*_single`` calls, which
    CollectiveLog wraps too (a call through the alias counts once: the innermost). Before them (torch 2.x up to
    2.13, ``distributed_c10d.py``) ``reduce_scatter_tensor`` called the group's ``_reduce_scatter_base``, whose
    ProcessGroupNCCL title is the same ``nccl:_reduce_scatter_base`` (``ProcessGroupNCCL.cpp``)."""
    import inspect
    import mmap
    import re
    from pathlib import Path

    import torch.distributed.distributed_c10d as c10d

    from pnpscale.rank.profiling import COLLECTIVE_CALLS

    lib = Path(torch.__file__).parent / "lib"
    cuda, cpu = lib / "libtorch_cuda.so", lib / "libtorch_cpu.so"
    if not cuda.exists() or not cpu.exists():
        pytest.skip(f"{lib}: no libtorch_cuda.so/libtorch_cpu.so (a CPU-only torch build)")
    with open(cuda, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        # ProcessGroupNCCL's titles lie together in .rodata: read the NUL-ended "nccl:*" strings within 1 MiB
        # of the first (a scan of the whole 500 MB library takes seconds)
        start = m.find(b"nccl:")
        window = m[start : start + (1 << 20)]
    titles = set(re.findall(rb"nccl:[A-Za-z_]*(?:reduce_scatter|all_gather)[A-Za-z_]*(?=\0)", window))
    assert {b"nccl:_reduce_scatter_base", b"nccl:_all_gather_base"} <= titles
    assert {t for t in titles if b"coalesced" not in t} == {
        b"nccl:_reduce_scatter_base", b"nccl:_all_gather_base", b"nccl:reduce_scatter", b"nccl:all_gather"
    }  # fmt: skip
    with open(cpu, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m.find(b"c10d::_reduce_scatter_base_\0") != -1
    for alias, single in (("reduce_scatter_tensor", "reduce_scatter_single"),
                          ("all_gather_into_tensor", "all_gather_single")):  # fmt: skip
        if hasattr(c10d, single):
            assert f"return {single}(" in inspect.getsource(getattr(c10d, alias)), alias
            assert (
                COLLECTIVE_CALLS[single]
                == COLLECTIVE_CALLS[alias]
                == (1, "input" if "reduce" in alias else "input_tensor")
            )


def test_uneven_all_to_all_bytes_of_the_benchmark():
    """``benchmarks/windowed_bytes.py`` (README's table): on 2 ranks the uneven all_to_all sends what the
    all_gather sends (the other rank reads every boundary pixel); on more, at most the windowed exchange's bytes
    and more than the cores' reduce-scatter's; everything below the all_reduce's."""
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("windowed_bytes", ROOT / "benchmarks" / "windowed_bytes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    two = bench.exchange_pixels(64, 16, 2, 2)  # 4x4 tiles, an overlap an eighth of the tile (the study's)
    assert two["uneven_max"] == two["uneven_mean"] == two["windowed"] < two["all_reduce"]
    for world in (3, 4, 5):
        px = bench.exchange_pixels(64, 16, 2, world)
        lay = window_layout(tiling((1, 1, 64, 64), 16, 2), world)
        cores = world * lay.block * (world - 1) / world
        assert cores < px["uneven_mean"] <= px["uneven_max"] < px["windowed"] < px["all_reduce"], world
