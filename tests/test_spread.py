"""Spread from one measured iteration to the next: quantiles in load(), the report, the comparison's verdict."""

from __future__ import annotations

import pandas as pd
import pytest

import pnpscale
from pnpscale import columns as K
from pnpscale.analysis.spread import MIN_ITERATIONS, per_iteration, spread
from pnpscale.results.compare import BEYOND, TOO_FEW, WITHIN, noise_verdict
from pnpscale.results.report import spread_markdown, write_report
from tests.test_report import sweep  # noqa: F401 - the module fixture


def sections(times: dict[str, list[tuple[float, float, float, float]]]) -> pd.DataFrame:
    """Per section, per iteration (iteration 0 = warm-up): (compute, compute_max, transfer, wait)."""
    rows = []
    for sec, per in times.items():
        for it, (c, cmax, t, w) in enumerate(per):
            rows.append({K.ITERATION: it, K.SECTION: sec, K.WARMUP: it == 0, K.COMPUTE_S: c, K.COMPUTE_MAX_S: cmax,
                         K.TRANSFER_S: t, K.WAIT_S: w, K.SECTION_S: c + t + w})  # fmt: skip
    return pd.DataFrame(rows)


def test_quantiles_per_section_and_combined_per_iteration():
    sec = sections({
        "a": [(9, 9, 9, 9), (1.0, 2.0, 0.1, 0.1), (2.0, 2.0, 0.1, 0.3), (3.0, 4.0, 0.1, 0.5)],
        "b": [(9, 9, 9, 9), (1.0, 1.0, 0.0, 0.0), (1.0, 1.0, 0.0, 0.0), (1.0, 1.0, 0.0, 0.0)],
    })  # fmt: skip
    per = per_iteration(sec).set_index([K.SECTION, K.ITERATION])
    assert per.loc[("all", 3), K.SECTION_S] == pytest.approx(3.6 + 1.0)
    assert per.loc[("all", 3), K.LB] == pytest.approx(4.0 / 5.0)  # sum C / sum C_max, per iteration
    assert per.loc[("a", 1), K.WAIT_PCT_OF_COMPUTE] == pytest.approx(10.0)
    s = spread(sec).set_index(K.SECTION)
    assert list(s.reset_index().columns) == [K.SECTION, K.ITERATIONS, *K.SPREAD_COLUMNS]
    assert (s[K.ITERATIONS] == 3).all()  # warm-up left out
    # section a per iteration: 1.2, 2.4, 3.6 -> linear quantiles
    assert s.loc["a", "section_p10_s"] == pytest.approx(1.2 + 0.2 * 1.2)
    assert s.loc["a", "section_p50_s"] == pytest.approx(2.4)
    assert s.loc["a", "section_p90_s"] == pytest.approx(2.4 + 0.8 * 1.2)
    assert s.loc["b", "lb_p10"] == s.loc["b", "lb_p90"] == 1.0


def test_load_carries_the_spread_and_the_report_says_too_few(sweep):  # noqa: F811
    df = pnpscale.load(str(sweep))
    assert set(K.SPREAD_COLUMNS) <= set(df.columns)
    two = df[(df["gpus"] == 2) & (df[K.SECTION] == "gradient")].iloc[0]
    # one measured iteration: every quantile is that iteration's value, the mean too
    assert two["section_p10_s"] == two["section_p90_s"] == pytest.approx(two[K.SECTION_S])
    assert df.loc[df["status"] != "complete", "section_p50_s"].isna().all()
    lines = spread_markdown(df)
    assert any(line.startswith("- 2d inference gpus=1, 2: 1 measured iterations, too few") for line in lines)
    assert any("(need ≥ 5: `iterations=5`)" in line for line in lines) and not any("\\`" in line for line in lines)
    printed = []
    write_report(sweep, echo=printed.append)
    assert any(line.startswith("2d inference gpus=1, 2: 1 measured iterations, too few") for line in printed)
    out = write_report(sweep, echo=lambda s: None)
    readme = (out / "README.md").read_text()
    assert "## Spread over the measured iterations" in readme and f"need ≥ {MIN_ITERATIONS}" in readme
    assert not (out / "timeline.png").exists()  # these runs recorded no collective starts: nothing guessed
    assert "- 2d inference: not drawn: gpus=2: no measured iteration whose slices can be placed" in readme
    summary = pd.read_parquet(out / "summary.parquet")
    assert set(K.SPREAD_COLUMNS) <= set(summary.columns)


def test_the_default_run_measures_enough_iterations_for_a_verdict():
    """``python -m pnpscale`` with no ``iterations=``: enough measured iterations that the report states a
    spread and the comparison of variants can call a difference beyond noise (the yaml and the schema agree)."""
    from pnpscale.core.config import PRESET_ITERATIONS, Config, resolve_spec
    from pnpscale.sweep.cli import compose_config

    cfg = compose_config([])
    assert cfg["iterations"] is None and Config().iterations is None  # the yaml and the schema agree: the preset's
    for cuda in (False, True):  # scale=auto: small on CPU ranks, paper on CUDA
        assert resolve_spec(cfg, cuda_available=cuda).iterations >= MIN_ITERATIONS
    assert PRESET_ITERATIONS["tiny"] < MIN_ITERATIONS  # seconds per point: too few for a verdict, as the report says


def test_a_difference_within_the_spread_is_not_a_gain():
    def row(n, lo, hi):
        return pd.Series({K.ITERATIONS: n, "section_p10_s": lo, "section_p90_s": hi})

    assert noise_verdict(row(10, 0.79, 1.42), row(10, 1.0, 1.1)) == WITHIN
    assert noise_verdict(row(10, 0.5, 0.6), row(10, 1.0, 1.1)) == BEYOND
    assert noise_verdict(row(MIN_ITERATIONS - 1, 0.5, 0.6), row(10, 1.0, 1.1)) == TOO_FEW
    assert pd.isna(noise_verdict(row(10, float("nan"), 0.6), row(10, 1.0, 1.1)))


def test_comparison_does_not_call_a_difference_of_too_few_iterations_a_gain(tmp_path):
    from pnpscale.results.compare import BASELINE, comparison, savings
    from pnpscale.results.runs import build_table
    from tests.test_compare import write_collective_sweep

    cmp = comparison(build_table(write_collective_sweep(tmp_path / "sweep"), echo=lambda _: None))
    base = cmp[K.SERIES].str.endswith("all_reduce")
    assert (cmp.loc[base, K.NOISE] == BASELINE).all() and (cmp.loc[~base, K.NOISE] == TOO_FEW).all()
    (line,) = savings(cmp)
    assert "saves" not in line and "not called a gain, 1 and 1 measured iterations are too few" in line
