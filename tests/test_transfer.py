"""Byte models, rates, calibration and prediction (pnpscale.transfer) on hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.metrics import decompose
from pnpscale.analysis.tables import frames
from pnpscale.core import layout
from pnpscale.results.transfer import (
    ByteModelError,
    algbw_GBps,
    all_gather_bytes,
    bus_factor,
    busbw_GBps,
    bytes_per_gpu,
    calibrate,
    nccl_tests_size,
    plot_transfer,
    predict,
    reduce_scatter_bytes,
    ring_all_reduce_bytes,
    route_label,
    section_transfers,
    transfer_inputs,
    transfer_rows,
    transfer_table,
    tree_all_reduce_bytes,
)

P2D = 8192 * 8192 * 3 * 4  # the study's 2D payload, 805 MB
P3D = 512**3 * 4  # 3D, 537 MB


# --- byte models -----------------------------------------------------------------------------


def test_ring_and_tree_bytes_one_and_two_nodes():
    # one node, 4 GPUs: ring 2·1000·3/4
    assert ring_all_reduce_bytes(1000, 4) == 1500.0
    assert bytes_per_gpu("all_reduce", 1000, 4, 1, "ring") == 1500.0
    # two nodes, 8 GPUs: ring 2·1000·7/8, tree 2·1000·1/2
    assert bytes_per_gpu("all_reduce", 1000, 8, 2, "ring") == 1750.0
    assert bytes_per_gpu("all_reduce", 1000, 8, 2, "TREE") == 1000.0
    assert tree_all_reduce_bytes(1000, 2) == 1000.0
    # the study: 1.4 GB by ring, 805 MB by tree at 8 GPUs; attributing ring bytes to a tree run
    # overstates the rate by 1.75
    assert ring_all_reduce_bytes(P2D, 8) == pytest.approx(1.409e9, rel=1e-3)
    assert tree_all_reduce_bytes(P2D, 2) == P2D
    assert ring_all_reduce_bytes(P2D, 8) / tree_all_reduce_bytes(P2D, 2) == 1.75
    # one GPU moves nothing; both converge to two payloads
    assert ring_all_reduce_bytes(P2D, 1) == 0.0
    assert ring_all_reduce_bytes(P2D, 64) < 2 * P2D and tree_all_reduce_bytes(P2D, 16) < 2 * P2D


def test_all_gather_reduce_scatter_broadcast_nccl_tests_conventions():
    # S is the gathered output (n x each rank's input) for all_gather, the full input for reduce_scatter
    assert nccl_tests_size("all_gather", 1000, 4) == 4000.0 and nccl_tests_size("reduce_scatter", 4000, 4) == 4000.0
    assert all_gather_bytes(4000, 4) == 3000.0 and reduce_scatter_bytes(4000, 4) == 3000.0
    assert bytes_per_gpu("all_gather", 4000, 4, 1, "pat") == 3000.0
    assert bytes_per_gpu("broadcast", 4000, 4, 1, "ring") == 4000.0
    # all_to_all (gloo's form of the windowed gradient's reduce-scatter): n equal blocks, one stays local
    assert nccl_tests_size("all_to_all", 4000, 4) == 4000.0
    assert bytes_per_gpu("all_to_all", 4000, 4, 1, "ring") == 3000.0
    assert bus_factor("all_to_all", 4) == bus_factor("reduce_scatter", 4) == 0.75


def test_byte_model_errors():
    with pytest.raises(ByteModelError, match="undefined on one node"):
        bytes_per_gpu("all_reduce", 1000, 4, 1, "tree")
    with pytest.raises(ByteModelError, match="no byte model for all_reduce with algorithm 'nvls'"):
        bytes_per_gpu("all_reduce", 1000, 4, 1, "nvls")
    with pytest.raises(ValueError, match="gpus=0"):
        ring_all_reduce_bytes(1000, 0)
    with pytest.raises(ValueError, match="payload_bytes=-1"):
        ring_all_reduce_bytes(-1, 2)
    with pytest.raises(ValueError, match="nodes=3: must be an integer in 1..gpus=2"):
        bytes_per_gpu("all_reduce", 1000, 2, 3, "ring")


def test_algbw_busbw_in_GBps():
    # 2 GB in 0.5 s = 4 GB/s (1e9 B/s); all_reduce bus factor 2(n-1)/n
    assert algbw_GBps(2e9, 0.5) == 4.0
    assert busbw_GBps("all_reduce", 2e9, 0.5, 2) == 4.0
    assert busbw_GBps("all_reduce", 2e9, 0.5, 4) == 6.0
    assert busbw_GBps("all_gather", 2e9, 0.5, 4) == 3.0
    assert bus_factor("broadcast", 64) == 1.0
    assert math.isnan(algbw_GBps(1.0, 0.0))
    with pytest.raises(ValueError, match="no nccl-tests bus factor"):
        bus_factor("send_recv", 2)


def test_route_labels():
    assert route_label(2, 1, "ring") == "intra-node, 2 GPUs"
    assert route_label(8, 2, "tree") == "inter-node tree"
    assert route_label(16, 4, "RING") == "inter-node ring"


# --- table, calibration, prediction ------------------------------------------------------------

#: routes and rates of the study (GB/s), with the algorithm NCCL reported
ROUTES = {2: (1, "ring", 40.0), 4: (1, "ring", 119.0), 8: (2, "tree", 17.0), 16: (4, "ring", 10.5)}
ROUTES |= {32: (8, "ring", 10.5), 64: (16, "ring", 10.5)}


def sweep(noise=None):
    """Runs whose transfer follows bytes / route rate exactly (times ``noise[(problem, gpus)]``)."""
    rows = []
    for problem, payload in (("2d", P2D), ("3d", P3D)):
        for section in ("gradient", "denoiser"):
            for gpus, (nodes, algo, rate) in ROUTES.items():
                nbytes = bytes_per_gpu("all_reduce", payload, gpus, nodes, algo)
                factor = (noise or {}).get((problem, section, gpus), 1.0)
                rows.append(
                    {
                        K.PROBLEM: problem,
                        K.MODE: "inference",
                        K.SECTION: section,
                        K.GPUS: gpus,
                        K.NODES: nodes,
                        K.BACKEND: "nccl",
                        K.COLLECTIVE: "all_reduce",
                        K.PAYLOAD_BYTES: payload,
                        K.TRANSFER_S: nbytes / (rate * 1e9) * factor,
                        K.ALGORITHM: algo,
                    }
                )
    return pd.DataFrame(rows)


def test_exact_sweep_returns_the_rates_and_predicts_every_row():
    table = transfer_table(sweep())
    assert list(table.columns) == list(K.TRANSFER_COLUMNS) and len(table) == 24
    rates = calibrate(table).rates.set_index(K.ROUTE)[K.RATE_GBPS]
    assert rates.to_dict() == pytest.approx(
        {"intra-node, 2 GPUs": 40.0, "intra-node, 4 GPUs": 119.0, "inter-node tree": 17.0, "inter-node ring": 10.5},
        rel=1e-12,
    )
    assert (table[K.REL_ERROR].abs() < 1e-9).all()
    assert np.allclose(table[K.PREDICTED_TRANSFER_S], table[K.TRANSFER_S], rtol=1e-9, atol=0)
    assert (table[K.ALGORITHM_SOURCE] == "nccl_log").all()
    # the 8-GPU rows are trees: rate from the tree bytes, not the ring's 1.75x
    eight = table[table[K.GPUS] == 8]
    assert (eight[K.BYTES_PER_GPU] == eight[K.PAYLOAD_BYTES]).all()
    assert eight[K.RATE_GBPS].to_numpy() == pytest.approx(17.0)
    # nccl-tests bus bandwidth of a tree row still uses 2(n-1)/n: 17 x 1.75
    assert eight[K.BUSBW_GBPS].to_numpy() == pytest.approx(17.0 * 1.75)


def test_noisy_rows_give_the_median_per_route():
    # ring rows: 16, 32, 64 GPUs x 2 problems x 2 sections = 12; a factor f on the transfer gives rate 10.5 / f
    noise = {("2d", "gradient", 16): 1 / 0.9, ("3d", "gradient", 64): 3.0, ("2d", "denoiser", 32): 1 / 1.2}
    table = transfer_table(sweep(noise))
    ring = calibrate(table).rates.set_index(K.ROUTE).loc["inter-node ring"]
    # sorted rates 3.5, 9.45, 10.5 x 9, 12.6: the median is 10.5 (the mean would be 9.96)
    assert ring[K.N_ROWS] == 12 and ring[K.RATE_GBPS] == pytest.approx(10.5, rel=1e-12)
    assert ring[K.CALIBRATION] == "median" and "2d/inference/gradient gpus=16" in ring[K.ROWS]
    row = table[(table[K.PROBLEM] == "2d") & (table[K.SECTION] == "gradient") & (table[K.GPUS] == 16)].iloc[0]
    # predicted / measured - 1 = row rate / route rate - 1
    assert row[K.REL_ERROR] == pytest.approx(9.45 / 10.5 - 1, rel=1e-9)


def test_rates_are_ordered_by_nodes_then_gpus_numerically_not_as_text():
    """The report's rates table: ``intra-node, 2 GPUs`` ... ``intra-node, 16 GPUs``, then inter-node by node
    count (as text, "16" sorts before "2" and "inter" before "intra")."""
    runs = sweep()
    single = runs[runs[K.GPUS] == 2].assign(**{K.GPUS: 16, K.NODES: 1})  # a 16-GPU node (gloo, a DGX)
    single[K.TRANSFER_S] = [bytes_per_gpu("all_reduce", p, 16, 1, "ring") / 80e9 for p in single[K.PAYLOAD_BYTES]]
    shuffled = pd.concat([runs, single]).sample(frac=1.0, random_state=0)  # input order must not matter
    rates = calibrate(transfer_rows(shuffled)).rates
    assert rates[K.ROUTE].tolist() == [
        "intra-node, 2 GPUs", "intra-node, 4 GPUs", "intra-node, 16 GPUs", "inter-node tree", "inter-node ring",
    ]  # fmt: skip
    assert rates.set_index(K.ROUTE).loc["intra-node, 16 GPUs", K.RATE_GBPS] == pytest.approx(80.0)
    # each route's rows are listed by GPU count too
    ring = rates.set_index(K.ROUTE).loc["inter-node ring", K.ROWS].split("; ")
    assert [int(r.rsplit("=", 1)[1]) for r in ring] == sorted(int(r.rsplit("=", 1)[1]) for r in ring)


def _route_rows(gpus, rates):
    """The sweep's rows at ``gpus`` (one route), re-timed to the given rates."""
    runs = sweep()
    runs = runs[runs[K.GPUS] == gpus].head(len(rates)).copy()
    nominal = ROUTES[gpus][2]
    runs[K.TRANSFER_S] = runs[K.TRANSFER_S] * [nominal / r for r in rates]
    return transfer_rows(runs)


