"""Messages that name the real cause (issue: trust by construction, item 3), on turn-3 style traces."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.offline import ANALYSIS_JSON, main
from pnpscale.core import layout

_SPEC = importlib.util.spec_from_file_location(
    "bug_report_cases", Path(__file__).parent / "data" / "trace-bug-reports" / "make_case.py"
)
assert _SPEC is not None and _SPEC.loader is not None
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)


def run(tmp_path: Path, docs: dict[int, dict], capsys, sections: str = "gradient,denoiser"):
    job = tmp_path / "job"
    job.mkdir()
    for r, d in docs.items():
        (job / f"rank{r}.json").write_text(json.dumps(d))
    out = tmp_path / "out"
    code = main([str(job), "--sections", sections, "--out", str(out), "--jobs", "1"])
    o, e = capsys.readouterr()
    return code, o, e, out


def anomalies(out: Path) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for a in json.loads((out / ANALYSIS_JSON).read_text())["anomalies"]:
        by.setdefault(a["kind"], []).append(a)
    return by


def _recategorised(old: str, new: str) -> dict:
    """The reference case of ``tests/data/trace-bug-reports`` with every event of category ``old`` moved to ``new``."""
    docs = cases.build("ref")
    for d in docs.values():
        for e in d["traceEvents"]:
            if e["cat"] == old:
                e["cat"] = new
    return docs


def test_unknown_runtime_category_is_named_with_its_count_not_correlation_0(tmp_path, capsys):
    docs = _recategorised("cuda_runtime", "acme_runtime")
    code, out, _, o = run(tmp_path, docs, capsys)
    assert code == 0
    by = anomalies(o)
    assert by["unknown_category"][0]["example"] == "'acme_runtime' (12)"
    placed = by["launch_unknown_by_start"][0]["example"]
    assert "correlation 100, and the trace holds no runtime event of a known category" in placed
    assert "categories not read: acme_runtime" in placed and "correlation 0" not in placed
    assert "anomaly unknown_category: 24 on ranks 0, 1" in out


def test_kernels_of_an_unknown_category_are_named_in_the_refusal(tmp_path, capsys):
    docs = _recategorised("kernel", "acme_kernel")
    code, _, err, _ = run(tmp_path, docs, capsys)
    assert code == 1
    assert "no GPU event of a category pnpscale reads" in err and "'acme_kernel' (12)" in err


def test_no_collective_warning_counts_descriptors_and_gpu_events_and_everything_unknown_is_nan(tmp_path, capsys):
    docs = cases.build("ref")  # collective kernels under a name no library writes: read as compute
    for d in docs.values():
        for e in d["traceEvents"]:
            if e["cat"] == "kernel" and e["name"].startswith("nccl"):
                e["name"] = "void acme_allreduce_kernel<float>"
    code, out, err, o = run(tmp_path, docs, capsys)
    assert code == 0
    assert "no collective was found in any section" in err
    assert "seen: 24 collective descriptor(s) (record_param_comms / nccl:* / xccl:*); 24 GPU event(s)" in err
    assert "the collectives' kernels are not in the trace or not recognised" in err
    (unread,) = anomalies(o)["collective_kernel_unrecognised"][:1]
    assert unread["example"] == "'void acme_allreduce_kernel<float>' (6)"
    s = pd.read_parquet(o / layout.SECTIONS)
    for col in (K.TRANSFER_S, K.WAIT_S, K.MAIN_TRANSFER_S, *K.WAIT_CAUSES):
        assert s[col].isna().all(), col  # unknown, never 0
    assert pd.read_parquet(o / layout.RANKS)[K.COMM_S].isna().all()
    metrics = json.loads((o / ANALYSIS_JSON).read_text())["metrics"]
    assert metrics["sections"]["gradient"]["transfer_total_s"] is None
    assert metrics["sections"]["gradient"]["wait_total_s"] is None
    assert metrics["comm_e"] is None
    assert out.splitlines()[1].split()[3:5] == ["transfer_s", "wait_s"] and "n/a" in out.splitlines()[2]


def test_unknown_section_lists_user_annotations_first_and_hints_at_a_missing_star(tmp_path, capsys):
    docs = cases.build("ref")
    for d in docs.values():
        for e in d["traceEvents"]:
            if e["name"] == "gradient":
                e["name"] = f"gradient#{e['ts']}"
    code, _, err, _ = run(tmp_path, docs, capsys, sections="gradient,denoiser")
    assert code == 1
    assert (
        "the trace's user annotations: 'nccl:all_reduce' (6), 'denoiser' (3), 'gradient#1000' (1), 'gradient#2000' "
        "(1), 'gradient#3000' (1); its most frequent range names: 'record_param_comms' (6)" in err
    )
    assert "a missing '*'? try --sections gradient=gradient*" in err
