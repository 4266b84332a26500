"""The validation suite: its checks pass on a correct decomposition and fail on a wrong one."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.metrics import decompose
from pnpscale.validation.suite import (
    PROBE,
    imbalance_checks,
    passed,
    payload_checks,
    run_suite,
)


def wait_against_mean(ranks: pd.DataFrame, colls: pd.DataFrame) -> pd.DataFrame:
    """A deliberately wrong decomposition: transfer = mean over ranks instead of the minimum."""
    d = colls.pivot_table(index=[K.ITERATION, K.SECTION, K.SEQ], columns=K.RANK, values=K.DURATION_S)
    transfer = d.mean(axis=1).groupby(level=[0, 1]).sum()
    wait = d.sub(d.mean(axis=1), axis=0).groupby(level=[0, 1]).sum().mean(axis=1)
    s = ranks.set_index([K.ITERATION, K.SECTION, K.RANK])[K.SECTION_S]
    comm = colls.groupby([K.ITERATION, K.SECTION, K.RANK])[K.DURATION_S].sum().reindex(s.index, fill_value=0)
    c = (s - comm).groupby(level=[0, 1])
    out = pd.DataFrame({K.COMPUTE_S: c.mean(), K.COMPUTE_MAX_S: c.max(), K.TRANSFER_S: transfer, K.WAIT_S: wait})
    out[K.WARMUP] = ranks.groupby([K.ITERATION, K.SECTION])[K.WARMUP].first()
    return out.reset_index()


def synthetic(world: int, delay: float, iterations: int = 4, payload: int = 1 << 20, rate: float = 1e9,
              compute: float = 0.05, seed: int = 0, section: str = "denoiser", offsets=None):  # fmt: skip
    """Tables of a section where the last rank is ``delay`` late; transfer = payload / rate; ``offsets``: each
    rank's compute beside ``compute`` (seconds; default none)."""
    rng = np.random.default_rng(seed)
    offsets = offsets or [0.0] * world
    rrows, crows = [], []
    for it in range(iterations + 1):
        arrive = [compute + offsets[r] + rng.normal(0, 1e-4) for r in range(world)]
        arrive[-1] += delay
        last = max(arrive)
        transfer = payload / rate
        for r in range(world):
            dur = last - arrive[r] + transfer
            rrows.append(
                {K.RANK: r, K.ITERATION: it, K.SECTION: section, K.WARMUP: it == 0, K.SECTION_S: arrive[r] + dur}
            )
            crows.append({K.RANK: r, K.ITERATION: it, K.SECTION: section, K.SEQ: 0, K.COLLECTIVE: "all_reduce",
                          K.DURATION_S: dur, K.PAYLOAD_BYTES: payload, K.MAIN: True})  # fmt: skip
    return pd.DataFrame(rrows), pd.DataFrame(crows)


def test_imbalance_checks_pass_with_the_pop_decomposition():
    checks = imbalance_checks(synthetic(4, 0.0), synthetic(4, 0.2, seed=1), "denoiser", 0.2, 4)
    assert passed(checks), [(c.name, c.measured, c.expected) for c in checks]


def test_imbalance_checks_fail_with_wait_against_the_mean():
    checks = imbalance_checks(synthetic(4, 0.0), synthetic(4, 0.2, seed=1), "denoiser", 0.2, 4, wait_against_mean)
    failed = {c.name.split(" [")[0] for c in checks if c.passed is False}
    assert "imbalance: wait grows by D(W-1)/W" in failed and "imbalance: transfer unchanged" in failed


@pytest.mark.parametrize("world", [2, 4])
def test_imbalance_checks_hold_when_the_delayed_rank_was_the_fastest(world):
    """Timing noise of equal work without injection (ranks 30 ms apart) where the delayed rank was the fastest:
    wait grows by D(W-1)/W - 30 ms, the delayed rank computes D - 30 ms more than the others and LB lies at the
    band's edge (a clean CI run read LB 0.577 against 0.517 so). The band still refuses the wrong decomposition."""
    offsets = [0.03] * (world - 1) + [0.0]
    base, injected = synthetic(world, 0.0, offsets=offsets), synthetic(world, 0.2, seed=1, offsets=offsets)
    checks = imbalance_checks(base, injected, "denoiser", 0.2, world)
    assert passed(checks), [(c.name, c.measured, c.expected, c.tolerance) for c in checks]
    lb = next(c for c in checks if c.name.startswith("imbalance: LB"))
    c = 0.05 + 0.03 * (world - 1) / world
    assert lb.measured == pytest.approx((c + 0.2 / world) / (0.05 + 0.2), abs=1e-3)
    ends = [(0.08 + (0.2 + d) / world) / (0.08 + 0.2 + d) for d in (-0.03, 0.03)]  # C_o = 0.08 s, spread 0.03 s
    assert lb.expected - lb.tolerance == pytest.approx(min(ends) - 0.05, abs=1e-3)
    wrong = imbalance_checks(base, injected, "denoiser", 0.2, world, wait_against_mean)
    assert "imbalance: transfer unchanged [denoiser]" in {c.name for c in wrong if c.passed is False}


@pytest.mark.parametrize("world", [2, 4])
def test_imbalance_checks_hold_when_the_machine_got_faster_between_the_runs(world):
    """A clean CI run under load: the base run's work took 0.11 s, the injected run's undelayed work 0.013 s.
    C_max "grew" by 0.115 s for D = 0.2 s; the delayed rank still computed D more than the others within its
    run and LB is what that predicts, so the checks pass; the wrong decomposition still fails."""
    base, injected = synthetic(world, 0.0, compute=0.11), synthetic(world, 0.2, seed=1, compute=0.013)
    checks = imbalance_checks(base, injected, "denoiser", 0.2, world)
    assert passed(checks), [(c.name, c.measured, c.expected, c.tolerance) for c in checks]
    excess = next(c for c in checks if c.name.startswith("imbalance: delayed rank computes D more"))
    assert excess.measured == pytest.approx(0.2, abs=1e-3)
    wrong = imbalance_checks(base, injected, "denoiser", 0.2, world, wait_against_mean)
    assert not passed(wrong)


