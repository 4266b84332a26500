"""Config schema, value rules and one-line errors before anything starts (pnpscale.config)."""

from __future__ import annotations

import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from pnpscale.core.config import ConfigError, register_schema, resolve_spec, validate
from pnpscale.sweep.cli import CONF, CommandLineError, check_overrides, group_options
from tests.helpers import run_cli, run_dirs


@pytest.fixture(scope="module")
def composer():
    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda *ov: compose("config", overrides=list(ov))


def test_defaults_compose_and_resolve(composer):
    cfg = composer()
    validate(cfg)
    small = resolve_spec(cfg, cuda_available=False)
    assert small.scale == "small" and small.scale_requested == "auto" and small.sections == ("gradient", "denoiser")
    paper = resolve_spec(cfg, cuda_available=True)
    assert paper.scale == "paper"
    assert paper.sizes["image_size"] == 8192 and paper.sizes["num_operators"] == 8 and paper.channels == 3
    assert paper.sizes["nc"] == [64, 128, 256, 512] and paper.sizes["nb"] == 4


#: The ten overrides the tests typed before ``scale=tiny`` existed (docs/configuration.md repeats them).
TEN_TINY_OVERRIDES = ["scale=small", "problem.image_size=32", "problem.num_operators=4", "problem.patch_size=8",
                      "problem.overlap=4", "problem.max_batch_size=4", "problem.nc=[4,8,8,8]", "problem.nb=1",
                      "iterations=2", "warmup=1"]  # fmt: skip


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_scale_tiny_is_the_ten_documented_overrides(composer, mode):
    tiny = resolve_spec(composer("scale=tiny", f"mode={mode}"), cuda_available=False)
    typed = resolve_spec(composer(*TEN_TINY_OVERRIDES, f"mode={mode}"), cuda_available=False)
    assert (tiny.scale, tiny.scale_requested) == ("tiny", "tiny")
    assert tiny.sizes == typed.sizes and (tiny.iterations, tiny.warmup) == (typed.iterations, typed.warmup) == (2, 1)
    # the other presets keep 5 measured iterations; an explicit value wins over every preset
    assert resolve_spec(composer("scale=small", f"mode={mode}"), cuda_available=False).iterations == 5
    assert resolve_spec(composer("scale=tiny", "iterations=7", f"mode={mode}"), cuda_available=False).iterations == 7


def test_scale_tiny_of_3d_and_ct_runs_in_seconds(composer):
    d3 = resolve_spec(composer("problem=3d", "scale=tiny"), cuda_available=False).sizes
    assert (d3["image_size"], d3["patch_size"], d3["overlap"], d3["nc"], d3["nb"]) == (16, 8, 4, [4, 8, 8, 8], 1)
    ct = resolve_spec(composer("problem=ct", "scale=tiny"), cuda_available=False).sizes
    assert (ct["image_size"], ct["num_operators"], ct["patch_size"], ct["nc"]) == (32, 8, 8, [4, 8, 8, 8])


def test_a_problem_without_the_chosen_preset_is_refused_in_one_line(composer):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(composer("scale=tiny"))  # a user's problem YAML without scales.tiny
    cfg["problem"]["scales"]["tiny"]["inference"] = dict.fromkeys(cfg["problem"]["scales"]["tiny"]["inference"])
    with pytest.raises(ConfigError, match=r"problem=2d has no preset problem\.scales\.tiny\.inference"):
        resolve_spec(cfg, cuda_available=False)


