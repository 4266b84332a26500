"""The section's main collectives and their bytes per GPU: one rule for the transfer table and the side-by-side
table (pipelined bands summed, reduce_scatter + all_gather summed), overlapped rows kept out of the route rates,
and rows one rate cannot explain flagged (fake run folders written by the real commit path)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.rank.commit import write_run
from pnpscale.results.compare import run_bytes_per_gpu
from pnpscale.results.report import write_report
from pnpscale.results.transfer import (
    MISS_TOLERANCE,
    OVERLAPPED_NOTE,
    section_main_bytes,
    transfer_inputs,
    transfer_table,
)
from tests.test_report import spec

IMAGE = 3 * 32 * 32 * 4  # the fake runs' 32²×3 float32 image, bytes

#: per section: the collectives one rank issues per iteration, (collective, payload bytes, duration s, hidden s)
Plan = dict[str, list[tuple[str, int, float, float]]]


def _run(d: Path, gpus: int, plan: Plan, **fields) -> Path:
    """A complete gloo inference run of ``gpus`` ranks issuing ``plan`` in iterations 0 (warm-up) and 1."""
    gathered = []
    for rank in range(gpus):
        rows, colls = [], []
        for it in (0, 1):
            for name, issued in plan.items():
                comm = sum(c[2] for c in issued)
                rows.append({K.RANK: rank, K.ITERATION: it, K.SECTION: name, K.WARMUP: it == 0, K.START_S: 0.0,
                             K.SECTION_S: 1.0 + comm, K.COMM_S: comm, K.N_COLLECTIVES: len(issued),
                             K.PEAK_MEM_BYTES: 1, K.HIDDEN_S: sum(c[3] for c in issued)})  # fmt: skip
                start = 0.0
                for seq, (kind, payload, dur, hidden) in enumerate(issued):
                    colls.append({K.RANK: rank, K.ITERATION: it, K.SECTION: name, K.SEQ: seq, K.COLLECTIVE: kind,
                                  K.START_S: start, K.DURATION_S: dur, K.PAYLOAD_BYTES: payload,
                                  K.HIDDEN_S: hidden})  # fmt: skip
                    start += dur
        info = {"host": "h", "device": "cpu", "threads": 1, "local_operators": [rank], "local_tiles": 1,
                "num_tiles": 16, "solver": {"weights_sha256": "x"}}  # fmt: skip
        gathered.append(({"ranks": rows, "collectives": colls}, info))
    write_run(d, spec("2d", "inference", gpus, **fields), gathered, backend="gloo", timings={})
    return d


BLOCKING: Plan = {"gradient": [("all_reduce", IMAGE, 0.1, 0.0)], "denoiser": [("all_reduce", IMAGE, 0.1, 0.0)]}
#: the pipelined step: the gradient keeps a 32-byte broadcast; the denoiser section issues 8 gradient bands
#: and 8 output bands of an eighth of the image each, mostly hidden behind the tiles' compute
PIPELINED: Plan = {
    "gradient": [("broadcast", 32, 0.001, 0.0)],
    "denoiser": [("all_reduce", IMAGE // 8, 0.002, 0.01)] * 16,
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("transfer") / "2026-01-01_00-00-00"
    _run(root / "none", 2, BLOCKING)
    _run(root / "pipelined", 2, PIPELINED, overlap="pipelined")
    return root


def test_pipelined_bands_are_summed_and_agree_with_the_side_by_side_bytes(sweep):
    colls = pd.read_parquet(sweep / "pipelined" / layout.COLLECTIVES)
    per = section_main_bytes(colls, 2).set_index(K.SECTION)
    # 16 bands of IMAGE/8 on 2 GPUs: 16 × 2·(IMAGE/8)·1/2 = 2·IMAGE, not one band's IMAGE/8
    assert per.loc["denoiser", K.BYTES_PER_GPU] == 2 * IMAGE and per.loc["denoiser", K.N_MAIN] == 16
    assert bool(per.loc["denoiser", "overlapped"])
    inputs = transfer_inputs([sweep / "pipelined"]).set_index(K.SECTION)
    assert inputs.loc["denoiser", K.BYTES_PER_GPU] == 2 * IMAGE
    # the transfer table's sections add up to the side-by-side table's bytes per GPU of the run
    assert inputs[K.BYTES_PER_GPU].sum() == run_bytes_per_gpu(sweep / "pipelined", 2, 1) == 2 * IMAGE + 32


def test_overlapped_rows_set_no_rate_and_say_why(sweep):
    table = transfer_table(transfer_inputs([sweep / "none", sweep / "pipelined"]))
    piped = table[table[K.OVERLAPPED]]
    assert len(piped) == 2 and not piped[K.CALIBRATES].any()  # the run's overlap=pipelined: both its sections
    assert piped[K.PREDICTED_TRANSFER_S].isna().all() and piped[K.REL_ERROR].isna().all()
    assert all(OVERLAPPED_NOTE in n for n in piped[K.ALGORITHM_NOTE])
    blocking = table[~table[K.OVERLAPPED]]
    assert blocking[K.CALIBRATES].all()
    # the route's rate is the blocking rows' alone: it predicts them exactly
    alone = transfer_table(transfer_inputs([sweep / "none"]))
    assert blocking[K.CALIBRATED_RATE_GBPS].tolist() == pytest.approx(alone[K.RATE_GBPS].tolist())
    assert blocking[K.REL_ERROR].abs().max() < 1e-9 and not blocking[K.MISSES].any()


def test_reduce_scatter_and_its_all_gather_are_summed(tmp_path):
    # the windowed gradient on 2 ranks: a reduce_scatter of S = IMAGE, then an all_gather of 256-byte boundaries
    plan: Plan = {"gradient": [("reduce_scatter", IMAGE, 0.05, 0.0), ("all_gather", 256, 0.01, 0.0)],
                  "denoiser": [("all_reduce", IMAGE, 0.1, 0.0)]}  # fmt: skip
    d = _run(tmp_path / "rs", 2, plan, gradient_collective="reduce_scatter")
    rows = transfer_table(transfer_inputs([d])).set_index(K.SECTION)
    grad = rows.loc["gradient"]
    main = pd.read_parquet(d / layout.COLLECTIVES)
    main = main[(main[K.RANK] == 0) & (main[K.ITERATION] == 1) & (main[K.SECTION] == "gradient")]
    assert main[K.MAIN].all()  # both carry the image: the blocks, then the boundaries
    # reduce_scatter S·(n−1)/n = IMAGE/2, all_gather of 256-byte buffers: S = 2·256, S·(n−1)/n = 256
    assert grad[K.COLLECTIVE] == "reduce_scatter+all_gather"
    assert grad[K.BYTES_PER_GPU] == IMAGE / 2 + 256 and grad[K.RATE_GBPS] > 0
    assert grad[K.BYTES_PER_GPU] + rows.loc["denoiser", K.BYTES_PER_GPU] == run_bytes_per_gpu(d, 2, 1)


def test_a_row_one_rate_cannot_explain_is_flagged_in_the_table_and_the_report(tmp_path):
    root = tmp_path / "2026-01-01_00-00-00"
    # the same bytes on the same route: gradient 6.6× faster than the denoiser
    _run(root / layout.point_subdir("2d", "inference", 2), 2,
         {"gradient": [("all_reduce", IMAGE, 0.015, 0.0)], "denoiser": [("all_reduce", IMAGE, 0.1, 0.0)]})  # fmt: skip
    table = transfer_table(transfer_inputs([root / layout.point_subdir("2d", "inference", 2)]))
    assert table[K.MISSES].all() and (table[K.REL_ERROR].abs() > MISS_TOLERANCE).all()
    readme = (write_report(root, echo=lambda s: None) / "README.md").read_text()
    assert "One rate per route does not explain 2 of 2 predicted row(s)" in readme
    assert "transfer-weighted mean" in readme  # why projection.md's route rate differs
