"""Sweep report and notebook loader on synthetic run folders written by the project's own writer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import pnpscale
from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.core.config import RunSpec
from pnpscale.core.record import write_failure
from pnpscale.rank.commit import write_run
from pnpscale.results.report import write_report
from pnpscale.sweep.cli import CONF
from tests.helpers import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def spec(problem: str, mode: str, gpus: int, **fields) -> RunSpec:
    sizes = dict(
        image_size=32,
        num_operators=8,
        factor=2,
        patch_size=8,
        overlap=4,
        max_batch_size=4,
        nc=[4, 8, 8, 8],
        nb=1,
        unroll=None,
    )
    sizes.update(fields.pop("sizes", {}))
    impl = {"2d": "superres:SuperResolution2D", "3d": "blur3d:AnisotropicBlur3D"}[problem]
    return RunSpec(
        problem=problem,
        mode=mode,
        gpus=gpus,
        dims=int(problem[0]),
        problem_impl=f"pnpscale.rank.problems.{impl}",
        mode_impl="pnpscale.rank.solver:" + ("TrainingSolver" if mode == "training" else "InferenceSolver"),
        sections=("forward", "backward") if mode == "training" else ("gradient", "denoiser"),
        linestyle="-" if problem == "2d" else "--",
        params={"blur_sigma": 1.0},
        scale=fields.get("scale", "small"),
        scale_requested=fields.pop("scale", "small"),
        sizes=sizes,
        channels=3,
        noise_sigma=0.01,
        denoiser_sigma=0.05,
        stepsize=1.0,
        iterations=1,
        warmup=1,
        seed=0,
        backend="gloo",
        timeout_s=10.0,
        threads_per_rank=1,
        record_shapes=True,
        export_traces=False,
        inject=fields.pop("inject", {}),
        save_reconstruction=False,
        **fields,
    )


def fake_run(
    run_dir: Path,
    problem: str,
    mode: str,
    times: dict[str, list[tuple[float, float]]],
    collective: dict[str, tuple[str, int]] | None = None,
    operators: int | None = None,
    cpus: list[int] | None = None,
    node_gpus: int | None = None,
    **spec_fields,
) -> None:
    """Write a run whose per-rank (section_s, collective_s) per section are ``times``; iteration 0 = warm-up.

    ``collective``: per section, (collective, payload bytes) of its one collective (default an
    all_reduce of the 32²×3 float32 image); ``operators``: the operators dealt round-robin over the
    ranks (run.json's assignment; default one per rank); ``cpus``: the cores every rank may run on (run.json's
    time_shared; default not recorded); ``node_gpus``: the GPUs every rank's host showed (run.json's node_gpus;
    default not recorded); ``spec_fields``: RunSpec fields to change.
    """
    gpus = len(next(iter(times.values())))
    gathered = []
    for rank in range(gpus):
        rows, colls = [], []
        for it in (0, 1):
            for name, per_rank in times.items():
                s, d = per_rank[rank]
                rows.append(
                    {
                        K.RANK: rank,
                        K.ITERATION: it,
                        K.SECTION: name,
                        K.WARMUP: it == 0,
                        K.START_S: 0.0,
                        K.SECTION_S: s,
                        K.COMM_S: d,
                        K.N_COLLECTIVES: int(gpus > 1),
                        K.PEAK_MEM_BYTES: 1,
                    }
                )
                if gpus > 1:
                    kind, payload = (collective or {}).get(name, ("all_reduce", 3 * 32 * 32 * 4))
                    colls.append(
                        {
                            K.RANK: rank,
                            K.ITERATION: it,
                            K.SECTION: name,
                            K.SEQ: 0,
                            K.COLLECTIVE: kind,
                            K.DURATION_S: d,
                            K.PAYLOAD_BYTES: payload,
                        }
                    )
        info = {
            "host": "h",
            "device": "cpu",
            "threads": 1,
            "local_operators": [0] if operators is None else list(range(rank, operators, gpus)),
            "local_tiles": 1,
            "num_tiles": 16,
            "solver": {"weights_sha256": "x"},
            **({"cpus": cpus, "gpu": None} if cpus is not None else {}),
            **({"node_gpus": node_gpus} if node_gpus is not None else {}),
        }
        gathered.append(({"ranks": rows, "collectives": colls}, info))
    write_run(run_dir, spec(problem, mode, gpus, **spec_fields), gathered, backend="gloo", timings={})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "2026-01-01_00-00-00"
    p = lambda g: root / layout.point_subdir("2d", "inference", g)  # noqa: E731
    fake_run(p(1), "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]})
    # gpus=2: gradient ranks (0.6 s, collective 0.2 / 0.1), denoiser (1.6 s, 0.1 / 0.1)
    fake_run(p(2), "2d", "inference", {"gradient": [(0.6, 0.2), (0.6, 0.1)], "denoiser": [(1.6, 0.1), (1.6, 0.1)]})
    write_failure(p(4), spec("2d", "inference", 4), None, "RankFailed: rank 3 failed: out of memory")
    return root


def test_summary_numbers_equal_hand_computed(sweep):
    out = write_report(sweep, echo=lambda s: None)
    table = pd.read_parquet(out / "summary.parquet")
    row = table[(table["gpus"] == 2) & (table[K.SECTION] == "all")].iloc[0]
    # GPU-seconds per iteration: 1 GPU: 1 + 3 = 4.0; 2 GPUs: 2 x (0.6 + 1.6) = 4.4
    assert row["scaled_cost"] == pytest.approx(4.4 / 4.0)
    # compute: gradient mean(0.4, 0.5) = 0.45, denoiser 1.5 -> 2 x 1.95 / 4
    assert row["scaled_compute"] == pytest.approx(2 * 1.95 / 4.0)
    # communication: transfer 0.1 + 0.1, wait 0.05 + 0 -> 2 x 0.25 / 4
    assert row["scaled_comm"] == pytest.approx(2 * 0.25 / 4.0)
    assert row[K.TRANSFER_S] == pytest.approx(0.2) and row[K.WAIT_S] == pytest.approx(0.05)
    assert row[K.LB] == pytest.approx(1.95 / 2.0) and row[K.COMM_E] == pytest.approx(2.0 / 2.2)
    grad = table[(table["gpus"] == 2) & (table[K.SECTION] == "gradient")].iloc[0]
    assert grad["section_growth"] == pytest.approx(2 * 0.6 / 1.0)
    assert grad["wait_pct_of_compute"] == pytest.approx(100 * 0.05 / 0.45)
    failed = table[table["gpus"] == 4]
    assert len(failed) == 1 and failed["status"].iloc[0] == "failed" and failed["scaled_cost"].isna().all()


def test_every_chart_is_a_png_and_readme_has_checks(sweep):
    out = write_report(sweep, echo=lambda s: None)
    for name in (
        "scaled_cost.png",
        "compute_transfer_wait.png",
        "load_balance.png",
        "comm_efficiency.png",
        "wait_pct.png",
    ):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    assert (out / "transfer.png").read_bytes()[:8] == PNG_MAGIC
    rates = pd.read_parquet(out / "rates.parquet")
    # gpus=2 sections: main transfer 0.1 s for 2 x 12288 x (2-1)/2 bytes: 0.12288 MB/s -> 1.2288e-4 GB/s
    assert rates["route"].tolist() == ["intra-node, 2 GPUs"] and rates["rate_GBps"].iloc[0] == pytest.approx(1.2288e-4)
    transfer = pd.read_parquet(out / "transfer.parquet")
    assert (transfer["algorithm_source"] == "assumed").all() and transfer["rel_error"].abs().max() < 1e-9
    readme = (out / "README.md").read_text()
    assert "## 2d inference" in readme and "missing (failed)" in readme
    assert "## Transfer explained (inference)" in readme and "ring (assumed)" in readme
    assert "At 2 GPUs the run costs 1.10x the GPU-seconds of ideal scaling from 1." in readme
    assert "rank 3 failed: out of memory" in readme
    # compute_max (0.5 + 1.5) vs transfer (0.2): 900% above
    assert "Critical-path compute (2 s) is 900% above transfer (0.2 s): compute-bound." in readme


def test_load_returns_typed_tidy_table(sweep):
    df = pnpscale.load(str(sweep))
    assert df["gpus"].dtype == "int64"
    assert pd.api.types.is_string_dtype(df["problem"]) and pd.api.types.is_string_dtype(df["mode"])
    # one text dtype, integer counts as Int64 (the failed point's NA kept): with or without failed points
    for table in (df, df[df["status"] == "complete"], pnpscale.load(str(sweep), include_failed=False)):
        assert table["problem"].dtype == table["mode"].dtype == table[K.SECTION].dtype == table["status"].dtype
        for col in ("iterations", K.N_MAIN, K.MAIN_PAYLOAD_BYTES, "nodes", "num_operators", "num_tiles"):
            assert str(table[col].dtype) == "Int64", col
    assert df.loc[df["gpus"] == 4, "iterations"].isna().all() and (df.loc[df["gpus"] == 2, K.N_MAIN] == 1).all()
    assert set(df["gpus"]) == {1, 2, 4}
    assert len(df[(df["gpus"] == 2)]) == 3  # gradient, denoiser, all
    assert df.groupby(["gpus", K.SECTION]).size().max() == 1
    assert {"problem", "mode", "gpus", K.SECTION, K.COMPUTE_S, K.LB, "status", "run_dir"} <= set(df.columns)


def test_newest_complete_run_wins_and_choice_is_printed(sweep, tmp_path):
    import shutil

    root = tmp_path / "outputs"
    shutil.copytree(sweep, root / "a")
    newer = root / "b" / layout.point_subdir("2d", "inference", 2)
    fake_run(newer, "2d", "inference", {"gradient": [(0.5, 0.1), (0.5, 0.1)], "denoiser": [(1.0, 0.1), (1.0, 0.1)]})
    notes: list[str] = []
    out = write_report(root, echo=notes.append)
    table = pd.read_parquet(out / "summary.parquet")
    assert table[(table["gpus"] == 2) & (table[K.SECTION] == "all")]["run_dir"].iloc[0] == str(newer)
    assert any("gpus=2: using" in n and str(newer) in n and "newest complete of 2" in n for n in notes)


def test_a_sweep_where_every_point_failed_still_gets_a_report(tmp_path):
    for g in (1, 2):
        write_failure(tmp_path / layout.point_subdir("3d", "training", g), spec("3d", "training", g), None, "boom")
    out = write_report(tmp_path, echo=lambda s: None)
    assert (out / "scaled_cost.png").read_bytes()[:8] == PNG_MAGIC
    assert "missing (failed)" in (out / "README.md").read_text()
    assert not (out / "transfer.png").exists()


def test_empty_folder_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pnpscale.report", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"pnpscale.report: error: {tmp_path}: no run folders found (no run.json under it)"


def test_stored_sweeps_compose_and_expand():
    from hydra import compose, initialize_config_dir

    from pnpscale.core.config import register_schema, resolve_spec

    register_schema()
    expected = {
        "comm_inference_2d": ("2d", "inference", 8, None, "1,2,4,8,16,32,64"),
        "comm_inference_3d": ("3d", "inference", 2, None, "1,2,4,8,16,32,64"),
        "comm_training_2d": ("2d", "training", 4, 5, "1,2,4,8,16,32,64"),
        "comm_training_3d": ("3d", "training", 4, 1, "4,8,16,32,64"),
        "comm_inference_ct": ("ct", "inference", 64, None, "1,2,4,8,16,32,64"),
        "remedy_denoiser_collective": ("2d", "inference", 8, None, "1,2,4,8,16,32,64"),
        "remedy_overlap": ("2d", "inference", 8, None, "1,2,4,8,16,32,64"),
        "remedy_gradient_collective": ("2d", "inference", 8, None, "1,2,4,8,16,32,64"),
    }
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name, (problem, mode, ops, unroll, gpus) in expected.items():
            cfg = compose("config", overrides=[f"sweeps={name}"], return_hydra_config=True)
            assert cfg.hydra.mode.name == "MULTIRUN" and str(cfg.hydra.sweeper.params.gpus) == gpus
            spec = resolve_spec(cfg, cuda_available=False)
            assert (spec.problem, spec.mode, spec.scale) == (problem, mode, "paper")
            assert (spec.sizes["num_operators"], spec.sizes["unroll"]) == (ops, unroll)
            assert str(cfg.hydra.sweep.subdir) == f"problem={problem}/mode={mode}/gpus={cfg.gpus}"  # no variant part
            small = resolve_spec(compose("config", overrides=[f"sweeps={name}", "scale=small"]), cuda_available=False)
            assert small.scale == "small"
        cfg = compose("config", overrides=["sweeps=remedy_denoiser_collective"], return_hydra_config=True)
        assert str(cfg.hydra.sweeper.params["solver.denoiser_collective"]) == "all_reduce,all_gather"
        cfg = compose("config", overrides=["sweeps=remedy_overlap"], return_hydra_config=True)
        assert str(cfg.hydra.sweeper.params["solver.overlap"]) == "none,pipelined"
        cfg = compose("config", overrides=["sweeps=remedy_gradient_collective"], return_hydra_config=True)
        assert str(cfg.hydra.sweeper.params["solver.gradient_collective"]) == "all_reduce,reduce_scatter"
        cfg = compose("config", overrides=["solver.gradient_collective=reduce_scatter"], return_hydra_config=True)
        assert str(cfg.hydra.sweep.subdir) == "problem=2d/mode=inference/gradient_collective=reduce_scatter/gpus=1"
        cfg = compose(
            "config", overrides=["sweeps=remedy_overlap", "solver.overlap=pipelined"], return_hydra_config=True
        )
        assert str(cfg.hydra.sweep.subdir) == f"problem=2d/mode=inference/overlap=pipelined/gpus={cfg.gpus}"
        cfg = compose(
            "config", overrides=["solver.overlap=pipelined", "solver.overlap_chunks=2"], return_hydra_config=True
        )
        assert str(cfg.hydra.sweep.subdir) == "problem=2d/mode=inference/overlap=pipelined/overlap_chunks=2/gpus=1"


def test_stored_sweep_prints_with_cfg_job():
    proc = subprocess.run(
        [sys.executable, "-m", "pnpscale", "sweeps=comm_training_3d", "--cfg", "hydra"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "gpus: 4,8,16,32,64" in proc.stdout


def run_notebook(sweep_dir: Path) -> list[dict]:
    """Execute examples/scaling.ipynb headless on ``sweep_dir``; its code cells' outputs (none an error)."""
    import os

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "scaling.ipynb", as_version=4)
    os.environ["PNPSCALE_SWEEP"] = str(sweep_dir)
    try:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        os.environ.pop("PNPSCALE_SWEEP")
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    charts = [cell for cell in code if "plot_" in cell.source or "sns." in cell.source]
    assert len(charts) >= 2
    for cell in charts:  # every chart cell shows its figure as an image, not "<Figure size 900x440 with 1 Axes>"
        shown = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        assert len(shown) == 1, (cell.source, [o.get("data", {}).get("text/plain") for o in cell.get("outputs", [])])
    return outputs


