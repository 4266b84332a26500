"""Each plugin owns its keys: a problem's ``problem.params`` and a mode's ``mode.params`` are declared and
checked by their classes (``Problem.params``, ``Solver.params``); keys the shared schema held before are refused
naming their new place; runs recorded before keep their digest."""

from __future__ import annotations

import pytest

from pnpscale.core.config import ConfigError, resolve_spec
from pnpscale.sweep.cli import CONF, CommandLineError, check_overrides, compose_config


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["problem.blur_sigma=2"], "problem.blur_sigma=2: moved to problem.params.blur_sigma"),
        (["mode.lr=0.001"], "mode.lr=0.001: moved to mode.params.lr (a parameter of mode=training)"),
        (["-m", "mode.train_stepsize=true,false"], "mode.train_stepsize=true,false: moved to mode.params.train_step"),
    ],
)
def test_a_key_moved_into_its_plugin_is_refused_naming_the_new_place(argv, expected):
    with pytest.raises(CommandLineError) as info:
        check_overrides(argv)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_a_config_file_setting_a_moved_key_is_one_line(tmp_path):
    """A problem YAML written for the old schema (``blur_sigma`` at the top) is refused in one line, not Hydra's."""
    (tmp_path / "problem").mkdir()
    old = (CONF / "problem" / "2d.yaml").read_text().replace("name: 2d", "name: old") + "blur_sigma: 0.5\n"
    (tmp_path / "problem" / "old.yaml").write_text(old)
    with pytest.raises(ConfigError) as info:
        compose_config(["problem=old", f"hydra.searchpath=[file://{tmp_path}]"])
    assert str(info.value) == (
        "problem.blur_sigma=(set in a config file): moved to problem.params.blur_sigma "
        "(a parameter of the problems that blur: 2d, 3d)"
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["mode=training", "+mode.params.lrr=1"],
         "mode.params.lrr=1: unknown key for mode=training; did you mean mode.params.lr? its keys: lr, train_stepsize"),
        (["mode=training", "mode.params.lr=0"], "mode.params.lr=0: must be a number > 0"),
        (["mode=training", "mode.params.train_stepsize=3"], "mode.params.train_stepsize=3: must be true or false"),
        (["+mode.params.lr=0.1"], "mode.params.lr=0.1: unknown key for mode=inference; its keys: none"),
        (["problem=ct", "+problem.params.blur_sigma=1"],
         "problem.params.blur_sigma=1: unknown key for problem=ct; its keys: angles_per_pixel"),
        (["problem.params.blur_sigma=-1"], "problem.params.blur_sigma=-1: must be a number > 0"),
        (["problem=3d", "problem.params.blur_sigma=abc"], "problem.params.blur_sigma=abc: must be a number > 0"),
    ],
)  # fmt: skip
def test_plugin_params_are_checked_by_their_class_before_any_rank(tmp_path, overrides, expected):
    from pnpscale.sweep.point import resolve_point

    with pytest.raises(ConfigError) as info:
        resolve_point(compose_config(["scale=small", *overrides]), tmp_path / "run", cuda_devices=0)
    assert str(info.value) == expected


#: Digests of runs recorded before the plugins owned their keys (computed by pnpscale at commit 31c7046, when
#: ``blur_sigma``, ``lr`` and ``train_stepsize`` were shared keys, and the default ``iterations`` was 3): a
#: resumed sweep still finds them complete.
OLD_DIGESTS = {
    ("2d", "inference", ()): "6919fab7c0b6b07d",
    ("2d", "inference", ("problem.params.blur_sigma=0.7",)): "5d9a6209c6ac396a",
    ("2d", "training", ()): "e0d6ccb1bb527c0c",
    ("2d", "training", ("mode.params.lr=0.001", "mode.params.train_stepsize=true")): "92854d3102c4e81b",
    ("3d", "training", ("problem.params.blur_sigma=0.7",)): "0907cf9417f96328",
    ("ct", "inference", ()): "178235f05f424370",
    ("ct", "training", ("mode.params.lr=0.001", "mode.params.train_stepsize=true")): "ebdaf51cb16bc313",
}


