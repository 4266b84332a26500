"""``problem=ct``: interleaved angle blocks, exact split, a correct step-size bound, distributed gradient."""

from __future__ import annotations

import os

import pytest
import torch

from pnpscale.core.config import resolve_spec
from pnpscale.rank.problems import make_problem
from pnpscale.rank.problems.ct import angle_blocks
from pnpscale.sweep.cli import compose_config
from tests.helpers import free_port, gloo_rank

TINY_CT = ["problem=ct", "scale=tiny"]  # 32² image, 8 angle blocks, 8 px tiles + 4 overlap, DRUNet 4-8-8-8


def _spec(*overrides: str):
    return resolve_spec(compose_config([*TINY_CT, *overrides]), cuda_available=False)


def test_paper_and_small_presets():
    paper = resolve_spec(compose_config(["problem=ct", "scale=paper"]), cuda_available=False)
    assert (paper.sizes["image_size"], paper.sizes["num_operators"], paper.channels) == (1024, 64, 1)
    assert make_problem(paper).num_angles == 1024
    small = resolve_spec(compose_config(["problem=ct", "scale=small"]), cuda_available=False)
    assert (small.sizes["image_size"], small.sizes["num_operators"]) == (128, 16)
    train = resolve_spec(compose_config(["problem=ct", "scale=paper", "mode=training"]), cuda_available=False)
    assert (train.sizes["image_size"], train.sizes["num_operators"], train.sizes["unroll"]) == (512, 64, 2)


def test_blocks_interleave_and_cover_every_angle_once():
    blocks = angle_blocks(32, 8)
    assert sorted(i for b in blocks for i in b) == list(range(32)) and blocks[1] == [1, 9, 17, 25]


