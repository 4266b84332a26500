"""Corruptions with a contract: generated traces (tests/tracegen.py), corrupted on purpose, must end in the
generator's numbers, a refusal naming the cause, or an anomaly that names it -- never exit 0 with a changed
number and no word.

Each corruption says what it may end in: ``exact`` (the generator's numbers, and only the anomalies it
lists), else the generator's numbers, one of its named anomalies (a dropped iteration leaves the others
exact), or a refusal whose message holds one of its phrases. The README's trace contract lists the same.
"""

from __future__ import annotations

import copy
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pnpscale import columns as K
from tests.test_trace_properties import PHASES, analyse, assert_decomposition, results, specs
from tests.tracegen import ABSOLUTE_NS, BASE_NS, COMPUTE_STREAM, Job, simulate, write

CORRUPTION = settings(max_examples=10, deadline=None, derandomize=True, database=None, phases=PHASES,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


@dataclass
class Corrupted:
    """A corrupted job: events per rank, where the metadata goes, a text edit; what it may end in."""

    events: dict[int, list[dict]]
    exact: bool = False
    allowed: frozenset[str] = frozenset()  # anomalies an exact result may carry
    named: frozenset[str] = frozenset()  # anomalies that name this corruption's cause
    refusals: tuple[str, ...] = ()  # phrases a refusal names the cause with
    meta_after: bool = False
    edit: Callable[[int, str], str] | None = None
    applies: bool = True  # False: nothing to corrupt in this job (the example is skipped)
    extra: dict = field(default_factory=dict)


def kernels(evs: list[dict], nccl: bool | None = None) -> list[dict]:
    out = [e for e in evs if e.get("cat") == "kernel"]
    if nccl is None:
        return out
    return [e for e in out if e["name"].startswith("nccl") == nccl]


def device(evs: list[dict]) -> list[dict]:
    """Every device event: kernels, memcpy, memset."""
    return [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def runtime(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e.get("cat") == "cuda_runtime"]


def pick(rng: random.Random, items: list):
    return items[rng.randrange(len(items))] if items else None


# --- the corruptions ---------------------------------------------------------------------------------


def ts_unset(job: Job, rng: random.Random) -> Corrupted:
    """kineto#109: one kernel written with ``ts: 0, dur: 0`` (or far before the trace's base time)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    k = pick(rng, device(evs[r]))
    if k is not None:
        k["ts"] = "\u0000" + rng.choice(["0", "0.000", f"-{BASE_NS // 1000}"])
        k["dur"] = 0
    return Corrupted(evs, named=frozenset({"non_physical_timing"}), refusals=("unset timestamp",),
                     applies=k is not None)  # fmt: skip


def ts_wrong_unit(job: Job, rng: random.Random) -> Corrupted:
    """One kernel's ``ts`` written in ns instead of us (1000 times too large)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    k = pick(rng, kernels(evs[r]))
    if k is not None:
        ns = k["ts"] + (0 if job.spec.time_base == "base" else ABSOLUTE_NS)
        k["ts"] = "\u0000" + str(ns)  # ns written where us belong
    return Corrupted(evs, named=frozenset({"non_physical_timing"}),
                     refusals=("out of any clock's range", "outside the profiled window"),
                     applies=k is not None)  # fmt: skip


def gpu_outside_window(job: Job, rng: random.Random) -> Corrupted:
    """A kernel launched before the profiler started: its correlation has no runtime event."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    first = min(e["ts"] for e in evs[r] if isinstance(e.get("ts"), int))
    evs[r].insert(1, {"ph": "X", "cat": "kernel", "name": "void early_kernel", "pid": 0, "tid": COMPUTE_STREAM,
                      "ts": first - 5000, "dur": 1000, "args": {"device": 0, "stream": COMPUTE_STREAM,
                                                                "correlation": 987654}})  # fmt: skip
    return Corrupted(evs, exact=True, allowed=frozenset({"gpu_event_outside_window"}),
                     applies=bool(kernels(evs[r])))  # fmt: skip


def runtime_clock(job: Job, rng: random.Random) -> Corrupted:
    """kineto#1082: the runtime events of one rank on another clock than its CPU ranges and kernels."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    delta = rng.choice([-1, 1]) * rng.randrange(1, 40_000)
    for e in runtime(evs[r]):
        e["ts"] += delta
    # without a collective the offset is found from the operators that issued the calls (External id)
    return Corrupted(evs, named=frozenset({"runtime_clock_offset", "gpu_before_launch"}),
                     refusals=("sections overlap", "non-physical"), extra={"delta": delta})  # fmt: skip


def gpu_clock_ahead(job: Job, rng: random.Random) -> Corrupted:
    """A GPU clock ahead of the CPU's: kernels start before their launch (the GPU span is unchanged)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    delta = rng.randrange(1, 30_000) + job.spec.gpu_lag_ns[r]
    for e in device(evs[r]):
        e["ts"] -= delta
    return Corrupted(evs, exact=True, allowed=frozenset({"gpu_before_launch"}))


def stream_overlap(job: Job, rng: random.Random) -> Corrupted:
    """kineto#990: a kernel moved onto the stream of the kernel before it, starting before that one ends."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    ks = sorted(kernels(evs[r]), key=lambda e: e["ts"])
    pairs = [(a, b) for a, b in zip(ks, ks[1:], strict=False) if a["dur"] > 0 and a["args"]["stream"] == COMPUTE_STREAM]
    pair = pick(rng, pairs)
    if pair is not None:
        a, b = pair
        new_ts = a["ts"] + a["dur"] - rng.randrange(1, a["dur"] + 1)
        b["dur"] += b["ts"] - new_ts
        b["ts"] = new_ts
        b["tid"] = b["args"]["stream"] = COMPUTE_STREAM
    return Corrupted(evs, named=frozenset({"non_physical_timing", "stream_overlap"}), refusals=("cannot overlap",),
                     applies=pair is not None)  # fmt: skip


def device_categories(job: Job, rng: random.Random) -> Corrupted:
    """Runtime categories of other devices (XPU, MTIA, PrivateUse1, 2021's Runtime); 2021's Kernel on
    ``"stream N"`` threads; XPU kernels on a ``sycl queue``."""
    evs = copy.deepcopy(job.events)
    rt = rng.choice(["xpu_runtime", "mtia_runtime", "privateuse1_runtime", "Runtime", "cuda_driver"])
    old = rng.random() < 0.5
    sycl = not old and rng.random() < 0.5
    for r in evs:
        for e in runtime(evs[r]):
            e["cat"] = rt
        for e in device(evs[r]):
            if old:
                e["cat"] = {"kernel": "Kernel", "gpu_memcpy": "Memcpy", "gpu_memset": "Memset"}[e["cat"]]
                e["tid"] = f"stream {e['tid']}"
            if sycl:
                e["args"]["sycl queue"] = 64 + e["args"].pop("stream")
    return Corrupted(evs, exact=True)


def ccl_names(job: Job, rng: random.Random) -> Corrupted:
    """Collective kernels of oneCCL (with ``xccl:`` descriptors), HCCL (``hccl:``) or RCCL's MSCCL."""
    evs = copy.deepcopy(job.events)
    lib = rng.choice(["oneccl", "hccl", "msccl"])
    names = {"oneccl": {"all_reduce": "oneccl_allreduce_base<float, 2, 16, 1, 1, 2>",
                        "broadcast": "oneccl_broadcast<float>", "all_gather": "oneccl_allgather<float, 2>",
                        "reduce_scatter": "oneccl_reduce_scatter<float>",
                        "all_to_all": "oneccl_alltoall<float>"},
             "hccl": {"all_reduce": "hcom_allReduce__101_0_1", "broadcast": "hcom_broadcast__7_0_1",
                      "all_gather": "hcom_allGather__9_0_1", "reduce_scatter": "hcom_reduceScatter__3_0_1",
                      "all_to_all": "hcom_alltoall__5_0_1"}}  # fmt: skip
    prefix = {"oneccl": "xccl:", "hccl": "hccl:", "msccl": "nccl:"}[lib]
    for r in evs:
        for e in evs[r]:
            if e.get("cat") == "user_annotation" and e["name"].startswith("nccl:"):
                e["name"] = prefix + e["name"][5:]
        for e in kernels(evs[r], nccl=True):
            op = e["args"]["Collective name"]
            op = {"allreduce": "all_reduce", "_allgather_base": "all_gather",
                  "_reduce_scatter_base": "reduce_scatter"}.get(op, op)  # fmt: skip
            e["name"] = "mscclKernel_Sum_float_LL128(...)" if lib == "msccl" else names[lib][op]
    return Corrupted(evs, exact=True)


def dropped_kernel(job: Job, rng: random.Random) -> Corrupted:
    """A collective descriptor whose kernel was dropped (repeated profiler sessions)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    k = pick(rng, kernels(evs[r], nccl=True))
    if k is not None:
        evs[r].remove(k)
    return Corrupted(evs, named=frozenset({"collective_without_kernel", "iteration_incomplete"}),
                     refusals=("without a GPU kernel", "no NCCL kernel recorded", "have no GPU event"),
                     applies=k is not None)  # fmt: skip


def all_gpu_dropped(job: Job, rng: random.Random) -> Corrupted:
    """kineto#996: every GPU record of one rank dropped."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    evs[r] = [e for e in evs[r] if e not in device(evs[r])]
    return Corrupted(evs, refusals=("but no GPU event: the profiler dropped every GPU record",))


def two_processes(job: Job, rng: random.Random) -> Corrupted:
    """A file that holds the events of two processes (two ranks merged into one file)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    other = [dict(e, pid=e["pid"] + 1000) for e in copy.deepcopy(job.events[(r + 1) % job.spec.world])
             if e.get("ph") == "X" and e.get("cat") != "kernel" and isinstance(e["pid"], int)]  # fmt: skip
    evs[r] += other
    return Corrupted(evs, refusals=("processes in one file",))


def two_devices(job: Job, rng: random.Random) -> Corrupted:
    """Collective kernels of two devices in one file (two ranks' GPU activities merged)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    other = [dict(e, pid=1, args=dict(e["args"], device=1)) for e in kernels(evs[r], nccl=True)]
    for e in other:
        e["args"]["correlation"] += 100_000
    evs[r] += other
    return Corrupted(evs, refusals=("devices in one file",), applies=bool(other))


def negative_cpu_ts(job: Job, rng: random.Random) -> Corrupted:
    """A CPU range (a collective's descriptor or gloo range) or a runtime launch written with a negative ``ts``."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    cands = [e for e in evs[r] if e.get("cat") == "cuda_runtime" and e["name"] != "cudaDeviceSynchronize"]
    cands += [e for e in evs[r] if str(e.get("name", "")).startswith(("gloo:", "record_param_comms"))]
    e = pick(rng, cands)
    if e is not None:
        e["ts"] = "\u0000-" + str(rng.randrange(1, 10**6))
    return Corrupted(evs, named=frozenset({"non_physical_timing"}), refusals=("non-physical",), applies=e is not None)


def unknown_ccl(job: Job, rng: random.Random) -> Corrupted:
    """Collective kernels of a library pnpscale does not know (names that speak of a collective)."""
    evs = copy.deepcopy(job.events)
    n = 0
    for r in evs:
        for k in kernels(evs[r], nccl=True):
            k["name"] = rng.choice(["myccl_allreduce_kernel", "fastcomm::all_gather_ll", "x_reduce_scatter_ring"])
            n += 1
    return Corrupted(evs, named=frozenset({"collective_kernel_unrecognised"}),
                     refusals=("collective", "without a GPU kernel"), applies=n > 0)  # fmt: skip


def unread_categories(job: Job, rng: random.Random) -> Corrupted:
    """Every device event of one rank in a category pnpscale does not read (another device's kernels)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    cat = rng.choice(["tpu_kernel", "gpu_kernel_v2", "accelerator_op"])
    for e in device(evs[r]):
        e["cat"] = cat
    return Corrupted(evs, refusals=(f"{cat!r}",))


def shuffled(job: Job, rng: random.Random) -> Corrupted:
    """Events out of order."""
    evs = copy.deepcopy(job.events)
    for r in evs:
        rng.shuffle(evs[r])
    return Corrupted(evs, exact=True)


def duplicated(job: Job, rng: random.Random) -> Corrupted:
    """Events written twice."""
    evs = copy.deepcopy(job.events)
    for r in evs:
        xs = [e for e in evs[r] if e.get("ph") == "X"]
        for e in rng.sample(xs, min(len(xs), rng.randrange(1, 6))):
            evs[r].insert(rng.randrange(len(evs[r]) + 1), copy.deepcopy(e))
    return Corrupted(evs, exact=True, allowed=frozenset({"duplicate_event"}))


#: what a broken correlation between launches and GPU events ends in (issue #33: every kernel accounted for)
_CONSERVATION = frozenset({"iteration_incomplete", "gpu_event_unknown_correlation", "gpu_event_outside_window",
                           "collective_without_kernel", "copy_without_gpu_event"})  # fmt: skip
_CONSERVATION_REFUSALS = ("have no GPU event", "matches no runtime launch", "without a GPU kernel",
                          "no NCCL kernel recorded", "every iteration is dropped", "but no GPU event")  # fmt: skip


def deleted_event(job: Job, rng: random.Random) -> Corrupted:
    """One random runtime call or device event deleted (a GPU record dropped, or its launch): every launch inside a
    section must have its GPU event and every GPU event its launch, else the iteration is named and dropped."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    e = pick(rng, runtime(evs[r]) + device(evs[r]))
    if e is not None:
        evs[r].remove(e)
    return Corrupted(evs, named=_CONSERVATION, refusals=_CONSERVATION_REFUSALS, applies=e is not None)


def reid_event(job: Job, rng: random.Random) -> Corrupted:
    """One random device event or runtime call given a correlation id nothing else has (re-id'd by a tool)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    e = pick(rng, [x for x in runtime(evs[r]) + device(evs[r]) if "correlation" in x.get("args", {})])
    if e is not None:
        e["args"]["correlation"] = 9_000_000 + rng.randrange(1000)
    return Corrupted(evs, named=_CONSERVATION, refusals=_CONSERVATION_REFUSALS, applies=e is not None)


def truncated(job: Job, rng: random.Random) -> Corrupted:
    """A file cut short (the profiler or a copy died while writing)."""
    r = rng.randrange(job.spec.world)
    frac = rng.uniform(0.05, 0.98)

    def edit(rank: int, text: str) -> str:
        return text[: int(len(text) * frac)] if rank == r else text

    return Corrupted(copy.deepcopy(job.events), edit=edit, refusals=("cannot read trace: the file ends", "truncated?"))


def cut_and_closed(job: Job, rng: random.Random) -> Corrupted:
    """A file cut short and then closed as valid JSON (the profiler killed while writing, the file completed by
    a tool): one rank's events end at some point of the order Kineto writes them in (the CPU events by start,
    the profiler's span, then the GPU events by start; ChromeTraceLogger), and Kineto's last event (``Record
    Window End``) is gone, and the span with it (a CPU trace of one rank, which no other rank vouches for, is
    told cut by that: it holds Kineto's header but neither the span nor the marker, pnpscale/analysis/trace/cut.py)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    body = [e for e in evs[r] if e.get("ph") == "X"]
    body.sort(key=lambda e: (2 if e.get("cat") in gpu else 1 if e.get("cat") == "Trace" else 0, e["ts"]))
    head = [e for e in evs[r] if e.get("ph") == "M"]
    n_cpu = sum(1 for e in body if e.get("cat") not in gpu)
    # on CUDA mostly inside the GPU events (a cut before them leaves none: refused, as kineto#996)
    lo = n_cpu if n_cpu < len(body) and rng.random() < 0.7 else len(body) // 3
    cut = rng.randrange(lo, len(body))
    evs[r] = head + body[:cut]
    return Corrupted(evs, named=frozenset({"trace_cut_short"}), refusals=("cut short",))


def non_finite_token(job: Job, rng: random.Random) -> Corrupted:
    """A bare ``inf`` / ``NaN`` in an operator's args (Kineto writes them; not JSON)."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    first = min(e["ts"] for e in evs[r] if isinstance(e.get("ts"), int))
    evs[r].insert(1, {"ph": "X", "cat": "cpu_op", "name": "aten::fill_", "pid": 100 + r, "tid": 1001,
                      "ts": first - 3000, "dur": 1000, "args": {"Concrete Inputs": ["", "@@INF@@"],
                                                                "External id": 99999}})  # fmt: skip
    token = rng.choice(["inf", "Infinity", "NaN", "-inf"])
    return Corrupted(evs, exact=True, allowed=frozenset({"non_finite_number"}),
                     edit=lambda rank, text: text.replace('"@@INF@@"', token))  # fmt: skip


def negative_duration(job: Job, rng: random.Random) -> Corrupted:
    """An event whose end was written as 0: a negative ``dur``."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    cands = kernels(evs[r]) or [e for e in evs[r] if str(e.get("name", "")).startswith("gloo:")]
    e = pick(rng, cands)
    if e is not None:
        e["dur"] = -e["ts"] - rng.randrange(1, 10**6)
    return Corrupted(evs, named=frozenset({"non_physical_timing"}), refusals=("non-physical",),
                     applies=e is not None)  # fmt: skip


def metadata_after(job: Job, rng: random.Random) -> Corrupted:
    """``distributedInfo`` and ``baseTimeNanoseconds`` written after ``traceEvents``."""
    return Corrupted(copy.deepcopy(job.events), exact=True, meta_after=True)


def shifted_steps(job: Job, rng: random.Random) -> Corrupted:
    """One rank's ``ProfilerStep#N`` numbered from another first step."""
    evs = copy.deepcopy(job.events)
    r = rng.randrange(job.spec.world)
    shift = rng.randrange(1, 3)
    for e in evs[r]:
        if str(e.get("name", "")).startswith("ProfilerStep#"):
            e["name"] = f"ProfilerStep#{int(e['name'].split('#')[1]) + shift}"
    return Corrupted(evs, named=frozenset({"step_not_on_every_rank"}),
                     refusals=("no ProfilerStep number in common", "matched by ProfilerStep number"),
                     applies=job.spec.steps and job.spec.world > 1)  # fmt: skip


def correlation_zero(job: Job, rng: random.Random) -> Corrupted:
    """ROCm: every collective kernel with correlation 0 (unknown launch)."""
    evs = copy.deepcopy(job.events)
    for r in evs:
        for k in kernels(evs[r], nccl=True):
            k["args"]["correlation"] = 0
    return Corrupted(evs, exact=True, allowed=frozenset({"launch_unknown_paired"}))


CORRUPTIONS: dict[str, tuple[Callable[[Job, random.Random], Corrupted], str | None]] = {
    "ts_unset": (ts_unset, "nccl"),
    "gpu_outside_window": (gpu_outside_window, "nccl"),
    "ts_wrong_unit": (ts_wrong_unit, "nccl"),
    "runtime_clock": (runtime_clock, "nccl"),
    "gpu_clock_ahead": (gpu_clock_ahead, "nccl"),
    "stream_overlap": (stream_overlap, "nccl"),
    "device_categories": (device_categories, "nccl"),
    "ccl_names": (ccl_names, "nccl"),
    "dropped_kernel": (dropped_kernel, "nccl"),
    "all_gpu_dropped": (all_gpu_dropped, "nccl"),
    "two_processes": (two_processes, None),
    "two_devices": (two_devices, "nccl"),
    "negative_cpu_ts": (negative_cpu_ts, None),
    "unknown_ccl": (unknown_ccl, "nccl"),
    "unread_categories": (unread_categories, "nccl"),
    "shuffled": (shuffled, None),
    "duplicated": (duplicated, None),
    "deleted_event": (deleted_event, "nccl"),
    "reid_event": (reid_event, "nccl"),
    "truncated": (truncated, None),
    "cut_and_closed": (cut_and_closed, None),
    "non_finite_token": (non_finite_token, None),
    "negative_duration": (negative_duration, None),
    "metadata_after": (metadata_after, None),
    "shifted_steps": (shifted_steps, None),
    "correlation_zero": (correlation_zero, "nccl"),
}


#: anomalies that drop iterations (on every rank): the others must stay exact
DROPS = frozenset({"non_physical_timing", "trace_cut_short", "iteration_incomplete"})


def check_contract(job: Job, bad: Corrupted) -> str:
    """Run the analysis on the corrupted job and check what it ended in; returns ``exact``, ``named`` or ``refused``."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "job"
        write(job, folder, meta_after=bad.meta_after, events=bad.events, edit=bad.edit)
        code, err, out = analyse(folder, job.spec.sections)
        if code != 0:
            assert not bad.exact, f"refused a corruption that must be read exactly: {err}"
            assert any(p in err for p in bad.refusals), f"refusal names no cause of this corruption: {err}"
            return "refused"
        table, anomalies = results(out)
    kinds = {a["kind"] for a in anomalies}
    no_coll = job.spec.world > 1 and not any(c for it in job.spec.plan for sec in it for c in sec)
    if no_coll:
        kinds.discard("no_collectives")
        table = table.assign(**{K.TRANSFER_S: table[K.TRANSFER_S].fillna(0.0), K.WAIT_S: table[K.WAIT_S].fillna(0.0)})
    if bad.exact:
        assert kinds <= bad.allowed, kinds
        assert_decomposition(job, table)
        return "exact"
    if kinds & bad.named:
        if kinds & bad.named & DROPS:  # the other iterations stay exact
            assert_decomposition(job, table, iterations=set(table[K.ITERATION].astype(int)))
        return "named"
    assert_decomposition(job, table)  # no word: then the numbers must be the generator's
    return "exact"


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corruption_ends_in_the_numbers_a_refusal_or_a_named_anomaly(name: str) -> None:
    corrupt, backend = CORRUPTIONS[name]
    seen: list[str] = []

    @CORRUPTION
    @given(spec=specs(backend=backend, max_world=4), seed=st.integers(0, 2**32 - 1))
    def prop(spec, seed):
        job = simulate(spec)
        bad = corrupt(job, random.Random(seed))
        if bad.applies:
            seen.append(check_contract(job, bad))

    prop()
    assert seen, f"{name}: no generated job could be corrupted"


def test_untyped_kernels_issued_in_another_order_are_matched_by_descriptor_type_and_sequence(tmp_path):
    """Generic kernels (no type in the name) of two process groups, issued in a different order on rank 1:
    matched by (process group, Seq) of their descriptors, not by position."""
    import pandas as pd

    from pnpscale.core import layout
    from tests.tracegen import Coll, Spec

    plan = (((Coll("broadcast", 64, "Float", 3000), Coll("all_reduce", 4096, "Float", 9000)),),)
    spec = Spec("nccl", 2, ("gradient",), plan, work=(((((5000, 4000, 3000),),)),) * 2,
                kernels=((((1, 1, 1),),),) * 2, gap=(((0,),),) * 2, rank_skew_ns=(0, 777), gpu_lag_ns=(0, 0),
                names="generic")  # fmt: skip
    job = simulate(spec)
    evs = copy.deepcopy(job.events)
    for r in (0, 1):
        descs = [e for e in evs[r] if e["name"] == "record_param_comms"]
        ks = kernels(evs[r], nccl=True)
        ranges = [e for e in evs[r] if e["name"].startswith("nccl:")]
        for e in (descs[1], ks[1]["args"]):  # the all_reduce belongs to process group "1", its own sequence
            (e["args"] if "args" in e else e).update({"Process Group Name": "1", "Seq": 0})
        ks[1]["tid"] = ks[1]["args"]["stream"] = 21
        if r == 1:  # rank 1 issued the all_reduce first: swap what each slot ran, keep the times
            for a, b in ((descs[0]["args"], descs[1]["args"]), (ks[0]["args"], ks[1]["args"])):
                for key in ("Collective name", "In msg nelems", "Out msg nelems", "Process Group Name", "Seq"):
                    if key in a:
                        a[key], b[key] = b[key], a[key]
            ranges[0]["name"], ranges[1]["name"] = ranges[1]["name"], ranges[0]["name"]
            ks[0]["tid"], ks[1]["tid"] = 21, 20
            ks[0]["args"]["stream"], ks[1]["args"]["stream"] = 21, 20
    write(job, tmp_path / "job", events=evs)
    code, err, out = analyse(tmp_path / "job", spec.sections)
    assert code == 0, err
    c = pd.read_parquet(out / layout.COLLECTIVES).sort_values(["seq", "rank"])
    assert c.groupby("seq")["collective"].nunique().max() == 1  # one type per matched collective
    durations = {r: [k["dur"] for k in kernels(evs[r], nccl=True)] for r in (0, 1)}
    by = {(row["rank"], row["collective"]): round(row["duration_s"] * 1e9) for _, row in c.iterrows()}
    assert by[(0, "broadcast")] == durations[0][0] and by[(1, "broadcast")] == durations[1][1]
    assert by[(0, "all_reduce")] == durations[0][1] and by[(1, "all_reduce")] == durations[1][0]


def test_a_lone_cpu_trace_cut_inside_its_last_iteration_is_named_not_read_as_complete() -> None:
    """One CPU rank, its file cut in Kineto's writing order and closed as valid JSON: no other rank vouches for
    it, and its ranges are complete events, so a cut inside the last iteration silently lost that iteration's
    last ``gloo:*`` work ranges (a smaller transfer). Kineto's header without its span or end marker tells the
    cut: the last iteration is dropped and named (``trace_cut_short``: file, rank, iteration), the others exact,
    or the cut refused when it leaves nothing."""
    seen: list[str] = []

    @settings(CORRUPTION, max_examples=12)
    @given(spec=specs(backend="gloo", max_world=1), seed=st.integers(0, 2**32 - 1))
    def prop(spec, seed):
        job = simulate(spec)
        bad = cut_and_closed(job, random.Random(seed))
        seen.append(check_contract(job, bad))

    prop()
    assert "named" in seen, seen


def test_a_lone_cpu_trace_cut_between_iterations_is_named_and_what_is_left_exact(tmp_path: Path) -> None:
    """The case CI drew (hypothesis, seed 14): one CPU rank, its file cut after iteration 1's last range closed,
    so iteration 2 is gone whole and nothing left is open. What is left is whole and exact, and the cut is still
    named (``trace_cut_short``), not read as a 2-iteration job in silence."""
    from tests.tracegen import Coll, Spec

    spec = Spec(backend="gloo", world=1, sections=("gradient",),
                plan=(((),), ((Coll("broadcast", 60544, "Float", 5763), Coll("all_reduce", 35319, "BFloat16", 3507),
                               Coll("all_to_all", 90, "Half", 2756)),), ((Coll("all_to_all", 3295, "Float", 2218),),)),
                work=((((29287,),), ((34348, 60000, 9678, 742),), ((31822, 1915),)),),
                kernels=((((1,),), ((2, 3, 1, 1),), ((3, 3),)),), gap=(((164,), (4253,), (20000,)),),
                rank_skew_ns=(14578,), gpu_lag_ns=(0,), names="old", time_base="base", integer_ts=False, steps=True,
                first_step=2, memcpy=False, orders=(), tails=())  # fmt: skip
    job = simulate(spec)
    bad = cut_and_closed(job, random.Random(14))
    assert check_contract(job, bad) == "named"  # and iterations 0, 1 exact
    folder = tmp_path / "job"
    write(job, folder, meta_after=bad.meta_after, events=bad.events, edit=bad.edit)
    code, err, out = analyse(folder, spec.sections)
    assert code == 0, err
    table, anomalies = results(out)
    assert sorted(table[K.ITERATION].astype(int)) == [0, 1]
    (a,) = [a for a in anomalies if a["kind"] == "trace_cut_short"]
    assert a["rank"] == 0 and "cut short after iteration 1 (ProfilerStep#3)" in a["example"], a


def _complete_cpu_job(world: int = 1) -> Job:
    from tests.tracegen import Coll, Spec

    plan = ((((Coll("all_reduce", 64, "Float", 3000),),),) * 3)
    work = (((((5000, 4000),),) * 3),) * world
    return simulate(Spec("gloo", world, ("gradient",), plan, work=work, kernels=(((((0, 0),),) * 3),) * world,
                         gap=((((0,),) * 3),) * world, rank_skew_ns=(0,) * world, gpu_lag_ns=(0,) * world))  # fmt: skip


@pytest.mark.parametrize("drop", ["marker", "marker_and_span_not_kineto"])
def test_a_complete_lone_cpu_trace_that_kineto_did_not_close_is_read_exactly(drop: str) -> None:
    """No false alarm: a complete one-rank CPU file without ``Record Window End`` but with Kineto's span (as
    HolisticTraceAnalysis' sampled traces), or without span and marker and without Kineto's header (another
    tool's trace), is read exactly with no anomaly."""
    job = _complete_cpu_job()
    evs = copy.deepcopy(job.events)
    evs[0] = [e for e in evs[0] if e.get("name") != "Record Window End"]
    if drop == "marker_and_span_not_kineto":
        evs[0] = [e for e in evs[0] if e.get("cat") != "Trace"]
        job.meta[0].pop("schemaVersion")
    assert check_contract(job, Corrupted(evs, exact=True)) == "exact"


def test_a_kineto_cpu_file_without_span_and_marker_drops_its_last_iteration_by_name(tmp_path: Path) -> None:
    """The cost of the rule: a complete one-rank Kineto file stripped of both its span and its end marker cannot
    be told from a cut one, so its last iteration is dropped, named with file, rank and iteration."""
    job = _complete_cpu_job()
    evs = copy.deepcopy(job.events)
    evs[0] = [e for e in evs[0] if e.get("name") != "Record Window End" and e.get("cat") != "Trace"]
    write(job, tmp_path / "job", events=evs)
    code, err, out = analyse(tmp_path / "job", job.spec.sections)
    assert code == 0, err
    table, anomalies = results(out)
    assert [(a["kind"], a["rank"]) for a in anomalies] == [("trace_cut_short", 0)]
    assert "rank0.json: rank 0, iteration 2" in anomalies[0]["example"]
    assert sorted(table[K.ITERATION]) == [0, 1]
    assert_decomposition(job, table, iterations={0, 1})


def test_a_deleted_copy_is_named_not_a_silent_shorter_section() -> None:
    """A case the property above once found (3 NCCL ranks): the GPU event of a 4 KiB device-to-device copy deleted
    on rank 2, the last GPU work of its denoiser, gave a section 0.7 µs short with no word. A copy may have no GPU
    event (0 bytes), so it is not dropped: named ``copy_without_gpu_event``. The case is the generator's arguments
    as hypothesis printed them (``tests/data/corruption_deleted_copy.txt``)."""
    import textwrap

    import tests.tracegen as tracegen

    text = (Path(__file__).parent / "data" / "corruption_deleted_copy.txt").read_text()
    scope = dict(vars(tracegen))
    exec("args = dict(" + textwrap.dedent(text) + ")", scope)  # noqa: S102 - the repository's own test data
    job = simulate(scope["args"]["spec"])
    bad = deleted_event(job, random.Random(scope["args"]["seed"]))
    assert bad.applies
    with tempfile.TemporaryDirectory() as tmp:
        write(job, Path(tmp) / "job", events=bad.events)
        code, err, out = analyse(Path(tmp) / "job", job.spec.sections)
        assert code == 0, err
        _, anomalies = results(out)
    (copy,) = [a for a in anomalies if a["kind"] == "copy_without_gpu_event"]
    assert copy["rank"] == 2 and "section 'denoiser'" in str(copy), copy
    assert check_contract(job, bad) == "named"
