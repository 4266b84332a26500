"""The CUDA/NCCL path without a GPU: device queries monkeypatched, Kineto events synthetic (issue 13).

One test (or a few) per defect: backend by device isolation, the probe's device rule, traces
without GPU events, lost iterations, S_r on CUDA, busy_wait calibration, NCCL log sizes and
staging, set_device before init_process_group, CPUs per GPU task.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from pnpscale import columns as K
from pnpscale.analysis.events import Event, Kind, SectionError, rank_rows
from pnpscale.analysis.metrics import DecompositionError, decompose
from pnpscale.analysis.section.records import section_records
from pnpscale.analysis.tables import frames
from pnpscale.core import layout
from pnpscale.rank import group, loop, process
from pnpscale.rank.profiling import IncompleteTrace, check_trace_complete
from pnpscale.results.transfer import nccl_log_size
from tests.helpers import ROOT

US = 1000


def cpu(name, t0_us, t1_us, **kw):
    return Event(name, Kind.CPU, int(t0_us * US), int(t1_us * US), **kw)


def gpu(name, t0_us, t1_us, launch_us, **kw):
    return Event(name, Kind.GPU, int(t0_us * US), int(t1_us * US), tid=7, launch_ns=int(launch_us * US), **kw)


# --- 1. backend by device isolation ---------------------------------------------------------------


def test_slurm_one_gpu_per_task_is_nccl_not_gloo():
    # SLURM binds one GPU per task: every rank sees 1 device (cuda:0) but they are 4 different GPUs
    devices = [("n1", f"GPU-{i}") for i in range(4)] + [("n2", f"GPU-{i + 4}") for i in range(4)]
    assert group.choose_backend("auto", devices) == "nccl"
    assert group.cuda_device_index(local_rank=3, visible=1) == 0


def test_ranks_sharing_a_gpu_are_refused_unless_a_structure_check():
    shared = [("n1", "GPU-a"), ("n1", "GPU-a")]
    for requested in ("auto", "nccl"):
        with pytest.raises(RuntimeError, match="ranks 0 and 1 share the GPU GPU-a on host n1"):
            group.choose_backend(requested, shared)
    env = {group.SHARED_GPU_ENV: "1"}
    assert group.choose_backend("nccl", shared, group.shared_gpu_allowed("nccl", env)) == "nccl"
    assert not group.shared_gpu_allowed("auto", env)  # never chosen silently
    assert group.choose_backend("gloo", shared) == "gloo"


def test_ranks_without_gpu_give_gloo_or_a_refusal_for_nccl():
    devices = [("n1", "GPU-a"), ("n2", None)]
    assert group.choose_backend("auto", devices) == "gloo"
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 have no CUDA device \(host n2\)"):
        group.choose_backend("nccl", devices)


def test_devices_are_exchanged_through_the_store():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    got: dict[int, list] = {}
    t = threading.Thread(target=lambda: got.update({1: group.exchange_devices(store, 1, 2, ("n1", "GPU-b"))}))
    t.start()  # rank 1 waits for rank 0's key
    got[0] = group.exchange_devices(store, 0, 2, ("n1", None))
    t.join(10)
    assert got[0] == got[1] == [("n1", None), ("n1", "GPU-b")]  # every rank sees the same list


@pytest.mark.parametrize("local_rank, visible", [(0, 1), (3, 1), (1, 4), (5, 4), (2, 8)])
def test_device_rule_is_deepinvs(monkeypatch, local_rank, visible):
    """The rank's device (solver and validation probe alike) is the one deepinv's DistributedContext picks."""
    from deepinv.distributed import DistributedContext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    with DistributedContext(device_mode="gpu", cleanup=False) as ctx:
        assert ctx.device == torch.device("cuda", group.cuda_device_index(local_rank, visible))


def _fake_cuda(monkeypatch, calls, visible=1, uuid="GPU-0"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"{uuid}-{i}"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))


def test_one_rank_cuda_group_uses_the_gpu(monkeypatch):
    calls: list = []
    _fake_cuda(monkeypatch, calls)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    g = group.Group("auto", 10.0)
    assert (g.backend, g.device, g.distributed) == ("nccl", torch.device("cuda", 0), False)
    assert calls == [("set_device", torch.device("cuda", 0))]


# --- 8. set_device before init_process_group(device_id=...) ---------------------------------------


def test_set_device_precedes_init_process_group_with_device_id(monkeypatch):
    calls: list = []
    _fake_cuda(monkeypatch, calls, visible=2)
    store = dist.HashStore()
    store.set("pnpscale/device/0/1", '["h", "GPU-other"]')  # the peer, on another GPU
    monkeypatch.setattr(dist, "rendezvous", lambda url, timeout: iter([(store, 0, 2)]))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    seen: list = []
    g = group.Group("auto", 10.0, before_init=lambda backend: seen.append((backend, list(calls))))
    assert g.backend == "nccl" and g.device == torch.device("cuda", 0)
    assert [c[0] for c in calls] == ["set_device", "init"]
    init = calls[1][1]
    assert init["device_id"] == torch.device("cuda", 0) and init["store"] is store and init["backend"] == "nccl"
    assert (init["rank"], init["world_size"]) == (0, 2)
    assert seen == [("nccl", [("set_device", torch.device("cuda", 0))])]  # NCCL env set before init


# --- 3. no GPU events on CUDA; NCCL descriptors without kernels; Kineto log level ------------------


def test_cuda_run_without_gpu_events_is_refused():
    events = [cpu("gradient", 0, 10), cpu("nccl:all_reduce", 2, 3, collective="all_reduce")]
    with pytest.raises(SectionError, match="recorded no GPU event"):
        section_records(events, ("gradient",), require_gpu=True)
    assert section_records(events, ("gradient",))[0].section_s == pytest.approx(10e-6)  # gloo semantics


def test_nccl_descriptor_without_nccl_kernel_is_refused():
    events = [
        cpu("gradient", 0, 100),
        cpu("nccl:all_reduce", 30, 31, collective="all_reduce", payload_bytes=4096),
        gpu("volta_sgemm", 10, 40, 5),  # the compute kernel is there, the NCCL kernel was dropped
    ]
    with pytest.raises(SectionError, match="iteration 0 section 'gradient': 1 NCCL collective.*no NCCL kernel"):
        section_records(events, ("gradient",), require_gpu=True)


def test_kineto_log_level_shows_errors():
    # Kineto: 0 VERBOSE, 1 INFO, 2 WARNING, 3 ERROR, 4 STAGE; messages below the level are hidden
    assert int(process.KINETO_LOG_LEVEL) <= 3


# --- 4. every iteration in the trace ----------------------------------------------------------------


def _records(n_gradient, gpu_from=None, gpu_until=None):
    evs = []
    for i in range(n_gradient):
        t = i * 1000
        evs.append(cpu("gradient", t, t + 100))
        if (gpu_until is None or i < gpu_until) and (gpu_from is None or i >= gpu_from):
            evs.append(gpu("k", t + 10, t + 90, t + 5))
    return section_records(evs, ("gradient",))


def test_lost_iterations_are_refused_with_advice():
    check_trace_complete(_records(5), ("gradient",), 5, cuda=True, rank=0)
    with pytest.raises(IncompleteTrace, match=r"rank 2: section 'gradient' recorded 4 time\(s\), expected 5.*CUPTI"):
        check_trace_complete(_records(4), ("gradient",), 5, cuda=True, rank=2)


def test_gpu_trace_stopping_mid_run_is_refused():
    recs = _records(5, gpu_until=3)  # CUPTI stopped after iteration 2: CPU ranges go on, GPU events stop
    with pytest.raises(IncompleteTrace, match="no GPU event from iteration 3 on"):
        check_trace_complete(recs, ("gradient",), 5, cuda=True, rank=1)
    check_trace_complete(recs, ("gradient",), 5, cuda=False, rank=1)  # CPU backends: no GPU work expected


# --- 5. S_r on CUDA -----------------------------------------------------------------------------------


def test_rank_late_on_cpu_shows_compute_not_peer_wait():
    """Rank 1 spends 300 us on the CPU before its first kernel; both GPUs then do the same work.

    With the GPU span as S_r both ranks would look equal and the late rank's delay would be its
    peer's wait inside the all_reduce; from the CPU start it is rank 1's compute (imbalance).
    """

    def rank_events(late_us):
        t = late_us
        return [
            cpu("gradient", 0, t + 200),
            cpu("nccl:all_reduce", t + 50, t + 51, collective="all_reduce", payload_bytes=4096),
            gpu("sgemm", t + 10, t + 50, t + 5),
            # the all_reduce ends when the late rank arrives: rank 0 waits in its kernel
            gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 55, 350 + 100, t + 50),
        ]

    per_rank = {
        r: section_records(rank_events(late), ("gradient",), require_gpu=True, cpu_start=True)
        for r, late in [(0, 0), (1, 300)]
    }
    gathered = [(rank_rows(r, recs, 0), {}) for r, recs in per_rank.items()]
    ranks, colls = frames(gathered)
    assert ranks[K.SECTION_S].tolist() == pytest.approx([450e-6, 450e-6])
    assert ranks[K.GPU_SPAN_S].tolist() == pytest.approx([440e-6, 140e-6])
    row = decompose(ranks, colls).iloc[0]
    # rank 0: 450 - 395 = 55 us compute; rank 1: 450 - 95 = 355 us
    assert row[K.COMPUTE_MAX_S] == pytest.approx(355e-6) and row[K.LB] == pytest.approx(205 / 355)


def test_negative_compute_is_refused_live_and_warned_offline():
    ranks = pd.DataFrame({K.RANK: [0, 1], K.ITERATION: 0, K.SECTION: "s", K.WARMUP: False, K.SECTION_S: [1.0, 0.5]})
    colls = pd.DataFrame({K.RANK: [0, 1], K.ITERATION: 0, K.SECTION: "s", K.SEQ: 0, K.COLLECTIVE: "all_reduce",
                          K.DURATION_S: [0.2, 0.7], K.PAYLOAD_BYTES: 8})  # fmt: skip
    with pytest.raises(DecompositionError, match="iteration 0 section 's' rank 1: negative compute"):
        decompose(ranks, colls)
    said: list[str] = []
    decompose(ranks, colls, on_negative_compute=said.append)
    assert len(said) == 1 and "rank 1" in said[0]


# --- 6. busy_wait calibrated with CUDA events ----------------------------------------------------------


def _fake_cuda_event() -> type:
    """A fresh stand-in for ``torch.cuda.Event``, timed by the class's own ``clock`` (seconds), which a test moves."""

    class FakeEvent:
        clock = 0.0

        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = FakeEvent.clock

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    return FakeEvent