def test_imbalance_checks_fail_when_the_delay_is_not_compute():
    """A decomposition that books the delayed rank's extra time as nobody's compute (compute = the section's
    minimum over ranks) fails the within-run check."""

    def flat_compute(ranks: pd.DataFrame, colls: pd.DataFrame) -> pd.DataFrame:
        out = decompose(ranks, colls)
        out[K.COMPUTE_MAX_S] = out[K.COMPUTE_S]
        return out

    checks = imbalance_checks(synthetic(2, 0.0), synthetic(2, 0.2, seed=1), "denoiser", 0.2, 2, flat_compute)
    failed = {c.name.split(" [")[0] for c in checks if c.passed is False}
    assert "imbalance: delayed rank computes D more" in failed


def test_payload_wait_check_is_one_sided():
    """Wait growing with bytes (the bytes' time booked as wait) fails; wait falling across the separate runs
    (timing noise: a CI run read -0.66x the transfer slope) passes."""
    sizes = (1 << 14, 1 << 18, 1 << 22, 1 << 25)
    name = f"payload: wait does not grow with bytes [{PROBE}]"

    def wait_check(delay_of):
        runs = [synthetic(2, delay_of(p), payload=p, rate=1e9, section=PROBE) for p in sizes]
        return next(c for c in payload_checks(runs, PROBE) if c.name == name)

    growing = wait_check(lambda p: p / 1e9)  # wait = D/2 grows at half the transfer slope
    assert growing.passed is False and growing.measured == pytest.approx(0.5, abs=0.02)
    falling = wait_check(lambda p: 0.05 - 0.66 * 2 * p / 1e9)  # wait falls at 0.66x the transfer slope
    assert falling.passed is True and falling.measured == pytest.approx(-0.66, abs=0.02)


def test_payload_checks_recover_the_rate_and_flag_nonlinear_transfer():
    runs = [synthetic(2, 0.0, payload=p, rate=5e9, section=PROBE) for p in (1 << 14, 1 << 18, 1 << 22, 1 << 25)]
    checks = payload_checks(runs, PROBE)
    assert passed(checks)
    rate = next(c for c in checks if c.name.startswith("payload: transfer grows"))
    assert rate.measured == pytest.approx(5.0, rel=1e-6)  # GB/s
    flat = [
        synthetic(2, 0.0, payload=p, rate=5e9 * p / 2**14, section=PROBE) for p in (1 << 14, 1 << 18, 1 << 22, 1 << 25)
    ]
    assert not passed(payload_checks(flat, PROBE))  # constant transfer: R² ~ 0, slope ~ 0
    with pytest.raises(ValueError, match="at least 3 sizes"):
        payload_checks(runs[:2], PROBE)


@pytest.mark.slow
def test_suite_passes_on_cpu_ranks_and_fails_when_the_decomposition_is_broken(tmp_path):
    from pnpscale.validation.suite import evaluate, read_tables

    result = run_suite(tmp_path, gpus=2, delay_s=0.2, section="denoiser", payloads=[1 << 14, 1 << 18, 1 << 22, 1 << 25],
                       iterations=4, echo=lambda s: None)  # fmt: skip
    failed = [c for c in result["checks"] if c["passed"] is False]
    assert result["passed"], failed
    assert (tmp_path / "validate.json").is_file()
    noise = [c for c in result["checks"] if c["name"].startswith("noise")]
    assert {c["passed"] for c in noise} == {None} and all(c["measured"] >= 0 for c in noise)
    base, inj = read_tables(tmp_path / "case=baseline"), read_tables(tmp_path / "case=imbalance")
    payload = [read_tables(tmp_path / "case=payload" / f"payload={p}") for p in (1 << 14, 1 << 18, 1 << 22, 1 << 25)]
    assert passed(evaluate(base, inj, payload, section="denoiser", delay_s=0.2, world=2, decompose_fn=decompose))
    assert not passed(
        evaluate(base, inj, payload, section="denoiser", delay_s=0.2, world=2, decompose_fn=wait_against_mean)
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--payloads", "0"], "--payloads=0: needs at least 3 distinct sizes of at least 1 byte"),
        (["--payloads=0,1,2"], "--payloads=0,1,2: needs at least 3 distinct sizes"),
        (["--payloads=1000,2000,4000"], "the largest at least 100 times the smallest"),
        (["--iterations", "0"], "--iterations=0: must be >= 1"),
        (["--probe-iterations", "0"], "--probe-iterations=0: must be >= 1"),
        (["--gpus", "1"], "--gpus=1: must be >= 2"),
        (["--delay-s", "0"], "--delay-s=0.0: must be > 0"),
        (["problme=2d"], "problme=2d: unknown key; did you mean problem"),
        (["solver.denoiser_collective=foo"], "solver.denoiser_collective=foo"),
    ],
)
def test_the_suite_refuses_what_it_cannot_judge_before_any_rank(tmp_path, capsys, argv, said):
    """One line naming the option or key, exit 2, nothing written: the payload span and each case's config are
    checked before the first case runs (they were found after two cases had run, as a traceback)."""
    from pnpscale.validation.suite import main

    assert main([*argv, "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m pnpscale.validate: error: ") and said in err[0], err
    assert not (tmp_path / "v").exists()