def test_odd_number_of_rows_takes_the_middle_rate():
    rates = calibrate(_route_rows(2, [30.0, 100.0, 38.0])).rates
    assert rates[K.RATE_GBPS].tolist() == pytest.approx([38.0])  # mean would be 56


def test_even_number_of_rows_takes_the_mean_of_the_middle_two():
    rates = calibrate(_route_rows(2, [30.0, 100.0, 42.0, 38.0])).rates
    assert rates[K.RATE_GBPS].tolist() == pytest.approx([40.0])  # mean would be 52.5
    assert rates[K.N_ROWS].tolist() == [4]


def test_reference_run_calibrates_its_routes_only():
    table = transfer_rows(sweep({("2d", "denoiser", 32): 2.0}))
    cal = calibrate(table, reference={K.GPUS: 16, K.PROBLEM: "2d"})
    rates = cal.rates.set_index(K.ROUTE)
    assert rates.loc["inter-node ring", K.CALIBRATION] == "reference"
    assert rates.loc["inter-node ring", K.N_ROWS] == 2
    assert rates.loc["inter-node ring", K.RATE_GBPS] == pytest.approx(10.5)
    assert rates.loc["inter-node tree", K.CALIBRATION] == "median (not in reference)"
    predicted = predict(table, cal)
    off = predicted[(predicted[K.PROBLEM] == "2d") & (predicted[K.SECTION] == "denoiser") & (predicted[K.GPUS] == 32)]
    assert off[K.REL_ERROR].iloc[0] == pytest.approx(-0.5)  # measured twice the prediction
    # a separate reference table (e.g. a forced-ring 2-node job) works the same way
    forced = transfer_rows(
        [{"gpus": 8, "nodes": 2, "backend": "nccl", "section": "denoiser", "payload_bytes": P2D,
          "transfer_s": ring_all_reduce_bytes(P2D, 8) / 10.5e9, "algorithm": "ring"}]
    )  # fmt: skip
    by_forced = calibrate(table, reference=forced).rates.set_index(K.ROUTE)
    assert by_forced.loc["inter-node ring", K.RATE_GBPS] == pytest.approx(10.5)
    assert by_forced.loc["inter-node ring", K.ROWS] == "denoiser gpus=8"
    with pytest.raises(ValueError, match="selects no row"):
        calibrate(table, reference={K.GPUS: 3})
    with pytest.raises(ValueError, match="unknown column"):
        calibrate(table, reference={"nope": 1})