def test_busy_wait_uses_the_measured_sleep_rate_not_the_max_clock(monkeypatch):
    """A GPU whose sleep kernel runs at 1.0 GHz while its maximum clock says 1.98 GHz."""
    real_hz, slept = 1.0e9, []

    FakeEvent = _fake_cuda_event()

    def sleep(cycles):
        slept.append(cycles)
        FakeEvent.clock += cycles / real_hz

    monkeypatch.setattr(loop, "_SLEEP_RATE_HZ", {})
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(clock_rate=1_980_000))
    dev = torch.device("cuda", 0)
    loop.busy_wait(0.2, dev)
    assert slept[-1] == round(0.2 * real_hz)  # 0.2 s at the measured rate
    n = len(slept)
    loop.busy_wait(0.1, dev)
    assert len(slept) == n + 1 and slept[-1] == round(0.1 * real_hz)  # calibrated once


# --- 7. NCCL logs: sizes, node-local files ---------------------------------------------------------------


def test_tuning_size_is_per_rank_for_all_gather_and_reduce_scatter():
    assert nccl_log_size("all_gather", 4096, 8, (2, 30, 7)) == 4096
    assert nccl_log_size("reduce_scatter", 4096, 8, (2, 30, 7)) == 512
    assert nccl_log_size("all_reduce", 4096, 8, (2, 30, 7)) == 4096
    assert nccl_log_size("all_gather", 4096, 8, (2, 21, 5)) == 8 * 4096  # 2.20-2.23 printed the total


