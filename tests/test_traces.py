"""Streaming Kineto reader (pnpscale.traces): synthetic traces, then the real ones of ../shared/traces/hta."""

from __future__ import annotations

import gzip
import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

from pnpscale.analysis.events import Kind
from pnpscale.analysis.section.records import section_records
from pnpscale.analysis.trace.read import TraceError, comm_fields, parse_sections, read_header, read_trace

BASE_NS = 1_790_000_000_000_000_000  # a baseTimeNanoseconds


def X(name, cat, ts, dur, tid=1, **args):
    """A complete ('X') event; ts and dur in microseconds as Kineto writes them."""
    ev = {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = args
    return ev


def launch(ts, corr, tid=1):
    return X("cudaLaunchKernel", "cuda_runtime", ts, 2.5, tid=tid, correlation=corr, cbid=211)


def kernel(name, ts, dur, corr, stream=7, **args):
    return X(name, "kernel", ts, dur, tid=stream, device=0, stream=stream, correlation=corr, **args)


def write_trace(
    path: Path, events, *, rank=None, world=None, backend="nccl", base_ns=None, base_last=False, shift_us=0
):
    """Write a Kineto-like trace (gzip when the name ends in .gz); keys in Kineto's orders.

    ``shift_us`` is added exactly (in decimal) to every ``ts`` of the text, e.g. to make it absolute.
    """
    doc: dict = {"schemaVersion": 1, "deviceProperties": []}
    if rank is not None:
        doc["distributedInfo"] = {"backend": backend, "rank": rank, "world_size": world, "pg_count": 1}
    if base_ns is not None and not base_last:
        doc["baseTimeNanoseconds"] = base_ns
    doc["traceEvents"] = [{"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "python"}}, *events]
    doc["traceName"] = str(path)
    if base_ns is not None and base_last:
        doc["baseTimeNanoseconds"] = base_ns
    text = json.dumps(doc, indent=1)
    if shift_us:
        text = re.sub(r'"ts": ([0-9.]+)', lambda m: f'"ts": {Decimal(shift_us) + Decimal(m.group(1))}', text)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def cuda_rank_events(ts0=1000.0, nccl_dur=30.0, seq0=0, with_args=True, extra_kernels=0):
    """One rank of a CUDA job: two iterations of gradient | denoiser, one all_reduce in each section."""
    evs = []
    for it in range(2):
        t = ts0 + it * 1000
        corr = 100 * (it + 1)
        args = dict(
            {"Collective name": "allreduce", "In msg nelems": 3072, "dtype": "Float", "Process Group Name": "0"},
            **({"Seq": seq0 + it} if with_args else {}),
        )
        evs += [
            X("gradient", "user_annotation", t, 100.5),
            launch(t + 10, corr),
            kernel("void elementwise_kernel<float>", t + 20, 40.25, corr),
            launch(t + 60, corr + 1),
            X("record_param_comms", "cpu_op", t + 58, 5, **({"Seq": seq0 + it} if with_args else {})),
            X("nccl:all_reduce", "user_annotation", t + 59, 3,
              **{"Input Dims": [[1, 3, 32, 32]], "Input type": ["float"]}),
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", t + 70, nccl_dur,
                   corr + 1, stream=20, **(args if with_args else {})),
            X("denoiser", "user_annotation", t + 200, 300),
            launch(t + 210, corr + 2),
            # launched inside denoiser, runs after the CPU range closed: still the denoiser's
            kernel("void conv2d_kernel", t + 400, 150.125, corr + 2),
            X("gpu_user_annotation_should_be_ignored", "gpu_user_annotation", t + 200, 400, tid=7),
        ]  # fmt: skip
        for k in range(extra_kernels):
            evs += [
                launch(t + 211 + k * 0.01, 10_000 * (it + 1) + k),
                kernel("void k", t + 220 + k, 0.5, 10_000 * (it + 1) + k),
            ]
    return evs


# --- synthetic ---------------------------------------------------------------------------------


def test_cuda_sections_from_cpu_start_to_gpu_end_and_nccl_args(tmp_path):
    tr = read_trace(write_trace(tmp_path / "r0.json", cuda_rank_events(), rank=0, world=2), ["gradient", "denoiser"])
    recs = section_records(tr.events, ["gradient", "denoiser"], cpu_start=True)
    assert [(r.iteration, r.section) for r in recs] == [
        (0, "gradient"),
        (0, "denoiser"),
        (1, "gradient"),
        (1, "denoiser"),
    ]
    g, d = recs[0], recs[1]
    assert g.section_s == pytest.approx(100e-6)  # CPU start 1000 -> last GPU end 1100 us
    assert g.gpu_span_s == pytest.approx(80e-6)  # GPU span 1020 -> 1100 us
    # the kernel that ends after the CPU range still belongs to it (by its launch): 1200 -> 1550.125 us
    assert d.section_s == pytest.approx(350.125e-6) and d.gpu_span_s == pytest.approx(150.125e-6)
    (c,) = g.collectives
    assert (c.name, c.payload_bytes, c.stream, c.group, c.group_seq) == ("all_reduce", 3072 * 4, 20, "0", 0)
    assert c.duration_s == pytest.approx(30e-6) and recs[2].collectives[0].group_seq == 1
    kernels = [e for e in tr.events if e.kind is Kind.GPU]
    assert all(e.launch_ns is not None for e in kernels)
    assert tr.info.rank == 0 and tr.info.world_size == 2 and tr.info.backend == "nccl"


def test_sequence_numbers_from_record_param_comms_around_the_nccl_range(tmp_path):
    evs = cuda_rank_events(seq0=5)
    for e in evs:
        if e["name"].startswith("ncclDev"):
            e["args"] = {"stream": 20, "correlation": e["args"]["correlation"]}  # a kernel without NCCL args
        if e["name"] == "record_param_comms":
            e["args"].update({"Process Group Name": "7", "Collective name": "allreduce"})
    tr = read_trace(write_trace(tmp_path / "r.json", evs), ["gradient", "denoiser"])
    recs = section_records(tr.events, ["gradient", "denoiser"])
    assert [(c.group, c.group_seq, c.payload_bytes) for r in recs for c in r.collectives] == [
        ("7", 5, 12288),
        ("7", 6, 12288),
    ]


def test_nccl_kernel_without_args_takes_the_descriptor(tmp_path):
    evs = [e for e in cuda_rank_events(with_args=False) if e["name"] != "record_param_comms"]
    for e in evs:
        if e["name"].startswith("ncclDev"):
            e["name"] = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"  # old name
    tr = read_trace(write_trace(tmp_path / "r.json", evs), ["gradient", "denoiser"])
    (c,) = section_records(tr.events, ["gradient", "denoiser"])[0].collectives
    assert (c.name, c.payload_bytes, c.group, c.group_seq) == ("all_reduce", 12288, None, None)


def test_relative_and_absolute_timestamps_give_the_same_events(tmp_path):
    rel = cuda_rank_events(ts0=1000.001)
    sections = ["gradient", "denoiser"]
    a = read_trace(write_trace(tmp_path / "rel.json", rel, base_ns=BASE_NS), sections)
    b = read_trace(write_trace(tmp_path / "rel_last.json.gz", rel, base_ns=BASE_NS, base_last=True), sections)
    c = read_trace(write_trace(tmp_path / "abs.json", rel, shift_us=BASE_NS // 1000), sections)
    assert '"ts": 1790000000001000.001' in (tmp_path / "abs.json").read_text()
    assert a.info.base_ns == b.info.base_ns == BASE_NS and c.info.base_ns is None
    key = sorted((e.name, e.start_ns, e.end_ns, e.launch_ns) for e in a.events)
    assert key == sorted((e.name, e.start_ns, e.end_ns, e.launch_ns) for e in b.events)
    assert key == sorted((e.name, e.start_ns, e.end_ns, e.launch_ns) for e in c.events)
    # exact to the nanosecond on the Unix epoch: 1000.001 us after the base
    assert min(e.start_ns for e in a.events if e.name == "gradient") == BASE_NS + 1_000_001


def test_gloo_work_on_worker_threads(tmp_path):
    evs = [
        X("gradient", "user_annotation", 0, 1000, tid=1),
        X("c10d::allreduce_", "cpu_op", 10, 5, tid=1),
        X("gloo:all_reduce", "user_annotation", 20, 300, tid=91, **{"Input Dims": [[4, 8]], "Input type": ["float"]}),
        X("gloo:broadcast", "user_annotation", 30, 10, tid=92, **{"Input Dims": [[1]], "Input type": ["long int"]}),
        X("denoiser", "user_annotation", 1100, 500, tid=1),
        X("gloo:barrier", "user_annotation", 1700, 10, tid=91),  # outside every section
    ]
    tr = read_trace(write_trace(tmp_path / "g.json", evs, rank=1, world=2, backend="gloo"), ["gradient", "denoiser"])
    g, d = section_records(tr.events, ["gradient", "denoiser"])
    assert [(c.name, c.payload_bytes, c.stream) for c in g.collectives] == [
        ("all_reduce", 128, None),
        ("broadcast", 8, None),
    ]
    assert g.section_s == pytest.approx(1e-3) and d.collectives == []
    # metadata dropped; the c10d call is kept (it names the collective asked for, and its time is not compute)
    assert tr.info.events_kept == 6 and tr.info.events_read == 7
    assert [e.kind for e in tr.events if e.name == "c10d::allreduce_"] == [Kind.OP]


def test_glob_sections_are_renamed(tmp_path):
    evs = [X(f"ProfilerStep#{n}", "user_annotation", n * 100, 90) for n in (7, 8)]
    tr = read_trace(write_trace(tmp_path / "s.json", evs), parse_sections("step=ProfilerStep#*"))
    assert [r.section for r in section_records(tr.events, ["step"])] == ["step", "step"]


def test_reduction_keeps_the_section_records_of_the_full_event_list(tmp_path):
    path = write_trace(tmp_path / "many.json.gz", cuda_rank_events(extra_kernels=50))
    full = read_trace(path, ["gradient", "denoiser"], keep_all_gpu=True)
    reduced = read_trace(path, ["gradient", "denoiser"])
    assert len(reduced.events) < len(full.events) / 5
    sections = ["gradient", "denoiser"]
    assert section_records(reduced.events, sections) == section_records(full.events, sections)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"not json at all", "not a JSON trace"),
        (b'{"schemaVersion": 1, "traceEvents": [{"ph": "X", "ts": 1,', "cannot read trace"),
        (b'{"schemaVersion": 1}', "no traceEvents list"),
        (gzip.compress(b'{"traceEvents": []}', mtime=0)[:-8] + b"garbage!", "cannot read trace"),
    ],
)
def test_unreadable_traces_raise_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message) as err:
        read_trace(path, ["gradient"])
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_header_of_a_json_that_is_not_a_trace(tmp_path):
    (tmp_path / "run.json").write_text('{"status": "complete", "gpus": 2}')
    with pytest.raises(TraceError, match="run.json: no traceEvents list before the end of the file"):
        read_header(tmp_path / "run.json")


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="nope.json: cannot read trace: No such file"):
        read_header(tmp_path / "nope.json")