def test_assumed_algorithm_is_stated_in_every_row():
    runs = [
        {"gpus": 2, "backend": "gloo", "section": "denoiser", "payload_bytes": 12288, "transfer_s": 1e-4},
        {"gpus": 8, "nodes": 2, "backend": "nccl", "section": "denoiser", "payload_bytes": 1000, "transfer_s": 1e-6,
         "algorithm_note": "NCCL 2.17.1 does not log the per-collective algorithm at INFO level (2.20+ does)"},
    ]  # fmt: skip
    table = transfer_table(runs)
    assert table[K.ALGORITHM].tolist() == ["ring", "ring"]
    assert table[K.ALGORITHM_SOURCE].tolist() == ["assumed", "assumed"]
    assert table[K.ALGORITHM_NOTE].tolist() == [
        "gloo: no NCCL log; ring assumed",
        "NCCL 2.17.1 does not log the per-collective algorithm at INFO level (2.20+ does); ring assumed",
    ]
    # gloo runs are one node; the 2-GPU gloo row: 2·12288·1/2 bytes in 1e-4 s
    assert table[K.NODES].tolist() == [1, 2] and table[K.ROUTE].tolist() == ["intra-node, 2 GPUs", "inter-node ring"]
    assert table[K.RATE_GBPS].iloc[0] == pytest.approx(12288 / 1e-4 / 1e9)


