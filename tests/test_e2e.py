"""End to end on CPU ranks (gloo): the main job writes measured, additive run folders."""

from __future__ import annotations

import json
import os
import time

import pandas as pd
import pytest
import torch

from pnpscale import columns as K
from pnpscale.core import layout
from tests.helpers import TINY_2D, read_run, run_cli, run_dirs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    proc = run_cli("-m", "gpus=1,2", *TINY_2D, "output.save_reconstruction=true", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dirs = {read_run(d)["gpus"]: d for d in run_dirs(root)}
    assert set(dirs) == {1, 2}
    return proc, dirs


def test_hive_layout_and_documented_files(sweep):
    _, dirs = sweep
    for gpus, d in dirs.items():
        # problem.num_operators set explicitly (TINY_2D): a variant part of its own
        assert d.parts[-4:] == ("problem=2d", "mode=inference", "num_operators=4", f"gpus={gpus}")
        for name in (layout.RUN_JSON, layout.RANKS, layout.SECTIONS, layout.COLLECTIVES):
            assert (d / name).is_file(), name
        assert list(pd.read_parquet(d / layout.RANKS).columns) == list(K.RANKS_COLUMNS)
        assert list(pd.read_parquet(d / layout.SECTIONS).columns) == list(K.SECTIONS_COLUMNS)
        assert list(pd.read_parquet(d / layout.COLLECTIVES).columns) == list(K.COLLECTIVES_COLUMNS)


def test_run_json_provenance(sweep):
    _, dirs = sweep
    run = read_run(dirs[2])
    assert run["status"] == "complete" and run["error"] is None
    assert run["backend"] == "gloo" and run["world_size"] == 2 and run["nodes"] == 1
    assert run["scale"] == "tiny" and run["scale_requested"] == "tiny"
    assert run["versions"]["torch"].startswith("2.14.1") and run["versions"]["deepinv"].startswith("0.5")
    assert len(run["device_names"]) == 2 and run["assignment"]["operators_per_rank"] == [2, 2]
    assert run["assignment"]["tiles_per_rank"] == [8, 8] and run["assignment"]["num_tiles"] == 16
    assert run["config"]["gpus"] == 2 and run["timings"]["measure_s"] > 0
    cores = len(os.sched_getaffinity(0))  # the ranks' cores: time-shared when 2 ranks' threads need more
    assert run["cores"] == cores and run["time_shared"] is (2 * run["threads_per_rank"] > cores)
    assert 0 < run["metrics"]["pe"] <= 1 and run["metrics"]["iterations"] == 2
    # issue 19: every rank of a real sweep started clean (not a bad fork), each its own process
    procs = run["processes"]
    assert [p["rank"] for p in procs] == [0, 1] and not any(p["cuda_bad_fork"] for p in procs)
    assert len({p["pid"] for p in procs}) == 2


def test_two_ranks_measured_and_additive(sweep):
    _, dirs = sweep
    ranks = pd.read_parquet(dirs[2] / layout.RANKS)
    sections = pd.read_parquet(dirs[2] / layout.SECTIONS)
    colls = pd.read_parquet(dirs[2] / layout.COLLECTIVES)
    assert len(ranks) == 2 * 3 * 2  # ranks x (warm-up + 2) x sections
    assert (ranks[K.SECTION_S] > 0).all() and (colls[K.DURATION_S] > 0).all()
    assert (ranks[K.PEAK_MEM_BYTES] > 0).all()
    peak = json.loads((dirs[2] / layout.RUN_JSON).read_text())["peak_memory"]
    assert peak["bytes_per_rank"] == ranks.groupby(K.RANK)[K.PEAK_MEM_BYTES].max().tolist()
    assert peak["max_bytes"] == max(peak["bytes_per_rank"]) > 0 and peak["source"].startswith("cpu")
    assert sections[K.WARMUP].tolist() == [True, True, False, False, False, False]
    total = sections[K.COMPUTE_S] + sections[K.TRANSFER_S] + sections[K.WAIT_S]
    assert (total - sections[K.SECTION_S]).abs().max() < 1e-9
    assert (sections[K.TRANSFER_S] > 0).all()
    # deepinv: the gradient runs 2 broadcasts + 2 all_reduces, the denoiser one all_reduce
    per = sections.groupby(K.SECTION)[K.N_COLLECTIVES].first().to_dict()
    assert per == {"gradient": 4, "denoiser": 1}
    image_bytes = 3 * 32 * 32 * 4
    assert (sections[K.MAIN_PAYLOAD_BYTES] == image_bytes).all()
    assert set(sections[K.MAIN_COLLECTIVE]) == {"all_reduce"}


def test_one_rank_has_zero_wait_and_no_collectives(sweep):
    _, dirs = sweep
    sections = pd.read_parquet(dirs[1] / layout.SECTIONS)
    assert (sections[K.WAIT_S] == 0).all() and (sections[K.TRANSFER_S] == 0).all()
    assert (sections[K.N_COLLECTIVES] == 0).all()
    assert pd.read_parquet(dirs[1] / layout.COLLECTIVES).empty
    assert (sections[K.COMPUTE_S] == sections[K.SECTION_S]).all()


def test_two_rank_reconstruction_equals_one_rank(sweep):
    _, dirs = sweep
    x1 = torch.load(dirs[1] / layout.RECONSTRUCTION)
    x2 = torch.load(dirs[2] / layout.RECONSTRUCTION)
    assert x1.shape == (1, 3, 32, 32)
    assert torch.allclose(x1, x2, atol=1e-6, rtol=1e-5), float((x1 - x2).abs().max())


def test_progress_and_output_folder_are_shown(sweep):
    proc, dirs = sweep
    assert "iteration 3/3" in proc.stdout + proc.stderr
    assert str(dirs[2]) in proc.stdout + proc.stderr


def test_failing_rank_ends_the_run_quickly_with_its_error(tmp_path):
    t0 = time.monotonic()
    proc = run_cli(
        "gpus=2", *TINY_2D, "inject.rank=1", "inject.section=denoiser", "inject.fail=true", root=tmp_path, timeout=120
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 60
    assert "rank 1 failed: InjectedFailure: rank 1: injected failure in section 'denoiser'" in proc.stderr
    assert "Traceback" not in proc.stderr
    # one line: neither Hydra's "Error executing job with overrides" nor its HYDRA_FULL_ERROR hint
    assert proc.stderr.strip().splitlines() == [
        line for line in proc.stderr.strip().splitlines() if line.startswith("pnpscale: error: ")
    ][-1:], proc.stderr
    (d,) = run_dirs(tmp_path)
    run = read_run(d)
    assert run["status"] == "failed" and "InjectedFailure" in run["error"]
    assert not any((d / name).exists() for name in layout.TABLES)


def test_multirun_ends_with_a_report(sweep):
    _, dirs = sweep
    report = dirs[1].parents[3] / layout.REPORT_DIR  # .../problem=2d/mode=inference/num_operators=4/gpus=1
    for name in ("scaled_cost.png", "load_balance.png", "summary.parquet", "README.md"):
        assert (report / name).is_file(), name
    summary = pd.read_parquet(report / "summary.parquet")
    assert sorted(summary["gpus"].unique()) == [1, 2] and (summary["status"] == "complete").all()
    one = summary[(summary["gpus"] == 1) & (summary[K.SECTION] == "all")]
    assert one["scaled_cost"].iloc[0] == 1.0


def test_two_rank_timeline_adds_up_to_the_section_times_and_the_report_draws_it(sweep):
    """timeline.json of the 2-rank run: per rank x measured iteration x section the slices add up to the rank's
    section time (1 %), and their kinds averaged over ranks to the section's compute / transfer / wait."""
    from pnpscale.analysis import timeline_slices as T
    from tests.trace_event_format import check_trace

    _, dirs = sweep
    text = (dirs[2] / layout.TIMELINE_JSON).read_text(encoding="utf-8")
    assert check_trace(text)[1] == []  # the Trace Event Format and Perfetto importer's rules
    doc = json.loads(text)
    ranks = pd.read_parquet(dirs[2] / layout.RANKS)
    sections = pd.read_parquet(dirs[2] / layout.SECTIONS)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    assert names == {T.PID_BASE: "rank 0", T.PID_BASE + 1: "rank 1"}
    xs = pd.DataFrame(
        [{"rank": e["pid"] - T.PID_BASE, **e["args"], "kind": e["name"], "dur_s": e["dur"] / 1e6}
         for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == T.SLICES_TID]
    )  # fmt: skip
    assert set(xs["kind"]) == {"compute", "transfer", "wait"} and set(xs["warmup"]) == {True, False}
    comm = xs[xs["kind"] != "compute"]
    assert comm["collective"].notna().all() and (comm.loc[comm["collective"] == "all_reduce", "bytes"] > 0).all()
    m = xs[~xs["warmup"]]
    got = m.groupby(["rank", "iteration", "section"])["dur_s"].sum()
    want = ranks[~ranks[K.WARMUP]].set_index([K.RANK, K.ITERATION, K.SECTION])[K.SECTION_S]
    assert len(got) == len(want) == 2 * 2 * 2
    assert ((got / want.reindex(got.index) - 1).abs() < 0.01).all()
    per_kind = m.groupby(["iteration", "section", "kind"])["dur_s"].sum().unstack("kind") / 2
    sec = sections[~sections[K.WARMUP]].set_index([K.ITERATION, K.SECTION]).reindex(per_kind.index)
    for kind, col in (("compute", K.COMPUTE_S), ("transfer", K.TRANSFER_S), ("wait", K.WAIT_S)):
        assert ((per_kind[kind] - sec[col]).abs() <= 0.01 * sec[K.SECTION_S]).all(), kind
    report = dirs[1].parents[3] / layout.REPORT_DIR
    assert (report / layout.TIMELINE_PNG).read_bytes()[:4] == b"\x89PNG"
    summary = pd.read_parquet(report / layout.SUMMARY)
    assert summary[list(K.SPREAD_COLUMNS)].notna().all().all() and (summary["iterations"] == 2).all()
    assert "## One iteration per rank" in (report / layout.REPORT_README).read_text()


def test_ctrl_c_stops_the_whole_sweep_and_records_the_point(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pnpscale", "-m", "gpus=1,2", *TINY_2D, "iterations=400", "warmup=0",
           f"output.root={tmp_path / 'outputs'}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stdout:  # wait until the first point's rank is iterating
        lines.append(line)
        if "iteration 2/400" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + out
    dirs = {read_run(x)["gpus"]: x for x in run_dirs(tmp_path)}
    assert sorted(dirs) == [1, 2]
    second = read_run(dirs[2])  # the second point never started: recorded as not run, no tables
    assert second["status"] == layout.STATUS_NOT_RUN and "interrupted" in second["error"]
    assert not any((dirs[2] / name).exists() for name in layout.TABLES)
    d = dirs[1]
    run = read_run(d)
    assert run["gpus"] == 1 and run["status"] == "failed" and run["error"].startswith("interrupted")
    assert not any((d / name).exists() for name in layout.TABLES)
    assert "hydra.sweep.dir=" in out and (d.parents[3] / layout.REPORT_DIR / "README.md").is_file()


def test_resume_skips_the_same_spec_and_refuses_to_overwrite_another(tmp_path):
    """A point run with more threads than CPUs says its ranks share cores; its resume skips it and says nothing
    of a run it does not make; another spec in the same folder is refused, naming what differs."""
    sweep = f"hydra.sweep.dir={tmp_path / 'outputs' / 'sweep'}"
    crowded = f"dist.threads_per_rank={len(os.sched_getaffinity(0)) + 1}"
    first = run_cli("-m", "gpus=1", *TINY_2D, crowded, sweep, "report=false", root=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "ranks share cores" in first.stderr + first.stdout, first.stderr[-2000:]
    (d,) = run_dirs(tmp_path)
    before = read_run(d)
    again = run_cli("-m", "gpus=1", *TINY_2D, crowded, sweep, "report=false", root=tmp_path)
    skipped = "skipping problem=2d mode=inference num_operators=4 gpus=1"
    assert again.returncode == 0 and skipped in again.stderr + again.stdout
    assert "ranks share cores" not in again.stderr + again.stdout, again.stderr[-2000:]
    other = run_cli("-m", "gpus=1", *TINY_2D, crowded, "iterations=3", sweep, "report=false", root=tmp_path)
    assert other.returncode == 2
    assert "resume=true:" in other.stderr and "holds a complete run of another spec" in other.stderr
    assert "iterations: 2 (stored) vs 3" in other.stderr, other.stderr  # what differs, not only fingerprints
    assert read_run(d) == before


@pytest.mark.slow
def test_a_damaged_complete_point_is_run_again_and_said_so(tmp_path):
    """A resumed sweep re-runs a point whose folder is damaged and says why, whether its run.json was cut short
    (no status left to read) or one of its tables was edited (its digest); the point ends complete."""
    sweep = f"hydra.sweep.dir={tmp_path / 'outputs' / 'sweep'}"
    args = ["-m", "gpus=1", *TINY_2D, sweep, "report=false"]
    first = run_cli(*args, root=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (d,) = run_dirs(tmp_path)
    record = d / layout.RUN_JSON
    record.write_text(record.read_text()[:120])  # cut short, as by a crash of the file system
    again = run_cli(*args, root=tmp_path)
    said = again.stderr + again.stdout
    assert again.returncode == 0, said[-2000:]
    assert f"the run.json in {d} is unreadable (not JSON (" in said and "running it again" in said, said[-2000:]
    assert read_run(d)["status"] == "complete"
    table = d / layout.SECTIONS
    table.write_bytes(table.read_bytes()[:-1] + b"\0")  # one byte of a table changed
    third = run_cli(*args, root=tmp_path)
    said = third.stderr + third.stdout
    assert third.returncode == 0 and f"the complete run in {d} is unreadable (" in said, said[-2000:]
    assert read_run(d)["status"] == "complete"