def test_transfer_inputs_find_the_algorithm_of_an_all_gather(tmp_path):
    from pnpscale.results.transfer import transfer_inputs

    gpus, per_rank = 4, 1 << 20
    ranks = pd.DataFrame([{K.RANK: r, K.ITERATION: i, K.SECTION: "s", K.WARMUP: i == 0, K.SECTION_S: 1.0,
                           K.START_S: 0.0, K.COMM_S: 0.01, K.N_COLLECTIVES: 1, K.PEAK_MEM_BYTES: None,
                           K.GPU_SPAN_S: 0.9} for r in range(gpus) for i in range(2)])  # fmt: skip
    colls = pd.DataFrame([{K.RANK: r, K.ITERATION: i, K.SECTION: "s", K.SEQ: 0, K.COLLECTIVE: "all_gather",
                           K.DURATION_S: 0.01, K.PAYLOAD_BYTES: per_rank}
                          for r in range(gpus) for i in range(2)])  # fmt: skip
    r, c = frames([({"ranks": ranks.to_dict("records"), "collectives": colls.to_dict("records")}, {})])
    d = tmp_path / "run"
    d.mkdir()
    decompose(r, c).to_parquet(d / layout.SECTIONS)
    layout.write_json(d / layout.RUN_JSON, {"status": "complete", "problem": "2d", "mode": "inference", "gpus": gpus,
                                            "nodes": 1, "backend": "nccl"})  # fmt: skip
    (d / layout.NCCL_DIR).mkdir()
    (d / layout.NCCL_DIR / "rank0.log").write_text(
        "h:1:1 [0] NCCL INFO NCCL version 2.30.7+cuda13.0\n"
        f"h:1:1 [0] NCCL INFO AllGather: {per_rank} Bytes -> Algo RING proto SIMPLE channel{{Lo..Hi}}={{0..7}}\n"
    )
    row = transfer_inputs([d]).iloc[0]
    assert (row[K.ALGORITHM], row[K.PROTOCOL]) == ("ring", "simple")
    assert row[K.PAYLOAD_BYTES] == gpus * per_rank  # the table keeps nccl-tests' size


