"""The report's side-by-side comparison when a sweep varies a compared key (synthetic sweeps)."""

from __future__ import annotations

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.core.config import variant_subdir
from pnpscale.results.compare import COMPARE_PNG, comparison
from pnpscale.results.report import write_report
from pnpscale.results.runs import build_table, discover
from pnpscale.results.series import labelled
from tests.test_report import PNG_MAGIC, fake_run

IMAGE = 3 * 32 * 32 * 4


def _dir(root, problem, gpus, collective="all_reduce", num_operators=None):
    return root / f"problem={problem}/mode=inference{variant_subdir(collective, num_operators)}/gpus={gpus}"


def write_collective_sweep(root, gpus=(1, 2, 4)):
    """gpus x denoiser_collective=all_reduce,all_gather (8 operators); the all_gather's transfer is half."""
    for coll in ("all_reduce", "all_gather"):
        for g in gpus:
            if g == 1:
                times, kinds = {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]}, None
            else:
                den = 0.4 if coll == "all_reduce" else 0.2
                # the all_gather records one rank's buffer: the cores of its tiles, P / g here
                kinds = {"denoiser": (coll, IMAGE if coll == "all_reduce" else IMAGE // g)}
                times = {"gradient": [(0.6, 0.1)] * g, "denoiser": [(1.0 + den, den)] * g}
            fake_run(_dir(root, "2d", g, coll), "2d", "inference", times, kinds, operators=8, denoiser_collective=coll)
    return root


@pytest.fixture(scope="module")
def collective_sweep(tmp_path_factory):
    """gpus=1,2,4 x denoiser_collective=all_reduce,all_gather; the all_gather's transfer is half."""
    return write_collective_sweep(tmp_path_factory.mktemp("cmp") / "sweep")


def test_variant_discovered_from_run_json(collective_sweep):
    runs = discover(collective_sweep)
    assert set(runs["variant"]) == {"denoiser_collective=all_reduce", "denoiser_collective=all_gather"}
    assert len(runs) == 6  # both values kept at every GPU count, never one replacing the other


def test_side_by_side_table_halves_the_bytes(collective_sweep):
    cmp = comparison(build_table(collective_sweep, echo=lambda _: None))
    assert cmp is not None and set(cmp[K.VARIED]) == {"denoiser_collective"}
    assert list(cmp.columns) == list(K.COMPARE_COLUMNS)
    assert cmp[K.SERIES].iloc[0] == "2d denoiser_collective=all_reduce"  # the baseline first
    ag = cmp[cmp[K.SERIES].str.endswith("all_gather")].set_index(K.GPUS)
    # gradient all_reduce 2P(n-1)/n + denoiser: all_reduce 2P(n-1)/n vs all_gather P(n-1)/n
    for g in (2, 4):
        ar_bytes = 2 * (2 * IMAGE * (g - 1) / g)
        assert ag.loc[g, K.BYTES_PER_GPU] == pytest.approx(0.75 * ar_bytes)
        assert ag.loc[g, K.BYTES_VS_BASE] == pytest.approx(0.75)
        assert ag.loc[g, K.TRANSFER_S] == pytest.approx(0.3) and ag.loc[g, K.TRANSFER_VS_BASE] == pytest.approx(0.6)
    assert ag.loc[1, K.BYTES_PER_GPU] == 0.0 and pd.isna(ag.loc[1, K.BYTES_VS_BASE])


def test_report_writes_comparison_and_transfer_knows_all_gather(collective_sweep, tmp_path):
    out = write_report(collective_sweep, tmp_path / "rep", echo=lambda _: None)
    assert (out / COMPARE_PNG).read_bytes()[:8] == PNG_MAGIC
    assert len(pd.read_parquet(out / layout.COMPARE)) == 6
    readme = (out / layout.REPORT_README).read_text()
    assert "## Side by side: denoiser_collective" in readme
    assert "4 GPUs: `2d denoiser_collective=all_gather` takes" in readme and "bytes per GPU 0.75x" in readme
    assert "## 2d denoiser_collective=all_gather inference" in readme  # every series keeps its own table
    transfer = pd.read_parquet(out / layout.TRANSFER)
    den = transfer[transfer[K.SECTION] == "denoiser"].set_index([K.PROBLEM, K.GPUS])
    for g in (2, 4):
        ar = den.loc[("2d denoiser_collective=all_reduce", g)]
        ag = den.loc[("2d denoiser_collective=all_gather", g)]
        assert ag[K.COLLECTIVE] == "all_gather" and ag[K.PAYLOAD_BYTES] == IMAGE  # nccl-tests' size: g x buffer
        assert ag[K.BYTES_PER_GPU] == pytest.approx(ar[K.BYTES_PER_GPU] / 2)


def test_compare_marks_the_time_shared_points_in_its_chart_and_table(collective_sweep):
    from pnpscale.results.charts import TIME_SHARED_LABEL
    from pnpscale.results.compare import markdown, plot_comparison
    from tests.test_report_flags import _hollow

    table = build_table(collective_sweep, echo=lambda _: None)
    table[K.TIME_SHARED] = pd.array(table["gpus"] == 4, dtype="boolean")  # 4 ranks on 2 cores
    cmp = comparison(table)
    assert cmp.groupby(K.GPUS)[K.TIME_SHARED].agg(lambda v: set(v.tolist())).to_dict() == {
        1: {False}, 2: {False}, 4: {True}}  # fmt: skip
    fig = plot_comparison(cmp)
    assert set(_hollow(fig)) == {4.0}  # every panel, both series: only the 4-GPU points
    legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert TIME_SHARED_LABEL in legend
    rows = [line for line in "\n".join(markdown(cmp)).splitlines() if line.startswith("|")]
    status = sorted((int(cells[2]), cells[3]) for cells in ([c.strip() for c in line.split("|")] for line in rows)
                    if cells[2].isdigit())  # fmt: skip
    assert status == [(1, "complete")] * 2 + [(2, "complete")] * 2 + [(4, "complete, time-shared")] * 2
    table[K.TIME_SHARED] = pd.array([pd.NA] * len(table), dtype="boolean")  # unknown: no marks
    assert _hollow(plot_comparison(comparison(table))) == []


def test_problem_and_num_operators_comparisons(tmp_path):
    root = tmp_path / "sweep"
    for problem, ops in (("2d", 2), ("3d", None)):
        for g in (1, 4):
            times = {"gradient": [(1.0, 0.0)] * g, "denoiser": [(1.0, 0.0)] * g}
            extra = {"sizes": {"num_operators": ops}} if ops else {}
            fake_run(_dir(root, problem, g, num_operators=ops), problem, "inference", times, **extra)
    table = build_table(root, echo=lambda _: None)
    cmp = comparison(table)
    assert set(cmp[K.VARIED]) == {"problem"} and list(dict.fromkeys(cmp[K.SERIES])) == ["2d", "3d"]
    fake_run(_dir(root, "2d", 4, num_operators=8), "2d", "inference",
             {"gradient": [(1.0, 0.0)] * 4, "denoiser": [(1.0, 0.0)] * 4})  # fmt: skip
    cmp = comparison(build_table(root, echo=lambda _: None))
    assert set(cmp[K.VARIED]) == {"problem, num_operators"}
    assert "2d num_operators=2" in set(cmp[K.SERIES]) and "2d num_operators=8" in set(cmp[K.SERIES])


def test_no_comparison_without_a_varied_key(tmp_path):
    root = tmp_path / "sweep"
    fake_run(_dir(root, "2d", 1), "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(1.0, 0.0)]})
    assert comparison(build_table(root, echo=lambda _: None)) is None
    out = write_report(root, tmp_path / "rep", echo=lambda _: None)
    assert not (out / COMPARE_PNG).exists() and "Side by side" not in (out / layout.REPORT_README).read_text()


def _varied_sweep(root, key):
    """A sweep (gpus 1, 2) that varies ``key``; the 2-GPU point of the last series failed."""
    from pnpscale.core.record import write_failure
    from tests.test_report import spec

    series = {
        "denoiser_collective": [("2d", {"denoiser_collective": c}, c, None) for c in ("all_reduce", "all_gather")],
        "problem": [("2d", {}, "all_reduce", None), ("3d", {}, "all_reduce", None)],
        "num_operators": [("2d", {"sizes": {"num_operators": n}}, "all_reduce", n) for n in (2, 8)],
    }[key]
    for i, (problem, fields, coll, ops) in enumerate(series):
        for g in (1, 2):
            d = _dir(root, problem, g, coll, ops)
            if g == 2 and i == len(series) - 1:
                write_failure(d, spec(problem, "inference", g, **fields), None, "boom")
                continue
            times = {"gradient": [(1.0 / g, 0.1 * (g - 1))] * g, "denoiser": [(2.0 / g, 0.1 * (g - 1))] * g}
            fake_run(d, problem, "inference", times, **fields)
    return root


@pytest.mark.parametrize("key", ["denoiser_collective", "problem", "num_operators"])
def test_every_chart_draws_a_varied_sweep_from_load(tmp_path, key):
    import pnpscale
    from pnpscale.results.charts import CHARTS

    table = pnpscale.load(_varied_sweep(tmp_path / "sweep", key))
    series = sorted({label for label in labelled(table)["problem"]})
    assert len(series) == 2 and (key == "problem" or all(key in s for s in series))
    for name, plot in CHARTS.items():
        fig = plot(table)
        assert fig.axes, name
        labels = {ax.get_title() for ax in fig.axes}
        labels |= {line.get_label() for ax in fig.axes for line in ax.get_lines()}
        labels |= {t.get_text() for leg in fig.legends for t in leg.get_texts()}
        assert all(any(s in label for label in labels) for s in series), (name, series, labels)
    # the same figures as on the report's view (labelled twice is labelled once)
    assert labelled(labelled(table))["problem"].tolist() == labelled(table)["problem"].tolist()


def test_example_notebook_runs_on_a_varied_sweep(collective_sweep):
    from tests.test_report import run_notebook

    outputs = run_notebook(collective_sweep)
    text = "".join(str(o.get("data", {}).get("text/plain", "")) + str(o.get("text", "")) for o in outputs)
    assert "denoiser_collective=all_gather" in text


def _measured(table, times, shared=()):
    """``table`` with each (series suffix, gpus)'s section time (``all`` rows) set from ``times``, ten measured
    iterations with a tight p10–p90 (±1 %) and TIME_SHARED at the GPU counts in ``shared``."""
    table = table.copy()
    for (suffix, g), t in times.items():
        sel = (table[K.SECTION] == "all") & (table["gpus"] == g) & table["variant"].str.endswith(suffix)
        assert sel.sum() == 1, (suffix, g)
        table.loc[sel, K.SECTION_S] = t
        table.loc[sel, "section_p10_s"], table.loc[sel, "section_p90_s"] = 0.99 * t, 1.01 * t
    table[K.ITERATIONS] = 10
    table[K.TIME_SHARED] = pd.array(table["gpus"].isin(shared), dtype="boolean")
    return table


def test_between_run_drift_at_one_gpu_and_time_shared_points_are_no_gain(collective_sweep):
    from pnpscale.results.compare import BEYOND, DRIFT, SAME_CODE, SHARED, markdown, savings

    table = build_table(collective_sweep, echo=lambda _: None)
    # all_gather 0.68x at 1 GPU (the same code: the drift between the runs), 25 % less at 2, time-shared at 4
    times = {("all_reduce", 1): 1.0, ("all_gather", 1): 0.68, ("all_reduce", 2): 0.8, ("all_gather", 2): 0.6,
             ("all_reduce", 4): 0.44, ("all_gather", 4): 0.2}  # fmt: skip
    cmp = comparison(_measured(table, times, shared=(4,)))
    ag = cmp[cmp[K.SERIES].str.endswith("all_gather")].set_index(K.GPUS)
    assert ag[K.NOISE].to_dict() == {1: SAME_CODE, 2: DRIFT, 4: SHARED}
    assert ag[K.DRIFT_1GPU].to_numpy() == pytest.approx([0.32] * 3)
    (line,) = savings(cmp)
    assert line.startswith("inference, 2 GPUs (gpus=4 left out: time-shared): `2d denoiser_collective=all_gather`")
    assert "within the between-run drift measured at 1 GPU (32%)" in line and "beyond" not in line
    rows = "\n".join(markdown(cmp))
    assert "| same code" in rows and "| within drift" in rows and "| time-shared" in rows
    # a small drift: the 2-GPU difference is a gain beyond both
    cmp = comparison(_measured(table, {**times, ("all_gather", 1): 0.99}, shared=(4,)))
    assert cmp.set_index([K.SERIES, K.GPUS]).loc[("2d denoiser_collective=all_gather", 2), K.NOISE] == BEYOND
    (line,) = savings(cmp)
    assert "saves 0.2 s, 25%, beyond the noise and the between-run drift measured at 1 GPU (1%)" in line
    # every shared point time-shared: the headline says so and calls nothing a gain
    (line,) = savings(comparison(_measured(table, times, shared=(1, 2, 4))))
    assert line.startswith("inference, 4 GPUs (every GPU count both share is time-shared):")
    assert "not called a gain, time-shared" in line and "saves" not in line and "beyond" not in line


def test_keys_that_change_the_computation_at_one_gpu_get_the_noise_test(tmp_path):
    from pnpscale.results.compare import BEYOND, SAME_CODE_AT_1

    assert "overlap" not in SAME_CODE_AT_1 and "overlap_chunks" not in SAME_CODE_AT_1  # pipelined bands on 1 rank
    table = build_table(_varied_sweep(tmp_path / "sweep", "num_operators"), echo=lambda _: None)
    cmp = comparison(_measured(table, {("num_operators=2", 1): 1.0, ("num_operators=8", 1): 2.0}))
    one = cmp.set_index([K.SERIES, K.GPUS])
    assert one.loc[("2d num_operators=8", 1), K.NOISE] == BEYOND and one[K.DRIFT_1GPU].isna().all()


def test_series_of_different_scale_presets_are_not_compared_as_the_varied_key(tmp_path):
    from pnpscale.results.compare import SIZES, markdown, savings

    root = tmp_path / "outputs"
    for sweep, scale, ops, size in (("main", "small", 8, 32), ("tiny", "tiny", 4, 16)):
        for g in (1, 2):
            times = {"gradient": [(1.0 / g, 0.0)] * g, "denoiser": [(2.0 / g, 0.0)] * g}
            fake_run(_dir(root / sweep, "2d", g, num_operators=ops), "2d", "inference", times, scale=scale,
                     sizes={"num_operators": ops, "image_size": size})  # fmt: skip
    cmp = comparison(build_table(root, echo=lambda _: None))
    assert set(cmp[K.VARIED]) == {"num_operators"}
    eight = cmp[cmp[K.SERIES] == "2d num_operators=8"]
    assert (eight[K.NOISE] == SIZES).all()
    assert set(eight[K.DIFFERS]) == {"scale small vs tiny, problem.image_size 32 vs 16"}
    text = "\n".join(markdown(cmp))
    assert ("**Caution** (inference): `2d num_operators=8` and `2d num_operators=4` differ in more than "
            "num_operators at gpus=1, 2: scale small vs tiny, problem.image_size 32 vs 16.") in text  # fmt: skip
    (line,) = savings(cmp)
    assert "not called a gain, the runs did different work (scale small vs tiny" in line and "saves" not in line
