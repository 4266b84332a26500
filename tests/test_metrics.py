"""POP decomposition on hand-computed per-rank tables (pnpscale.metrics)."""

from __future__ import annotations

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.metrics import DecompositionError, decompose, mark_main, run_metrics, summarize


def ranks_table(rows):
    """rows: (rank, iteration, section, section_s[, warmup])."""
    return pd.DataFrame(
        [
            {K.RANK: r, K.ITERATION: i, K.SECTION: s, K.SECTION_S: t, K.WARMUP: (w[0] if w else False)}
            for r, i, s, t, *w in rows
        ]
    )


def coll_table(rows):
    """rows: (rank, iteration, section, seq, duration_s, payload_bytes)."""
    return pd.DataFrame(
        [
            {
                K.RANK: r,
                K.ITERATION: i,
                K.SECTION: s,
                K.SEQ: q,
                K.COLLECTIVE: "all_reduce",
                K.DURATION_S: d,
                K.PAYLOAD_BYTES: p,
            }
            for r, i, s, q, d, p in rows
        ]
    )


def test_imbalanced_two_ranks_one_collective():
    ranks = ranks_table([(0, 0, "denoiser", 1.0), (1, 0, "denoiser", 1.0)])
    coll = coll_table([(0, 0, "denoiser", 0, 0.5, 800), (1, 0, "denoiser", 0, 0.1, 800)])
    row = decompose(ranks, coll).iloc[0]
    # rank 1 arrived last: its 0.1 s is pure transfer; rank 0 waited 0.4 s.
    assert row[K.TRANSFER_S] == pytest.approx(0.1, abs=1e-12)
    assert row[K.WAIT_S] == pytest.approx(0.2, abs=1e-12)  # mean(0.4, 0)
    assert row[K.COMPUTE_S] == pytest.approx(0.7, abs=1e-12)  # mean(0.5, 0.9)
    assert row[K.COMPUTE_MAX_S] == pytest.approx(0.9, abs=1e-12)
    assert row[K.LB] == pytest.approx(0.7 / 0.9, abs=1e-12)
    assert row[K.COMPUTE_S] + row[K.TRANSFER_S] + row[K.WAIT_S] == pytest.approx(row[K.SECTION_S], abs=1e-9)
    assert row[K.MAIN_PAYLOAD_BYTES] == 800 and row[K.N_COLLECTIVES] == 1


def test_three_ranks_two_collectives_per_section():
    ranks = ranks_table([(0, 0, "gradient", 2.0), (1, 0, "gradient", 1.5), (2, 0, "gradient", 1.8)])
    coll = coll_table(
        [
            (0, 0, "gradient", 0, 0.30, 8), (1, 0, "gradient", 0, 0.10, 8), (2, 0, "gradient", 0, 0.20, 8),
            (0, 0, "gradient", 1, 0.05, 4096), (1, 0, "gradient", 1, 0.25, 4096), (2, 0, "gradient", 1, 0.15, 4096),
        ]
    )  # fmt: skip
    row = decompose(ranks, coll).iloc[0]
    assert row[K.TRANSFER_S] == pytest.approx(0.10 + 0.05, abs=1e-12)
    # excess per rank: (0.2 + 0) , (0 + 0.2), (0.1 + 0.1) -> mean 0.2
    assert row[K.WAIT_S] == pytest.approx(0.2, abs=1e-12)
    assert row[K.COMPUTE_S] == pytest.approx((1.65 + 1.15 + 1.45) / 3, abs=1e-12)
    assert row[K.COMPUTE_MAX_S] == pytest.approx(1.65, abs=1e-12)
    assert row[K.SECTION_S] == pytest.approx(5.3 / 3, abs=1e-12)
    assert row[K.COMPUTE_S] + row[K.TRANSFER_S] + row[K.WAIT_S] == pytest.approx(row[K.SECTION_S], abs=1e-9)
    # the image-sized collective is the main one; the 8-byte one is "other"
    assert row[K.MAIN_PAYLOAD_BYTES] == 4096 and row[K.OTHER_PAYLOAD_BYTES] == 8
    assert row[K.MAIN_TRANSFER_S] == pytest.approx(0.05, abs=1e-12)
    assert row[K.N_COLLECTIVES] == 2 and row[K.N_MAIN] == 1