def test_rows_without_a_model_or_collective():
    runs = [
        {"gpus": 1, "nodes": 1, "section": "denoiser", "payload_bytes": None, "transfer_s": 0.0},  # dropped
        {"gpus": 4, "nodes": 1, "backend": "nccl", "section": "denoiser", "payload_bytes": 1000, "transfer_s": 1e-6,
         "algorithm": "tree"},
    ]  # fmt: skip
    table = transfer_table(runs)
    assert len(table) == 1
    row = table.iloc[0]
    assert math.isnan(row[K.BYTES_PER_GPU]) and math.isnan(row[K.RATE_GBPS]) and math.isnan(row[K.PREDICTED_TRANSFER_S])
    assert "undefined on one node" in row[K.ALGORITHM_NOTE] and row[K.ALGORITHM_SOURCE] == "nccl_log"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="lacks column.*transfer_s"):
        transfer_rows([{"gpus": 2, "section": "s", "payload_bytes": 8}])
    with pytest.raises(ValueError, match="row 0: number of nodes unknown"):
        transfer_rows([{"gpus": 2, "backend": "nccl", "section": "s", "payload_bytes": 8, "transfer_s": 1.0}])
    # gpus_per_node gives the node count
    t = transfer_rows([{"gpus": 8, "gpus_per_node": 4, "section": "s", "payload_bytes": 8, "transfer_s": 1.0}])
    assert t[K.NODES].tolist() == [2]


def test_section_transfers_means_over_measured_iterations():
    sections = pd.DataFrame(
        {
            K.ITERATION: [0, 0, 1, 1, 2, 2],
            K.SECTION: ["gradient", "denoiser"] * 3,
            K.WARMUP: [True, True, False, False, False, False],
            K.MAIN_COLLECTIVE: ["all_reduce"] * 6,
            K.MAIN_PAYLOAD_BYTES: pd.array([12288] * 6, dtype="Int64"),
            K.MAIN_TRANSFER_S: [9.0, 9.0, 1.0, 2.0, 3.0, 4.0],
        }
    )
    out = section_transfers(sections)
    assert out[K.SECTION].tolist() == ["gradient", "denoiser"]
    assert out[K.TRANSFER_S].tolist() == [2.0, 3.0] and out[K.ITERATIONS].tolist() == [2, 2]
    assert out[K.PAYLOAD_BYTES].tolist() == [12288, 12288]
    with pytest.raises(ValueError, match="no measured iteration"):
        section_transfers(sections[sections[K.WARMUP]])