def test_explicit_size_overrides_every_preset(composer):
    cfg = composer("problem.image_size=512", "scale=paper")
    spec = resolve_spec(cfg, cuda_available=False)
    assert spec.scale == "paper" and spec.sizes["image_size"] == 512 and spec.sizes["num_operators"] == 8


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["gpus=0"], "gpus=0", "1..64"),
        (["gpus=65"], "gpus=65", "1..64"),
        (["iterations=-1"], "iterations=-1", ">= 1"),
        (["warmup=-2"], "warmup=-2", ">= 0"),
        (["problem.patch_size=30"], "problem.patch_size=30", "multiple of 8"),
        (
            ["problem.image_size=64", "problem.patch_size=64", "problem.overlap=0"],
            "problem.patch_size=64",
            "smaller than",
        ),
        (["scale=huge"], "scale=huge", "paper, small, tiny, auto"),
        (["dist.backend=mpi"], "dist.backend=mpi", "auto, gloo, nccl"),
        (["inject.rank=3", "gpus=2"], "inject.rank=3", "0..1"),
        (["inject.section=forward"], "inject.section=forward", "gradient, denoiser"),
        (["solver.overlap=async"], "solver.overlap=async", "none, pipelined"),
        (["solver.overlap_chunks=2"], "solver.overlap_chunks=2", "needs solver.overlap=pipelined"),
        (["solver.overlap=pipelined", "solver.overlap_chunks=0"], "solver.overlap_chunks=0", ">= 1, or null"),
        (["solver.overlap=pipelined", "solver.overlap_chunks=9", "scale=small"], "solver.overlap_chunks=9", "1..8"),
        (
            ["solver.overlap=pipelined", "solver.denoiser_collective=all_gather"],
            "solver.overlap=pipelined",
            "needs solver.denoiser_collective=all_reduce",
        ),
        (["solver.gradient_collective=all_gather"], "solver.gradient_collective=all_gather", "all_reduce, reduce_"),
        (
            ["solver.gradient_collective=reduce_scatter", "solver.overlap=pipelined"],
            "solver.gradient_collective=reduce_scatter",
            "needs solver.overlap=none",
        ),
        (
            ["solver.gradient_collective=reduce_scatter", "scale=small", "problem.image_size=16",
             "problem.patch_size=8", "problem.overlap=16"],
            "problem.overlap=16",
            "must be < problem.patch_size=8",
        ),  # fmt: skip
        (["scale=small", "problem.patch_size=8", "problem.overlap=8"], "problem.overlap=8", "< problem.patch_size=8"),
    ],
)
def test_value_errors_are_one_line_naming_key_and_allowed(composer, overrides, key, allowed):
    with pytest.raises(ConfigError) as info:
        validate(composer(*overrides))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(key) and allowed in msg