def test_parse_sections_and_comm_fields():
    assert parse_sections(" gradient , denoiser ") == {"gradient": "gradient", "denoiser": "denoiser"}
    assert parse_sections("step=ProfilerStep#*,fwd") == {"step": "ProfilerStep#*", "fwd": "fwd"}
    for bad, msg in (("", "no section names"), ("a,a", "given twice"), ("=x", "expected NAME")):
        with pytest.raises(ValueError, match=msg):
            parse_sections(bad)
    # record_param_comms without sizes (sampled traces) and TensorList dims give no payload
    assert comm_fields("record_param_comms", {"Input Dims": [[], []], "Input type": ["TensorList", ""]}) == {
        "collective": None,
        "payload_bytes": None,
        "group": None,
        "group_seq": None,
    }
    gather = comm_fields("nccl:_all_gather_base", {"Input Dims": [[16]], "Input type": ["signed char"]})
    assert gather["payload_bytes"] == 16 and gather["collective"] == "all_gather"


# --- the real traces (../shared/traces/hta) ----------------------------------------------------

STEP = parse_sections("step=ProfilerStep#*")


def test_real_nccl_trace_with_nccl_args_old_kernel_names(shared_traces):
    path = shared_traces / "nccl_parser_config" / "nccl_data.json.gz"
    h = read_header(path)
    assert (h.rank, h.world_size, h.backend, h.nccl_version) == (0, 2, "nccl", "2.17.1")
    tr = read_trace(path, STEP)
    assert tr.info.base_ns == 1711964646000000000 and tr.info.events_read == 40573
    recs = section_records(tr.events, ["step"])
    assert len(recs) == 3 and all(len(r.collectives) == 7 for r in recs)  # 21 NCCL kernels, 3 steps
    names = [c.name for c in recs[0].collectives]
    assert names == ["broadcast", "broadcast"] + ["all_reduce"] * 5
    # payloads from the kernels' own NCCL args: "In msg nelems" x Float
    assert recs[0].collectives[0].payload_bytes == 53120 * 4
    assert {c.group for r in recs for c in r.collectives} == {"0"}
    nccl = [e for e in tr.events if e.kind is Kind.GPU and e.name.startswith("ncclKernel_")]
    assert len(nccl) == 21 and all(e.launch_ns is not None for e in nccl)
    # a foreign trace: S_r is the GPU span (the GPU may run earlier work when a range starts)
    assert recs[0].section_s == recs[0].gpu_span_s == pytest.approx(0.215769424, abs=1e-9)
    assert section_records(read_trace(path, STEP, keep_all_gpu=True).events, ["step"]) == recs


