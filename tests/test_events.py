"""Reduction of one rank's profiler events to section records (pnpscale.events)."""

from __future__ import annotations

import pytest

from pnpscale.analysis.events import Event, Kind, SectionError
from pnpscale.analysis.kineto import payload_bytes
from pnpscale.analysis.section.records import section_records

US = 1000  # ns


def cpu(name, start_us, end_us, tid=1, **kw):
    return Event(name, Kind.CPU, start_us * US, end_us * US, tid=tid, **kw)


def test_gloo_sections_and_collectives():
    events = [
        cpu("gradient", 0, 100),
        cpu("aten::mm", 1, 40),
        cpu("c10d::allreduce_", 41, 42),
        cpu("gloo:all_reduce", 43, 90, tid=7, payload_bytes=4096, collective="all_reduce"),
        cpu("denoiser", 110, 300),
        cpu("gloo:broadcast", 120, 125, tid=8, payload_bytes=8, collective="broadcast"),
        cpu("gloo:all_reduce", 200, 290, tid=7, payload_bytes=4096, collective="all_reduce"),
        cpu("gloo:barrier", 305, 310, tid=7),  # outside every section: ignored
        cpu("gradient", 400, 450),
        cpu("denoiser", 460, 500),
    ]
    recs = section_records(events, ("gradient", "denoiser"))
    assert [(r.iteration, r.section) for r in recs] == [
        (0, "gradient"),
        (0, "denoiser"),
        (1, "gradient"),
        (1, "denoiser"),
    ]
    g0, d0 = recs[0], recs[1]
    assert g0.section_s == pytest.approx(100e-6) and g0.start_s == 0
    assert [(c.name, c.payload_bytes) for c in g0.collectives] == [("all_reduce", 4096)]
    assert g0.collectives[0].duration_s == pytest.approx(47e-6)
    assert [c.name for c in d0.collectives] == ["broadcast", "all_reduce"] and [c.seq for c in d0.collectives] == [0, 1]
    assert recs[2].collectives == [] and recs[3].start_s == pytest.approx(460e-6)


def test_cuda_section_runs_from_cpu_start_to_last_gpu_end_and_nccl_kernels_are_collectives():
    events = [
        cpu("denoiser", 0, 50),
        cpu("nccl:all_reduce", 30, 31, payload_bytes=1 << 20, collective="all_reduce"),
        # kernels run later than their launch; assignment is by launch time
        Event("volta_sgemm", Kind.GPU, 20 * US, 60 * US, tid=7, launch_ns=5 * US),
        Event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", Kind.GPU, 60 * US, 90 * US, tid=7, launch_ns=31 * US),
        cpu("gradient", 100, 120),
        Event("elementwise", Kind.GPU, 125 * US, 140 * US, tid=7, launch_ns=110 * US),
    ]
    # pnpscale's own runs (sections start with the GPU idle): from the CPU range start
    d, g = section_records(events, ("denoiser", "gradient"), cpu_start=True)
    assert d.section_s == pytest.approx(90e-6)  # CPU start 0 -> last GPU end 90 us
    assert d.gpu_span_s == pytest.approx(70e-6)  # 20 -> 90 us on the GPU
    # foreign traces: the GPU span
    assert section_records(events, ("denoiser", "gradient"))[0].section_s == pytest.approx(70e-6)
    assert len(d.collectives) == 1
    c = d.collectives[0]
    assert c.name == "all_reduce" and c.payload_bytes == 1 << 20 and c.duration_s == pytest.approx(30e-6)
    assert g.section_s == pytest.approx(40e-6) and g.gpu_span_s == pytest.approx(15e-6) and g.collectives == []


def test_kernel_without_launch_time_is_placed_by_its_start():
    events = [
        cpu("gradient", 0, 100),
        Event("ncclKernel_AllReduce_RING_LL_Sum_float", Kind.GPU, 40 * US, 80 * US, tid=7),
        cpu("denoiser", 100, 200),
    ]
    g, d = section_records(events, ("gradient", "denoiser"))
    assert [c.name for c in g.collectives] == ["all_reduce"] and g.collectives[0].payload_bytes is None
    # no GPU work launched inside: no GPU span, and 0 (foreign trace) or the CPU range (pnpscale run)
    assert d.section_s == 0 and d.gpu_span_s is None and d.collectives == []
    own = section_records(events, ("gradient", "denoiser"), cpu_start=True)[1]
    assert own.section_s == pytest.approx(100e-6) and own.gpu_span_s is None