def test_unknown_key_fails_at_compose_time(composer):
    with pytest.raises(ConfigCompositionException):
        composer("problem.imagesize=3")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["gpus=0"], "gpus=0: must be an integer in 1..64"),
        (["-m", "gpus=1,2,65"], "gpus=65: must be an integer in 1..64"),
        (["problem=4d"], "problem=4d: allowed values: 2d"),
        (["mode=train"], "mode=train: allowed values: inference"),
        (["gpuz=2"], "gpuz=2: unknown key; did you mean gpus"),
        (["problem.imagesize=3"], "did you mean problem.image_size"),
        (["+gpus=2"], "drop the leading '+'"),
        (["iterations=-1"], "iterations=-1: must be an integer >= 1"),
        (["solver.overlap=blocking"], "solver.overlap=blocking: allowed values: none, pipelined"),
        (
            ["solver.gradient_collective=reduce"],
            "solver.gradient_collective=reduce: allowed values: all_reduce, reduce_scatter",
        ),
        (["gpus=abc"], "gpus=abc: must be an integer in 1..64"),
    ],
)
def test_command_line_precheck(argv, expected):
    with pytest.raises(CommandLineError) as info:
        check_overrides(argv)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_precheck_reports_every_bad_value_and_unparsable_lines():
    with pytest.raises(CommandLineError) as info:
        check_overrides(["-m", "gpus=1,abc,0", "resume=maybe", "problem=4d,2d"])
    assert info.value.problems == [
        "gpus=abc: must be an integer in 1..64",
        "gpus=0: must be an integer in 1..64",
        "resume=maybe: must be true or false",
        f"problem=4d: allowed values: {', '.join(group_options('problem'))}",  # the registry, not a pinned list
    ]
    with pytest.raises(CommandLineError, match="could not parse the overrides"):
        check_overrides(["gpus=[1,2"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["inject.delay_s=0.5", "inject.rank=0"], "inject.delay_s=0.5: needs inject.section"),
        (["inject.delay_s=0.5", "inject.section=denoiser"], "inject.delay_s=0.5: needs inject.rank"),
        (["inject.fail=true"], "inject.fail=true: needs inject.rank"),
    ],
)
def test_partial_injection_is_refused(composer, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        validate(composer(*overrides))


def test_scale_auto_is_checked_as_the_preset_it_resolves_to(composer):
    cfg = composer("problem.image_size=128")  # fine for the small preset, not for paper (256-pixel tiles)
    validate(cfg, cuda_available=False)
    with pytest.raises(ConfigError, match=r"\(scale=paper\)"):
        validate(cfg, cuda_available=True)
    with pytest.raises(ConfigError, match=r"\(scale=paper\)"):
        validate(cfg)  # unknown (SLURM: decided on the compute node): both presets


def test_precheck_accepts_valid_lines():
    check_overrides(["-m", "gpus=1,2,4", "problem=2d", "hydra.verbose=true", "cluster=slurm",
                     "cluster.additional_parameters.foo=1"])  # fmt: skip
    # a backend's own key belongs to that backend: the SLURM options are refused on cluster=local
    with pytest.raises(CommandLineError, match="a key of cluster=slurm, not of cluster=local"):
        check_overrides(["cluster.additional_parameters.foo=1"])
    check_overrides(["problem.nc=[8,16,32,64]", "iterations=5", "scale=paper", "--cfg", "job"])
    assert "2d" in group_options("problem") and "inference" in group_options("mode")


def test_a_hydra_key_hydra_does_not_have_is_refused_naming_its_neighbours():
    """A typo under ``hydra.`` is refused before anything starts (exit 2 on the command line), with the close
    match and the keys of its parent in Hydra's schema; open nodes (dicts, a plugin's config) are left to Hydra."""
    for line, want in (
        (["hydra.run.dri=/tmp/x"], "hydra.run.dri=/tmp/x: unknown key; did you mean hydra.run.dir? keys of "
                                   "hydra.run: dir"),
        (["-m", "hydra.sweep.subdr=a", "gpus=1,2"], "hydra.sweep.subdr=a: unknown key; did you mean "
                                                   "hydra.sweep.subdir? keys of hydra.sweep: dir, subdir"),
    ):  # fmt: skip
        with pytest.raises((CommandLineError, ConfigError)) as bad:
            check_overrides(line)
        assert want in str(bad.value), str(bad.value)
    check_overrides(["hydra.job.chdir=false", "hydra.verbose=pnpscale", "hydra.job.name=x"])


def test_cli_bad_value_exits_at_once_with_one_line(tmp_path):
    t0 = time.monotonic()
    proc = run_cli("gpus=65", root=tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["pnpscale: error: gpus=65: must be an integer in 1..64"]
    assert time.monotonic() - t0 < 30 and not (tmp_path / "outputs").exists()
    # a value OmegaConf cannot convert to the schema's type: one line naming key, type and value, not 85
    proc = run_cli("problem.nc=abc", root=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pnpscale: error: problem.nc=abc: expected a list of integers or null, got 'abc'"
    ]


def _typed_fields():
    """Every field of the schema's dataclasses whose type is not a plain string (a string takes any scalar)."""
    from pnpscale.cluster import cluster_backends
    from pnpscale.core.config import schema_types

    def typed(hint) -> bool:
        return hint not in (str, str | None)

    fields = [(k, t) for k, t in schema_types().items() if typed(t)]
    for name, backend in cluster_backends().items():
        if backend.params is not None:
            fields += [(f"cluster={name} cluster.{k}", t) for k, t in schema_types(backend.params).items() if typed(t)]
    return fields


def test_every_typed_field_refuses_an_unconvertible_value_in_one_line():
    """Iterates the schema (never a list of names): each int, float, bool, list or nested field given a
    value OmegaConf cannot convert is one line naming the key and the value (the type, when no value rule
    of the key speaks first), never Hydra's merge traceback."""
    from pnpscale.core.config import type_text

    fields = _typed_fields()
    assert len(fields) > 40 and any(k.startswith("problem.scales.") for k, _ in fields)
    for key, hint in fields:
        *selector, key = key.split(" ")
        with pytest.raises(CommandLineError) as info:
            check_overrides([*selector, f"{key}=abc"])
        (line,) = info.value.problems
        assert line.startswith(f"{key}=abc: "), line
        if "must" not in line:  # no value rule of its own: the type's words
            assert line == f"{key}=abc: expected {type_text(hint)}, got 'abc'", line
    with pytest.raises(CommandLineError, match=r"^problem.nc=\[a\]: expected a list of integers or null"):
        check_overrides(["problem.nc=[a]"])
    with pytest.raises(CommandLineError, match=r"^warmup=null: "):
        check_overrides(["warmup=null"])
    check_overrides(["iterations=null"])  # null: the scale preset's (5; scale=tiny: 2)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["problem.patch_size=30"],
            "problem.patch_size=30: tile window patch_size+2*overlap=46 must be a multiple of 8",
        ),
        (["output.root=/proc/nope"], "output.root=/proc/nope: must be a folder this user can create and write"),
    ],
)
def test_cli_single_run_checks_the_composed_point_before_anything(tmp_path, args, line):
    proc = run_cli(*args, root=tmp_path, timeout=60) if "output.root" not in args[0] else None
    if proc is None:  # run_cli appends its own output.root: call the module directly
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-m", "pnpscale", *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pnpscale: error: {line}" + ("" if "output" in line else " (overlap=8) (scale=small)")
    ]
    assert not (tmp_path / "outputs").exists()