def test_real_sampled_pair_without_nccl_args_absolute_timestamps(shared_traces):
    for rank in (0, 1):
        path = shared_traces / "trace_filter" / f"sampled_rank-{rank}.json.gz"
        tr = read_trace(path, STEP)
        assert (tr.info.rank, tr.info.world_size, tr.info.base_ns) == (rank, 128, None)
        recs = section_records(tr.events, ["step"])
        assert len(recs) == 2
        for r in recs:
            assert [c.stream for c in r.collectives] == [84, 84, 84, 84, 203]  # ncclKernel_SendRecv_* on 2 streams
            # nccl:all_to_all and nccl:all_reduce on two threads beside SendRecv kernels: each kernel's launch lies
            # inside exactly one descriptor range, which types it (issue #33: never by position)
            assert sorted(c.name for c in r.collectives) == ["all_gather"] + ["all_reduce"] * 2 + ["all_to_all"] * 2
            assert r.collectives[-1].name == "all_gather" and r.collectives[-1].payload_bytes == 16777216
        # the two threads' collectives interleave differently on the two ranks
        order = {0: ["all_to_all", "all_to_all", "all_reduce", "all_reduce", "all_gather"],
                 1: ["all_to_all", "all_reduce", "all_to_all", "all_reduce", "all_gather"]}  # fmt: skip
        assert [c.name for c in recs[1].collectives] == order[rank]
        # absolute microseconds since the epoch: 2023-04-29
        assert min(e.start_ns for e in tr.events) // 10**9 == 1682725898


