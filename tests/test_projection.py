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


# --- the command on run folders (synthetic sweeps written by the project's own writer) -------------


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_command_projects_each_variant_of_a_sweep(tmp_path, capsys):
    from pnpscale import layout
    from pnpscale.results.projection import main
    from tests.test_compare import write_collective_sweep

    root = write_collective_sweep(tmp_path / "sweep")
    assert main([str(root), "--gpus", "8,16"]) == 0
    out = capsys.readouterr().out
    series = ["2d denoiser_collective=all_gather", "2d denoiser_collective=all_reduce"]
    assert all(f"### Projection: {s} inference" in out for s in series)
    table = pd.read_parquet(root / layout.REPORT_DIR / layout.PROJECTION)
    assert sorted(set(table[K.PROBLEM])) == series
    for s in series:  # one measured row per (GPU count, section) of each series, never two merged
        measured = table[(table[K.PROBLEM] == s) & table[K.MEASURED]]
        assert sorted(set(measured[K.GPUS])) == [1, 2, 4] and not measured.duplicated([K.GPUS, K.SECTION]).any()
    val = pd.read_parquet(root / layout.REPORT_DIR / layout.PROJECTION_VALIDATION)
    assert sorted(set(val[K.PROBLEM])) == series


def test_a_table_with_two_rows_per_point_is_refused_not_merged():
    rows = pd.concat([sweep([1, 2, 4]), sweep([1, 2, 4])], ignore_index=True)
    with pytest.raises(ProjectionError, match="share problem=2d mode=inference gpus=1 section=gradient"):
        leave_one_out(rows)
    p = project(rows, [8])
    assert "share" in p.skipped[("2d", "inference")] and not p.findings


def test_failed_command_leaves_the_report_as_it_was(tmp_path, capsys):
    from pnpscale import layout
    from pnpscale.results.projection import main
    from pnpscale.results.report import write_report
    from tests.test_compare import write_collective_sweep

    root = write_collective_sweep(tmp_path / "sweep")
    report = write_report(root, echo=lambda _: None)
    before = _snapshot(report)
    assert layout.PROJECTION in before
    for args, message in (
        (["--fit-gpus", "1"], "nothing could be projected (2d denoiser_collective=all_gather inference: 1 measured"),
        (["--fit-gpus", "1,3,2,8"], "--fit-gpus=1,3,2,8: no complete run at 3, 8 GPU(s) (measured: 1, 2, 4)"),
        (["--pe-min", "0"], "--pe-min=0: must be in (0, 1]"),
        (["--pe-min", "1.5"], "--pe-min=1.5: must be in (0, 1]"),
        (["--gpus", "x"], "--gpus=x: give positive integers"),
    ):
        assert main([str(root), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)
        assert _snapshot(report) == before, args
    # success: the projection files and the README's projection section change together
    assert main([str(root), "--gpus", "32", "--pe-min", "0.5"]) == 0
    readme = (report / layout.REPORT_README).read_text()
    heads = [line for line in readme.splitlines() if line.startswith("## ")]
    assert [h for h in heads if h.startswith("## Projection")] == ["## Projection past the measured GPU counts"]
    assert heads.index("## Projection past the measured GPU counts") == len(heads) - 2  # before the side by side
    assert "python -m pnpscale.project" in readme and "PE >= 0.5" in readme
    assert readme.count("![projection.png](projection.png)") == 1
    md = (report / layout.PROJECTION_MD).read_text()
    assert "PE >= 0.5" in md and all(line in readme for line in md.splitlines()[2:] if line)
    after = _snapshot(report)
    changed = {k for k in after if after[k] != before[k]}
    assert changed >= {layout.PROJECTION, layout.PROJECTION_MD, layout.REPORT_README}
    assert after[layout.SUMMARY] == before[layout.SUMMARY]


def test_one_gpu_count_writes_nothing(tmp_path, capsys):
    from pnpscale import layout
    from pnpscale.results.projection import main
    from tests.test_compare import write_collective_sweep

    root = write_collective_sweep(tmp_path / "sweep", gpus=(2,))
    assert main([str(root)]) == 2
    assert "nothing could be projected" in capsys.readouterr().err
    assert not (root / layout.REPORT_DIR).exists()