def test_nccl_log_is_written_node_local_and_moved_into_the_run(tmp_path, monkeypatch):
    run = tmp_path / "shared" / "run-1"
    local = tmp_path / "node-tmp"
    local.mkdir()
    f = group.nccl_log_file(run, 2, str(local))
    assert f.parent == local and not str(f).startswith(str(run))
    env = group.nccl_debug_env(f, {})
    assert env["NCCL_DEBUG_FILE"] == str(f) and env["NCCL_DEBUG_SUBSYS"] == "INIT,GRAPH,TUNING"
    f.write_text("NCCL INFO AllReduce: 8 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0}\n")
    dest = group.collect_nccl_log(f, run, 2)
    assert dest == run / layout.NCCL_DIR / "rank2.log" and "AllReduce" in dest.read_text() and not f.exists()
    assert group.collect_nccl_log(f, run, 2) is None  # nothing staged: nothing copied


# --- 9. CPUs per GPU task -------------------------------------------------------------------------------


def test_too_few_cpus_per_gpu_task_are_warned():
    from pnpscale.cluster.slurm import cpus_per_task_warning

    assert "cluster.cpus_per_task=null" in cpus_per_task_warning({"cpus_per_task": None})
    assert "cluster.cpus_per_task=2" in cpus_per_task_warning({"cpus_per_task": 2})
    assert cpus_per_task_warning({"cpus_per_task": 4}) is None
    assert "1 CPU(s) for a GPU rank" in group.cpu_warning(1, "nccl", 0)
    assert group.cpu_warning(1, "gloo", 0) is None


def test_slurm_default_config_keeps_null_and_says_why():
    text = (Path(__file__).resolve().parents[1] / "conf" / "cluster" / "slurm.yaml").read_text()
    assert "cpus_per_task: null" in text and ">= 4" in text


# --- issue 19: no rank forked after CUDA, one GPU per rank --------------------------------------------


def test_the_forkserver_preload_never_touches_cuda():
    # a fresh interpreter imports exactly what the forkserver imports, then forks: torch marks the
    # child a bad fork when anything before the fork called into CUDA (is_available() included)
    from pnpscale.cluster.local import RANK_PRELOAD

    code = (
        "import importlib, os, sys, torch\n"
        f"for m in {list(RANK_PRELOAD)!r}:\n"
        "    importlib.import_module(m)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(3 if torch._C._cuda_isInBadFork() else 0)\n"
        "print(os.waitpid(pid, 0)[1] >> 8, 'deepinv' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False"], out.stdout  # not a bad fork; deepinv left to each rank


