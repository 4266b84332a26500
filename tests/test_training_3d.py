"""Training mode (unrolled PnP, forward/backward sections) and the 3D problem, end to end."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.core.config import ConfigError, register_schema, resolve_spec
from pnpscale.sweep.cli import CONF
from tests.helpers import TINY_2D, TINY_3D, read_run, run_cli, run_dirs

UNROLL = 2


@pytest.fixture(scope="module")
def composer():
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda *ov: compose("config", overrides=list(ov))


@pytest.mark.parametrize("problem", ["2d", "3d"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_paper_scale_configs_compose_and_validate(composer, problem, mode):
    spec = resolve_spec(composer(f"problem={problem}", f"mode={mode}", "scale=paper"), cuda_available=False)
    expected = {
        ("2d", "inference"): (8192, 8, None),
        ("2d", "training"): (4096, 4, 5),
        ("3d", "inference"): (512, 2, None),
        ("3d", "training"): (512, 4, 1),
    }[(problem, mode)]
    assert (spec.sizes["image_size"], spec.sizes["num_operators"], spec.sizes["unroll"]) == expected
    window = spec.sizes["patch_size"] + 2 * spec.sizes["overlap"]
    assert window % 8 == 0 and spec.sections == (
        ("forward", "backward") if mode == "training" else ("gradient", "denoiser")
    )
    assert spec.channels == (3 if problem == "2d" else 1)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["mode=training", "problem.unroll=0"], "problem.unroll=0: must be an integer >= 1"),
        (
            ["problem=3d", "scale=small", "problem.patch_size=40"],
            "problem.patch_size=40: must be < problem.image_size=32",
        ),
    ],
)
def test_training_and_3d_bad_input(composer, overrides, expected):
    with pytest.raises(ConfigError) as info:
        resolve_spec(composer(*overrides), cuda_available=False)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_cli_unroll_zero_is_one_line(tmp_path):
    proc = run_cli("mode=training", "problem.unroll=0", root=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pnpscale: error: problem.unroll=0: must be an integer >= 1"


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    proc = run_cli("-m", "gpus=1,2", "mode=training", *TINY_2D, f"problem.unroll={UNROLL}", "report=false", root=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {read_run(d)["gpus"]: d for d in run_dirs(root)}


@pytest.mark.slow
def test_unrolled_training_agrees_on_one_and_two_ranks(training):
    one, two = read_run(training[1])["solver"], read_run(training[2])["solver"]
    assert len(one["losses"]) == 3  # warm-up + 2 measured steps
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    for a, b in zip(one["grad_norms"], two["grad_norms"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    assert one["grad_norms"][0] > 0


@pytest.mark.slow
def test_weights_stay_identical_across_ranks(training):
    digests = read_run(training[2])["solver"]["weights_sha256_per_rank"]
    assert len(digests) == 2 and digests[0] == digests[1]


@pytest.mark.slow
def test_training_sections_are_measured_and_flag_image_collectives(training):
    d = training[2]
    sections = pd.read_parquet(d / layout.SECTIONS)
    assert list(dict.fromkeys(sections[K.SECTION])) == ["forward", "backward"]
    total = sections[K.COMPUTE_S] + sections[K.TRANSFER_S] + sections[K.WAIT_S]
    assert (total - sections[K.SECTION_S]).abs().max() < 1e-9
    image = 3 * 32 * 32 * 4
    fwd = sections[sections[K.SECTION] == "forward"]
    bwd = sections[sections[K.SECTION] == "backward"]
    # forward: one image-sized all_reduce per gradient step and per denoiser call
    assert (fwd[K.N_MAIN] == 2 * UNROLL).all() and (fwd[K.MAIN_PAYLOAD_BYTES] == image).all()
    # backward carries the weight-gradient all_reduces beyond the image-sized ones
    assert (bwd[K.MAIN_PAYLOAD_BYTES] == image).all() and (bwd[K.OTHER_PAYLOAD_BYTES] > 0).all()
    assert (bwd[K.N_COLLECTIVES] > bwd[K.N_MAIN]).all()
    ranks = pd.read_parquet(d / layout.RANKS)
    assert (ranks[K.PEAK_MEM_BYTES] > 0).all()


@pytest.mark.slow
def test_two_rank_3d_inference(tmp_path):
    proc = run_cli("gpus=2", *TINY_3D, root=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (d,) = run_dirs(tmp_path)
    run = read_run(d)
    assert run["status"] == "complete" and run["problem"] == "3d" and run["assignment"]["num_tiles"] == 8
    assert run["assignment"]["operators_per_rank"] == [1, 1]
    sections = pd.read_parquet(d / layout.SECTIONS)
    total = sections[K.COMPUTE_S] + sections[K.TRANSFER_S] + sections[K.WAIT_S]
    assert (total - sections[K.SECTION_S]).abs().max() < 1e-9
    assert (sections[K.MAIN_PAYLOAD_BYTES] == 16**3 * 4).all()
    for name in (layout.RANKS, layout.COLLECTIVES):
        assert (d / name).is_file()
