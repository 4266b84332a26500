"""The trace contract: every number right or refused out loud (issue "a trace contract with an anomaly report").

First the eight small cases of tests/data/trace-contract (one Kineto trace per rank, right answers in its
README), then one synthetic test per class of fault.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.anomalies import Anomalies, summary_lines
from pnpscale.analysis.events import Event, Kind, SectionError
from pnpscale.analysis.kineto import COLLECTIVE_KERNELS, is_collective_kernel, kernel_collective, kernel_family
from pnpscale.analysis.metrics import InvariantError, check_invariants, decompose
from pnpscale.analysis.nccl_log import algorithm_for, merge_logs, parse_nccl_log
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.analysis.section.records import section_records
from pnpscale.analysis.trace.read import TraceError, read_header, read_trace
from pnpscale.core import layout
from pnpscale.results.report import _anomalies_markdown
from pnpscale.results.transfer import route_label
from tests.test_traces import X, cuda_rank_events, kernel, write_trace

CASES = Path(__file__).parent / "data" / "trace-contract"
SECTIONS = "gradient,denoiser"


def analyze(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def totals(out: Path) -> pd.DataFrame:
    """Sums over the measured iterations per section (seconds), from sections.parquet."""
    s = pd.read_parquet(out / layout.SECTIONS)
    return s.groupby(K.SECTION)[[K.COMPUTE_S, K.TRANSFER_S, K.WAIT_S]].sum()


def anomalies_of(out: Path) -> dict[str, list[dict]]:
    doc = json.loads((out / ANALYSIS_JSON).read_text())
    by: dict[str, list[dict]] = {}
    for a in doc["anomalies"]:
        by.setdefault(a["kind"], []).append(a)
    return by


REFERENCE = {"gradient": (0.000135, 9e-05, 3e-05), "denoiser": (0.000465, 9e-05, 6e-05)}


def assert_reference(out: Path, iterations: int = 3):
    t = totals(out)
    for sec, (c, tr, w) in REFERENCE.items():
        scale = iterations / 3
        assert t.loc[sec].tolist() == pytest.approx([c * scale, tr * scale, w * scale], abs=1e-12), sec


# --- the eight cases -------------------------------------------------------------------------------


def test_case_06_reference_and_zero_anomalies_stated(tmp_path, capsys):
    code, out, _ = analyze(capsys, CASES / "06_ref_valid_corr", "--sections", SECTIONS, "--out", tmp_path)
    assert code == 0
    assert_reference(tmp_path)
    assert json.loads((tmp_path / ANALYSIS_JSON).read_text())["anomalies"] == []
    assert "pnpscale.analyze: anomalies: none (nothing dropped, assumed or repaired)" in out


def test_case_06a_correlation_zero_is_unknown_and_paired_with_descriptors(tmp_path, capsys):
    code, out, _ = analyze(capsys, CASES / "06a_corr0", "--sections", SECTIONS, "--out", tmp_path)
    assert code == 0
    assert_reference(tmp_path)  # not 0.00171 (13x): correlation 0 never matches a launch
    (a0, a1) = anomalies_of(tmp_path)["launch_unknown_paired"]
    assert (a0["rank"], a0["count"], a1["rank"], a1["count"]) == (0, 6, 1, 6)
    assert "anomaly launch_unknown_paired: 12 on ranks 0, 1: collective kernel with correlation 0" in out


def test_case_07_descriptor_wins_over_the_kernel_name(tmp_path, capsys):
    code, _, _ = analyze(capsys, CASES / "07_allreduce_in_sendrecv_kernel", "--sections", SECTIONS, "--out", tmp_path)
    assert code == 0
    colls = pd.read_parquet(tmp_path / layout.COLLECTIVES)
    assert set(colls[K.COLLECTIVE]) == {"all_reduce"} and set(colls[K.PAYLOAD_BYTES]) == {12288}
    assert_reference(tmp_path)
    assert anomalies_of(tmp_path)["kernel_name_disagrees"][0]["example"].startswith(
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t ran all_reduce"
    )


def test_case_02a_negative_duration_drops_the_iteration_loudly(tmp_path, capsys):
    code, out, _ = analyze(capsys, CASES / "02a_negdur_nccl", "--sections", SECTIONS, "--out", tmp_path)
    assert code == 0
    sections = pd.read_parquet(tmp_path / layout.SECTIONS)
    assert sorted(set(sections[K.ITERATION])) == [0, 2]
    assert (sections[[K.COMPUTE_S, K.TRANSFER_S, K.WAIT_S]] >= 0).all(axis=None)
    assert_reference(tmp_path, iterations=2)  # the valid iterations are the reference's
    (a,) = anomalies_of(tmp_path)["non_physical_timing"]
    assert a["rank"] == 1 and a["example"].startswith(
        "iteration 1 section 'gradient': 'ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)': "
        "negative dur -1002068 us"
    )
    assert "anomaly non_physical_timing: 1 on rank 1" in out


def test_case_09_nested_sections_all_row_from_non_overlapping_time(tmp_path, capsys):
    code, out, _ = analyze(
        capsys, CASES / "09_nested_sections", "--sections", "step=ProfilerStep#*,gradient,denoiser", "--out", tmp_path
    )
    assert code == 0
    doc = json.loads((tmp_path / ANALYSIS_JSON).read_text())
    assert doc["nested_sections"] == {"gradient": "step", "denoiser": "step"}
    # 'all' = the step (compute 0.00405, transfer 0.0012, wait 0.00045 summed over 3 iterations), not 0.0072;
    # printed per measured iteration
    (one,) = [line for line in out.splitlines() if line.strip().startswith("all")]
    assert one.split()[2:5] == ["0.00135", "0.0004", "0.00015"]
    assert "nested sections left out: gradient (inside step), denoiser (inside step)" in out


def test_case_08_steps_matched_by_number(tmp_path, capsys):
    code, _, _ = analyze(capsys, CASES / "08_step_sets_differ", "--sections", "step=ProfilerStep#*", "--out", tmp_path)
    assert code == 0
    ranks = pd.read_parquet(tmp_path / layout.RANKS)
    assert sorted(set(ranks[K.ITERATION])) == [0, 1, 2]
    (a,) = anomalies_of(tmp_path)["step_not_on_every_rank"]
    assert (a["rank"], a["count"], a["example"]) == (1, 1, "ProfilerStep #1 (steps on every rank: #2-4)")
    t = totals(tmp_path).loc["step"]  # rank 1's #1 (a 500 us all_reduce) is not paired with rank 0's #2
    assert t.tolist() == pytest.approx([0.00405, 0.0012, 0.00045], abs=1e-12)


def test_case_19b_dropped_kernels_named(tmp_path, capsys):
    """Rank 1's last kernels missing from a file Kineto did not close: what a file cut short looks like (Kineto
    writes the GPU events last); the iteration is dropped on every rank, both causes named, the others kept."""
    code, _, err = analyze(capsys, CASES / "19b_dropped_kernels", "--sections", SECTIONS, "--out", tmp_path)
    assert code == 0, err
    (a,) = anomalies_of(tmp_path)["trace_cut_short"]
    assert a["rank"] == 1 and a["example"].startswith("iteration 2 section 'gradient': 2 launch(es) inside it")
    assert "cut short (or the profiler dropped those GPU records)" in a["example"]
    assert sorted(set(pd.read_parquet(tmp_path / layout.SECTIONS)[K.ITERATION])) == [0, 1]
    (d,) = anomalies_of(tmp_path)["collective_without_kernel"]
    assert d["rank"] == 1 and d["example"].startswith("iteration 2 section 'gradient'")


def test_dropped_kernels_in_a_file_kineto_closed_drop_their_iteration_naming_the_profiler(tmp_path, capsys):
    """The same kernels missing from a file that ends with Kineto's last event: not a cut, but the launch without
    its GPU event still shows the iteration incomplete: dropped on every rank, the profiler named (issue #33)."""
    job = tmp_path / "job"
    job.mkdir()
    marker = ',{"ph": "i", "cat": "", "name": "Record Window End", "s": "g", "pid": "", "tid": "", "ts": 9e9}]'
    for f in (CASES / "19b_dropped_kernels").glob("*.json"):
        text = f.read_text()
        cut = text.rindex("]")
        (job / f.name).write_text(text[:cut].rstrip() + marker + text[cut + 1 :])
    code, _, err = analyze(capsys, job, "--sections", SECTIONS, "--out", tmp_path / "o")
    assert code == 0, err
    (a,) = anomalies_of(tmp_path / "o")["iteration_incomplete"]
    assert a["rank"] == 1 and a["example"].startswith("iteration 2 section 'gradient': 2 launch(es) inside it")
    assert "in a file Kineto closed: the profiler dropped those GPU records" in a["example"]
    assert sorted(set(pd.read_parquet(tmp_path / "o" / layout.SECTIONS)[K.ITERATION])) == [0, 1]


def test_case_01_bare_inf_token_is_read(tmp_path, capsys):
    code, out, _ = analyze(capsys, CASES / "01_inf_token", "--sections", SECTIONS, "--out", tmp_path)
    assert code == 0
    assert_reference(tmp_path)
    (a0, _) = anomalies_of(tmp_path)["non_finite_number"]
    assert a0["example"] == "r0.json: token 'inf' at byte 10557"


# --- 1. GPU events without a known launch ----------------------------------------------------------


def test_gpu_event_whose_correlation_has_no_launch_gets_the_cause_its_place_allows(tmp_path):
    evs = cuda_rank_events()
    # correlation 7 has no runtime event and runs inside 'gradient', after the first launch (ts 1010 us): its
    # launch is missing though the profiler was recording; correlation 8 runs before it: before the profiler
    evs.append(kernel("ncclDevKernel_Generic(ncclDevComm*, channelMasks, ncclWork*)", 1030, 5, 7, stream=20))
    evs.append(kernel("void early", 1001, 1, 8))
    an = Anomalies()
    tr = read_trace(write_trace(tmp_path / "r.json", evs), ["gradient", "denoiser"], anomalies=an, rank=3)
    assert tr.orphan_gpu == (1030_000,)
    recs = section_records(tr.events, ["gradient", "denoiser"], an, 3, orphan_gpu=tr.orphan_gpu)
    assert [len(r.collectives) for r in recs] == [1, 0, 1, 0]
    kinds = {a["kind"]: a for a in an.records()}
    assert (kinds["gpu_event_outside_window"]["rank"], kinds["gpu_event_outside_window"]["count"]) == (3, 1)
    assert "void early at ts 1001000 ns, correlation 8" in kinds["gpu_event_outside_window"]["example"]
    unknown = kinds["gpu_event_unknown_correlation"]
    assert unknown["count"] == 1 and "ncclDevKernel_Generic at ts 1030000 ns, correlation 7" in unknown["example"]
    # the iteration holding it is dropped (never computed without that kernel), not the others
    assert [(r.bad_kind, r.bad is not None) for r in recs] == [("iteration_incomplete", True)] + [
        ("non_physical_timing", False)
    ] * 3
    assert "matches no runtime launch, though the profiler was recording" in (recs[0].bad or "")


def test_correlation_zero_kernels_without_matching_descriptors_are_placed_by_start_and_said(tmp_path):
    evs = [e for e in cuda_rank_events() if e["name"] not in ("nccl:all_reduce", "record_param_comms")]
    for e in evs:
        if e["name"].startswith("ncclDev"):
            e["args"]["correlation"] = 0
    an = Anomalies()
    tr = read_trace(write_trace(tmp_path / "r.json", evs), ["gradient", "denoiser"], anomalies=an, rank=0)
    section_records(tr.events, ["gradient", "denoiser"], an, 0)
    (a,) = an.records()
    assert a["kind"] == "launch_unknown_by_start" and a["count"] == 2
    assert a["example"].endswith("(2 kernels, 0 descriptors)")


# --- 2. non-physical timings and the invariants ----------------------------------------------------


def test_section_without_ts_is_refused_naming_file_and_event(tmp_path):
    evs = cuda_rank_events()
    del evs[0]["ts"]
    path = write_trace(tmp_path / "r.json", evs)
    with pytest.raises(TraceError, match=r"r\.json: event #1 'gradient' \(section 'gradient'\) has no ts"):
        read_trace(path, ["gradient", "denoiser"])


def test_missing_dur_is_not_zero_but_a_bad_iteration(tmp_path):
    evs = cuda_rank_events()
    del next(e for e in evs if e["name"].startswith("ncclDev"))["dur"]
    tr = read_trace(write_trace(tmp_path / "r.json", evs), ["gradient", "denoiser"])
    recs = section_records(tr.events, ["gradient", "denoiser"])
    assert recs[0].bad is not None and "no dur" in recs[0].bad and recs[1].bad is None


def _tables():
    ranks = pd.DataFrame({K.RANK: [0, 1], K.ITERATION: 0, K.SECTION: "s", K.WARMUP: False,
                          K.SECTION_S: [1.0, 1.0], K.COMM_S: [0.5, 0.1]})  # fmt: skip
    colls = pd.DataFrame({K.RANK: [0, 1], K.ITERATION: 0, K.SECTION: "s", K.SEQ: 0, K.COLLECTIVE: "all_reduce",
                          K.DURATION_S: [0.5, 0.1], K.PAYLOAD_BYTES: 8})  # fmt: skip
    return ranks, colls


def test_invariants_hold_on_a_good_table_and_fire_on_corrupted_ones():
    ranks, colls = _tables()
    sections = decompose(ranks, colls)
    check_invariants(ranks, sections)
    bad = sections.copy()
    bad[K.TRANSFER_S] = -1.0
    with pytest.raises(InvariantError, match=r"^iteration 0 section 's': transfer_s = -1 s is negative"):
        check_invariants(ranks, bad)
    bad = sections.copy()
    bad[K.WAIT_S] += 1e-6
    with pytest.raises(InvariantError, match=r"compute \+ transfer \+ wait = 1\.000001 s differs from the mean"):
        check_invariants(ranks, bad)
    over = ranks.assign(**{K.COMM_S: [1.5, 0.1]})
    with pytest.raises(InvariantError, match=r"^iteration 0 section 's' rank 0: collectives take 1\.5 s of a 1 s"):
        check_invariants(over, sections)
    check_invariants(ranks, sections.assign(**{K.WAIT_S: sections[K.WAIT_S] + 5e-10}))  # within 1 ns


def test_partial_world_size_is_the_jobs():
    ranks, colls = _tables()
    assert decompose(ranks, colls, world_size=128)[K.WORLD_SIZE].tolist() == [128]


# --- 3. nested / overlapping sections ---------------------------------------------------------------


def test_overlapping_sections_are_refused():
    evs = [Event("a", Kind.CPU, 0, 10), Event("b", Kind.CPU, 5, 15), Event("a", Kind.CPU, 20, 30),
           Event("b", Kind.CPU, 22, 28)]  # fmt: skip
    with pytest.raises(SectionError, match=r"^sections overlap without nesting: 'a' \[0 ns, 10 ns\] and 'b' "):
        section_records(evs, ["a", "b"])
    recs = section_records(evs[2:], ["a", "b"])
    assert [(r.section, r.parent) for r in recs] == [("a", None), ("b", "a")]


# --- 4. collective identity: one kernel-name vocabulary ---------------------------------------------


@pytest.mark.parametrize(
    ("name", "family", "collective"),
    [
        ("ncclDevKernel_Generic(ncclDevComm*, channelMasks, ncclWork*)", "nccl>=2.19 generic", None),
        ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "nccl>=2.19 generic", None),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl>=2.19", "all_reduce"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "nccl>=2.19", "send_recv"),
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "nccl<2.19",
         "send_recv"),
        ("void ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "nccl<2.19", "all_gather"),
        ("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "nccl<2.19", "broadcast"),
        ("ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_bf16(ncclSymDevArgs)", "nccl>=2.27 symmetric", "all_reduce"),
        ("ncclSymDevKernel_AllGather_LL(ncclSymDevArgs)", "nccl>=2.27 symmetric", "all_gather"),
        ("ncclSymDevKernel_ReduceScatter_LD_sum_f16(ncclSymDevArgs)", "nccl>=2.27 symmetric", "reduce_scatter"),
        # NCCL >= 2.28 renamed them (src/device/symmetric/generate.py: ncclSymkDevKernel_<coll>_<algo>_<op>_<type>)
        ("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_f32(ncclSymkDevWorkArgs4K)", "nccl>=2.28 symmetric", "all_reduce"),
        ("ncclSymkDevKernel_AllGather_STMC(ncclSymkDevWorkArgs4K)", "nccl>=2.28 symmetric", "all_gather"),
        ("ncclSymkDevKernel_ReduceScatter_RailA2A_LsaLD_sum_bf16(ncclSymkDevWorkArgs4K)", "nccl>=2.28 symmetric",
         "reduce_scatter"),
        ("mscclKernel_Sum_float_LL128(...)", "rccl msccl", None),
    ],
)  # fmt: skip
def test_kernel_vocabulary(name, family, collective):
    assert kernel_family(name).family == family and is_collective_kernel(name)
    assert kernel_collective(name) == collective


def test_every_vocabulary_row_recognises_its_example():
    assert [kernel_family(f.example) for f in COLLECTIVE_KERNELS] == list(COLLECTIVE_KERNELS)
    assert not is_collective_kernel("void at::native::vectorized_elementwise_kernel<4>")


# --- 5. steps ----------------------------------------------------------------------------------------


def test_ranks_without_a_common_step_are_refused_naming_the_steps(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    for rank, steps in ((0, (1, 2)), (1, (5, 6, 7))):
        evs = [X(f"ProfilerStep#{n}", "user_annotation", 1000 * n, 500) for n in steps]
        write_trace(job / f"r{rank}.json", evs, rank=rank, world=2, backend="gloo")
    code, _, err = analyze(capsys, job, "--sections", "step=ProfilerStep#*", "--out", tmp_path / "o")
    assert code == 1
    assert "the ranks have no ProfilerStep number in common (rank 0: #1-2; rank 1: #5-7)" in err


# --- 6. missing data explained -----------------------------------------------------------------------


def test_section_not_found_lists_the_range_names_present(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    write_trace(job / "r0.json", cuda_rank_events(), rank=0, world=1)
    code, _, err = analyze(capsys, job, "--sections", "forward", "--out", tmp_path / "o")
    assert code == 1
    assert "section ranges found per name: forward=0" in err
    assert (
        "the trace's user annotations: 'gradient' (2), 'nccl:all_reduce' (2), 'denoiser' (2); its most frequent "
        "range names: 'gradient' (2), 'record_param_comms' (2), 'nccl:all_reduce' (2), 'denoiser' (2)" in err
    )


def test_multi_rank_job_without_collectives_warns_and_gives_no_comm_e(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    for rank in (0, 1):
        evs = [e for e in cuda_rank_events() if not e["name"].startswith("ncclDev") and "comms" not in e["name"]]
        evs = [e for e in evs if e["name"] != "nccl:all_reduce" and e.get("args", {}).get("correlation", 0) % 100 != 1]
        write_trace(job / f"r{rank}.json", evs, rank=rank, world=2)
    code, out, err = analyze(capsys, job, "--sections", SECTIONS, "--out", tmp_path / "o")
    assert code == 0
    assert "WARNING: 2-rank job but no collective was found in any section" in err
    assert "n/a" in out.splitlines()[-3]  # the 'all' row: CommE and PE not given
    doc = json.loads((tmp_path / "o" / ANALYSIS_JSON).read_text())
    assert doc["metrics"]["comm_e"] is None and doc["metrics"]["pe"] is None
    assert [a["kind"] for a in doc["anomalies"]] == ["no_collectives"]
    # every communication-derived column unknown, hidden time too (issue #33: it was 0.0 beside NaN)
    table = pd.read_parquet(tmp_path / "o" / layout.SECTIONS)
    assert table[[K.TRANSFER_S, K.WAIT_S, K.HIDDEN_S, *K.WAIT_CAUSES]].isna().all().all()
    assert pd.read_parquet(tmp_path / "o" / layout.RANKS)[[K.COMM_S, K.HIDDEN_S]].isna().all().all()


# --- 7. readers --------------------------------------------------------------------------------------


def test_metadata_after_trace_events_is_found(tmp_path):
    path = tmp_path / "x.json.gz"
    doc = {"traceEvents": [X("gradient", "user_annotation", 1, 2)], "distributedInfo": {"rank": 3, "world_size": 4},
           "baseTimeNanoseconds": 1000}  # fmt: skip
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert (read_header(path).rank, read_header(path).world_size) == (3, 4)
    assert read_trace(path, ["gradient"]).info.base_ns == 1000


def test_file_name_rank_never_overrides_the_trace(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    write_trace(job / "rank1.json", cuda_rank_events(), rank=0, world=2)
    code, _, err = analyze(capsys, job, "--sections", SECTIONS, "--partial", "--out", tmp_path / "o")
    assert code == 1
    assert f"{job / 'rank1.json'}: the trace states rank 0 (distributedInfo) but its file name says rank 1" in err


def test_unrepairable_json_names_the_byte_offset(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"traceEvents": [{"ph": "X", "ts": 1, "dur": oops}]}')
    with pytest.raises(TraceError, match=r"r\.json: cannot read trace: invalid JSON at or before byte \d+"):
        read_trace(path, ["gradient"])


def test_non_finite_tokens_of_every_spelling_are_read(tmp_path):
    path = tmp_path / "r.json"
    text = json.dumps({"traceEvents": [X("gradient", "user_annotation", 1, 2, a=1.5, b=2.5, c=[3.5])]})
    path.write_text(text.replace("1.5", "-Infinity").replace("2.5", "NaN").replace("3.5", "inf"))
    an = Anomalies()
    tr = read_trace(path, ["gradient"], anomalies=an, rank=0)
    assert len(tr.events) == 1 and an.records()[0]["count"] == 3


def test_other_json_in_a_trace_folder_is_skipped_with_a_note(tmp_path, capsys):
    job = tmp_path / "job"
    shutil.copytree(CASES / "06_ref_valid_corr", job)
    (job / "expected.json").write_text('{"gradient": 1}')
    code, _, err = analyze(capsys, job, "--sections", SECTIONS, "--out", tmp_path / "o")
    assert code == 0
    assert "expected.json: no traceEvents list before the end of the file: not a Kineto trace: skipped" in err
    assert [a["kind"] for a in json.loads((tmp_path / "o" / ANALYSIS_JSON).read_text())["anomalies"]] == [
        "non_trace_file"
    ]


# --- 8. --partial --------------------------------------------------------------------------------------


def test_one_rank_present_says_transfer_includes_wait(tmp_path, capsys):
    code, out, _ = analyze(
        capsys, CASES / "06_ref_valid_corr" / "r0.json", "--sections", SECTIONS, "--partial", "--out", tmp_path
    )
    assert code == 0
    assert "one rank present: transfer includes the wait for other ranks" in out
    assert set(pd.read_parquet(tmp_path / layout.SECTIONS)[K.WORLD_SIZE]) == {2}


# --- 9. NCCL logs --------------------------------------------------------------------------------------

P = "node-a:11:12 [0] NCCL INFO "


def test_channels_from_coll_channels_never_from_connection_lines():
    log = parse_nccl_log([
        P + "comm 0x1 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0",
        P + "Channel 00/24 :    0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15",
        P + "24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels, 2 p2p channels per peer",
        P + "Channel 02/1 : 0[0] -> 9[1] [send] via NET/IB/1/GDRDMA",
        P + "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
    ])  # fmt: skip
    assert log.communicators[0].channels == 24
    assert dict(log.transports) == {"NET/IB GDRDMA": 1, "P2P": 1}


def test_pre_2_20_log_nodes_from_host_names_and_channels_from_ring_listing():
    logs = []
    for host, rank in (("node-a", 0), ("node-a", 1), ("node-b", 2), ("node-b", 3)):
        logs.append(parse_nccl_log([
            f"{host}:1:2 [0] NCCL INFO NCCL version 2.18.3+cuda12.2",
            f"{host}:1:2 [0] NCCL INFO Channel 00/02 :    0   1   2   3",
            f"{host}:1:2 [0] NCCL INFO Channel 01/02 :    0   1   2   3",
            f"{host}:1:2 [0] NCCL INFO comm 0x9 rank {rank} nranks 4 cudaDev {rank % 2} busId 1000 - Init COMPLETE",
        ]))  # fmt: skip
    merged = merge_logs(logs)
    (comm,) = merged.communicators
    assert (comm.nranks, comm.nnodes) == (4, 2)
    log = parse_nccl_log([P + "comm 0x2 rank 0 nranks 2 cudaDev 0 busId 1000", P + "Channel 00/02 :    0   1"])
    assert log.communicators[0].channels == 2


def test_two_records_glued_on_one_line_are_both_read():
    glued = P + "AllReduce: 4096 Bytes -> Algo 1 proto 2 time 9.5" + P + "Broadcast: 8 Bytes -> Algo 1 proto 0 time 1.0"
    log = parse_nccl_log([glued])
    assert [(r.collective, r.size_bytes) for r in log.tuning] == [("all_reduce", 4096), ("broadcast", 8)]


def test_empty_log_says_empty():
    assert algorithm_for(parse_nccl_log([]), "all_reduce", 8).note == "the NCCL log is empty"


def test_transport_names_the_route():
    nvlink = parse_nccl_log([
        P + "Pattern 4, crossNic 0, nChannels 2, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1",
        P + "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read",
    ])  # fmt: skip
    shm = parse_nccl_log([P + "Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct"])
    sock = parse_nccl_log([P + "Channel 00/0 : 0[0] -> 4[0] [send] via NET/Socket/0"])
    assert route_label(4, 1, "ring", nvlink.transport_label(False)) == "intra-node NVLink P2P, 4 GPUs"
    assert route_label(2, 1, "ring", shm.transport_label(False)) == "intra-node SHM, 2 GPUs"
    assert route_label(8, 2, "ring", sock.transport_label(True)) == "inter-node ring over NET/Socket"
    assert parse_nccl_log([P + "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC"]).transport_label(False) == "P2P"


# --- the anomaly report --------------------------------------------------------------------------------


def test_report_readme_lists_anomalies_or_says_there_is_none():
    none = "\n".join(_anomalies_markdown({"2d inference gpus=2": [], "2d inference gpus=4": None}))
    assert "No anomaly in any run: nothing was dropped, assumed or repaired." in none
    assert "- not recorded (runs written before anomaly reports): 2d inference gpus=4" in none
    rec = {"kind": "event_without_ts", "rank": 1, "count": 2, "example": "x", "action": "dropped"}
    some = "\n".join(_anomalies_markdown({"2d inference gpus=2": [rec]}))
    assert "- 2d inference gpus=2: anomaly event_without_ts: 2 on rank 1: dropped; e.g. x" in some
    assert summary_lines([rec]) == ["anomaly event_without_ts: 2 on rank 1: dropped; e.g. x"]


def test_a_misspelt_section_name_gets_the_closest_range_name(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    write_trace(job / "r0.json", cuda_rank_events(), rank=0, world=1)
    code, _, err = analyze(capsys, job, "--sections", "gradiant,denoiser", "--out", tmp_path / "o")
    assert code == 1 and err.count("\n") == 1
    assert "section ranges found per name: gradiant=0, denoiser=2" in err
    assert err.rstrip().endswith("'gradiant': did you mean 'gradient'?")
    assert not (tmp_path / "o").exists()
