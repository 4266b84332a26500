"""benchmarks/trace_floor.py: its floor decoders read what the analysis reads, on a tiny gzip'd Kineto trace."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from tests.helpers import ROOT

EVENTS = [
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 7, "tid": 7, "ts": 1.5, "dur": 2.25,
     "args": {"External id": 4, "cbid": 211, "correlation": 100001}},
    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "pid": 0, "tid": 7, "ts": 3.0, "dur": 9.0,
     "args": {"correlation": 100001, "In msg nelems": 1024, "dtype": "Float", "Collective name": "allreduce",
              "grid": [1, 1, 1]}},
    {"ph": "s", "id": 1, "pid": 7, "tid": 7, "ts": 1.5, "cat": "ac2g", "name": "ac2g"},
    {"name": "process_name", "ph": "M", "pid": "Spans", "tid": 0, "args": {"name": "python"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("trace_floor", ROOT / "benchmarks" / "trace_floor.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "rank0.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": EVENTS}).encode()))
    return path


def test_gzip_size_and_decompressors_agree(floor, trace: Path) -> None:
    raw = gzip.decompress(trace.read_bytes())
    assert floor._gzip_size(str(trace)) == len(raw)
    for name in ("zlib", "isal", "zlib-ng"):
        if name == "zlib" or importlib.util.find_spec(name.replace("-", "_")):
            assert floor._decompressor(name)(trace.read_bytes()) == raw, name


def test_msgspec_typed_decoder_keeps_the_fields_read(floor, trace: Path) -> None:
    pytest.importorskip("msgspec", reason="the bench extra is not installed")
    evs = floor._msgspec_decoder().decode(gzip.decompress(trace.read_bytes())).traceEvents
    assert [(e.ph, e.cat, e.name, e.pid, e.tid) for e in evs] == [
        (e["ph"], e.get("cat", ""), e["name"], e["pid"], e["tid"]) for e in EVENTS
    ]
    assert [(e.ts, e.dur) for e in evs[:2]] == [(1.5, 2.25), (3.0, 9.0)]
    kernel = evs[1].args
    got = (kernel.correlation, kernel.in_nelems, kernel.dtype, kernel.collective)
    assert got == (100001, 1024, "Float", "allreduce")
    assert (evs[0].args.external_id, evs[0].args.in_nelems) == (4, None)