def test_example_notebook_runs_headless(sweep):
    run_notebook(sweep)


def test_headline_checks_warn_when_points_differ_in_settings():
    from pnpscale.results.summary import describe, headline_checks, scaled_cost

    rows = []
    for gpus, iters in ((1, 3), (2, 5)):
        rows.append({"problem": "2d", "mode": "inference", "gpus": gpus, K.SECTION: "all", "status": "complete",
                     "scale": "small", "iterations": iters, K.GPU_SECONDS: 1.0 * gpus, K.COMPUTE_S: 0.9,
                     K.COMPUTE_MAX_S: 0.95, K.TRANSFER_S: 0.05 * (gpus - 1), K.WAIT_S: 0.0})  # fmt: skip
    (check,) = headline_checks(scaled_cost(pd.DataFrame(rows)))
    assert check["mixed"] == {"iterations": ["3", "5"]}
    assert "Caution: the points compared differ in iterations (3, 5)." in describe(check)


@pytest.mark.parametrize(
    ("section", "operators", "tiles", "want"),
    [
        # training's sections hold operators and tiles: one clause for both, "differ in speed" said once
        (
            "forward",
            [2, 2],
            [8, 8],
            "uneven work: every rank holds 2 operators and 8 tiles: the ranks differ in speed (",
        ),
        # an uneven assignment is the cause: the evenly held unit is named, no "differ in speed"
        ("backward", [1, 0], [8, 8], "uneven work: 1 of 2 ranks hold no operator, every rank holds 8 tiles ("),
        ("gradient", [2, 2], [8, 8], "uneven work: every rank holds 2 operators: the ranks differ in speed ("),
    ],
)
def test_a_wait_sentence_says_each_reason_once(section, operators, tiles, want):
    from pnpscale.results.report import wait_sentence

    row = pd.Series({K.SECTION: section, "gpus": 2, K.WAIT_S: 1.0, K.WAIT_LATE_START_S: 0.0,
                     K.WAIT_IMBALANCE_S: 0.8, K.WAIT_JITTER_S: 0.2})  # fmt: skip
    ranks = pd.DataFrame({K.RANK: [0, 1], "operators": operators, "tiles": tiles, "critical": [True, False],
                          "critical_share": 1.0})  # fmt: skip
    text = wait_sentence(row, ranks)
    assert want in text, text
    assert text.count("differ in speed") <= 1 and text.count("every rank holds") <= 1, text
