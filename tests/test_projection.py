"""Projection past the measured GPU counts: a synthetic sweep from a known model gives that model back."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.results.projection import (
    Options,
    ProjectionError,
    evaluate,
    fit,
    leave_one_out,
    parse_rates,
    project,
)

M, T, P = 8, 64, 3 * 256 * 256 * 4  # operators, tiles, image bytes
#: section -> (fixed s, s per operator, s per tile, latency s, jitter fraction)
TRUTH = {"gradient": (0.01, 0.2, 0.0, 1e-3, 0.02), "denoiser": (0.02, 0.0, 0.05, 5e-4, 0.05)}


def held(total: int, n: int) -> list[int]:
    """Round-robin counts written out: rank r holds items r, r+n, ... (deepinv)."""
    return [len(range(r, total, n)) for r in range(n)]


def truth(n: int, section: str, rate_gbps: float = 5.0, gpus_per_node: int | None = None,
          rates: dict | None = None) -> dict:  # fmt: skip
    a, b, c, lat, phi = TRUTH[section]
    per_rank = [a + b * o + c * t for o, t in zip(held(M, n), held(T, n), strict=True)]
    mean, top = sum(per_rank) / n, max(per_rank)
    nodes = 1 if gpus_per_node is None else math.ceil(n / gpus_per_node)
    if n == 1:
        transfer = wait = 0.0
    else:
        if nodes == 1:
            nbytes, rate = 2 * P * (n - 1) / n, rate_gbps
        else:
            nbytes, rate = 2 * P * (n - 1) / n, rates["inter-node ring"]
        transfer = lat + nbytes / (rate * 1e9)
        wait = (top - mean) + phi * top
    return {K.COMPUTE_S: mean, K.COMPUTE_MAX_S: top, K.TRANSFER_S: transfer, K.WAIT_S: wait,
            K.SECTION_S: mean + transfer + wait, K.NODES: nodes}  # fmt: skip


def sweep(gpus, **kw) -> pd.DataFrame:
    rows = []
    for n in gpus:
        for section in TRUTH:
            rows.append(
                {K.PROBLEM: "2d", K.MODE: "inference", K.GPUS: n, K.SECTION: section, "status": "complete",
                 K.MAIN_PAYLOAD_BYTES: P if n > 1 else pd.NA, K.N_MAIN: 1 if n > 1 else 0,
                 K.OTHER_PAYLOAD_BYTES: 0, "num_operators": M, "num_tiles": T, **truth(n, section, **kw)}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_known_model_is_recovered_at_unmeasured_gpu_counts():
    model = fit(sweep([1, 2, 3, 4]))
    out = evaluate(model, [6, 8, 16, 100, 1024]).set_index([K.GPUS, K.SECTION])
    for n in (6, 8, 16, 100, 1024):
        for section in TRUTH:
            want = truth(n, section)
            for col in (K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.SECTION_S):
                assert out.loc[(n, section), col] == pytest.approx(want[col], rel=1e-6, abs=1e-12), (n, section, col)
        total = sum(truth(n, s)[K.SECTION_S] for s in TRUTH)
        assert out.loc[(n, "all"), K.SECTION_S] == pytest.approx(total, rel=1e-6)
        c = sum(truth(n, s)[K.COMPUTE_S] for s in TRUTH)
        assert out.loc[(n, "all"), K.PE] == pytest.approx(c / total, rel=1e-6)
        assert out.loc[(n, "all"), K.GPU_SECONDS] == pytest.approx(n * total, rel=1e-6)
    assert model.rates["intra-node"] == pytest.approx(5.0, rel=1e-9)


def test_leave_one_out_is_exact_on_the_model_and_has_a_headline():
    v = leave_one_out(sweep([1, 2, 3, 4, 6]))
    assert set(v["held_out_gpus"]) >= {4, 6}
    head = v[v["headline"]]
    assert set(head["held_out_gpus"]) == {6} and (head["fitted_on"] == "1,2,3,4").all()
    assert head[K.REL_ERROR].abs().max() < 1e-6


def test_project_reports_findings_assumptions_and_measured_rows():
    p = project(sweep([1, 2, 3, 4]), [8, 16, 64], Options(pe_min=0.5))
    key = ("2d", "inference")
    assert key in p.findings and not p.skipped
    t = p.table
    assert set(t.loc[t[K.MEASURED], K.GPUS]) == {1, 2, 3, 4}
    assert {8, 16, 64} <= set(t.loc[~t[K.MEASURED], K.GPUS])
    f = p.findings[key]
    grid = evaluate(fit(sweep([1, 2, 3, 4])), range(1, 65))
    a = grid[grid[K.SECTION] == "all"].set_index(K.GPUS)
    assert f["fastest_gpus"] == int(a[K.SECTION_S].idxmin())
    assert f["largest_gpus_pe"] == int(a.index[a[K.PE] >= 0.5].max())
    over = a[(a.index > 1) & (a[K.TRANSFER_S] > a[K.COMPUTE_MAX_S])]
    assert f["crossover_gpus"] == (int(over.index.min()) if not over.empty else None)
    text = " ".join(p.assumptions[key])
    assert "round-robin" in text and "ring (assumed" in text and "rate intra-node" in text


def test_given_inter_node_rate_and_a_missing_one():
    rates = {"inter-node ring": 2.0}
    measured = sweep([1, 2, 3, 4])
    model = fit(measured, Options(gpus_per_node=4, rates=rates))
    out = evaluate(model, [8, 32]).set_index([K.GPUS, K.SECTION])
    for n in (8, 32):
        want = truth(n, "denoiser", gpus_per_node=4, rates=rates)
        assert out.loc[(n, "denoiser"), K.TRANSFER_S] == pytest.approx(want[K.TRANSFER_S], rel=1e-6)
    bare = fit(measured, Options(gpus_per_node=4))
    with pytest.raises(ProjectionError, match="no rate for route 'inter-node ring'.*--rate ring=GBps"):
        evaluate(bare, [8])


def test_too_few_points_or_unknown_assignment_are_refused():
    with pytest.raises(ProjectionError, match="at least 2"):
        fit(sweep([2]))
    with pytest.raises(ProjectionError, match="num_operators is unknown"):
        fit(sweep([1, 2, 4]).drop(columns=["num_operators"]))
    p = project(sweep([1, 2]), [8], min_points=3)
    assert "needs 3" in p.skipped[("2d", "inference")] and p.table.empty


def test_parse_rates():
    assert parse_rates(["ring=10.5", "INTRA=40"]) == {"inter-node ring": 10.5, "intra-node": 40.0}
    with pytest.raises(ProjectionError, match="route must be one of"):
        parse_rates(["nvlink=100"])
    with pytest.raises(ProjectionError, match="positive"):
        parse_rates(["tree=-1"])


def test_command_refuses_bad_input_with_exit_code_2(tmp_path, capsys):
    from pnpscale.results.projection import main

    assert main([str(tmp_path / "nowhere"), "--gpus", "8"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main([str(tmp_path), "--rate", "nvlink=1"]) == 2
    assert "route must be one of" in capsys.readouterr().err


def test_time_sharing_devices_stretch_compute():
    model = fit(sweep([1, 2, 3, 4]), Options(devices=2))
    plain = fit(sweep([1, 2]), Options(devices=2))  # N <= devices: no stretch, same truth
    out = evaluate(plain, [4]).set_index(K.SECTION)
    want = truth(4, "denoiser")
    assert out.loc["denoiser", K.COMPUTE_S] == pytest.approx(2 * want[K.COMPUTE_S], rel=1e-6)
    assert model.devices == 2