def test_split_is_exact_and_lipschitz_bounds_the_normal_operator():
    """Sum over blocks of A_i^T A_i (unnormalised) = the full scan's A^T A; with deepinv's per-block
    normalisation, the power-iteration norm of sum_i A_i^T A_i stays <= L = M (and close to it)."""
    from deepinv.physics import Tomography

    spec = _spec()
    problem = make_problem(spec)
    x = torch.rand(1, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    full = Tomography(angles=problem.angles_deg(), img_width=32, normalize=False)
    blocks = [Tomography(angles=problem.angles_deg()[b], img_width=32, normalize=False) for b in angle_blocks(32, 8)]
    split = sum(op.A_adjoint(op.A(x)) for op in blocks)
    whole = full.A_adjoint(full.A(x))
    assert torch.allclose(split, whole, rtol=1e-4, atol=1e-4 * whole.abs().max())
    ops = [problem.operator(i, torch.device("cpu")) for i in range(8)]
    v = torch.randn(1, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(60):
        v = sum(op.A_adjoint(op.A(v)) for op in ops)
        norm = v.norm()
        v = v / norm
    assert 0.5 * problem.lipschitz() < float(norm) <= problem.lipschitz() * 1.01


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        _rank_body(rank, out_dir)


def _rank_body(rank: int, out_dir: str) -> None:
    from deepinv.distributed import DistributedContext, distribute
    from deepinv.optim.data_fidelity import L2

    from pnpscale.rank.problems import measurements

    spec = _spec()
    with DistributedContext(backend="gloo", cleanup=False, device_mode="cpu") as ctx:
        data = make_problem(spec).build(ctx.device)
        physics = distribute(data.factory, ctx, num_operators=data.num_operators, type_object="linear_physics")
        fidelity = distribute(lambda i, d, kw: L2(), ctx, num_operators=data.num_operators, type_object="data_fidelity")
        y = measurements(data, physics.local_physics, physics.local_indexes, spec.noise_sigma, spec.seed)
        x = torch.rand(data.x_true.shape, generator=torch.Generator().manual_seed(3))
        grad = fidelity.grad(x, y, physics)
    torch.save({"grad": grad, "local": list(physics.local_indexes)}, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_distributed_gradient_equals_single_process(tmp_path):
    """deepinv's distributed data-fidelity gradient (sum over ranks of their angle blocks) on 3 gloo ranks
    equals the 1-process gradient over all blocks."""
    import torch.multiprocessing as mp

    out = {}
    for world in (1, 3):
        d = tmp_path / f"w{world}"
        d.mkdir()
        mp.start_processes(_rank, args=(world, free_port(), str(d)), nprocs=world, start_method="fork")
        out[world] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    assert [r["local"] for r in out[3]] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    single = out[1][0]["grad"]
    for r in out[3]:
        assert float((r["grad"] - single).norm() / single.norm()) < 1e-5


@pytest.mark.slow
def test_angle_blocks_keep_the_gradient_balanced_where_two_operators_cannot(tmp_path):
    """gpus=4: ct with 16 angle blocks (4 per rank) keeps the gradient balanced; 2d with 2 operators leaves
    two ranks without an operator: LB about 0.5 (the study's wall, and its remedy).

    ct's balance is judged on each rank's compute averaged over the measured iterations (``mean_r C_r /
    max_r C_r`` of the per-rank means: the assignment's LB, what the operator split decides); 2d's on
    the per-iteration LB of ``run.json`` (0.47..0.60 seen). The per-iteration LB also carries
    time-slice noise when 4 ranks share fewer cores (seen 0.70..0.93 for ct on 2 loaded cores), so
    there ct is only required to rank above 2d; with a core per rank it must reach 0.9 (0.85 for the
    per-rank means).
    """
    import pandas as pd

    from pnpscale import columns as K
    from pnpscale.core import layout
    from tests.helpers import TINY_2D, read_run, run_cli, run_dirs

    common = ["gpus=4", "iterations=5", "warmup=1", "report=false"]
    ct = ["problem=ct", "scale=small", "problem.num_operators=16", "problem.params.angles_per_pixel=2",
          "problem.patch_size=56", "problem.nc=[4,8,8,8]"]  # fmt: skip
    two_d = [o for o in TINY_2D if not o.startswith(("problem.num_operators", "iterations", "warmup"))]
    # 2d at 256² (tile window 64): each operator's gradient takes 10-20 ms on a CPU rank, well above the few
    # milliseconds of scheduling noise an idle rank shows on shared cores (at 32² both were 3-5 ms and a CI
    # run on 2 loaded cores saw an idle rank's mean above an operator rank's)
    two_d = [*two_d, "problem.num_operators=2", "problem.image_size=256", "problem.patch_size=56", "problem.overlap=4"]
    for overrides in (ct, two_d):
        proc = run_cli(*common, *overrides, root=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    lb, assigned, operators, busy = {}, {}, {}, {}
    for d in run_dirs(tmp_path):
        run = read_run(d)
        lb[run["problem"]] = run["metrics"]["sections"]["gradient"]["lb"]
        ranks = pd.read_parquet(d / layout.RANKS)
        g = ranks[(ranks[K.SECTION] == "gradient") & ~ranks[K.WARMUP]]
        per_rank = (g[K.SECTION_S] - g[K.COMM_S]).groupby(g[K.RANK]).mean()
        assigned[run["problem"]] = float(per_rank.mean() / per_rank.max())
        operators[run["problem"]] = run["assignment"]["operators_per_rank"]
        busy[run["problem"]] = per_rank.sort_index().tolist()
    enough_cores = len(os.sched_getaffinity(0)) >= 4
    # per-rank means also carry time-slice noise when 4 ranks share fewer cores (a CI run on 2 cores read 0.786
    # for ct against 0.532 for 2d): there ct must beat 2d clearly; with a core per rank it must reach 0.85
    assert assigned["ct"] >= (0.85 if enough_cores else assigned["2d"] + 0.15), (assigned, lb)
    assert operators["2d"] == [1, 1, 0, 0] and operators["ct"] == [4, 4, 4, 4], operators
    # 2d, per rank: the two ranks with an operator compute longer than the two without, whatever the load
    assert min(busy["2d"][:2]) > max(busy["2d"][2:]), busy
    # 2d: per iteration, the two ranks without an operator idle; their per-rank means are not used here
    # (on shared cores the idle ranks' scheduling delays land in their compute and smooth the means: a CI
    # run on 2 loaded cores read 0.706, so the study's 0.5 is only required with a core per rank)
    assert 0.35 <= lb["2d"] <= (0.7 if enough_cores else 0.85), (assigned, lb)
    assert lb["ct"] >= (0.9 if enough_cores else lb["2d"] + 0.1), (lb, f"{len(os.sched_getaffinity(0))} cores")
