"""Offline analysis (python -m pnpscale.analyze): ranks, matching, tables equal to a live run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, AnalyzeError, assign_ranks, main, rank_from_name
from pnpscale.analysis.trace.read import TraceInfo, read_header
from pnpscale.core import layout
from pnpscale.results.transfer import transfer_inputs, transfer_table
from tests.helpers import ROOT, TINY_2D, run_cli, run_dirs
from tests.test_traces import X, cuda_rank_events, kernel, launch, write_trace

SECTIONS = "gradient,denoiser"


def info(name, rank=None, world=None):
    return TraceInfo(Path("/t") / name, rank, world, None, None)


def run_main(*args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- ranks -----------------------------------------------------------------------------------


def test_rank_from_distributed_info_file_name_or_explicit():
    traces, world = assign_ranks([info("a.json", 1), info("worker_rank0.json.gz"), info("x.json")], {"x.json": 2})
    assert [(t.rank, t.path.name, t.source) for t in traces] == [
        (0, "worker_rank0.json.gz", "file name"),
        (1, "a.json", "distributedInfo"),
        (2, "x.json", "explicit"),
    ]
    assert world == 3  # no trace records a world size: highest rank + 1
    assert rank_from_name("sampled_rank-12.json.gz") == 12 and rank_from_name("RANK_3.pt.trace.json") == 3


@pytest.mark.parametrize(
    ("headers", "explicit", "message"),
    [
        ([], None, "no trace files"),
        ([info("a.json", 0, 2), info("b.json", 0, 2)], None, "rank 0 appears in 2 traces: a.json, b.json"),
        ([info("a.json", 0, 4)], None, r"3 of 4 ranks missing \(rank 1-3\); traces of rank 0: pass --partial to"),
        ([info("trace.json")], None, "trace.json: rank unknown .*pass --rank trace.json=R"),
        ([info("a.json", 0, 2), info("b.json", 1, 4)], None, r"disagree on the world size: \[2, 4\]"),
        ([info("a.json", 5, 2)], None, r"rank\(s\) \[5\] outside the world size 2"),
        ([info("a.json", 0, 1)], {"zz.json": 1}, "--rank names no given trace: zz.json"),
    ],
)
def test_rank_errors_are_named(headers, explicit, message):
    with pytest.raises(AnalyzeError, match=message):
        assign_ranks(headers, explicit)


def test_partial_accepts_the_ranks_present():
    traces, world = assign_ranks([info("r0.json", 0, 128), info("r1.json", 1, 128)], partial=True)
    assert world == 128 and [t.rank for t in traces] == [0, 1]


# --- synthetic jobs ----------------------------------------------------------------------------


def two_rank_job(folder: Path, durations=(30.0, 50.0), **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, dur in enumerate(durations):
        write_trace(folder / f"rank{rank}.json", cuda_rank_events(nccl_dur=dur, **kw), rank=rank, world=len(durations))
    return folder


def test_cli_decomposes_a_cuda_job(tmp_path, capsys):
    job = two_rank_job(tmp_path / "job")
    code, out, err = run_main(job, "--sections", SECTIONS, "--warmup", "1", capsys=capsys)
    assert code == 0, err
    res = job / "analysis"
    sections = pd.read_parquet(res / layout.SECTIONS)
    assert list(sections.columns) == list(K.SECTIONS_COLUMNS)
    assert sections[K.WARMUP].tolist() == [True, True, False, False]
    g = sections[sections[K.SECTION] == "gradient"].iloc[0]
    # the all_reduce took 30 us on rank 0 and 50 us on rank 1: transfer = min, wait = mean excess
    assert g[K.TRANSFER_S] == pytest.approx(30e-6, abs=1e-12) and g[K.WAIT_S] == pytest.approx(10e-6, abs=1e-12)
    assert g[K.MAIN_PAYLOAD_BYTES] == 3072 * 4 and g[K.MAIN_COLLECTIVE] == "all_reduce"
    assert g[K.COMPUTE_S] + g[K.TRANSFER_S] + g[K.WAIT_S] == pytest.approx(g[K.SECTION_S], abs=1e-15)
    assert set(pd.read_parquet(res / layout.RANKS)[K.RANK]) == {0, 1}
    doc = json.loads((res / ANALYSIS_JSON).read_text())
    assert doc["status"] == "complete" and doc["ranks"] == [0, 1] and doc["partial"] is False
    assert doc["warmup"] == 1 and doc["metrics"]["iterations"] == 1
    assert not (res / layout.RUN_JSON).exists()  # never mistaken for a sweep point
    assert "2 of 2 ranks" in out and "gradient" in out


def test_collectives_matched_by_process_group_and_sequence(tmp_path, capsys):
    """Two process groups on two streams, run in opposite orders on the two ranks."""
    job = tmp_path / "pg"
    job.mkdir()

    def rank_events(order):
        evs = [X("step", "user_annotation", 0, 1000)]
        for i, (group, stream, nbytes) in enumerate(order):
            corr = 10 + i
            args = {"Collective name": "allreduce", "In msg nelems": nbytes, "dtype": "Byte"}
            evs += [
                launch(10 + 10 * i, corr),
                kernel("ncclDevKernel_AllReduce_Sum_u8_RING_LL", 100 + 100 * i, 20 + i, corr, stream=stream,
                       **args, **{"Process Group Name": group, "Seq": 0}),
            ]  # fmt: skip
        return evs

    a, b = ("0", 20, 1000), ("1", 30, 8)
    write_trace(job / "r0.json", rank_events([a, b]), rank=0, world=2)
    write_trace(job / "r1.json", rank_events([b, a]), rank=1, world=2)
    code, _, err = run_main(job, "--sections", "step", "--out", tmp_path / "out", capsys=capsys)
    assert code == 0, err
    colls = pd.read_parquet(tmp_path / "out" / layout.COLLECTIVES)
    per_seq = colls.groupby(K.SEQ)[K.PAYLOAD_BYTES].agg(set).tolist()
    assert per_seq == [{1000}, {8}]  # each seq is one collective on both ranks
    for durations in colls.groupby(K.SEQ)[K.DURATION_S].agg(sorted):
        assert durations == pytest.approx([20e-6, 21e-6], abs=1e-15)


def test_unmatched_collectives_and_missing_sections_are_one_line_errors(tmp_path, capsys):
    job = tmp_path / "bad"
    job.mkdir()
    write_trace(job / "rank0.json", cuda_rank_events(), rank=0, world=2)
    # rank 1's second collective kernel and its launch are gone (a launch left without its kernel would only drop
    # that iteration, named: tests/test_trace_conservation.py); its descriptor is left
    one = [e for e in cuda_rank_events()
           if not e["name"].startswith("ncclDev") and e.get("args", {}).get("correlation") != 201]  # fmt: skip
    one += [e for e in cuda_rank_events() if e["name"].startswith("ncclDev")][:1]
    write_trace(job / "rank1.json", one, rank=1, world=2)
    code, _, err = run_main(job, "--sections", SECTIONS, "--out", tmp_path / "o", capsys=capsys)
    assert code == 1 and err.count("\n") == 1
    assert (
        "iteration 1 section 'gradient': rank 1 has 1 collective(s) on the CPU side (record_param_comms / nccl:*) "
        "without a GPU kernel in the trace (0 kernel(s) for them): the profiler dropped kernels" in err
    )
    code, _, err = run_main(job, "--sections", "forward", "--out", tmp_path / "o", capsys=capsys)
    assert code == 1 and "rank 0 (rank0.json): section ranges found per name: forward=0" in err
    assert not (tmp_path / "o").exists()


def test_cli_rank_errors(tmp_path, capsys):
    job = two_rank_job(tmp_path / "job")
    (job / "rank1.json").unlink()
    code, _, err = run_main(job, "--sections", SECTIONS, capsys=capsys)
    assert code == 1 and err == (
        "pnpscale.analyze: error: 1 of 2 ranks missing (rank 1); traces of rank 0: pass --partial to analyse the 1 "
        "present\n"
    )
    code, _, err = run_main(job / "rank0.json", job / "rank0.json", "--sections", SECTIONS, capsys=capsys)
    assert code == 1 and "rank 0 appears in 2 traces: rank0.json, rank0.json" in err
    # refused input, before any trace is read: exit 2 as every command's (an InputError's)
    code, _, err = run_main(tmp_path / "nowhere", "--sections", SECTIONS, capsys=capsys)
    assert code == 2 and "nowhere: no such file or folder" in err
    code, _, err = run_main(job, "--sections", SECTIONS, "--rank", "rank0.json=x", capsys=capsys)
    assert code == 2 and "expected FILE=RANK" in err
    twice = ("--rank", "rank0.json=0", "--rank", "rank0.json=1")
    code, _, err = run_main(job, "--sections", SECTIONS, *twice, capsys=capsys)
    assert code == 2 and "--rank rank0.json=0 and --rank rank0.json=1: one file, two ranks" in err  # not the last
    for bad in (("--warmup", "-3"), ("--jobs", "0")):
        code, _, err = run_main(job, "--sections", SECTIONS, *bad, capsys=capsys)
        assert code == 2 and err.startswith(f"pnpscale.analyze: error: {bad[0]} {bad[1]}: must be >= "), err


# --- the real traces -----------------------------------------------------------------------------


def test_real_rank_of_two_alone_needs_partial(shared_traces, tmp_path, capsys):
    src = shared_traces / "nccl_parser_config"
    code, _, err = run_main(src, "--sections", "step=ProfilerStep#*", "--out", tmp_path, capsys=capsys)
    assert code == 1 and "1 of 2 ranks missing (rank 1); traces of rank 0" in err
    code, out, err = run_main(src, "--sections", "step=ProfilerStep#*", "--partial", "--out", tmp_path, capsys=capsys)
    assert code == 0, err
    sections = pd.read_parquet(tmp_path / layout.SECTIONS)
    assert len(sections) == 3 and (sections[K.N_COLLECTIVES] == 7).all() and (sections[K.WAIT_S] == 0).all()
    assert "partial analysis: ranks 0 of 2" in out


def test_real_sampled_pair_of_128(shared_traces, tmp_path, capsys):
    src = shared_traces / "trace_filter"
    code, out, err = run_main(src, "--sections", "step=ProfilerStep#*", "--partial", "--out", tmp_path, capsys=capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / ANALYSIS_JSON).read_text())
    assert doc["world_size"] == 128 and doc["ranks"] == [0, 1] and doc["partial"] is True
    assert [t["time_base"] for t in doc["traces"]] == ["absolute", "absolute"]
    colls = pd.read_parquet(tmp_path / layout.COLLECTIVES)
    assert len(colls) == 2 * 2 * 5  # ranks x steps x NCCL kernels, matched by order within each stream
    sections = pd.read_parquet(tmp_path / layout.SECTIONS)
    dmin = colls.groupby([K.ITERATION, K.SEQ])[K.DURATION_S].min().groupby(K.ITERATION).sum()
    # a real training job: its NCCL kernels overlap compute kernels on other streams, so the rank is blocked
    # on them for less than their length (the study's min_r D_rc counts them whole): transfer is the blocked
    # time after the last rank entered, at most min_r D_rc; the rest of each kernel is hidden
    assert (sections[K.TRANSFER_S].to_numpy() <= dmin.to_numpy() + 1e-12).all()
    assert (colls[K.BLOCKED_S] + colls[K.HIDDEN_S] - colls[K.DURATION_S]).abs().max() < 1e-9  # one stream
    assert sections[K.HIDDEN_S].sum() > 0.05 and (colls[K.HIDDEN_S] > 0).mean() > 0.5


def test_real_gloo_trace_with_file_name_and_distributed_info(shared_traces, tmp_path, capsys):
    src = shared_traces / "cpu_only"
    (trace,), world = assign_ranks([read_header(f) for f in src.iterdir()], partial=True)
    assert (trace.rank, trace.source, world, trace.info.backend) == (34, "distributedInfo", 300, "gloo")
    # its two gloo:all_reduce run concurrently on two worker threads: 0.34 s of collectives in a 0.21 s
    # step, refused once (their sum gave a negative compute); counted once, their union: 18.476 ms to
    # 26.783 + 170.471 ms after the step's start = 0.178777 s (no operator recorded: nothing hidden)
    code, _, err = run_main(src, "--sections", "step=ProfilerStep#*", "--partial", "--out", tmp_path, capsys=capsys)
    assert code == 0, err
    ranks = pd.read_parquet(tmp_path / layout.RANKS).iloc[0]
    assert ranks[K.COMM_S] == pytest.approx(0.026782656 + 0.170471258 - 0.018476487, abs=1e-9)
    assert ranks[K.HIDDEN_S] == 0 and ranks[K.SECTION_S] == pytest.approx(0.210109162)
    sec = pd.read_parquet(tmp_path / layout.SECTIONS).iloc[0]
    assert sec[K.COMPUTE_S] + sec[K.TRANSFER_S] + sec[K.WAIT_S] == pytest.approx(sec[K.SECTION_S], abs=1e-9)


# --- offline == live ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    proc = run_cli("gpus=2", *TINY_2D, "profile.export_traces=true", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(root)
    return run_dir


@pytest.fixture(scope="module")
def live_gated_run(tmp_path_factory):
    """The same run, its operators recorded only around collectives (exported traces otherwise keep them all)."""
    root = tmp_path_factory.mktemp("live_gated")
    proc = run_cli("gpus=2", *TINY_2D, "profile.export_traces=true", "profile.operators=collectives", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(root)
    for trace in (run_dir / "traces").iterdir():  # DRUNet's convolutions ran unrecorded, the collectives not
        text = trace.read_text()
        assert "aten::convolution" not in text and '"c10d::allreduce_"' in text, trace
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("which", ["live_run", "live_gated_run"])
def test_offline_analysis_of_exported_traces_equals_the_live_run(which, request, tmp_path):
    """Kineto writes ts and dur in microseconds with 3 decimals (1 ns), so each offline time equals
    the live one to ~1 ns; derived values add or subtract at most a few such times: 10 ns absolute
    tolerance for seconds, and a relative 1e-5 for the ratio LB (section times are >= 1 ms). The same with
    operators recorded only around collectives (``profile.operators=collectives``)."""
    live_run = request.getfixturevalue(which)
    out = tmp_path / "offline"
    # the run folder stands for its traces/ folder
    cmd = [sys.executable, "-m", "pnpscale.analyze", str(live_run), "--sections", SECTIONS, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "warm-up 1 (" in proc.stdout  # taken from the run's run.json
    for name in (layout.RANKS, layout.COLLECTIVES, layout.SECTIONS):
        live, off = pd.read_parquet(live_run / name), pd.read_parquet(out / name)
        assert list(off.columns) == list(live.columns) and off.dtypes.equals(live.dtypes), name
        assert len(off) == len(live), name
        floats = [c for c in live.columns if live[c].dtype.kind == "f"]
        exact = [c for c in live.columns if c not in floats and c not in (K.PEAK_MEM_BYTES, K.PROCESS_GROUP)]
        pd.testing.assert_frame_equal(off[exact], live[exact], check_exact=True)
        if K.PROCESS_GROUP in live:  # the live run knows each call's group; a gloo trace names none (docs/outputs.md)
            assert set(live[K.PROCESS_GROUP]) == {"0"} and off[K.PROCESS_GROUP].isna().all(), name
        for c in floats:
            rtol, atol = (1e-5, 0.0) if c == K.LB else (0.0, 1e-8)
            assert np.allclose(off[c], live[c], rtol=rtol, atol=atol, equal_nan=True), (name, c)
    assert pd.read_parquet(out / layout.RANKS)[K.PEAK_MEM_BYTES].isna().all()  # not in a trace
    # the offline analysis writes the same timeline: the same slices, to ~1 ns
    live_tl, off_tl = (json.loads((d / layout.TIMELINE_JSON).read_text())["traceEvents"] for d in (live_run, out))
    assert [(e["name"], e["pid"]) for e in off_tl] == [(e["name"], e["pid"]) for e in live_tl]
    assert np.allclose([e.get("dur", 0) for e in off_tl], [e.get("dur", 0) for e in live_tl], atol=0.01)  # us
    # both analyses state their anomalies, here none
    assert json.loads((live_run / layout.RUN_JSON).read_text())["anomalies"] == []
    assert json.loads((out / ANALYSIS_JSON).read_text())["anomalies"] == []
    assert "pnpscale.analyze: anomalies: none (nothing dropped, assumed or repaired)" in proc.stdout


@pytest.mark.slow
def test_transfer_table_of_a_live_gloo_run(live_run):
    table = transfer_table(transfer_inputs([live_run]))
    assert table[K.SECTION].tolist() == ["gradient", "denoiser"]
    assert (table[K.ALGORITHM_SOURCE] == "assumed").all() and (table[K.ROUTE] == "intra-node, 2 GPUs").all()
    assert (table[K.ALGORITHM_NOTE] == "gloo: no NCCL log; ring assumed").all()
    # 32x32 RGB float32 image, ring on 2 ranks: each rank sends one payload
    assert (table[K.PAYLOAD_BYTES] == 3 * 32 * 32 * 4).all() and (table[K.BYTES_PER_GPU] == 3 * 32 * 32 * 4).all()
    assert (table[K.RATE_GBPS] > 0).all() and np.isfinite(table[K.REL_ERROR]).all()


@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable"])
def test_a_bad_out_is_refused_before_any_trace_or_run_is_read(tmp_path, capsys, kind):
    """analyze, report and project refuse the same --out the same way: one line naming --out, exit 2, before
    reading anything (the trace here is garbage and the folder holds no run: reading either would say so)."""
    from pnpscale.results.projection.command import main as project
    from pnpscale.results.report import main as report

    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "rank0.json").write_text("{garbage")
    (tmp_path / "file").write_text("x")
    out = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "sub", "unwritable": Path("/proc/x")}[kind]
    why = {"a file": "is a file, not a folder", "under a file": f"{tmp_path / 'file'} is a file, so no folder",
           "unwritable": "must be a folder this user can create and write"}[kind]  # fmt: skip
    for prog, command in (("pnpscale.analyze", lambda: main([str(tmp_path / "traces"), "--sections", "gradient",
                                                             "--out", str(out)])),
                          ("pnpscale.report", lambda: report([str(tmp_path), "--out", str(out)])),
                          ("pnpscale.project", lambda: project([str(tmp_path), "--out", str(out)]))):  # fmt: skip
        assert command() == 2, prog
        captured = capsys.readouterr()
        (line,) = captured.err.strip().splitlines()
        assert line.startswith(f"{prog}: error: --out {out}: {why}"), line
        assert not captured.out
    assert not (tmp_path / "report").exists() and (tmp_path / "file").read_text() == "x"
    if kind == "a file":  # a file given as the folder of runs is named a file, not "no such directory"
        assert report([str(tmp_path / "file")]) == 2
        assert capsys.readouterr().err.strip() == (
            f"pnpscale.report: error: {tmp_path / 'file'}: is a file, not a folder of run folders "
            "(give the sweep folder)"
        )


def test_a_named_file_that_is_no_trace_and_an_analysis_folder_are_refused_input(tmp_path, capsys):
    """Exit 2, one line: a file given by name that is no JSON trace (a README), and a folder this command wrote
    (its timeline.json is a Chrome trace of the analysis, never a rank's trace); a damaged trace stays exit 1."""
    readme = tmp_path / "README.md"
    readme.write_text("# not a trace\n")
    assert main([str(readme), "--sections", "a"]) == 2
    assert f"{readme}: not a JSON trace" in capsys.readouterr().err
    out = tmp_path / "analysis"
    out.mkdir()
    (out / ANALYSIS_JSON).write_text("{}")
    (out / "timeline.json").write_text('{"traceEvents": []}')
    assert main([str(out), "--sections", "a"]) == 2
    assert f"{out}: an analysis output folder" in capsys.readouterr().err
    cut = tmp_path / "rank0.json"
    cut.write_bytes(b'{"schemaVersion": 1, "traceEvents": [{"ph": "X", "ts": 1,')
    assert main([str(cut), "--sections", "a"]) == 1
