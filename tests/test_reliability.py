"""Reliability v3 (issue 36): re-run commands that parse with hostile folder names, the commands' one
stop handler, the forkserver's end with its launcher, config refusals before heavy imports."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

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


# ------------------------------------------------------------------ the commands, as an operator runs them


def _env() -> dict[str, str]:
    import os

    from tests.helpers import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def _live_members(pgid: int) -> list[str]:
    """The processes of group ``pgid`` that still run: ``/proc/PID/stat``'s group field, zombies left out (an
    ended process whose exit status init has not collected yet holds no memory and runs nothing)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(text.split(" ", 1)[0])  # its pid
    return out


def _group_gone(pgid: int, within_s: float) -> bool:
    import time

    end = time.monotonic() + within_s
    while True:
        if not _live_members(pgid):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


#: A ``sitecustomize`` that holds the interpreter at its first ``import pandas``: it writes ``{marker}`` and
#: sleeps (a stop signal's handler runs between the sleeps) for at most 30 s before letting the import go on.
_HOLD_AT_PANDAS = """
import pathlib, sys, time

class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "pandas":
            sys.meta_path.remove(self)
            pathlib.Path({marker!r}).write_text("held")
            end = time.monotonic() + 30
            while time.monotonic() < end:
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, _Hold())
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", ["pnpscale.report", "pnpscale.analyze"])
def test_two_sigints_while_a_command_imports_are_one_line_and_exit_130(tmp_path, command):
    import os
    import subprocess
    import sys
    import time

    from pnpscale.core import layout
    from tests.test_report import fake_run

    run = tmp_path / "sweep" / layout.point_subdir("2d", "inference", 2)
    fake_run(run, "2d", "inference", {"gradient": [(0.6, 0.2)] * 2, "denoiser": [(1.6, 0.1)] * 2})
    # pnpscale.analyze imports pandas once its readers hold the traces (a 2-rank job's), so it is given one
    traces = Path(__file__).parent / "data" / "trace-contract" / "06_ref_valid_corr"
    args = ([str(tmp_path / "sweep")] if command == "pnpscale.report"
            else [str(traces), "--sections", "gradient,denoiser", "--out", str(tmp_path / "analysis")])  # fmt: skip
    # The command is held at its first import of pandas (a sitecustomize finder that marks the moment in a file
    # and waits), so the two signals land inside its imports however fast the machine is.
    hold = tmp_path / "hold"
    hold.mkdir()
    marker = tmp_path / "importing-pandas"
    (hold / "sitecustomize.py").write_text(_HOLD_AT_PANDAS.format(marker=str(marker)))
    env = _env()
    env["PYTHONPATH"] = f"{hold}{os.pathsep}{env['PYTHONPATH']}"
    proc = subprocess.Popen([sys.executable, "-m", command, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    end = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)
    assert marker.exists(), ("the command never reached its import of pandas", proc.poll())
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.splitlines() == [f"{command}: interrupted (SIGINT)"] or (
        len(err.splitlines()) == 1 and err.startswith(f"{command}: interrupted (SIGINT): ")), err
    assert "Traceback" not in out + err
    assert not list(tmp_path.glob(f"**/{layout.STAGING_PREFIX}*"))
    assert not (tmp_path / "analysis").exists()


@pytest.mark.slow
def test_a_failed_point_leaves_no_process_of_its_own(tmp_path):
    """The ranks, the forkserver (~790 MB with torch) and the resource tracker end with the command:
    1.5 s after it exits its process group is empty (the forkserver used to live 3-10 s on)."""
    import subprocess
    import sys

    from tests.helpers import TINY_2D

    proc = subprocess.Popen([sys.executable, "-m", "pnpscale", "gpus=2", *TINY_2D, "iterations=2",
                             "inject.fail=true", "inject.rank=1", f"output.root={tmp_path}",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1 and "injected failure" in out, out
    assert _group_gone(proc.pid, 1.5), "a process of the point outlived its command by 1.5 s"


@pytest.mark.slow
def test_a_sweep_on_a_40_kib_disk_ends_with_the_failed_points_and_the_resume_command(tmp_path):
    import subprocess
    import sys

    from tests.helpers import TINY_2D

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a 40 KiB tmpfs here (needs root)")
    try:
        proc = subprocess.run([sys.executable, "-m", "pnpscale", "-m", "gpus=1,2", *TINY_2D, "iterations=2",
                               f"hydra.sweep.dir={disk / 'sweep'}"], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=240)  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "HYDRA_FULL_ERROR" not in out and "Traceback" not in out, out
    assert out.count("report not written (OSError") == 1, out
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pnpscale: error: 2 of 2 sweep point(s) failed (gpus=1 "), last
    assert "to re-run only the failed points: python -m pnpscale -m gpus=1,2 " in last, last