def test_real_gloo_trace_worker_threads(shared_traces):
    path = shared_traces / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    tr = read_trace(path, STEP)
    assert (tr.info.rank, tr.info.world_size, tr.info.backend) == (34, 300, "gloo")
    assert tr.info.base_ns == 1719853884000000000 and tr.info.events_kept == 12  # 10 gloo, step, ProfilerStep
    (step,) = section_records(tr.events, ["step"])
    # two gloo:all_reduce on two gloo worker threads start inside the step; payload from Input Dims
    assert [(c.name, c.payload_bytes) for c in step.collectives] == [
        ("all_reduce", 321271 * 4),
        ("all_reduce", 2082411 * 4),
    ]
    assert [c.duration_s for c in step.collectives] == pytest.approx([0.173209713, 0.170471258], abs=1e-12)


# --- the fast reader (bytes-level pre-filter) against the exact ijson path ---------------------------


def _both_paths(path: Path, sections=("gradient",), keep_all_gpu=True):
    """(events of the fast path, events of the exact ijson path) of one trace; the fast path must not fall back."""
    from pnpscale.analysis.trace import scan as T
    from pnpscale.analysis.trace.select import collected_events

    pats = {s: s for s in sections}
    fast = T.scan_file(path, pats, keep_all_gpu)
    exact = T.stream_events(path, pats, keep_all_gpu, repair=False)
    assert fast[1] == exact[1] and fast[2] == exact[2]
    assert fast[0].read == exact[0].read and fast[0].range_names == exact[0].range_names
    base = int(exact[1].get("baseTimeNanoseconds") or 0)
    return collected_events(fast[0], base), collected_events(exact[0], base)


def test_timestamps_of_1_7e15_us_are_exact_to_the_nanosecond(tmp_path):
    # 1.7e15 us with ns decimals has 19 significant digits: a float64 (about 16) would lose the last ones
    ts = ["1700000000000000.123", "1700000000000000.125", "1700000000000001.999", "1700000000000002.001"]
    events = [
        X("gradient", "user_annotation", ts[0], "5.007"),
        launch(ts[1], 11),
        kernel("k1", ts[2], "0.001", 11),
        X("nccl:all_reduce", "cpu_op", ts[3], "1.001"),
    ]
    text = json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 7, "tid": 0}, *events]})
    for t in ts:  # numbers, not strings, as Kineto writes them
        text = text.replace(f'"{t}"', t)
    text = text.replace('"5.007"', "5.007").replace('"0.001"', "0.001").replace('"1.001"', "1.001")
    path = tmp_path / "t.json"
    path.write_text(text)
    got = read_trace(path, ["gradient"], keep_all_gpu=True).events
    by_name = {e.name: e for e in got}
    assert by_name["gradient"].start_ns == 1_700_000_000_000_000_123
    assert by_name["gradient"].end_ns == 1_700_000_000_000_005_130
    assert by_name["k1"].start_ns == 1_700_000_000_000_001_999 and by_name["k1"].end_ns == 1_700_000_000_000_002_000
    assert by_name["k1"].launch_ns == 1_700_000_000_000_000_125
    assert by_name["nccl:all_reduce"].start_ns == 1_700_000_000_000_002_001
    assert float(ts[0]) * 1000 != 1_700_000_000_000_000_123  # what a float reader would have got wrong
    fast, exact = _both_paths(path)
    assert fast == exact == got


