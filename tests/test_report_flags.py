"""The report says what matters: time-shared points flagged everywhere, and timeline.png drawing the ranks that
hold operators and naming the critical rank the README names (synthetic run folders, the project's writer)."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.rank.commit import time_sharing, write_run
from pnpscale.results.charts import TIME_SHARED_LABEL, plot_load_balance, plot_scaled_cost, plot_wait_pct
from pnpscale.results.report import plot_transfer_figure, shared_points, transfer_explained, write_report
from pnpscale.results.runs import build_table
from pnpscale.results.series import labelled
from tests.test_report import fake_run, spec
from tests.test_timeline import random_run


@pytest.fixture(scope="module")
def two_core_sweep(tmp_path_factory):
    """gpus=1, 2, 4 of one thread per rank on a host whose ranks may run on cores 0 and 1."""
    root = tmp_path_factory.mktemp("cores") / "sweep"
    for g in (1, 2, 4):
        times = {"gradient": [(1.0 / g, 0.01 * (g > 1))] * g, "denoiser": [(3.0 / g, 0.02 * (g > 1))] * g}
        fake_run(root / layout.point_subdir("2d", "inference", g), "2d", "inference", times, cpus=[0, 1])
    write_report(root, echo=lambda s: None)  # one report for the tests below
    return root


def test_time_sharing_counts_threads_against_each_hosts_cores():
    one = {"host": "a", "threads": 1, "cpus": [0, 1], "gpu": None}
    assert time_sharing([one] * 2) == {"time_shared": False, "cores": 2}
    assert time_sharing([one] * 3) == {"time_shared": True, "cores": 2}
    assert time_sharing([{**one, "threads": 2}] * 2)["time_shared"] is True  # 2 ranks x 2 threads on 2 cores
    # SLURM: each rank its own cores, two hosts: not shared; two ranks of a host on one GPU: shared
    slurm = [{"host": h, "threads": 2, "cpus": [2 * r, 2 * r + 1], "gpu": f"GPU-{h}{r}"} for h in "ab" for r in (0, 1)]
    assert time_sharing(slurm) == {"time_shared": False, "cores": 4}
    assert time_sharing([*slurm[:1], {**slurm[1], "gpu": slurm[0]["gpu"]}])["time_shared"] is True
    assert time_sharing([{"host": "a", "threads": 1}]) == {"time_shared": None, "cores": None}  # older ranks


def test_the_flag_is_true_exactly_at_4_ranks_on_2_cores_in_every_table(two_core_sweep):
    for g, want in ((1, False), (2, False), (4, True)):
        d = two_core_sweep / layout.point_subdir("2d", "inference", g)
        run = json.loads((d / layout.RUN_JSON).read_text())
        assert (run[K.TIME_SHARED], run[K.CORES]) == (want, 2)
        sec = pd.read_parquet(d / layout.SECTIONS)
        assert str(sec[K.TIME_SHARED].dtype) == "boolean" and sec[K.TIME_SHARED].tolist() == [want] * len(sec)
    out = two_core_sweep / layout.REPORT_DIR
    summary = pd.read_parquet(out / layout.SUMMARY)
    assert summary.groupby("gpus")[K.TIME_SHARED].agg(lambda v: set(v.tolist())).to_dict() == {
        1: {False}, 2: {False}, 4: {True}}
    readme = (out / layout.REPORT_README).read_text()
    assert "- gpus=4: 4 ranks on 2 cores, time-shared: not a scaling result." in readme
    assert "At 4 GPUs (time-shared) the run costs" in readme
    table = [line for line in readme.splitlines() if line.startswith("|") and "complete" in line]
    assert [("**yes**" in line) for line in table] == [False, False, True]


def _hollow(fig) -> list[float]:
    """x of the hollow (white-faced) markers of a figure."""
    xs = []
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_marker() == "o" and line.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0)):
                xs += [float(x) for x in line.get_xdata()]
    return xs


def test_the_charts_mark_the_time_shared_point_and_promise_only_what_they_draw(two_core_sweep):
    table = build_table(two_core_sweep, echo=lambda s: None)
    lb = plot_load_balance(table)
    assert set(_hollow(lb)) == {4.0}
    assert TIME_SHARED_LABEL in [t.get_text() for legend in lb.legends for t in legend.get_texts()]  # below the panels
    cost = plot_scaled_cost(table)
    hatched = [p for p in cost.axes[0].patches if p.get_hatch() and p.get_height() > 0]
    assert len(hatched) == 2 and {round(p.get_x() + p.get_width() / 2) for p in hatched} == {2}  # the 3rd bar
    rows, _ = transfer_explained(labelled(table))
    title = plot_transfer_figure(rows, shared_points(table)).axes[0].get_title()
    assert "time-shared, not a scaling result: 2d inference gpus=4" in title and "gpus=2" not in title
    # one measured iteration: no band can be drawn, so no title promises one; the legend names only 2d's style
    assert "no p10–p90 band" in lb.get_suptitle() and "band: p10" not in lb.get_suptitle()
    wait = plot_wait_pct(table)
    assert "(2d solid; no p10–p90 band" in wait.axes[0].get_title() and "3D" not in wait.axes[0].get_title()


def test_a_16_rank_timeline_draws_the_operator_holders_and_the_reports_critical_rank(tmp_path):
    """16 ranks, operators on ranks 0 and 1 only: both drawn, and the chart's critical rank is the README's."""
    ranks, colls = random_run(world=16, iterations=4, seed=7)
    ranks[K.PEAK_MEM_BYTES], ranks[K.N_COLLECTIVES] = 1, 3
    gathered = []
    for r in range(16):
        table = {"ranks": ranks[ranks[K.RANK] == r].to_dict("records"),
                 "collectives": colls[colls[K.RANK] == r].to_dict("records")}  # fmt: skip
        info = {"host": "h", "device": "cpu", "threads": 1, "cpus": list(range(16)), "gpu": None,
                "local_operators": [r] if r < 2 else [], "local_tiles": 1, "num_tiles": 16,
                "solver": {"weights_sha256": "x"}}  # fmt: skip
        gathered.append((table, info))
    root = tmp_path / "sweep"
    write_run(root / layout.point_subdir("2d", "inference", 16), spec("2d", "inference", 16), gathered,
              backend="gloo", timings={})  # fmt: skip
    out = write_report(root, echo=lambda s: None)
    assert (out / layout.TIMELINE_PNG).is_file()
    readme = (out / layout.REPORT_README).read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("- 2d inference at 16 GPUs")]
    assert "ranks 0–1 (hold an operator)" in line
    chart = dict(re.findall(r"(\w+): critical-path rank (\d+)", line))
    waits = dict(re.findall(r"- (\w+) at 16: .*critical-path rank (\d+):", readme))
    assert chart and chart == waits, (chart, waits)
    ranks_table = pd.read_parquet(out / layout.WAIT_RANKS)
    crit = ranks_table[ranks_table["critical"]].set_index(K.SECTION)[K.RANK].astype(str).to_dict()
    assert chart == crit
    np.testing.assert_array_equal(sorted(ranks_table[ranks_table["operators"] > 0][K.RANK].unique()), [0, 1])


def test_the_ideal_line_stays_readable_on_a_0_to_140_scale():
    """A 129x scaled cost: the chart goes to a log axis, where 1.0 sits mid-height, not on the floor."""
    t = pd.DataFrame({"problem": "2d", "mode": "inference", "section": "all", "status": "complete",
                      "gpus": [1, 8, 64], "baseline_gpus": 1, "scaled_compute": [1.0, 6.0, 9.0],
                      "scaled_comm": [0.0, 20.0, 120.0], K.TIME_SHARED: [False, True, True]})  # fmt: skip
    ax = plot_scaled_cost(t).axes[0]
    assert ax.get_yscale() == "log"
    lo, hi = ax.get_ylim()
    assert 0.15 < (np.log(1.0) - np.log(lo)) / (np.log(hi) - np.log(lo)) < 0.5  # the ideal line's height
    small = plot_scaled_cost(t.assign(scaled_compute=[1.0, 1.2, 1.5], scaled_comm=[0.0, 0.5, 1.0])).axes[0]
    assert small.get_yscale() == "linear"


def test_the_gpus_a_node_holds_travel_from_the_ranks_to_the_table(tmp_path):
    """run.json's node_gpus is the fewest GPUs any rank's host showed; the table reads it as Int64 (NA: unknown)."""
    from pnpscale.core.record import read_record
    from tests.test_report import fake_run

    times = {"gradient": [(1.0, 0.1)] * 2, "denoiser": [(1.0, 0.1)] * 2}
    fake_run(tmp_path / "s" / layout.point_subdir("2d", "inference", 2), "2d", "inference", times, node_gpus=8)
    fake_run(tmp_path / "s" / layout.point_subdir("2d", "inference", 4), "2d", "inference",
             {k: v * 2 for k, v in times.items()})  # fmt: skip
    run = read_record(tmp_path / "s" / layout.point_subdir("2d", "inference", 2))
    assert run.node_gpus == 8
    table = build_table(tmp_path / "s", echo=lambda s: None)
    assert str(table[K.NODE_GPUS].dtype) == "Int64"
    held = table.groupby("gpus")[K.NODE_GPUS].first()
    assert held[2] == 8 and pd.isna(held[4])


def test_load_says_which_folder_it_took_where_two_sweeps_hold_one_point(tmp_path):
    """Two sweeps under one output root, both with 2d inference gpus=2: load takes the newest and says so."""
    import pnpscale
    from pnpscale.results.runs import RunChoiceWarning
    from tests.test_report import fake_run

    times = {"gradient": [(1.0, 0.1)] * 2, "denoiser": [(1.0, 0.1)] * 2}
    for sweep in ("a", "b"):
        fake_run(tmp_path / sweep / layout.point_subdir("2d", "inference", 2), "2d", "inference", times)
    with pytest.warns(RunChoiceWarning, match=r"1 point\(s\) under .* have several run folders"):
        table = pnpscale.load(str(tmp_path))
    (choice,) = table.attrs["choices"]
    assert "gpus=2: using " in choice and "newest complete of 2; 2 folders" in choice
    assert str(tmp_path / "b") in choice  # written last


def test_load_warns_at_the_callers_line(tmp_path):
    """pnpscale.load's RunChoiceWarning names the line that called it, not pnpscale's own."""
    import warnings

    import pnpscale
    from tests.test_report import fake_run

    times = {"gradient": [(1.0, 0.1)] * 2, "denoiser": [(1.0, 0.1)] * 2}
    for sweep in ("a", "b"):
        fake_run(tmp_path / sweep / layout.point_subdir("2d", "inference", 2), "2d", "inference", times)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pnpscale.load(str(tmp_path))
    (w,) = [w for w in said if w.category.__name__ == "RunChoiceWarning"]
    assert w.filename == __file__, w.filename


def test_a_run_with_a_perturbation_put_in_is_its_own_series(tmp_path):
    """A run made with ``inject.*`` (the validation suite's imbalance case) beside a clean run of the same point,
    newer than it: never taken as the point's measurement; its own series, labelled by what was injected."""
    import pnpscale
    from tests.test_report import fake_run

    clean = {"gradient": [(1.0, 0.1)] * 2, "denoiser": [(1.0, 0.1)] * 2}
    skewed = {"gradient": [(1.0, 0.1)] * 2, "denoiser": [(1.0, 0.3), (1.0, 0.1)]}
    fake_run(tmp_path / "a" / layout.point_subdir("2d", "inference", 2), "2d", "inference", clean)
    inject = {"rank": 1, "section": "denoiser", "delay_s": 0.2, "fail": False}
    fake_run(tmp_path / "b" / layout.point_subdir("2d", "inference", 2), "2d", "inference", skewed, inject=inject)
    table = pnpscale.load(str(tmp_path)).query("section == 'all'").set_index("variant")
    assert sorted(table.index) == ["inject=none", "inject=rank1:denoiser:+0.2s"]
    assert str(tmp_path / "a") in table.loc["inject=none", "run_dir"]
    assert table.loc["inject=none", "lb"] > table.loc["inject=rank1:denoiser:+0.2s", "lb"]
