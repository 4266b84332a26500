"""The eight wild-trace cases of set 3 (tests/data/trace-bug-reports): each gives the reference or names its cause.

Reference (sums over the 3 iterations): gradient C 0.000141 s, T 8.4e-05, W 1.5e-05; denoiser C 0.000465,
T 7.5e-05, W 0. The traces are generated in the test from a copy of the cases' generator.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.core import layout

_SPEC = importlib.util.spec_from_file_location(
    "bug_report_cases", Path(__file__).parent / "data" / "trace-bug-reports" / "make_case.py"
)
assert _SPEC is not None and _SPEC.loader is not None
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)

REFERENCE = {"gradient": (0.000141, 8.4e-05, 1.5e-05), "denoiser": (0.000465, 7.5e-05, 0.0)}


def run(tmp_path: Path, case: str, capsys) -> tuple[int, str, str, Path]:
    cases.write(case, tmp_path / "job")
    out = tmp_path / "out"
    code = main([str(tmp_path / "job"), "--sections", "gradient,denoiser", "--out", str(out), "--jobs", "1"])
    o, e = capsys.readouterr()
    return code, o, e, out


def totals(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / layout.SECTIONS).groupby(K.SECTION)[[K.COMPUTE_S, K.TRANSFER_S, K.WAIT_S]].sum()


def kinds(out: Path) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for a in json.loads((out / ANALYSIS_JSON).read_text())["anomalies"]:
        by.setdefault(a["kind"], []).append(a)
    return by


def assert_reference(out: Path, iterations: int = 3) -> None:
    t = totals(out)
    for sec, ref in REFERENCE.items():
        assert t.loc[sec].tolist() == pytest.approx([v * iterations / 3 for v in ref], abs=1e-12), sec


@pytest.mark.parametrize("case", ["ref", "oldcats", "xpu", "mtia"])
def test_read_as_the_reference_without_anomalies(tmp_path, capsys, case):
    # oldcats: 2021's Kernel/Runtime categories and "stream 7" tids; xpu: xpu_runtime launches, kernels on a
    # "sycl queue", a oneCCL kernel and an xccl: descriptor; mtia: mtia_runtime launches, GPU 1 ms behind
    code, out, _, o = run(tmp_path, case, capsys)
    assert code == 0
    assert_reference(o)
    assert kinds(o) == {} and "anomalies: none" in out


@pytest.mark.parametrize("case", ["ts0", "ts0neg"])
def test_unset_kernel_timestamp_drops_its_iteration_and_says_so(tmp_path, capsys, case):
    code, out, _, o = run(tmp_path, case, capsys)
    assert code == 0
    assert_reference(o, iterations=2)  # iterations 0 and 2, exact
    (a,) = kinds(o)["non_physical_timing"]
    assert a["rank"] == 1 and "iteration 1 section 'gradient'" in a["example"]
    assert "'void compute_kernel'" in a["example"] and "unset timestamp (ts <= 0" in a["example"]
    assert "anomaly non_physical_timing: 1 on rank 1" in out


def test_runtime_clock_skew_is_found_from_the_descriptors_and_repaired(tmp_path, capsys):
    code, out, _, o = run(tmp_path, "skew", capsys)
    assert code == 0
    assert_reference(o)  # not compute 0, CommE 0
    found = kinds(o)["runtime_clock_offset"]
    assert {a["rank"] for a in found} == {0, 1}
    assert "outside its 'nccl:all_reduce'" in found[0]["example"] and "shifted by +10000 ns" in found[0]["example"]


def test_every_gpu_record_dropped_is_refused_naming_the_descriptors(tmp_path, capsys):
    code, _, err, o = run(tmp_path, "nokernels", capsys)
    assert code == 1 and not o.exists()
    assert "rank 0 (rank0.json): 12 collective descriptor(s)" in err
    assert "but no GPU event: the profiler dropped every GPU record" in err


def test_kernels_overlapping_on_one_stream_are_refused_naming_them(tmp_path, capsys):
    code, _, err, o = run(tmp_path, "overlap", capsys)
    assert code == 1 and not o.exists()
    assert "rank 1 iteration 0 section 'gradient'" in err
    assert "starts 10 us before 'void compute_kernel' ends on stream 7: a collective cannot overlap work" in err


@pytest.mark.parametrize("case", ["ref", "skew"])
def test_runtime_clock_skew_without_descriptors_or_external_id_is_refused_not_read_as_compute_0(
    tmp_path, capsys, case
):
    """The skew case with its descriptors removed (no ``record_param_comms``/``nccl:*``; the case has no
    ``External id``): nothing links a launch to what issued it, and read as it is compute is 0 with "anomalies:
    none". Each compute launch, 11 us early, crosses the start of its section range on its own thread: refused
    naming the call and kineto#1082. Without the skew the same stripped trace reads as the reference."""
    docs = cases.build(case)
    (tmp_path / "job").mkdir()
    for r, doc in docs.items():
        drop = ("record_param_comms", "nccl:all_reduce")
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e["name"] not in drop]
        (tmp_path / "job" / f"rank{r}.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    code = main([str(tmp_path / "job"), "--sections", "gradient,denoiser", "--out", str(out), "--jobs", "1"])
    err = capsys.readouterr().err
    if case == "ref":
        assert code == 0, err
        assert_reference(out)
        return
    assert code == 1 and not out.exists()
    assert "rank0.json (rank 0): 6 runtime call(s) cross the start or end of a CPU range of their own thread" in err
    assert "kineto#1082" in err