def test_single_rank_has_no_transfer_or_wait():
    ranks = ranks_table([(0, 0, "gradient", 0.3), (0, 0, "denoiser", 0.7)])
    out = decompose(ranks, coll_table([]))
    assert (out[K.TRANSFER_S] == 0).all() and (out[K.WAIT_S] == 0).all()
    assert list(out[K.COMPUTE_S]) == [0.3, 0.7] and (out[K.LB] == 1).all()
    assert list(out[K.SECTION]) == ["gradient", "denoiser"]


def test_additivity_on_random_tables():
    import numpy as np

    rng = np.random.default_rng(0)
    w, n_it, n_c = 5, 4, 3
    rrows, crows = [], []
    for it in range(n_it):
        for sec in ("gradient", "denoiser"):
            for r in range(w):
                d = rng.uniform(0.001, 0.3, n_c)
                rrows.append((r, it, sec, float(d.sum() + rng.uniform(0.1, 2.0))))
                crows += [(r, it, sec, c, float(d[c]), 100) for c in range(n_c)]
    out = decompose(ranks_table(rrows), coll_table(crows))
    total = out[K.COMPUTE_S] + out[K.TRANSFER_S] + out[K.WAIT_S]
    assert (total - out[K.SECTION_S]).abs().max() < 1e-9
    assert (out[K.WAIT_S] >= -1e-15).all() and (out[K.LB] <= 1 + 1e-12).all()


def test_unmatched_collectives_are_refused():
    ranks = ranks_table([(0, 0, "s", 1.0), (1, 0, "s", 1.0)])
    coll = coll_table([(0, 0, "s", 0, 0.1, 8), (1, 0, "s", 0, 0.1, 8), (1, 0, "s", 1, 0.1, 8)])
    with pytest.raises(DecompositionError, match="different numbers of collectives.*rank 0: 1, rank 1: 2"):
        decompose(ranks, coll)


def test_missing_rank_row_is_refused():
    ranks = ranks_table([(0, 0, "s", 1.0), (1, 0, "s", 1.0), (0, 1, "s", 1.0)])
    with pytest.raises(DecompositionError, match="iteration 1 section 's': 1 of 2 ranks"):
        decompose(ranks, coll_table([]))


def test_mark_main_flags_largest_payload_per_section():
    coll = coll_table([(0, 0, "s", 0, 0.1, 8), (0, 0, "s", 1, 0.1, 1 << 20), (0, 0, "t", 0, 0.1, 16)])
    assert list(mark_main(coll)) == [False, True, True]


def test_image_sized_collectives_are_main_even_when_a_weight_gradient_is_larger():
    # training backward at small scale: the image (4096 B) is smaller than one weight gradient
    rows = [(r, 0, "backward", q, d, p) for r in (0, 1) for q, d, p in ((0, 0.2, 4096), (1, 0.1, 9000), (2, 0.3, 4096))]
    coll = coll_table(rows)
    coll[K.MAIN] = mark_main(coll, image_bytes=4096)
    assert coll[coll[K.RANK] == 0][K.MAIN].tolist() == [True, False, True]
    ranks = ranks_table([(0, 0, "backward", 1.0), (1, 0, "backward", 1.0)])
    row = decompose(ranks, coll).iloc[0]
    assert row[K.N_MAIN] == 2 and row[K.MAIN_PAYLOAD_BYTES] == 4096 and row[K.OTHER_PAYLOAD_BYTES] == 9000
    assert row[K.MAIN_TRANSFER_S] == pytest.approx(0.5)


