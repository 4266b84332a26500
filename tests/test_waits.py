"""Wait split by cause: late start + uneven work + jitter = the POP wait, on tables with known causes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.metrics import decompose
from pnpscale.analysis.waits import CRITICAL, CRITICAL_SHARE, rank_table, wait_by_cause, wait_parts


def timeline(base, skew, jitter, iterations=4, warmup=1, transfer=0.01, tail=0.02):
    """Tables of two sections per iteration on a shared clock, built from known causes.

    Each iteration starts with every rank entering ``first`` together (after the barrier). In both
    sections rank r computes ``base[r] + jitter[i][r]`` and then all_reduces (all ranks leave at the
    last arrival + ``transfer``). Between the sections rank r spends ``tail + skew[r]``, so it enters
    ``second`` ``skew[r]`` later than a rank with skew 0.
    """
    w = len(base)
    rrows, crows, t = [], [], 0.0
    for it in range(warmup + iterations):
        starts = [t] * w
        for name in ("first", "second"):
            arrive = [starts[r] + base[r] + jitter[it][r] for r in range(w)]
            end = max(arrive) + transfer
            for r in range(w):
                rrows.append({K.RANK: r, K.ITERATION: it, K.SECTION: name, K.WARMUP: it < warmup,
                              K.START_S: starts[r], K.SECTION_S: end - starts[r]})  # fmt: skip
                crows.append({K.RANK: r, K.ITERATION: it, K.SECTION: name, K.SEQ: 0, K.COLLECTIVE: "all_reduce",
                              K.START_S: arrive[r], K.DURATION_S: end - arrive[r], K.PAYLOAD_BYTES: 8})  # fmt: skip
            starts = [end + tail + skew[r] for r in range(w)]
        t = max(starts) + 0.5
    return pd.DataFrame(rrows), pd.DataFrame(crows)


def zero_mean_jitter(w, iterations, warmup, scale, seed=0):
    """Per-iteration deviations whose mean over the measured iterations is exactly 0 for every rank."""
    rng = np.random.default_rng(seed)
    j = rng.normal(0, scale, (warmup + iterations, w))
    j[warmup:] -= j[warmup:].mean(axis=0)
    return j.tolist()


def measured(sections, name):
    return sections[(sections[K.SECTION] == name) & ~sections[K.WARMUP]]


def test_pure_entry_skew_is_late_start():
    skew = [0.0, 0.1, 0.3]
    ranks, colls = timeline([0.2] * 3, skew, [[0.0] * 3] * 5)
    s = decompose(ranks, colls)
    second = measured(s, "second")
    expected = np.mean([0.3 - g for g in skew])
    assert second[K.WAIT_S].to_numpy() == pytest.approx(expected, abs=1e-12)
    assert second[K.WAIT_LATE_START_S].to_numpy() == pytest.approx(expected, abs=1e-12)
    assert second[K.WAIT_IMBALANCE_S].abs().max() < 1e-12
    assert second[K.WAIT_JITTER_S].abs().max() < 1e-12
    # the first section of an iteration starts after the barrier: no wait at all here
    assert measured(s, "first")[list(K.WAIT_CAUSES)].abs().to_numpy().max() < 1e-12


def test_systematic_work_difference_is_uneven_work():
    base = [0.1, 0.2, 0.5]
    ranks, colls = timeline(base, [0.0] * 3, [[0.0] * 3] * 5)
    s = measured(decompose(ranks, colls), "first")
    expected = np.mean([0.5 - b for b in base])
    assert s[K.WAIT_IMBALANCE_S].to_numpy() == pytest.approx(expected, abs=1e-12)
    assert s[K.WAIT_LATE_START_S].abs().max() < 1e-12 and s[K.WAIT_JITTER_S].abs().max() < 1e-12


def test_zero_mean_deviations_are_jitter():
    jit = zero_mean_jitter(4, 6, 1, 0.05)
    ranks, colls = timeline([0.3] * 4, [0.0] * 4, jit, iterations=6)
    s = measured(decompose(ranks, colls), "first")
    assert s[K.WAIT_IMBALANCE_S].abs().max() < 1e-12
    assert s[K.WAIT_LATE_START_S].abs().max() < 1e-12
    assert s[K.WAIT_JITTER_S].to_numpy() == pytest.approx(s[K.WAIT_S].to_numpy(), abs=1e-12)
    assert s[K.WAIT_S].min() > 0


def test_three_causes_together_add_up_to_the_pop_wait():
    base, skew = [0.1, 0.4, 0.2, 0.25], [0.05, 0.0, 0.2, 0.1]
    jit = zero_mean_jitter(4, 5, 1, 0.03, seed=3)
    ranks, colls = timeline(base, skew, jit, iterations=5)
    s = decompose(ranks, colls)
    total = s[list(K.WAIT_CAUSES)].sum(axis=1)
    assert np.abs(total - s[K.WAIT_S]).max() < 1e-9
    # the systematic part is the same every measured iteration of a section: mean_r (max x̄ − x̄_r)
    first = measured(s, "first")
    assert first[K.WAIT_IMBALANCE_S].to_numpy() == pytest.approx(np.mean([0.4 - b for b in base]), abs=1e-12)
    parts = wait_parts(ranks, colls)
    assert np.abs(parts[list(K.WAIT_CAUSES)].sum(axis=1) - parts[K.WAIT_S]).max() < 1e-12


def test_additivity_on_random_tables_with_several_collectives():
    rng = np.random.default_rng(7)
    w, rrows, crows = 5, [], []
    for it in range(4):
        for name in ("a", "b"):
            s0 = rng.uniform(0, 0.05, w)
            t = s0.copy()
            for seq in range(3):
                arrive = t + rng.uniform(0.01, 0.2, w)
                end = arrive.max() + rng.uniform(0.001, 0.01)
                for r in range(w):
                    crows.append({K.RANK: r, K.ITERATION: it, K.SECTION: name, K.SEQ: seq, K.COLLECTIVE: "all_reduce",
                                  K.START_S: arrive[r], K.DURATION_S: end - arrive[r], K.PAYLOAD_BYTES: 8})  # fmt: skip
                t = np.full(w, end)
            for r in range(w):
                rrows.append({K.RANK: r, K.ITERATION: it, K.SECTION: name, K.WARMUP: it == 0,
                              K.START_S: s0[r] + 10 * it, K.SECTION_S: t[r] + 0.01 - s0[r]})  # fmt: skip
    colls = pd.DataFrame(crows)
    for it in range(4):  # each iteration on its own clock offset, like the section starts
        colls.loc[colls[K.ITERATION] == it, K.START_S] += 10 * it
    s = decompose(pd.DataFrame(rrows), colls)
    assert np.abs(s[list(K.WAIT_CAUSES)].sum(axis=1) - s[K.WAIT_S]).max() < 1e-9


def test_tables_without_collective_starts_give_na_parts():
    ranks, colls = timeline([0.1, 0.3], [0.0, 0.0], [[0.0, 0.0]] * 5)
    s = decompose(ranks.drop(columns=[K.START_S]), colls.drop(columns=[K.START_S]))
    assert s[list(K.WAIT_CAUSES)].isna().all(axis=None)
    assert (s[K.WAIT_S] > 0).all()


def test_one_rank_has_zero_parts():
    ranks, colls = timeline([0.1], [0.0], [[0.0]] * 5)
    s = decompose(ranks, colls.iloc[0:0])
    assert (s[list(K.WAIT_CAUSES)] == 0).all(axis=None)
    assert len(wait_by_cause(ranks, colls.iloc[0:0])) == len(s)


def test_rank_table_names_the_critical_rank_and_its_assignment():
    base = [0.5, 0.1, 0.1, 0.1]  # rank 0 holds two operators, the others one or none
    jit = zero_mean_jitter(4, 4, 1, 0.001, seed=1)
    ranks, colls = timeline(base, [0.0] * 4, jit)
    t = rank_table(ranks, colls, operators_per_rank=[2, 1, 1, 0], tiles_per_rank=[1, 1, 1, 1])
    first = t[t[K.SECTION] == "first"].set_index(K.RANK)
    assert first[CRITICAL].tolist() == [True, False, False, False]
    assert first.loc[0, CRITICAL_SHARE] == 1.0
    assert first.loc[0, "operators"] == 2 and first.loc[3, "operators"] == 0
    assert first.loc[3, K.WAIT_IMBALANCE_S] == pytest.approx(0.4, abs=1e-9)
    assert first.loc[0, K.WAIT_S] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="3 entries for 4 ranks"):
        rank_table(ranks, colls, operators_per_rank=[1, 1, 1])


@pytest.mark.slow
def test_injected_delay_shows_up_as_uneven_work_not_late_start(tmp_path):
    """A busy delay D on rank 1 of 2 in the denoiser: uneven work grows by D(W−1)/W, late start stays ~0."""
    from tests.helpers import TINY_2D, run_cli, run_dirs

    delay, world = 0.5, 2  # large against the noise of a shared machine (the 5 % is relative to D(W-1)/W)
    tiny = [o for o in TINY_2D if not o.startswith("iterations=")] + ["iterations=3"]
    parts = {}
    for name, extra in (
        ("base", []),
        ("injected", ["inject.rank=1", "inject.section=denoiser", f"inject.delay_s={delay}"]),
    ):
        root = tmp_path / name
        root.mkdir()
        proc = run_cli(f"gpus={world}", *tiny, *extra, root=root, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (run,) = run_dirs(root)
        s = pd.read_parquet(run / "sections.parquet")
        parts[name] = measured(s, "denoiser")[[K.WAIT_S, *K.WAIT_CAUSES]].mean()
        assert np.abs(s[list(K.WAIT_CAUSES)].sum(axis=1) - s[K.WAIT_S]).max() < 1e-9
    share = delay * (world - 1) / world
    growth = parts["injected"][K.WAIT_IMBALANCE_S] - parts["base"][K.WAIT_IMBALANCE_S]
    # the delayed rank's own work differs from the other's by the timing noise of equal work, which the base
    # run's uneven-work wait measures: the band is 5 % of D(W-1)/W plus that noise (two runs, two loads)
    assert abs(growth - share) <= 0.05 * share + parts["base"][K.WAIT_IMBALANCE_S], parts
    assert abs(parts["injected"][K.WAIT_LATE_START_S]) < 0.05 * share, parts