def test_plot_draws_measured_and_predicted_on_the_given_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = transfer_table(sweep())
    fig, ax = plt.subplots()
    try:
        assert plot_transfer(table, ax) is ax
        assert ax.get_xscale() == "log" and [int(t) for t in ax.get_xticks()] == [2, 4, 8, 16, 32, 64]
        lines = {line.get_label(): line for line in ax.get_lines()}
        # 4 measured lines; a problem's two sections send the same image on the same routes, so their
        # predictions are equal: one predicted line per problem, naming both (not two lines drawn over each other)
        assert len(lines) == 6, list(lines)
        g = table[(table[K.PROBLEM] == "3d") & (table[K.SECTION] == "denoiser")].sort_values(K.GPUS)
        assert list(lines["3d/inference/denoiser: measured"].get_ydata()) == g[K.TRANSFER_S].tolist()
        shared = lines["3d/inference: denoiser = gradient (same bytes, same route rates): predicted"]
        assert list(shared.get_ydata()) == g[K.PREDICTED_TRANSFER_S].tolist()
        assert shared.get_color() not in {line.get_color() for label, line in lines.items() if "measured" in label}
        other = lines["2d/inference: denoiser = gradient (same bytes, same route rates): predicted"]
        assert other.get_linestyle() != shared.get_linestyle()  # two grey lines, told apart by their dashes
        assert ax.get_legend() is not None
        ax.clear()
        differ = table[table[K.PROBLEM] == "2d"].copy()
        differ.loc[differ[K.SECTION] == "gradient", K.PREDICTED_TRANSFER_S] *= 2  # different bytes: own lines
        plot_transfer(differ, ax)
        predicted = sorted(line.get_label() for line in ax.get_lines() if "predicted" in line.get_label())
        assert predicted == ["2d/inference/denoiser: predicted", "2d/inference/gradient: predicted"]
        ax.clear()
        plot_transfer(transfer_table([{"gpus": 2, "backend": "gloo", "section": "d", "payload_bytes": 8,
                                       "transfer_s": 1.0}]), ax)  # fmt: skip
        assert [line.get_label() for line in ax.get_lines()][0] == "d (ring assumed): measured"
    finally:
        plt.close(fig)


# --- run folders -> transfer input ---------------------------------------------------------------


def _write_run(d, gpus, nodes, backend, transfer_s, log_lines=None):
    ranks = pd.DataFrame(
        [{K.RANK: r, K.ITERATION: i, K.SECTION: "denoiser", K.WARMUP: i == 0, K.SECTION_S: 1.0} for r in range(gpus)
         for i in range(3)]
    )  # fmt: skip
    colls = pd.DataFrame(
        [{K.RANK: r, K.ITERATION: i, K.SECTION: "denoiser", K.SEQ: 0, K.COLLECTIVE: "all_reduce",
          K.DURATION_S: transfer_s, K.PAYLOAD_BYTES: P2D} for r in range(gpus) for i in range(3)]
    )  # fmt: skip
    ranks = ranks.assign(**{K.START_S: 0.0, K.COMM_S: transfer_s, K.N_COLLECTIVES: 1, K.PEAK_MEM_BYTES: None})
    r, c = frames([({"ranks": ranks.to_dict("records"), "collectives": colls.to_dict("records")}, {})])
    d.mkdir(parents=True)
    decompose(r, c).to_parquet(d / layout.SECTIONS)
    layout.write_json(
        d / layout.RUN_JSON,
        {"status": "complete", "problem": "2d", "mode": "inference", "gpus": gpus, "nodes": nodes, "backend": backend},
    )
    if log_lines is not None:
        (d / layout.NCCL_DIR).mkdir()
        (d / layout.NCCL_DIR / "rank0.log").write_text("\n".join(log_lines) + "\n")


def test_transfer_inputs_read_run_folders_and_nccl_logs(tmp_path):
    tree_line = f"h:1:1 [0] NCCL INFO AllReduce: {P2D} Bytes -> Algo 0 proto 2 time 40000.0"
    _write_run(tmp_path / "a", 8, 2, "nccl", 0.047, [tree_line])
    _write_run(tmp_path / "b", 2, 1, "gloo", 0.02)
    _write_run(tmp_path / "c", 16, 4, "nccl", 0.15, ["h:1:1 [0] NCCL INFO NCCL version 2.17.1+cuda11.8"])
    (tmp_path / "d").mkdir()
    layout.write_json(tmp_path / "d" / layout.RUN_JSON, {"status": "failed"})
    inputs = transfer_inputs([tmp_path / n for n in "abcd"])
    assert inputs[K.GPUS].tolist() == [8, 2, 16]
    assert inputs[K.ALGORITHM].tolist()[0] == "tree" and inputs[K.PROTOCOL].tolist()[0] == "simple"
    assert inputs[K.TRANSFER_S].tolist() == pytest.approx([0.047, 0.02, 0.15])
    table = transfer_table(inputs)
    assert table[K.ALGORITHM_SOURCE].tolist() == ["nccl_log", "assumed", "assumed"]
    assert table[K.ROUTE].tolist() == ["inter-node tree", "intra-node, 2 GPUs", "inter-node ring"]
    assert table[K.ALGORITHM_NOTE].tolist()[1:] == [
        "gloo: no NCCL log; ring assumed",
        "NCCL 2.17.1 does not log the per-collective algorithm at INFO level (2.20+ does); ring assumed",
    ]
    assert table[K.RATE_GBPS].iloc[0] == pytest.approx(P2D / 0.047 / 1e9)