def test_fast_reader_agrees_with_the_exact_path_on_odd_layouts(tmp_path):
    events = [
        X("ProfilerStep#3", "user_annotation", 90, 200),
        X("gradient", "user_annotation", 100, 50),
        X("aten::conv2d", "cpu_op", 101, 4, **{"Input Dims": [[1, 2]], "note": 'a "ph": "X" in a string'}),
        launch(102, 21),
        kernel("k {lambda()#1}", 110, 3, 21),
        launch("103.5", 22),  # fewer than 3 decimals
        kernel("k\u00e9\\x", "111.1234", "2.0005", 22),  # more than 3 decimals, escapes, non-ASCII
        X("cudaLaunchKernel", "cuda_runtime", 104, 1),  # no correlation: not a launch
        {"ph": "X", "cat": "kernel", "name": "k-no-args", "pid": 0, "tid": 9, "ts": 120, "dur": 1},
        {
            "name": "late-ph",
            "ph": "X",
            "cat": "kernel",
            "pid": 0,
            "tid": 7,
            "ts": 121,
            "dur": 1,
            "args": {"stream": 7, "correlation": 22},
        },  # fmt: skip
        {"ph": "X", "cat": "kernel", "name": "no-dur", "pid": 0, "tid": 7, "ts": 122, "args": {"correlation": 21}},
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 130, 5, 21, **{"Collective name": "allreduce", "Seq": 1}),
        X("neg", "kernel", 131, -1, stream=7, correlation=21),
        {"ph": "s", "id": 21, "pid": 7, "tid": 1, "ts": 102, "cat": "ac2g", "name": "ac2g"},
        X(
            "record_param_comms",
            "cpu_op",
            125,
            10,
            **{"Collective name": "allreduce", "In msg nelems": 4, "dtype": "Float"},
        ),
        X("gloo:all_reduce", "cpu_op", 126, 5, tid=3, **{"Input Dims": [[4]], "Input type": ["float"]}),
    ]
    for name, kw in (
        ("a.json", {}),
        ("b.json.gz", {"base_ns": BASE_NS}),
        ("c.json", {"base_ns": BASE_NS, "base_last": True}),
    ):
        path = write_trace(tmp_path / name, events, rank=0, world=2, **kw)
        fast, exact = _both_paths(path, sections=("gradient", "step"))
        assert fast == exact and len(fast) > 5
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(events, separators=(",", ":")))  # array at the top, no spaces
    fast, exact = _both_paths(compact)
    assert fast == exact


def test_a_file_kineto_did_not_close_and_its_lost_gpu_tail_are_seen_on_both_reading_paths(tmp_path):
    """Kineto's last event (Record Window End) says the file was closed; without it, launches whose GPU event is
    missing mark the work lost to a cut; with it, to the profiler (fast path and exact ijson path alike): either
    way the iteration holding one is incomplete (issue #33: checked whether or not the file closed)."""
    end = {"ph": "i", "cat": "", "name": "Record Window End", "s": "g", "pid": "", "tid": "", "ts": 900}
    evs = [X("gradient", "user_annotation", 100, 200), launch(110, 1), kernel("k1", 120, 10, 1), launch(150, 2)]
    evs.append(X("aten::fill_", "cpu_op", 5, 1, v="@@TOKEN@@"))
    for token, exact in (("1", False), ("inf", True)):  # a bare inf token sends the file to the exact path
        for closed in (False, True):
            path = write_trace(tmp_path / f"t{closed}{exact}.json", evs + ([end] if closed else []))
            path.write_text(path.read_text().replace('"@@TOKEN@@"', token))
            tr = read_trace(path, ["gradient"])
            assert tr.info.end_marker is closed, (closed, exact)
            assert tr.missing_gpu == (150_000,), (closed, exact)
            assert tr.info.last_ns == 150_000  # the launch at 150 us starts last (the marker's time is not read)
            recs = section_records(tr.events, ["gradient"], rank=0, file_end_ns=None if closed else tr.info.last_ns,
                                   missing_gpu=tr.missing_gpu)  # fmt: skip
            assert (recs[0].bad_kind, recs[0].open_end) == (
                ("iteration_incomplete", False) if closed else ("trace_cut_short", True)
            )
            assert recs[0].bad is not None and ("Kineto closed" in recs[0].bad) is closed
    # the latest launch has its kernel: the missing kernel is still missing (the profiler dropped it)
    path = write_trace(tmp_path / "dropped.json", [*evs[:4], launch(160, 3), kernel("k3", 170, 5, 3)])
    assert read_trace(path, ["gradient"]).missing_gpu == (150_000,)


