"""Reliability v3 (issue 36): re-run commands that parse with hostile folder names, the commands' one
stop handler, the forkserver's end with its launcher, config refusals before heavy imports."""

from __future__ import annotations

import shlex
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pnpscale.core import signals
from pnpscale.sweep.cli import hydra_value, resume_command

HOSTILE = ["/o/a|b<c>&`d`", "/o/it's ${x}", "/o/sp ace,comma=eq", "/o/back\\slash", "/o/end\\", "/o/q\\'x",
           "/o/\\${y}", "/o/[1,2]", "/o/{a:b}", '/o/"dq"', "true", "null", "/o/$HOME", "/o/(x);rm -rf ~",
           "/o/ünï", "/o/a\tb", "/o/!?#*", "/o/plain-1_2"]  # fmt: skip


def _read_back(override: str) -> str:
    """The string Hydra's override grammar and OmegaConf's resolution make of ``key=value``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    return str(OmegaConf.create({"v": OverridesParser.create().parse_override(override).value()}).v)


@pytest.mark.parametrize("name", HOSTILE)
def test_a_resume_command_reads_back_the_folder_through_the_shell_and_hydra(name):
    cmd = resume_command(["gpus=1,2", "resume=true"], ["hydra.mode=MULTIRUN"], name)
    argv = shlex.split(cmd)  # the shell's reading: one word per argument, nothing run (|, <, &, `)
    assert argv[:5] == ["python", "-m", "pnpscale", "-m", "gpus=1,2"] and len(argv) == 6, argv
    assert argv[5].startswith("hydra.sweep.dir=") and _read_back(argv[5]) == name


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1))
def test_hydra_value_reads_back_as_the_same_string(text):
    assert _read_back(f"hydra.run.dir={hydra_value(text)}") == text


@pytest.fixture
def command_handlers():
    """The stop-signal handlers and the signals module's state put back after a test of a command's handler."""
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)
    signals.install()
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_command_stops_once_in_one_line_and_a_second_stop_never_interrupts_its_cleanup(command_handlers, capsys):
    signals.install_command("pnpscale.report")
    cleaned = []

    def main() -> int:
        try:
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: raised where main is
            raise AssertionError("not stopped")
        finally:
            signal.raise_signal(signal.SIGINT)  # a second one 20 ms later, while the staging folder goes
            cleaned.append(True)

    assert signals.run_command(main, lambda: "report not written") == 130
    assert cleaned == [True]
    assert capsys.readouterr().err == "pnpscale.report: interrupted (SIGINT): report not written\n"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the line is out: nothing more to stop


def test_a_stop_once_the_output_is_published_is_ignored(command_handlers, tmp_path, capsys):
    from pnpscale.core import layout

    signals.install_command("pnpscale.report")

    def main() -> int:
        def build(stage):
            (stage / "README.md").write_text("x")

        layout.commit_folder(tmp_path / "report", build)  # published: its renames done
        signal.raise_signal(signal.SIGTERM)  # while Python finishes: the report stands, exit 0
        return 0

    assert signals.run_command(main) == 0
    assert (tmp_path / "report" / "README.md").read_text() == "x"
    assert not list((tmp_path / "report").glob(layout.STAGING_PREFIX + "*")) and capsys.readouterr().err == ""


def test_a_stop_held_back_during_the_renames_still_stops_a_sweep(command_handlers, tmp_path):
    """Outside a command's run (the sweep's handler), publishing settles nothing: the stop is raised."""
    from pnpscale.core import layout

    signals.install()

    def build(stage):
        (stage / "a").write_text("x")
        signal.raise_signal(signal.SIGINT)  # raised in build: nothing published, the staging folder removed

    with pytest.raises(signals.Interrupted):
        layout.commit_folder(tmp_path / "run", build)
    assert not (tmp_path / "run").exists()