def test_cli_sweep_with_a_bad_composed_point_starts_nothing(tmp_path):
    # passes the command-line pre-check (each value is fine alone) but the composed point is not
    proc = run_cli("-m", "gpus=1,2", "problem.patch_size=30", "scale=small", root=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "problem.patch_size=30: tile window patch_size+2*overlap=46 must be a multiple of 8" in proc.stderr
    assert "sweep points: gpus=1 problem.patch_size=30 scale=small; gpus=2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert run_dirs(tmp_path) == [] and list((tmp_path / "outputs").glob("*")) == []


def test_only_the_problems_that_decimate_need_a_factor(composer):
    """``problem.factor`` is super-resolution's (and the 3D decimation's) key, not every problem's."""
    import dataclasses

    from pnpscale.core.config import ConfigError, resolve_spec
    from pnpscale.rank.problems import make_problem

    spec = resolve_spec(composer("scale=small"), cuda_available=False)
    assert make_problem(spec).decimation() == 2
    unset = dataclasses.replace(spec, sizes={**spec.sizes, "factor": None})
    with pytest.raises(ConfigError, match=r"^problem.factor=null: SuperResolution2D decimates"):
        make_problem(unset).check()



def _digest_before_the_solver_keys(spec) -> str:
    """The fingerprint as written before ``solver.overlap*`` / ``gradient_collective``, ``mode.params`` and
    ``profile.operators`` existed: those keys absent, the moved keys (``blur_sigma``, ``lr``, ``train_stepsize``)
    at the top level."""
    import hashlib
    import json

    drop = ("overlap", "overlap_chunks", "gradient_collective", "mode_params", "operators")
    before = {k: v for k, v in spec.to_dict().items() if k not in drop}
    before |= {"params": {}, "blur_sigma": 1.0, "lr": 1e-4, "train_stepsize": False}  # the shared keys of then
    return hashlib.sha256(json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_overlap_is_a_variant_with_its_own_folder(composer):
    """``solver.overlap`` / ``overlap_chunks`` reach the spec and the run folder; the defaults keep the old digest."""
    from pnpscale.core.config import cfg_variant

    spec = resolve_spec(composer("solver.overlap=pipelined", "solver.overlap_chunks=4"), cuda_available=False)
    assert (spec.overlap, spec.overlap_chunks) == ("pipelined", 4)
    assert cfg_variant(composer("solver.overlap=pipelined", "solver.overlap_chunks=4")) == (
        "overlap=pipelined overlap_chunks=4"
    )
    assert cfg_variant(composer()) == ""
    plain = resolve_spec(composer(), cuda_available=False)

    assert plain.fingerprint() == _digest_before_the_solver_keys(plain)  # a run recorded before still resumes
    assert plain.fingerprint() != spec.fingerprint()


def test_the_unknown_key_message_lists_every_top_level_key():
    """Derived from the schema and the config groups (``sweeps`` has no schema field), never a list by hand."""
    import dataclasses

    from pnpscale.core.config import Config

    with pytest.raises(CommandLineError) as info:
        check_overrides(["gpuz=2"])
    (line,) = info.value.problems
    listed = line.split("top-level keys: ")[1].split(", ")
    groups = {p.name for p in CONF.iterdir() if p.is_dir()} | {"sweeps"}  # sweeps/ sits beside conf/ in a checkout
    assert set(listed) == {f.name for f in dataclasses.fields(Config)} | groups


def test_gradient_collective_is_a_variant_with_its_own_folder(composer):
    """``solver.gradient_collective`` reaches the spec and the run folder; the default keeps the old digest."""

    from pnpscale.core.config import cfg_variant, variant_subdir

    spec = resolve_spec(composer("solver.gradient_collective=reduce_scatter"), cuda_available=False)
    assert spec.gradient_collective == "reduce_scatter"
    assert cfg_variant(composer("solver.gradient_collective=reduce_scatter")) == "gradient_collective=reduce_scatter"
    assert variant_subdir("all_reduce", None, "none", None, "reduce_scatter") == "/gradient_collective=reduce_scatter"
    plain = resolve_spec(composer(), cuda_available=False)
    assert plain.fingerprint() == _digest_before_the_solver_keys(plain)  # a run recorded before still resumes
    assert plain.fingerprint() != spec.fingerprint()


def test_mode_keys_default_to_null_and_a_sweep_over_both_modes_is_warned(composer):
    """Every key of :data:`pnpscale.sweep.point.MODE_KEYS` names a config key that defaults to null (so a
    value means it was set) and modes that exist; a sweep over both modes with a training key is one
    warning, not a refusal; a sweep of inference points only is refused."""
    from pnpscale.sweep.cli import group_options
    from pnpscale.sweep.point import MODE_KEYS, mode_key_problems

    cfg = composer()
    for key, modes in MODE_KEYS.items():
        group, name = key.split(".", 1)
        assert name in cfg[group] and cfg[group][name] is None, key
        assert set(modes) <= set(group_options("mode")), key
    mixed = [(f"mode={m}", composer(f"mode={m}", "problem.unroll=2")) for m in ("inference", "training")]
    refused, warnings = mode_key_problems(mixed)
    assert refused == {}
    assert warnings == ["problem.unroll=2 takes effect only in mode=training: ignored by mode=inference"]
    refused, _ = mode_key_problems(mixed[:1] * 2)
    assert list(refused.values()) == [["mode=inference", "mode=inference"]]
    preset = "problem.scales.small.training.image_size=64"  # the training preset, on an inference point
    refused, _ = mode_key_problems([("gpus=1", composer(preset), [preset])])
    assert list(refused) == [f"{preset}: takes effect only in mode=training; this point is mode=inference: "
                             "drop it, or run mode=training"]  # fmt: skip
    assert mode_key_problems([("gpus=1", composer(preset, "mode=training"), [preset])]) == ({}, [])


def test_the_top_level_sweeps_are_the_group_sweeps_and_a_bad_file_is_named(tmp_path):
    """The checkout's ``sweeps/`` (beside ``conf/``, not in it) is what ``sweeps=`` offers; each file keeps its
    ``# @package`` header; a file that is not a YAML mapping is refused naming it."""
    from pnpscale.core.config import CONF_DIR, SWEEPS_DIR, stored_sweeps
    from tests.helpers import ROOT

    assert (CONF_DIR, SWEEPS_DIR) == (ROOT / "conf", ROOT / "sweeps")
    stored = stored_sweeps(SWEEPS_DIR)
    assert {name for name, _, _ in stored} == set(group_options("sweeps")) >= {"comm_inference_2d", "remedy_overlap"}
    assert {package for _, _, package in stored} == {"_global_"}
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml must hold a YAML mapping"):
        stored_sweeps(tmp_path)


def test_overrides_on_both_sides_of_the_flag_get_one_line_and_the_command_that_works():
    """``scale=tiny -m gpus=1,2``: Hydra's parser takes one run of overrides and would print its usage block;
    one line names what was not read and the command with every flag first."""
    with pytest.raises(CommandLineError) as err:
        check_overrides(["scale=tiny", "-m", "gpus=1,2"])
    assert err.value.problems == [
        "gpus=1,2: overrides must all come after the flags (-m): python -m pnpscale -m scale=tiny gpus=1,2"
    ]
    check_overrides(["-m", "scale=tiny", "gpus=1,2"])  # the command it names is accepted
