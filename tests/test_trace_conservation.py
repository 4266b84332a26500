"""Every kernel accounted for (issue #33): tolerances at the trace's own resolution, copy-engine collectives named
offline as live, malformed device events named by index, name and field."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.analysis.section.records import section_records
from pnpscale.analysis.trace.read import TraceError, read_trace
from pnpscale.core import layout
from tests.test_traces import X, kernel, launch, write_trace

NCCL = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def overlapping(overlap_us: str) -> list[dict]:
    """A step whose collective kernel starts ``overlap_us`` before the compute kernel before it on its stream ends."""
    end = 1070.0 + float(overlap_us)
    return [X("step", "user_annotation", 1000, 300), launch(1010, 1), kernel("void compute(float*)", 1020.0,
            round(end - 1020.0, 3), 1), launch(1015, 2), kernel(NCCL, 1070.0, 30.0, 2, stream=7)]  # fmt: skip


@pytest.mark.parametrize(("overlap_us", "bad"), [("0.001", False), ("0.002", True)])
def test_a_one_ns_overlap_in_a_ns_trace_is_rounding_not_a_broken_clock(tmp_path, overlap_us, bad):
    # ts and dur are each rounded to the trace's resolution (1 ns here): an end may pass the next start by 1 ns
    tr = read_trace(write_trace(tmp_path / "r.json", overlapping(overlap_us)), ["step"])
    (rec,) = section_records(tr.events, ["step"])
    assert (rec.bad is not None) is bad
    if not bad:
        assert [c.name for c in rec.collectives] == ["all_gather"] and rec.collectives[0].duration_s == 30e-6


def test_a_device_event_without_ts_is_refused_naming_index_name_and_field(tmp_path):
    evs = [X("step", "user_annotation", 1000, 300), launch(1010, 1), kernel("void compute(float*)", 1020.0, 5, 1)]
    del evs[2]["ts"]
    with pytest.raises(TraceError, match=r"r\.json: event #3 'void compute\(float\*\)' \(kernel, correlation 1\) "
                                         r"has no 'ts' field"):  # fmt: skip
        read_trace(write_trace(tmp_path / "r.json", evs), ["step"])


def copy_engine_step(t: float, corr: int, copy_engine: bool) -> list[dict]:
    """One step: a compute kernel, then an all_gather on a kernel or on the copy engines (NCCL >= 2.28)."""
    evs = [X("step", "user_annotation", t, 300), launch(t + 10, corr), kernel("void compute(float*)", t + 20, 40, corr),
           X("record_param_comms", "cpu_op", t + 60, 20, **{"Collective name": "_allgather_base"}),
           X("nccl:_all_gather_base", "user_annotation", t + 61, 18)]  # fmt: skip
    if copy_engine:
        evs += [X("cudaMemcpyBatchAsync", "cuda_runtime", t + 65, 3, correlation=corr + 1),
                X("Memcpy DtoD (Device -> Device)", "gpu_memcpy", t + 70, 25, tid=7, device=0, stream=7,
                  correlation=corr + 1)]  # fmt: skip
    else:
        evs += [launch(t + 65, corr + 1), kernel(NCCL, t + 70, 25, corr + 1)]
    return evs


def test_a_copy_engine_all_gather_is_named_offline_not_blamed_on_dropped_kernels(tmp_path, capsys):
    job = tmp_path / "job"
    job.mkdir()
    write_trace(job / "r0.json", copy_engine_step(1000, 10, True) + copy_engine_step(2000, 20, False), rank=0,
                world=1)  # fmt: skip
    code = main([str(job), "--sections", "step", "--out", str(tmp_path / "o"), "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    kinds = {a["kind"]: a for a in json.loads((tmp_path / "o" / ANALYSIS_JSON).read_text())["anomalies"]}
    ce = kinds.pop("collective_on_copy_engines")
    assert "iteration 0 section 'step'" in ce["example"] and "'Memcpy DtoD (Device -> Device)'" in ce["example"]
    assert "copy engines (cudaMemcpyBatchAsync, no kernel)" in ce["example"]
    assert "collective_without_kernel" not in kinds and "dropped" not in ce["example"].split("(its transfer")[0]
    assert "another device" not in out
    table = pd.read_parquet(tmp_path / "o" / layout.SECTIONS)
    assert table[K.ITERATION].tolist() == [1]  # the copy-engine step dropped, the kernel step exact
    assert table[K.TRANSFER_S].tolist() == pytest.approx([25e-6], abs=1e-12)


def test_the_anomaly_catalogue_lists_every_kind_with_its_action():
    from pathlib import Path

    from pnpscale.analysis.anomalies import KINDS

    text = (Path(__file__).parent.parent / "docs" / "traces.md").read_text()
    catalogue = text[text.index("## The anomaly catalogue") :]
    for kind, action in KINDS.items():
        assert f"| `{kind}` | {action.replace('|', '/')} |" in catalogue, kind


def test_collectives_that_cannot_be_typed_are_never_matched_by_position_alone():
    from pnpscale.analysis.events import Collective, SectionError, SectionRecord
    from pnpscale.analysis.section.align import align_collectives

    generic = "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"

    def rec(*names: str) -> list[SectionRecord]:
        return [SectionRecord(0, "s", 0.0, 1.0, [Collective(i, n, 0.1, None, 7) for i, n in enumerate(names)])]

    with pytest.raises(SectionError, match=r"rank 0 ran 2 collectives on stream 7 whose type is unknown"):
        align_collectives({0: rec(generic, generic), 1: rec(generic, generic)})
    # typed ones issued in another order are matched by type; one untyped per stream is unambiguous
    out = align_collectives({0: rec("all_reduce", "all_to_all", generic), 1: rec("all_to_all", "all_reduce", generic)})
    assert [(c.seq, c.name) for c in out[1][0].collectives] == [(0, "all_reduce"), (1, "all_to_all"), (2, generic)]