def test_summary_combined_lb_comme_pe_by_hand():
    # two ranks, two sections, iteration 0 is warm-up and must be ignored
    ranks = ranks_table(
        [
            (0, 0, "g", 99.0, True), (1, 0, "g", 99.0, True), (0, 0, "d", 99.0, True), (1, 0, "d", 99.0, True),
            (0, 1, "g", 1.0), (1, 1, "g", 1.0), (0, 1, "d", 4.0), (1, 1, "d", 4.0),
        ]
    )  # fmt: skip
    coll = coll_table(
        [
            (0, 0, "g", 0, 1.0, 8), (1, 0, "g", 0, 1.0, 8), (0, 0, "d", 0, 1.0, 8), (1, 0, "d", 0, 1.0, 8),
            (0, 1, "g", 0, 0.6, 8), (1, 1, "g", 0, 0.2, 8),   # g: C_r = 0.4, 0.8; T = 0.2; W = 0.2
            (0, 1, "d", 0, 0.5, 8), (1, 1, "d", 0, 0.5, 8),   # d: C_r = 3.5, 3.5; T = 0.5; W = 0
        ]
    )  # fmt: skip
    sections = decompose(ranks, coll)
    summ = summarize(sections, gpus=2).set_index(K.SECTION)
    assert summ.loc["g", K.LB] == pytest.approx(0.6 / 0.8)
    assert summ.loc["d", K.LB] == pytest.approx(1.0)
    lb = (0.6 + 3.5) / (0.8 + 3.5)
    comm_e = (0.8 + 3.5) / (1.0 + 4.0)
    assert summ.loc["all", K.LB] == pytest.approx(lb)
    assert summ.loc["all", K.COMM_E] == pytest.approx(comm_e)
    assert summ.loc["all", K.PE] == pytest.approx(lb * comm_e)
    assert summ.loc["all", K.GPU_SECONDS] == pytest.approx(2 * 5.0)
    m = run_metrics(sections, gpus=2)
    assert m["iterations"] == 1 and m["pe"] == pytest.approx(lb * comm_e)
    assert set(m["sections"]) == {"g", "d"}


def test_summary_needs_a_measured_iteration():
    sections = decompose(ranks_table([(0, 0, "g", 1.0, True)]), coll_table([]))
    with pytest.raises(DecompositionError, match="no measured iteration"):
        summarize(sections, gpus=1)


def test_one_registry_of_measures_names_totals_and_per_iteration_values(tmp_path):
    """pnpscale.columns.MEASURES decides, for every summed measure, the run.json total's name and the
    per-iteration value of the summary / load (the wait parts and S_max included: they slipped before)."""
    from pnpscale.core import layout
    from pnpscale.rank.commit import write_run
    from pnpscale.results.runs import load
    from tests.test_report import spec as make_spec

    gathered = []
    for rank, (s, d) in enumerate([(1.0, 0.2), (1.5, 0.4)]):
        rows = [{K.RANK: rank, K.ITERATION: it, K.SECTION: "g", K.WARMUP: it == 0, K.START_S: 2.0 * it,
                 K.SECTION_S: s, K.COMM_S: d, K.N_COLLECTIVES: 1, K.PEAK_MEM_BYTES: 1} for it in range(4)]
        colls = [{K.RANK: rank, K.ITERATION: it, K.SECTION: "g", K.SEQ: 0, K.COLLECTIVE: "all_reduce",
                  K.START_S: 2.0 * it + s - d, K.DURATION_S: d, K.PAYLOAD_BYTES: 8} for it in range(4)]
        info = {"host": "h", "device": "cpu", "threads": 1, "local_operators": [rank], "local_tiles": 1,
                "num_tiles": 2, "solver": {"weights_sha256": "x"}}  # fmt: skip
        gathered.append(({"ranks": rows, "collectives": colls}, info))
    run_dir = tmp_path / layout.point_subdir("2d", "inference", 2)
    doc = write_run(run_dir, make_spec("2d", "inference", 2), gathered, backend="gloo", timings={})
    section = doc["metrics"]["sections"]["g"]
    summed = [m.name for m in K.MEASURES if m.over_iterations == K.SUM]
    for name in summed:
        assert K.total_name(name) in section and name not in section, name
    assert section["iterations"] == 3 and section[K.total_name(K.SECTION_MAX_S)] == pytest.approx(3 * 1.5)
    row = load(str(tmp_path)).set_index(K.SECTION).loc["g"]
    assert row[K.SECTION_MAX_S] == pytest.approx(1.5) and row[K.SECTION_S] == pytest.approx(1.25)
    for name in summed:  # every summed measure is per measured iteration in the table (NaN where unknown)
        total = section[K.total_name(name)]
        assert (pd.isna(row[name]) and total is None) or row[name] == pytest.approx(total / 3), name