def test_unequal_section_counts_raise():
    with pytest.raises(SectionError, match="gradient=2, denoiser=1"):
        section_records([cpu("gradient", 0, 1), cpu("denoiser", 2, 3), cpu("gradient", 4, 5)], ("gradient", "denoiser"))
    with pytest.raises(SectionError, match="forward=0"):
        section_records([cpu("aten::mm", 0, 1)], ("forward", "backward"))


def test_payload_bytes_dtypes():
    assert payload_bytes([[8, 3, 16, 16]], ["c10::BFloat16"]) == 8 * 3 * 16 * 16 * 2
    assert payload_bytes([[2]], ["Long"]) == 16
    assert payload_bytes(None, None) is None


def test_drop_cut_iterations_drops_only_what_an_unclosed_file_lost():
    from pnpscale.analysis.anomalies import Anomalies
    from pnpscale.analysis.events import Collective, SectionRecord
    from pnpscale.analysis.section.iterations import drop_cut_iterations

    def recs(n, colls=1, open_last=False, last_colls=None):
        out = []
        for i in range(n):
            k = last_colls if (i == n - 1 and last_colls is not None) else colls
            out.append(SectionRecord(i, "s", float(i), 1.0, [Collective(j, "all_reduce", 0.1, 8) for j in range(k)],
                                     open_end=open_last and i == n - 1))  # fmt: skip
        return out

    full = recs(3)
    # fewer iterations in a file Kineto closed: left alone (align_collectives refuses it)
    assert drop_cut_iterations({0: full, 1: recs(2)}, {}) == {0: full, 1: recs(2)}
    # fewer iterations, unclosed, the last complete (an event starts after it): the rest dropped, named
    an = Anomalies()
    out = drop_cut_iterations({0: full, 1: recs(2)}, {1: "rank1.json"}, an)
    assert [len(v) for v in out.values()] == [2, 2]
    (a,) = an.records()
    assert (a["kind"], a["rank"], a["count"]) == ("trace_cut_short", 1, 1)
    assert a["example"].startswith("rank1.json: rank 1 holds 2 iteration(s), rank 0 3")
    assert "iterations 2..2 dropped on every rank" in a["example"]
    # as many iterations, a CPU rank's open last one with fewer collectives: dropped
    out = drop_cut_iterations({0: full, 1: recs(3, open_last=True, last_colls=0)}, {1: "rank1.json"})
    assert [len(v) for v in out.values()] == [2, 2]
    # ... with as many collectives it may be complete: kept
    whole = recs(3, open_last=True)
    assert drop_cut_iterations({0: full, 1: whole}, {1: "r1.json"}) == {0: full, 1: whole}
    # nothing left: refused naming the file
    with pytest.raises(SectionError, match="rank1.json: rank 1 holds 1 iteration.*no iteration left"):
        drop_cut_iterations({0: full, 1: recs(1, open_last=True)}, {1: "rank1.json"})


def test_drop_cut_iterations_by_step_drops_a_cut_step_or_refuses_when_none_is_left():
    from pnpscale.analysis.anomalies import Anomalies
    from pnpscale.analysis.events import Collective, SectionRecord
    from pnpscale.analysis.section.iterations import drop_cut_iterations

    def step(i, n, open_end=False):
        return SectionRecord(i, "s", float(i), 1.0, [Collective(j, "all_reduce", 0.1, 8) for j in range(n)],
                             step=40 + i, open_end=open_end)  # fmt: skip

    an = Anomalies()
    out = drop_cut_iterations({0: [step(0, 2), step(1, 2)], 1: [step(0, 2), step(1, 1, True)]}, {1: "r1.json"}, an)
    assert [s.step for s in out[1]] == [40] and [s.step for s in out[0]] == [40, 41]  # match_steps drops 41 next
    assert an.records()[0]["example"].startswith("r1.json: rank 1 holds 1 collective(s) in ProfilerStep#41")
    with pytest.raises(SectionError, match="r1.json: rank 1 .*ProfilerStep#40.*no step left on rank 1"):
        drop_cut_iterations({0: [step(0, 2)], 1: [step(0, 0, True)]}, {1: "r1.json"})