def test_a_runtime_clock_offset_is_found_from_the_operators_without_any_descriptor(tmp_path):
    """kineto#1082 in a trace without collectives: every launch starts 40 us late, after its operator ended (the
    runtime clock ahead): the offset that puts each launch back inside the cpu_op with its External id is applied
    and named, so kernels land in the section that launched them (fast path and exact path)."""
    from pnpscale.analysis.anomalies import Anomalies

    def op_launch(name, ts, ext, corr, off):
        return [X(name, "cpu_op", ts, 10, **{"External id": ext}),
                X("cudaLaunchKernel", "cuda_runtime", ts + 2 + off, 2, correlation=corr, **{"External id": ext}),
                kernel(f"k{corr}", ts + 50 + off, 5, corr)]  # fmt: skip

    for token, exact in (("1", False), ("inf", True)):
        evs = [X("gradient", "user_annotation", 100, 20), *op_launch("aten::mul", 105, 1, 11, 40),
               X("denoiser", "user_annotation", 200, 20), *op_launch("aten::add", 205, 2, 12, 40),
               X("aten::fill_", "cpu_op", 5, 1, v="@@TOKEN@@")]  # fmt: skip
        path = write_trace(tmp_path / f"t{exact}.json", evs)
        path.write_text(path.read_text().replace('"@@TOKEN@@"', token))
        an = Anomalies()
        tr = read_trace(path, ["gradient", "denoiser"], keep_all_gpu=True, anomalies=an, rank=0)
        (a,) = [x for x in an.records() if x["kind"] == "runtime_clock_offset"]
        # each launch inside [op start, op end]: -42..-32 us; the one nearest 0 (the launches at their ops' ends)
        assert "offset of -42000..-32000 ns: runtime events shifted by -32000 ns (2 calls)" in a["example"], exact
        launches = {e.name: e.launch_ns for e in tr.events if e.kind is Kind.GPU}
        assert launches == {"k11": 115_000, "k12": 215_000}, exact
        recs = section_records(tr.events, ["gradient", "denoiser"], rank=0)
        assert [round(r.section_s * 1e6, 3) for r in recs] == [5.0, 5.0], exact  # each kernel in its own section


def test_the_fast_pass_steps_can_be_called_alone():
    """scan_file's named steps: the head, a batch of whole events up to the last event start (typed decoding, read
    by columns), then the file's last event decoded whole with the array's end."""
    import io

    import msgspec

    from pnpscale.analysis.trace import scan as T
    from pnpscale.analysis.trace.collect import Collector

    events = [X("gradient", "user_annotation", 100, 50), launch(110, 3), kernel("void k", 120.5, 2, 3),
              X("aten::mm", "cpu_op", 111, 4)]  # fmt: skip
    body = json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()
    meta, array_top, rest, _ = T.open_event_array(Path("r.json"), io.BytesIO(body))
    assert meta["schemaVersion"] == 1 and not array_top and rest.lstrip().startswith(b'{"ph"')
    state = T.ScanState(Collector({"gradient": "gradient"}, path=Path("r.json")), array_top)
    assert T.cpu_needed(state, "gradient") and not T.cpu_needed(state, "aten::mm")
    comma, start = T.last_event_start(rest)
    assert rest[comma : comma + 1] == b"," and rest[start:].startswith(b'{"ph": "X", "cat": "cpu_op"')
    assert T.read_batch(state, rest, comma, start, 0) == 3
    assert T.decode_run(state, rest, start, len(rest), 3, True) == 4
    col = state.collector
    assert [e.name for e in col.sections] == ["gradient"] and list(col.rt_corr) == [3]
    assert list(col.gpu_start) == [120_500] and list(col.gpu_end) == [122_500] and list(col.op_start) == [111_000]
    raw = msgspec.Raw
    assert T.us_to_ns(raw(b"1700000000000000.123")) == 1_700_000_000_000_000_123 and T.us_to_ns(raw(b"2")) == 2000
    assert T.us_to_ns(raw(b'"1.000"')) is None and T.us_to_ns(raw(b"null")) is None and T.us_to_ns(raw()) is None
    assert T.ns_array([raw(b"1.500"), raw(b"1700000000000000.001")]).tolist() == [1500, 1_700_000_000_000_000_001]
    assert T.ns_array([raw(b"1.500"), raw(b"1.5")]) is None and T.ns_array([raw(b"-1.500")]) is None
    assert T.ns_array([raw(b"99999999999999999999.000")]).tolist() == [2**63 - 1]  # saturated: above NS_RANGE