def test_windowed_gradient_scatter_and_boundaries_are_main_together():
    """``solver.gradient_collective=reduce_scatter``: the blocks (all_to_all on gloo, reduce_scatter on NCCL, at
    least the image) and the boundaries' all_gather right after them carry the image; a later all_gather that is
    not a boundary exchange and deepinv's small broadcasts do not. The section's main type names both, so the
    transfer table applies no single byte model to their summed transfer."""
    from pnpscale.results.transfer import main_bytes_per_gpu, transfer_rows

    image = 4096
    for scatter in ("all_to_all", "reduce_scatter"):
        kinds = [("broadcast", 8), (scatter, 4160), ("all_gather", 512), ("broadcast", 8), ("all_gather", 16)]
        rows = [(r, 0, "gradient", q, 0.1 * (q + 1) * (r + 1), p) for r in (0, 1) for q, (_, p) in enumerate(kinds)]
        coll = coll_table(rows)
        coll[K.COLLECTIVE] = [k for _ in (0, 1) for k, _ in kinds]
        coll[K.MAIN] = mark_main(coll, image_bytes=image, world_size=2)
        assert coll[coll[K.RANK] == 0][K.MAIN].tolist() == [False, True, True, False, False], scatter
        row = decompose(ranks_table([(0, 0, "gradient", 5.0), (1, 0, "gradient", 5.0)]), coll).iloc[0]
        assert row[K.MAIN_COLLECTIVE] == f"{scatter}+all_gather" and row[K.N_MAIN] == 2
        assert row[K.MAIN_TRANSFER_S] == pytest.approx(0.2 + 0.3)  # min over ranks of each main collective
        # bytes per GPU: the blocks S·(n−1)/n plus the gathered boundaries n·512·(n−1)/n
        assert main_bytes_per_gpu(coll.assign(**{K.WARMUP: False}), 2) == pytest.approx(4160 / 2 + 2 * 512 / 2)
        t = transfer_rows([{K.GPUS: 2, K.NODES: 1, K.BACKEND: "gloo", K.SECTION: "gradient",
                            K.COLLECTIVE: row[K.MAIN_COLLECTIVE], K.PAYLOAD_BYTES: 4160.0,
                            K.TRANSFER_S: 0.5}])  # fmt: skip
        assert t[K.BYTES_PER_GPU].isna().all() and t[K.BUSBW_GBPS].isna().all()
        assert f"no byte model for {scatter}+all_gather" in t[K.ALGORITHM_NOTE].iloc[0]


def test_training_backward_flags_the_windowed_adjoint_and_not_weight_gradients_adding_up_to_the_image():
    """Training's backward with ``solver.gradient_collective=reduce_scatter`` (2 ranks, 32²×3 float32, as a real
    run logs it): the denoiser's image all_reduce, the adjoint's boundaries (all_to_all of 2 blocks of 384 px)
    and cores (all_gather of 512 px) are main; deepinv's weight-gradient all_reduces, seven of which add up to
    exactly the image's 12,288 bytes, are not (they are not row bands: the section's image travels whole)."""
    from pnpscale.results.transfer import main_bytes_per_gpu

    image = 3 * 32 * 32 * 4
    step = [("all_reduce", image), ("all_to_all", 2 * 3 * 384 * 4), ("all_gather", 3 * 512 * 4)]
    weights = [576, 576, 512, 2304, 1024, 2304, 2304, 1024, 2304, 2304, 1024, 2304, 512, 432]
    kinds = step * 2 + [("all_reduce", image)] + [("all_reduce", w) for w in weights]
    rows = [(r, 0, "backward", q, 0.01, p) for r in (0, 1) for q, (_, p) in enumerate(kinds)]
    coll = coll_table(rows)
    coll[K.COLLECTIVE] = [k for _ in (0, 1) for k, _ in kinds]
    coll[K.MAIN] = mark_main(coll, image_bytes=image, world_size=2)
    assert coll[coll[K.RANK] == 0][K.MAIN].tolist() == [True] * 7 + [False] * len(weights)
    # ring bytes per GPU: 3 image all_reduces (P each on 2 ranks) and 2 adjoint pairs ((S + H)/2 each)
    want = 3 * image + 2 * (2 * 3 * 384 * 4 + 2 * 3 * 512 * 4) / 2
    assert main_bytes_per_gpu(coll.assign(**{K.WARMUP: False}), 2) == pytest.approx(want)