@pytest.mark.parametrize(("key", "digest"), OLD_DIGESTS.items(), ids=lambda v: str(v))
def test_plugin_keys_reach_the_spec_and_old_runs_keep_their_digest(key, digest):
    problem, mode, extra = key
    cfg = compose_config([f"problem={problem}", f"mode={mode}", "scale=small", "gpus=2", "iterations=3", *extra])
    spec = resolve_spec(cfg, cuda_available=False)
    assert spec.fingerprint() == digest
    if "mode.params.lr=0.001" in extra:
        assert spec.mode_params == {"lr": 0.001, "train_stepsize": True}
    if problem != "ct":
        assert spec.params == {"blur_sigma": 0.7 if extra and "blur" in extra[0] else 1.0}


def test_a_problem_yaml_without_its_channels_is_one_line(tmp_path):
    """``problem.channels`` has no default (a one-channel problem never silently gets 3): its YAML states it."""
    from pnpscale.sweep.point import resolve_point

    (tmp_path / "problem").mkdir()
    text = (CONF / "problem" / "3d.yaml").read_text().replace("name: 3d", "name: nochan").replace("channels: 1\n", "")
    (tmp_path / "problem" / "nochan.yaml").write_text(text)
    cfg = compose_config(["problem=nochan", f"hydra.searchpath=[file://{tmp_path}]"])
    with pytest.raises(ConfigError) as info:
        resolve_point(cfg, tmp_path / "run", cuda_devices=0)
    assert str(info.value) == (
        "problem.channels=???: must be set: the option's YAML (conf/problem/<name>.yaml) states it"
    )


def _old_problem(folder):
    """A user's problem YAML written for the schema before issue 20 (``blur_sigma`` at the top)."""
    (folder / "problem").mkdir()
    old = (CONF / "problem" / "2d.yaml").read_text().replace("name: 2d", "name: old") + "blur_sigma: 0.5\n"
    (folder / "problem" / "old.yaml").write_text(old)
    return f"hydra.searchpath=[file://{folder}]"


MOVED_LINE = (
    "problem.blur_sigma=(set in a config file): moved to problem.params.blur_sigma "
    "(a parameter of the problems that blur: 2d, 3d)"
)


@pytest.mark.parametrize("argv", [["-m", "gpus=1,2"], ["gpus=1,2", "hydra.mode=MULTIRUN"], ["-m", "cluster=slurm"]])
def test_a_sweep_over_an_old_problem_yaml_is_one_line_before_hydra(tmp_path, argv):
    """A sweep's shared part is composed before Hydra when a user's config folder is on the search path."""
    from pnpscale.sweep.cli import check_single_point

    with pytest.raises(ConfigError) as info:
        check_single_point([*argv, "problem=old", _old_problem(tmp_path)])
    assert str(info.value) == MOVED_LINE


def test_a_swept_old_problem_yaml_is_one_line_per_point_in_the_launchers_check(tmp_path):
    """``-m problem=2d,old``: the launchers' check composes each point; the old one is one line, nothing starts."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    import hydra_plugins.pnpscale_plugins.launcher as launcher
    from pnpscale.core.config import register_schema
    from pnpscale.core.errors import Abort

    register_schema()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    config = loader.load_configuration("config", [_old_problem(tmp_path)], run_mode=RunMode.MULTIRUN)
    checked = []
    with pytest.raises(Abort) as info:
        launcher.validate_points(loader, config, [["problem=2d"], ["problem=old", "gpus=2"]], checked.append)
    assert str(info.value.error) == (
        f"invalid sweep, nothing was started:\n{MOVED_LINE} (sweep point: problem=old gpus=2)"
    )
    assert [c.problem.name for c in checked] == ["2d"]  # the good point was checked, the old one refused


@pytest.mark.slow
def test_a_multirun_over_an_old_problem_yaml_exits_2_with_one_line(tmp_path):
    """The whole command: Hydra's own composition check of the batch is skipped (the launcher's says it in one
    line), exit 2, no traceback, and the sweep folder is left as it was (no ``multirun.yaml``)."""
    from tests.helpers import run_cli

    proc = run_cli("-m", "problem=2d,old", "gpus=1", _old_problem(tmp_path), root=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "pnpscale: error: invalid sweep, nothing was started:",
        f"pnpscale: error: {MOVED_LINE} (sweep point: problem=old gpus=1)",
    ], proc.stderr
    assert not list((tmp_path / "outputs").rglob("multirun.yaml"))