def test_reading_a_batch_by_columns_equals_reading_it_event_by_event():
    """read_columns (the Kineto layout) and read_one_by_one keep the same arrays, counters and events, in order."""
    from pnpscale.analysis.trace import scan as T
    from pnpscale.analysis.trace.collect import Collector

    end = {"ph": "i", "cat": "", "name": "Record Window End", "s": "g", "pid": "", "tid": "", "ts": "900.000"}
    events = [X("ProfilerStep#1", "user_annotation", "90.000", "300.000"), X("gradient", "user_annotation",
              "100.000", "50.000"), X("aten::mm", "cpu_op", "101.250", "4.000", **{"External id": 9}),
              X("cudaLaunchKernel", "cuda_runtime", "102.000", "2.500", correlation=3),
              kernel("void k", "120.500", "2.000", 3), X("fwd", "user_annotation", "103.000",
              "1.000"), kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "130.000", "5.000", 3),
              X("nccl:all_reduce", "cpu_op", "104.000", "1.000"), X("x", "overhead", "105.000", "1.000"),
              X("y", "new_cat", "106.000", "1.000"), X("cudaMemcpyAsync", "cuda_runtime", "107.000", "1.000",
              tid=4, correlation=5), X("Memcpy HtoD", "gpu_memcpy", "140.000", "1.000", tid=7, correlation=5),
              X("PyTorch Profiler (0)", "Trace", "1.000", "999.000"), X("aten::add", "cpu_op", "108.000",
              "1.000", tid=2), end]  # fmt: skip
    text = json.dumps(events)
    for t in re.findall(r'"(\d+\.\d{3})"', text):
        text = text.replace(f'"{t}"', t)
    batch = text.encode()
    evs = T._TYPED.decode(batch)
    got = []
    for read in (T.read_columns, T.read_one_by_one):
        state = T.ScanState(Collector({"gradient": "gradient"}, path=Path("r.json")))
        assert read(state, evs, batch, 0) in (True, None)
        got.append(_collector_state(state.collector))
    assert got[0] == got[1]
    arrays, sections, _, nccl, _, _, _, unknown, _, _, end_marker, profiler_span, *_ = got[0]
    assert arrays[0] == [3, 5] and arrays[11] == [101_250, 108_000] and end_marker and profiler_span
    assert [e.name for e in sections] == ["gradient"] and len(nccl) == 1 and unknown == [("new_cat", 1)]
    # a point-to-point c10d call is decoded whole yet kept among the operators: the batch is read one by one
    p2p = json.dumps([X("c10d::send", "cpu_op", 1, 2)]).encode()
    state = T.ScanState(Collector({"gradient": "gradient"}, path=Path("r.json")))
    assert T.read_columns(state, T._TYPED.decode(p2p), p2p, 0) is False and not len(state.collector.op_start)


def _collector_state(c) -> tuple:
    """What a batch read leaves in a collector: its arrays, events, counters and flags (comparable)."""
    arrays = [list(getattr(c, a)) for a in ("rt_corr", "rt_start", "rt_end", "rt_ext", "rt_tid", "rt_launch",
              "gpu_start", "gpu_end", "gpu_corr", "gpu_stream", "gpu_name", "op_start", "op_end", "op_tid",
              "op_name", "op_ext")]  # fmt: skip
    return (arrays, c.sections, c.cpu, c.nccl, c.bad_gpu, list(c.range_names.items()),
            list(c.user_annotations.items()), list(c.unknown_categories.items()), c.names, c.op_names, c.end_marker,
            c.profiler_span, c.window, c.last_start, c.read)  # fmt: skip


