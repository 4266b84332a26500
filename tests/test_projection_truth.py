"""The projection against generated sweeps with a known truth at 64 GPUs (issue 32's "done when").

The sweeps come from ``benchmarks/projection_study.py``'s generator (the study's mechanism: V100s, 4 per
node, its routes, rates, operators and tiles; seeded, pure): the clean study sweep, and the noisy one
(:data:`NOISY`: 3.5 % per-rank noise, ±3 % per iteration, node 1 8 % slow). Nothing here is measured. The
truth at 64 is the generator's own 64-GPU point (another seed, 200 iterations); each projection is fitted on
the points up to 8 GPUs (up to 16 where said) with the ring rate given, as the issue asks.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.results.projection import samples as ps_samples
from pnpscale.results.projection.base import NodeSizeUnknown
from pnpscale.results.projection.model import RING, Options, evaluate, fit, project

_SPEC = importlib.util.spec_from_file_location(
    "projection_study", Path(__file__).parent.parent / "benchmarks" / "projection_study.py"
)
study = importlib.util.module_from_spec(_SPEC)  # type: ignore[arg-type]
sys.modules.setdefault("projection_study", study)  # its dataclasses look their module up
_SPEC.loader.exec_module(study)  # type: ignore[union-attr]

CONFIGS = study.configs()


def truth_at_64(name: str, noise) -> float:
    """The generator's own time per iteration at 64 GPUs (200 iterations, a seed no fit saw)."""
    rows, _ = study.generate(CONFIGS[name], 200, 1000, noise, gpus=(64,))
    return float(rows[K.SECTION_S].sum())


def projected_at_64(name: str, noise, iterations: int, seed: int = 0, bootstrap: int = 100) -> pd.Series:
    """The projection at 64 (section ``all``) from the generated points up to 8 GPUs, the ring rate given."""
    rows, samples = study.generate(CONFIGS[name], iterations, seed, noise)
    keep = rows[K.GPUS] <= 8
    options = Options(rates={RING: 10.5}, bootstrap=bootstrap)
    p = project(rows[keep], [64], options, samples=samples[samples[K.GPUS] <= 8])
    assert not p.skipped, p.skipped
    t = p.table
    return t[(t[K.GPUS] == 64) & (t[K.SECTION] == "all") & ~t[K.MEASURED]].iloc[0]


def done(row: pd.Series, truth: float) -> bool:
    """The issue's criterion: within 10 % of the truth, or the truth inside the band and the band no wider
    than ±15 % of the projection."""
    point, lo, hi = row[K.SECTION_S], row["section_s_lo"], row["section_s_hi"]
    within = abs(point / truth - 1) <= 0.10
    banded = bool(lo <= truth <= hi) and max(hi / point - 1, 1 - lo / point) <= 0.15
    return within or banded