def test_a_fork_after_a_cuda_query_is_refused_by_the_rank():
    # the kind of fault the preload rule prevents, and what a rank says if it ever comes back
    code = (
        "import os, torch\n"
        "torch.cuda.is_available()\n"  # what deepinv's import does (Trainer -> get_device())
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    from pnpscale.rank.process import refuse_bad_fork\n"
        "    try:\n"
        "        refuse_bad_fork(3)\n"
        "    except RuntimeError as e:\n"
        "        print(e, flush=True); os._exit(5)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    if not hasattr(torch._C, "_cuda_isInBadFork"):
        pytest.skip("torch built without CUDA: no bad-fork flag")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.startswith("rank 3 (pid "), out.stdout + out.stderr
    assert "forked from a process that had called into CUDA" in out.stdout


@pytest.mark.slow
def test_a_launched_local_rank_is_not_a_bad_fork_and_is_bound_to_its_gpu(tmp_path, monkeypatch):
    from pnpscale.cluster.local import run_ranks
    from tests.toy_problem import probe_rank

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,GPU-x")  # the launcher's GPUs (none exist here)
    got = run_ranks(3, probe_rank, (), tmp_path / "logs", 1)
    assert [got[r]["cuda_bad_fork"] for r in range(3)] == [False, False, False], got
    assert [got[r]["deepinv_preloaded"] for r in range(3)] == [False, False, False], got
    # local rank r -> GPU r mod n, set before the rank's first CUDA call
    assert [got[r]["cuda_visible_devices"] for r in range(3)] == ["5", "GPU-x", "5"], got
    assert [got[r]["gpu_binding"] for r in range(3)] == ["5", "GPU-x", "5"], got
    # the next launch from the same forkserver, the launcher now without CUDA_VISIBLE_DEVICES: nothing kept
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    again = run_ranks(1, probe_rank, (), tmp_path / "logs2", 1)
    assert again[0]["cuda_visible_devices"] is None and again[0]["gpu_binding"] is None, again


def test_gpu_binding_rules():
    from pnpscale.rank.gpus import gpu_binding

    assert [gpu_binding(r, "0,1,2,3") for r in range(5)] == ["0", "1", "2", "3", "0"]
    assert gpu_binding(1, " 2, 3 ") == "3"
    assert gpu_binding(0, "GPU-aa") is None  # one GPU visible: bound outside (SLURM per task), kept
    assert gpu_binding(2, None, 4) == "2" and gpu_binding(0, None, None) is None and gpu_binding(0, "") is None


def test_slurm_task_binding_by_local_id(monkeypatch):
    from pnpscale.cluster import slurm
    from pnpscale.rank import gpus

    env = {"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    monkeypatch.delenv(gpus.GPU_BINDING_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert slurm.bind_task_gpu(env) == "2"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2" and os.environ[gpus.GPU_BINDING_ENV] == "2"
    monkeypatch.setattr(gpus, "nvml_device_count", lambda: None)  # no NVML: nothing known, nothing bound
    assert slurm.bind_task_gpu({"SLURM_LOCALID": "1"}) is None


def test_a_binding_that_did_not_take_is_refused():
    from pnpscale.rank.gpus import check_binding

    check_binding("1", 1, 0)
    with pytest.raises(RuntimeError, match=r"rank 3: bound to GPU 1 .* sees 4 GPUs: CUDA was initialised"):
        check_binding("1", 4, 3)


# --- issue 19 item 2: NCCL's own range names, every collective logged, a mismatch is an anomaly ---------

#: the ``nccl:*`` ranges ProcessGroupNCCL records (its profiling titles): read from the installed torch
#: 2.14.1 (the strings of ``torch/lib/libtorch_cuda.so``) and from ``ProcessGroupNCCL.cpp`` of torch 2.6+
#: (``barrier`` -> ``allreduce_impl(barrierTensor, "nccl:all_reduce_barrier")`` since PR 140785, torch 2.6;
#: ``send``/``recv`` -> ``c10::str("nccl:send ", rank_, "->", dstRank)``), with the type each is
NCCL_RANGES = {
    "nccl:all_reduce": "all_reduce", "nccl:all_reduce_barrier": "barrier", "nccl:allreduce_coalesced": "all_reduce",
    "nccl:broadcast": "broadcast", "nccl:_broadcast_oop": "broadcast", "nccl:reduce": "reduce",
    "nccl:_reduce_oop": "reduce", "nccl:all_gather": "all_gather", "nccl:_all_gather_base": "all_gather",
    "nccl:all_gather_into_tensor_coalesced": "all_gather", "nccl:reduce_scatter": "reduce_scatter",
    "nccl:_reduce_scatter_base": "reduce_scatter", "nccl:reduce_scatter_tensor_coalesced": "reduce_scatter",
    "nccl:all_to_all": "all_to_all", "nccl:gather": "gather", "nccl:gather_single": "gather",
    "nccl:scatter": "scatter", "nccl:send 0->1": "send", "nccl:recv 1<-0": "recv",
}  # fmt: skip
#: torch.distributed call -> the range ProcessGroupNCCL records for it (same sources)
NCCL_RANGE_OF_CALL = {
    "all_reduce": "nccl:all_reduce", "barrier": "nccl:all_reduce_barrier", "broadcast": "nccl:broadcast",
    "reduce": "nccl:reduce", "all_gather": "nccl:all_gather", "all_gather_into_tensor": "nccl:_all_gather_base",
    "reduce_scatter": "nccl:reduce_scatter", "reduce_scatter_tensor": "nccl:_reduce_scatter_base",
    "reduce_scatter_single": "nccl:_reduce_scatter_base", "all_gather_single": "nccl:_all_gather_base",
    "all_to_all": "nccl:all_to_all", "all_to_all_single": "nccl:all_to_all", "gather": "nccl:gather",
    "scatter": "nccl:scatter", "send": "nccl:send 0->1", "isend": "nccl:send 0->1", "recv": "nccl:recv 1<-0",
    "irecv": "nccl:recv 1<-0",
}  # fmt: skip
#: gloo's ranges (strings of the installed ``libtorch_cpu.so``)
GLOO_RANGES = {
    "gloo:all_reduce": "all_reduce", "gloo:barrier": "barrier", "gloo:broadcast": "broadcast",
    "gloo:all_gather": "all_gather", "gloo:gather": "gather", "gloo:scatter": "scatter", "gloo:reduce": "reduce",
    "gloo:all_to_all": "all_to_all", "gloo:send": "send", "gloo:recv": "recv",
}  # fmt: skip


def test_nccl_and_gloo_ranges_are_typed_as_their_calls():
    from pnpscale.analysis.kineto import collective_type
    from pnpscale.rank.profiling import COLLECTIVE_CALLS

    assert {n: collective_type(n) for n in NCCL_RANGES} == NCCL_RANGES
    assert {n: collective_type(n) for n in GLOO_RANGES} == GLOO_RANGES
    # each logged call has the type of the range its process group records, so they pair up
    assert set(NCCL_RANGE_OF_CALL) <= set(COLLECTIVE_CALLS)
    assert {c: collective_type(c) for c in NCCL_RANGE_OF_CALL} == {
        c: NCCL_RANGES[r] for c, r in NCCL_RANGE_OF_CALL.items()
    }


def _cpu_range(name: str, start: int, coll: str | None = None) -> Event:
    from pnpscale.analysis.kineto import collective_type

    return Event(name, Kind.CPU, start, start + 5, tid=1, collective=coll or collective_type(name))


def test_payloads_attach_to_nccl_ranges_including_barrier_and_reduce_scatter():
    from pnpscale.analysis.anomalies import Anomalies
    from pnpscale.rank.profiling import attach_payloads

    # an all_gather training step on NCCL: forward all_gather, backward's list-form reduce_scatter,
    # the weight-gradient all_reduce and the end-of-iteration barrier
    evs = [_cpu_range("nccl:all_gather", 10), _cpu_range("nccl:reduce_scatter", 20),
           _cpu_range("nccl:all_reduce", 30), _cpu_range("nccl:all_reduce_barrier", 40)]  # fmt: skip
    calls = [("all_gather", 64), ("reduce_scatter", 128), ("all_reduce", 8), ("barrier", None)]
    anomalies = Anomalies()
    out = attach_payloads(evs, calls, anomalies, rank=1)
    assert [e.payload_bytes for e in out] == [64, 128, 8, None] and len(anomalies) == 0


def test_a_count_mismatch_is_an_anomaly_never_an_exception():
    from pnpscale.analysis.anomalies import KINDS, Anomalies, summary_lines
    from pnpscale.rank.profiling import attach_payloads

    assert "payload_unmatched" in KINDS
    evs = [_cpu_range("nccl:all_reduce", 10), _cpu_range("nccl:reduce_scatter", 20), _cpu_range("nccl:all_reduce", 30)]
    anomalies = Anomalies()
    out = attach_payloads(evs, [("all_reduce", 40), ("all_reduce", 80)], anomalies, rank=2)  # no reduce_scatter
    assert [e.payload_bytes for e in out] == [40, None, 80]  # the others keep theirs; the unmatched stay NA
    (rec,) = anomalies.records()
    assert rec["kind"] == "payload_unmatched" and rec["rank"] == 2
    assert rec["example"].startswith("1 reduce_scatter range(s) in the profile, 0 torch.distributed")
    assert summary_lines(anomalies.records())[0].startswith("anomaly payload_unmatched: 1 on rank 2")


@pytest.mark.filterwarnings("ignore:torch.distributed.nn.functional.all_gather is deprecated")
def test_collective_log_records_the_all_gather_backward_reduce_scatter(monkeypatch):
    # torch.distributed.nn's autograd-aware all_gather (deepinv's training path) on NCCL: its backward is
    # a list-form reduce_scatter, which must be logged. The process group is faked, torch's code is not.
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.nn.functional as dist_nn

    from pnpscale.rank.profiling import CollectiveLog

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        for t in tensor_list:
            t.copy_(tensor)

    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        output.copy_(sum(input_list))

    for module in (dist, c10d):
        monkeypatch.setattr(module, "all_gather", all_gather)
        monkeypatch.setattr(module, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend.NCCL)
    x = torch.ones(3, requires_grad=True)
    with CollectiveLog() as log:
        torch.stack(dist_nn.all_gather(x)).sum().backward()
    assert log.calls == [("all_gather", 12), ("reduce_scatter", 24)]  # one rank's input; the list's bytes
    assert dist.all_gather is all_gather and c10d.reduce_scatter is reduce_scatter  # put back


def test_collective_log_sees_c10d_helpers_and_counts_nested_calls_once(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from pnpscale.rank.profiling import CollectiveLog

    def isend(tensor, dst=None, group=None, tag=0):
        return None

    def send(tensor, dst=None, group=None, tag=0):
        c10d.isend(tensor, dst)  # as c10d's send does

    def broadcast(tensor, src=0, group=None, async_op=False):
        return None

    def broadcast_object_list(objs, src=0, group=None, device=None):  # c10d's helper: two broadcasts
        c10d.broadcast(torch.zeros(1, dtype=torch.long), src)
        c10d.broadcast(torch.zeros(10, dtype=torch.uint8), src)

    for module in (dist, c10d):
        for fn in (isend, send, broadcast, broadcast_object_list):
            monkeypatch.setattr(module, fn.__name__, fn)
    with CollectiveLog() as log:
        dist.send(torch.zeros(4), 1)
        dist.broadcast_object_list([1], 0)
        other = threading.Thread(target=dist.broadcast, args=(torch.zeros(2),))  # another thread's call
        other.start()
        other.join()
    assert log.calls == [("send", 16), ("broadcast", 8), ("broadcast", 10), ("broadcast", 8)]


def test_a_collective_on_the_copy_engines_is_named_in_the_refusal():
    # NCCL >= 2.28 may run a collective as copies (no kernel): refused, and said so, not "CUPTI dropped" alone
    rng = Event("denoiser", Kind.CPU, 0, 100 * US)
    copy = Event("Memcpy PtoP (Device -> Device)", Kind.GPU, 10 * US, 50 * US, launch_ns=5 * US)
    with pytest.raises(SectionError, match=r"1 device-to-device copy\(ies\) \(e\.g\. 'Memcpy PtoP .*copy engines"):
        from pnpscale.analysis.section.gpu import cuda_section_span

        cuda_section_span(rng, [copy], 1, 0, 3)


def test_ranks_get_a_kineto_config_with_a_larger_cupti_buffer(tmp_path):
    env = process.kineto_config_env({}, str(tmp_path))
    text = Path(env["KINETO_CONFIG"]).read_text()
    assert text == f"ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB={process.KINETO_GPU_BUFFER_MB}\n"
    assert process.KINETO_GPU_BUFFER_MB > 128  # Kineto's default
    assert process.kineto_config_env({"KINETO_CONFIG": "/mine.conf"}, str(tmp_path)) == {}  # the user's is kept


# --- the rank memory probe without smaps_rollup, and the GPU-memory refusal (issue 35) ---------------------


SMAPS = """7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/libc.so
Rss:                 100 kB
Pss:                  50 kB
Private_Clean:        10 kB
Private_Dirty:        20 kB
7f0000002000-7f0000003000 rw-p 00000000 00:00 0
Rss:                 200 kB
Pss:                 200 kB
Private_Clean:         0 kB
Private_Dirty:       200 kB
"""


def test_memory_counts_fall_back_to_smaps_and_fail_naming_both_files(tmp_path):
    from pnpscale.cluster.resources import smaps_rollup

    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "smaps").write_text(SMAPS)  # a sandboxed kernel (gVisor): smaps, no smaps_rollup
    got = smaps_rollup(7, proc)
    assert (got["Rss"], got["Private_Clean"], got["Private_Dirty"], got["source"]) == (300 * 1024, 10 * 1024,
                                                                                      220 * 1024, 2)  # fmt: skip
    (proc / "7" / "smaps_rollup").write_text("Rss: 5 kB\nPrivate_Clean: 1 kB\nPrivate_Dirty: 2 kB\n")
    assert smaps_rollup(7, proc)["Rss"] == 5 * 1024 and smaps_rollup(7, proc)["source"] == 1
    (proc / "8").mkdir()
    (proc / "8" / "smaps").write_text("nothing here\n")
    with pytest.raises(OSError, match=r"smaps_rollup: .*; .*smaps: no Rss/Private_Clean/Private_Dirty"):
        smaps_rollup(8, proc)


def test_a_failed_footprint_probe_is_kept_and_not_run_again(tmp_path, monkeypatch, capsys):
    from pnpscale.cluster import local, resources

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def probe(cmd, **kwargs):  # the probe's subprocess on a kernel with neither file
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "footprint-failed no memory counts for process self: ...\n", "")

    monkeypatch.setattr(local.subprocess, "run", probe)
    monkeypatch.setattr(resources, "_SAID", set())
    assert local.rank_footprint() is None and local.rank_footprint() is None
    assert len(calls) == 1  # the failure was kept: the second point did not probe again
    kept = layout.read_json(tmp_path / "pnpscale" / layout.RANK_FOOTPRINT)
    assert kept["failed"].startswith("no memory counts") and kept["key"] == local._versions_key()
    err = capsys.readouterr().err
    assert err.count("host-memory check skipped") == 1 and "delete it to measure again" in err


def test_a_point_too_big_for_the_gpu_is_refused_before_any_rank_starts(monkeypatch):
    from pnpscale.cluster import local, resources
    from pnpscale.core.config import ConfigError, resolve_spec
    from pnpscale.sweep.cli import compose_config

    # two ranks sharing one GPU (a structure check) with less free memory than twice the lower bound
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    spec = resolve_spec(compose_config(["problem=2d", "scale=paper", "gpus=2", "dist.backend=nccl"]),
                        cuda_available=True)  # fmt: skip
    per_rank = resources.gpu_bytes_per_rank(spec)
    assert per_rank >= 6 * 8192**2 * 3 * 4  # the signal's copies alone (paper 2D: 8192² x 3 float32)
    monkeypatch.setattr(local, "rank_footprint", lambda: None)
    started = []
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: started.append(a))
    monkeypatch.setattr(local, "nvml_free_bytes", lambda visible: [int(1.5 * per_rank)])
    with pytest.raises(ConfigError, match=r"needs at least .* GB on each GPU \(2 rank\(s\) per GPU"):
        local.LocalCluster().check({}, spec, 1)
    assert not started
    monkeypatch.setattr(local, "nvml_free_bytes", lambda visible: [3 * per_rank])
    local.LocalCluster().check({}, spec, 1)  # fits: no refusal
    monkeypatch.setattr(local, "nvml_free_bytes", lambda visible: None)
    local.LocalCluster().check({}, spec, 1)  # unknown free memory: no refusal, never a guess
    assert resources.check_gpu_memory(spec, 0, [1]) is None  # CPU ranks: their memory is the host's


def test_the_sleep_rate_is_timed_once_the_gpu_has_clocked_up(monkeypatch):
    """An idle GPU whose clock runs at half speed for its first 50 ms of work: the rate read after the warm-up
    is the clocked-up one (timing the first 10 ms sleeps read half of it)."""
    full_hz, busy, timed = 1.5e9, [0.0], []

    FakeEvent = _fake_cuda_event()

    def sleep(cycles):
        seconds = cycles / (full_hz / 2 if busy[0] < 0.05 else full_hz)
        busy[0] += seconds
        FakeEvent.clock += seconds
        timed.append(seconds)

    monkeypatch.setattr(loop, "_SLEEP_RATE_HZ", {})
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda i: contextlib.nullcontext())
    assert loop.sleep_rate_hz(torch.device("cuda", 0)) == pytest.approx(full_hz, rel=1e-9)
    # sized by the first (slow) rate: the warm-up and the timed sleeps last at least half their nominal length
    assert timed[1] >= loop.SLEEP_WARMUP_S / 2 and all(t >= loop.SLEEP_TIMED_S / 2 for t in timed[2:])