def _batch_events():
    """A hypothesis strategy: lists of events as Kineto writes them (each ``ts``/``dur`` a number text), half of
    them with near misses among them (keys absent, a string ``tid``, a queue key, no name, times not in Kineto's
    ``{us}.{ns:03}`` form)."""
    from hypothesis import strategies as st

    kineto = st.builds(lambda us, ns: f"{us}.{ns:03d}", st.integers(0, 10**7), st.integers(0, 999))
    other = st.sampled_from(["12.5", "7", "-1.000", "1.2345", "3e2"])
    maybe = st.one_of(st.none(), st.integers(0, 50))

    def event(ph, cat, name, ts, dur, tid, args):
        ev = {"ph": ph, "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": f"<{ts}>", "dur": f"<{dur}>"}
        for k in [k for k, v in ev.items() if v is None]:
            del ev[k]
        if args is not None:
            ev["args"] = {k: v for k, v in args.items() if v is not None}
        return ev

    def events(times, tid, gpu_names, queue):
        runtime = st.builds(event, st.just("X"), st.sampled_from(["cuda_runtime", "cuda_driver"]),
                            st.sampled_from(["cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize"]),
                            times, times, tid,
                            st.fixed_dictionaries({"correlation": maybe, "External id": maybe}))  # fmt: skip
        gpu = st.builds(event, st.just("X"), st.sampled_from(["kernel", "gpu_memcpy", "gpu_memset", "Kernel"]),
                        st.sampled_from(gpu_names), times, times, st.integers(1, 9), st.one_of(st.none(),
                        st.fixed_dictionaries({"correlation": maybe, "stream": st.one_of(st.none(), st.integers(1, 9)),
                                               "sycl queue": queue})))  # fmt: skip
        cpu = st.builds(event, st.just("X"), st.sampled_from(["cpu_op", "cpu_op", "user_annotation", "Operator"]),
                        st.sampled_from(["aten::mm", "aten::add", "gradient", "ProfilerStep#1", "nccl:all_reduce",
                                         "record_param_comms", "gloo:all_reduce", None]),
                        times, times, tid,
                        st.one_of(st.none(), st.fixed_dictionaries({"External id": maybe})))  # fmt: skip
        rest = st.sampled_from([
            {"ph": "X", "cat": "overhead", "name": "x", "pid": 7, "tid": 1, "ts": "<5.000>", "dur": "<1.000>"},
            {"ph": "X", "cat": "new_cat", "name": "y", "pid": 7, "tid": 1, "ts": "<6.000>", "dur": "<1.000>"},
            {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": 7, "tid": 1, "ts": "<1.000>",
             "dur": "<9999999.000>"},
            {"ph": "s", "cat": "ac2g", "id": 3, "pid": 7, "tid": 1, "ts": "<7.000>"},
            {"ph": "i", "cat": "", "name": "Record Window End", "s": "g", "pid": "", "tid": "", "ts": "<900.000>"},
        ])  # fmt: skip
        return st.lists(st.one_of(runtime, gpu, cpu, cpu, rest), min_size=1, max_size=25)

    gpu_names = ["void k<1>", "Memcpy HtoD", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"]
    clean = events(kineto, st.integers(1, 3), gpu_names, st.none())
    near = events(st.one_of(*[kineto] * 9, other), st.one_of(*[st.integers(1, 3)] * 9, st.just("t1")),
                  [*gpu_names, None], st.sampled_from([None, None, 3]))  # fmt: skip
    return st.one_of(clean, near)


def test_reading_any_batch_by_columns_equals_reading_it_event_by_event():
    """Property: on any batch (Kineto's events and near misses, any order), read_columns either declines
    (``False``, nothing read) or leaves the collector exactly as read_one_by_one does."""
    from hypothesis import example, given, settings

    from pnpscale.analysis.trace import scan as T
    from pnpscale.analysis.trace.collect import Collector

    # a kernel whose stream is its queue (stream_of), not its tid
    queue = {"ph": "X", "cat": "kernel", "name": "k", "pid": 7, "tid": 5, "ts": "<1.000>", "dur": "<2.000>",
             "args": {"correlation": 4, "sycl queue": 3}}  # fmt: skip

    taken = []

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(_batch_events())
    @example([queue])
    def check(events):
        batch = re.sub(r'"<([^>]*)>"', r"\1", json.dumps(events)).encode()
        evs = T._TYPED.decode(batch)
        states = []
        for read in (T.read_columns, T.read_one_by_one):
            state = T.ScanState(Collector({"gradient": "gradient"}, path=Path("r.json")))
            ok = read(state, evs, batch, 0)
            states.append((ok, _collector_state(state.collector)))
        (ok, columns), (_, one_by_one) = states
        taken.append(ok is not False)
        if ok is False:
            assert columns == _collector_state(Collector({"gradient": "gradient"}, path=Path("r.json")))
        else:
            assert columns == one_by_one

    check()
    assert sum(taken) > len(taken) / 4  # the columns read most clean batches (177 of 301 when written)