@pytest.fixture(scope="module")
def cases() -> dict[str, tuple[pd.Series, float]]:
    """The issue's three sweeps, fitted on 1..8 with the ring rate given: (the row at 64, the truth)."""
    return {
        # the issue: +16 % at 5 iterations (a fitted backward per-operator term 1.971 s, true 0.03 s)
        "3d training clean, 5 iterations": (projected_at_64("3d training", study.Noise(), 5),
                                            truth_at_64("3d training", study.Noise())),
        # the issue: +26 % (2D training) and +10 % (2D inference), the slow node absorbed in the fixed term
        "2d training noisy": (projected_at_64("2d training", study.NOISY, 200),
                              truth_at_64("2d training", study.NOISY)),
        "2d inference noisy": (projected_at_64("2d inference", study.NOISY, 200),
                               truth_at_64("2d inference", study.NOISY)),
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", ["3d training clean, 5 iterations", "2d training noisy", "2d inference noisy"])
def test_time_per_iteration_at_64_within_10_percent_or_inside_a_tight_band(cases, case):
    row, truth = cases[case]
    assert done(row, truth), (case, row[K.SECTION_S], truth, row["section_s_lo"], row["section_s_hi"])
    # measured: 3d training +3.9 %, 2d training −3.4 %, 2d inference −0.1 % (seed 0); the point lies in its band
    assert abs(row[K.SECTION_S] / truth - 1) <= 0.10
    assert row["section_s_lo"] <= row[K.SECTION_S] <= row["section_s_hi"]
    for col in ("scaled_cost", "comm_e", "pe"):
        assert row[f"{col}_lo"] <= row[col] <= row[f"{col}_hi"], col


@pytest.mark.slow
def test_noisy_sweeps_hold_over_seeds_and_few_iterations():
    """Two more seeds at 20 iterations (the jitter warning's threshold): every one within 10 % (measured over
    seeds 0..5: 2d training −4.2…+0.5 %, 2d inference −0.3…+1.8 %)."""
    for name in ("2d training", "2d inference"):
        truth = truth_at_64(name, study.NOISY)
        for seed in (1, 2):
            row = projected_at_64(name, study.NOISY, 20, seed, bootstrap=0)
            assert abs(row[K.SECTION_S] / truth - 1) <= 0.10, (name, seed, row[K.SECTION_S], truth)


@pytest.mark.slow
def test_one_node_sweep_without_a_node_size_is_refused_naming_the_fix():
    """1, 2, 4 GPUs on one node, no node size: a 64-GPU node was assumed (scaled cost −38 %); now refused."""
    rows, samples = study.generate(CONFIGS["2d inference"], 20, 0, study.Noise(), gpus=(1, 2, 4))
    rows[K.NODES] = 1
    p = project(rows, [8, 64], Options(bootstrap=0), samples=samples)
    why = p.skipped[("2d", "inference")]
    assert "bigger than any measured one, is not assumed" in why and "--gpus-per-node G" in why
    assert "--rate ring=GBps" in why and not p.findings
    model = fit(rows, Options(bootstrap=0), samples)
    with pytest.raises(NodeSizeUnknown):
        evaluate(model, [8])
    assert len(evaluate(model, [3, 4])) == 6  # within the measured node: projected
    # the node size and the inter-node rate given: projected, on 16 nodes at 64
    p = project(rows, [64], Options(gpus_per_node=4, rates={RING: 10.5}, bootstrap=0), samples=samples)
    assert ("2d", "inference") in p.findings
    assert int(p.table.loc[(p.table[K.GPUS] == 64) & (p.table[K.SECTION] == "all"), K.NODES].iloc[0]) == 16


def test_a_one_node_sweep_projects_up_to_the_gpus_its_node_holds_and_refuses_past_them():
    """1, 2, 4 GPUs on a node whose hosts showed 8 GPUs (run.json's node_gpus): 8 is projected on that node, 16
    is refused (the node size past it is unknown); a node that showed only the 4 used changes nothing."""
    rows, samples = study.generate(CONFIGS["2d inference"], 20, 0, study.Noise(), gpus=(1, 2, 4))
    rows[K.NODES] = 1
    rows[K.NODE_GPUS] = pd.array([8] * len(rows), dtype="Int64")
    model = fit(rows, Options(bootstrap=0), samples)
    assert model.largest_node == 8 and model.gpus_per_node is None
    assert any("one node of 8 GPUs (NVML's count on its hosts)" in a for a in model.assumptions)
    at8 = evaluate(model, [8])
    assert set(at8[K.NODES]) == {1} and (at8[K.SECTION_S] > 0).all()
    with pytest.raises(NodeSizeUnknown, match="of at least 8 GPUs"):
        evaluate(model, [16])
    rows[K.NODE_GPUS] = pd.array([4] * len(rows), dtype="Int64")
    with pytest.raises(NodeSizeUnknown, match="of at least 4 GPUs"):
        evaluate(fit(rows, Options(bootstrap=0), samples), [8])
    rows[K.NODE_GPUS] = pd.array([8, pd.NA] * (len(rows) // 2) + [8] * (len(rows) % 2), dtype="Int64")
    assert fit(rows, Options(bootstrap=0), samples).largest_node == 8  # unknown on some rows: the known ones


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_studys_64_gpu_figures_from_8_and_16(name):
    """The study's 64-GPU scaled cost, CommE and transfer within 10 % from <= 8 (ring rate given) and the scaled
    cost within 5 % from <= 16, fitted on the per-rank samples (measured: within 5.6 % and 2.0 %)."""
    rows, samples = study.generate(CONFIGS[name], 200, 0)
    base = rows[rows[K.GPUS] == rows[K.GPUS].min()]
    for up_to, options, limit in ((8, Options(rates={RING: 10.5}, bootstrap=0), 0.10),
                                  (16, Options(bootstrap=0), 0.05)):  # fmt: skip
        keep = rows[K.GPUS] <= up_to
        model = fit(rows[keep], options, samples[samples[K.GPUS] <= up_to])
        assert model.from_samples
        got = study.figures(evaluate(model, [64]), base)
        figures = ("scaled cost", "CommE", "transfer (all)") if up_to == 8 else ("scaled cost",)
        for figure in figures:
            err = study._err(got[figure], study.STUDY[name][figure])
            assert abs(err) <= limit, (name, up_to, figure, got[figure], 100 * err)


# --- the pieces -----------------------------------------------------------------------------------


def test_jitter_from_samples_ignores_the_iterations_common_factor():
    rng = np.random.default_rng(0)
    x = 2.0 * (1 + 0.03 * rng.standard_normal((400, 8))) * (1 + 0.05 * rng.uniform(-1, 1, (400, 1)))
    sigma = ps_samples.jitter({8: x, 1: x[:, :1]})
    assert sigma == pytest.approx(0.03, rel=0.05)
    assert ps_samples.jitter({1: x[:, :1]}) is None


def test_a_slow_node_is_a_stated_speed_factor_not_a_fixed_term():
    """The issue: the slow node was absorbed into the fixed compute (0.074 s fitted, 0.004 s true)."""
    rows, samples = study.generate(CONFIGS["2d inference"], 200, 0, study.NOISY, gpus=(1, 2, 4, 8))
    model = fit(rows, Options(rates={RING: 10.5}, bootstrap=0), samples)
    by = {sm.section: sm for sm in model.sections}
    for sm in by.values():
        assert sm.node_speed.keys() == {1} and sm.node_speed[1] == pytest.approx(1.08, abs=0.01)
    true = CONFIGS["2d inference"].sections
    assert by["gradient"].coef[0] == pytest.approx(true["gradient"].fixed, rel=0.1)
    assert by["denoiser"].coef[0] < 0.002  # true 0
    text = " ".join(model.assumptions)
    assert "slower node(s), kept on the critical path: node 1 x1.08" in text
    # on the critical path: at 64 the slowest rank is on node 1, the mean is barely moved
    fast = evaluate(model, [64])
    for sm in model.sections:
        sm.node_speed = {}
    slow_free = evaluate(model, [64])
    assert fast[K.COMPUTE_MAX_S].iloc[-1] > slow_free[K.COMPUTE_MAX_S].iloc[-1] * 1.03  # measured: x1.039
    assert "fixed fitted 0.1 standard errors below 0: indistinguishable from 0, set to 0" in text  # denoiser


def test_few_iterations_warn_and_a_null_coefficient_is_said():
    rows, samples = study.generate(CONFIGS["2d inference"], 5, 0, study.NOISY, gpus=(1, 2, 4, 8))
    model = fit(rows, Options(rates={RING: 10.5}, bootstrap=0), samples)
    text = " ".join(model.assumptions)
    assert "jitter from only 5 iterations per point (fewer than ~20" in text
    # the denoiser's fixed term (true 0) is not clamped up silently: how far below 0, and what 0 costs
    assert "fixed fitted 2.3 standard errors below 0: set to 0 (the fit then misses the rank means by at most" in text
    assert all((sm.coef >= 0).all() for sm in model.sections)


@pytest.mark.slow
def test_without_samples_the_projection_says_it_has_no_band():
    rows, _ = study.generate(CONFIGS["2d inference"], 20, 0, gpus=(1, 2, 4, 8))
    p = project(rows, [16], Options(rates={RING: 10.5}, bootstrap=10))
    row = p.table[(p.table[K.GPUS] == 16) & (p.table[K.SECTION] == "all")].iloc[0]
    assert math.isnan(row["section_s_lo"]) and "no band" in " ".join(p.assumptions[("2d", "inference")])


def test_samples_from_a_ranks_table_and_a_gap_refused():
    ranks = pd.DataFrame({K.RANK: [0, 1, 0, 1], K.ITERATION: [0, 0, 1, 1], K.SECTION: "s",
                          K.WARMUP: [True, True, False, False], K.SECTION_S: [5.0, 5.0, 1.0, 1.5],
                          K.COMM_S: [0.0, 0.0, 0.5, 0.2]})  # fmt: skip
    x = ps_samples.from_ranks(ranks)
    assert x[K.COMPUTE_S].tolist() == [0.5, 1.3]
    s = x.assign(**{K.PROBLEM: "2d", K.MODE: "inference", K.GPUS: 2})
    assert ps_samples.section_arrays(s, "s", [2], "2d inference")[2].tolist() == [[0.5, 1.3]]
    assert ps_samples.section_arrays(s, "s", [4], "2d inference") is None
    gap = pd.concat([s, s.assign(**{K.ITERATION: 2}).iloc[:1]], ignore_index=True)
    with pytest.raises(ps_samples.ProjectionError, match="rank 1 has no sample at iteration 2"):
        ps_samples.section_arrays(gap, "s", [2], "2d inference")
    bad = ranks.assign(**{K.COMM_S: [0.0, 0.0, 2.0, 0.2]})
    with pytest.raises(ps_samples.ProjectionError, match="rank 0 iteration 1 section s: compute -1 s < 0"):
        ps_samples.from_ranks(bad)


def test_latency_per_collective_and_hop_is_fitted_and_carried_to_64():
    """10 µs per hop and collective (the issue: a constant latency per section put the transfer at 64 at
    −2.5 %): the ring measured at 16 and 32 GPUs (30 and 62 hops per collective, nearly the same bytes) tells the
    latency from the rate; the rates of the routes measured at one point each are given."""
    noise = study.Noise(hop_latency=10e-6)
    rows, samples = study.generate(CONFIGS["2d inference"], 50, 0, noise, gpus=(1, 2, 4, 8, 16, 32, 64))
    rates = {"intra-node, 2 GPUs": 40.0, "intra-node, 4 GPUs": 119.0, "inter-node tree": 17.0}
    keep = rows[K.GPUS] <= 32
    model = fit(rows[keep], Options(rates=rates, bootstrap=0), samples[samples[K.GPUS] <= 32])
    assert model.rates[RING] == pytest.approx(10.5, rel=1e-6)
    assert all(sm.latency_s == pytest.approx(10e-6, rel=1e-6) for sm in model.sections)
    got = evaluate(model, [64]).set_index(K.SECTION)[K.TRANSFER_S]
    true = rows[rows[K.GPUS] == 64].set_index(K.SECTION)[K.TRANSFER_S]
    for section in ("gradient", "denoiser"):
        assert got[section] == pytest.approx(true[section], rel=1e-6)
    assert "latency per collective and hop" in " ".join(model.assumptions)


@pytest.mark.slow
def test_a_node_size_refusal_prints_commands_that_work():
    from argparse import Namespace

    from pnpscale.results.projection.command import fix_hint

    rows, samples = study.generate(CONFIGS["2d inference"], 5, 0, gpus=(1, 2, 4))
    rows[K.NODES] = 1
    p = project(rows, [64], Options(bootstrap=0), samples=samples)
    hint = fix_hint(Namespace(path="SWEEP", devices=None), rows, p)
    assert "python -m pnpscale.project SWEEP --gpus-per-node G --rate ring=GBps (G >= 4)" in hint
    assert ("within the measured node (measured counts: the fit checked, nothing past it), this works now: "
            "python -m pnpscale.project SWEEP --gpus 2,4") in hint
    ok = project(rows, [2, 4], Options(bootstrap=0), samples=samples)  # that command's projection: made
    assert ("2d", "inference") in ok.findings
