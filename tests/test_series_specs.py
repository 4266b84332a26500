"""Runs of one point made with different work (sizes, threads) are different series, never one curve.

The case a new user hit: a single run ``problem.overlap=100`` at gpus=1 saved under ``outputs/`` beside a
sweep made with overlap 4 at gpus=1, 2; ``pnpscale.load("outputs/")`` then took the newest gpus=1 (overlap
100) as the sweep's baseline and reported a scaled cost of 0.15 at gpus=2, in silence.
"""

from __future__ import annotations

import pandas as pd

import pnpscale
from pnpscale import columns as K
from pnpscale.core import layout
from tests.test_report import fake_run

TIMES = {1: {"gradient": [(1.0, 0.0)], "denoiser": [(4.0, 0.0)]},
         2: {"gradient": [(0.6, 0.1)] * 2, "denoiser": [(2.2, 0.1)] * 2}}  # fmt: skip


def test_a_run_with_other_sizes_is_its_own_series_and_the_sweep_keeps_its_baseline(tmp_path):
    sweep, single = tmp_path / "2026-01-01_00-00-00", tmp_path / "2026-01-02_00-00-00"
    for g in (1, 2):
        fake_run(sweep / layout.point_subdir("2d", "inference", g), "2d", "inference", TIMES[g])
    slow = {"gradient": [(1.0, 0.0)], "denoiser": [(40.0, 0.0)]}  # a 10x bigger halo: 10x the denoiser
    fake_run(single / layout.point_subdir("2d", "inference", 1), "2d", "inference", slow, sizes={"overlap": 100})

    table = pnpscale.load(tmp_path)
    rows = table[table[K.SECTION] == "all"].set_index(["variant", "gpus"])
    assert set(rows.index) == {("problem.overlap=4", 1), ("problem.overlap=4", 2), ("problem.overlap=100", 1)}
    # the sweep's scaled cost from its own baseline: 2 x (0.6 + 2.2) / (1.0 + 4.0) = 1.12, not 2 x 2.8 / 41
    assert abs(rows.loc[("problem.overlap=4", 2), "scaled_cost"] - 2 * 2.8 / 5.0) < 1e-9
    assert rows.loc[("problem.overlap=100", 1), "scaled_cost"] == 1.0


def test_runs_of_one_spec_get_no_extra_label(tmp_path):
    sweep = tmp_path / "2026-01-01_00-00-00"
    for g in (1, 2):
        fake_run(sweep / layout.point_subdir("2d", "inference", g), "2d", "inference", TIMES[g])
    table = pnpscale.load(tmp_path)
    assert (table["variant"].fillna("") == "").all() or set(table["variant"].dropna()) == {""}
    assert isinstance(table, pd.DataFrame)
