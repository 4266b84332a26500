"""The harness under faults (README "Faults"): one test per fault family, each checking the exit code,
the status record, that no rank process survives and that no measurement is lost."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from pnpscale.core import layout
from tests.helpers import ROOT, TINY_2D, read_run, run_cli, run_dirs
from tests.test_report import fake_run, spec


def _cli(*args: str, cwd: Path) -> subprocess.Popen:
    """``python -m pnpscale ARGS`` in its own process group, stdout and stderr merged."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen([sys.executable, "-m", "pnpscale", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)  # fmt: skip


def _read_until(proc: subprocess.Popen, needle: str, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return
    pytest.fail(f"never saw {needle!r}:\n" + "".join(lines))


def _no_survivor(pgid: int, grace_s: float = 10.0) -> bool:
    """Every process of the group ``pgid`` (the command and its ranks) is gone."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def tmpfs(tmp_path):
    """A 3 MB tmpfs (root only), to fill up; skipped where it cannot be mounted."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@contextlib.contextmanager
def full_point_folder(sweep: Path, gpus: int = 2):
    """The gpus=``gpus`` point folder of ``sweep`` as a full 16 KiB tmpfs (root only; skipped where it cannot
    be mounted): yields (folder, filler file); unmounted at exit."""
    full = sweep / layout.point_subdir("2d", "inference", gpus, "num_operators=4")
    full.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield full, _fill(full)
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)


def _fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` until ENOSPC; returns the filler file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


# ------------------------------------------------------------------------------------ 1. signals


def test_1_signal_handlers_are_restored_and_a_signal_is_an_exit_code():
    from pnpscale.core import signals

    before = {s: signal.getsignal(s) for s in signals.ELASTIC_SIGNALS}
    with signals.preserved():
        for s in signals.ELASTIC_SIGNALS:
            signal.signal(s, lambda *a: None)  # what torch elastic does in PContext.start()
    assert {s: signal.getsignal(s) for s in signals.ELASTIC_SIGNALS} == before
    assert signals.exit_code(signals.Interrupted(signal.SIGTERM)) == 143
    assert signals.exit_code(KeyboardInterrupt()) == 130
    assert str(signals.Interrupted(signal.SIGTERM)) == "terminated (SIGTERM)"
    got = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        with signals.deferred((signal.SIGUSR1,)):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert got == []  # held back during the body
        assert got == [signal.SIGUSR1]  # delivered right after
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.slow
def test_1_run_ranks_puts_back_the_signal_handlers(tmp_path):
    from pnpscale.cluster.local import run_ranks
    from tests.toy_problem import noop_rank

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    run_ranks(1, noop_rank, (), tmp_path / "logs", 1)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (``/proc``: children, their children...)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p and c not in out}
        out |= kids
        todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an unreaped zombie holds nothing)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_2_sigkill_of_the_launcher_leaves_no_process(tmp_path):
    # issue 22 item 2: the forkserver, the resource tracker and the ranks all end with the launcher,
    # also when it is killed by SIGKILL (nothing can run in it then)
    pid_file = tmp_path / "rank.pid"
    code = (
        "from pathlib import Path\n"
        "from pnpscale.cluster.local import run_ranks\n"
        "from tests.toy_problem import sleepy_rank\n"
        f"run_ranks(2, sleepy_rank, (300.0, {str(pid_file)!r}), Path({str(tmp_path / 'logs')!r}), 1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, start_new_session=True)
    below: set[int] = set()
    try:
        end = time.monotonic() + 120
        while not all(Path(f"{pid_file}.{r}").is_file() for r in range(2)):
            assert proc.poll() is None and time.monotonic() < end, "the ranks never started"
            time.sleep(0.2)
        ranks = {int(Path(f"{pid_file}.{r}").read_text()) for r in range(2)}
        below = _descendants(proc.pid)
        assert ranks <= below and len(below) >= 4, below  # forkserver, resource tracker, 2 ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        end = time.monotonic() + 15
        while any(_alive(p) for p in below) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)], "processes outlived their launcher"
    finally:  # nothing left behind by a failing test either
        for p in [proc.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        proc.wait(timeout=10)


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _forkserver_preloading(launcher: subprocess.Popen, timeout_s: float = 120) -> int:
    """The pid of ``launcher``'s forkserver once it ignores SIGINT (``pnpscale.rank.forkserver``, its first
    preload, is in) and before torch is loaded (no ``libtorch`` mapped: the heavy preloads still import)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert launcher.poll() is None, "the command ended before its forkserver started"
        for pid in _descendants(launcher.pid):
            try:
                cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                status = (Path("/proc") / str(pid) / "status").read_text()
            except OSError:
                continue
            ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
            if b"multiprocessing.forkserver import main" in cmdline and ignored & (1 << (signal.SIGINT - 1)):
                with contextlib.suppress(OSError):
                    if "libtorch" in (Path("/proc") / str(pid) / "maps").read_text():
                        pytest.skip("torch was loaded before the test could look: no preload window to test")
                return pid
        time.sleep(0.02)
    pytest.fail("no forkserver preloading")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL of the launcher", "SIGINT to the process group"])
def test_2_a_stop_while_the_forkserver_preloads_leaves_no_process_and_no_traceback(tmp_path, how):
    """The launcher watch and the ignored SIGINT come first in RANK_PRELOAD: a launcher killed while torch
    imports takes the forkserver and the resource tracker with it within seconds (they used to live 8-21 s),
    and a Ctrl-C then prints no KeyboardInterrupt traceback from multiprocessing/forkserver.py."""
    proc = _cli("-m", "gpus=2", *TINY_2D, f"output.root={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                cwd=tmp_path)  # fmt: skip
    below: set[int] = set()
    try:
        server = _forkserver_preloading(proc)
        below = _descendants(proc.pid)
        assert server in below
        if how.startswith("SIGKILL"):
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=120)[0]  # until every process holding the pipe is gone
        end = time.monotonic() + 4
        while any(_alive(p) for p in below) and time.monotonic() < end:
            time.sleep(0.05)
        left = {p: _cmdline(p) for p in below if _alive(p)}
        assert not left, f"{left} outlived the command by 4 s"
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        if how.startswith("SIGINT"):
            assert proc.returncode == 130, out
    finally:
        for p in [proc.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.slow
def test_2_sigkill_of_a_sweep_leaves_no_process(tmp_path):
    # the same through the command a user runs: python -m pnpscale killed while its ranks iterate
    proc = _cli("-m", "gpus=2", *TINY_2D, "iterations=500", f"output.root={tmp_path}",
                f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)  # fmt: skip
    below: set[int] = set()
    try:
        lines: list[str] = []
        _read_until(proc, "iteration 2/", lines)  # the ranks are in their measured iterations
        below = _descendants(proc.pid)
        assert len(below) >= 4, below  # forkserver, resource tracker, 2 ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        end = time.monotonic() + 15
        while any(_alive(p) for p in below) and time.monotonic() < end:
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)], "processes outlived the sweep's command"
    finally:
        for p in [proc.pid, *below]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.slow
def test_1_sigint_between_points_records_reports_and_prints_the_resume_command(tmp_path):
    """SIGINT once the first of 3 points completed: exit 130; every point the sweep asked for is in the
    report, ``pnpscale.load`` and the summary line: complete, interrupted, or ``not_run`` with the reason."""
    import pnpscale

    sweep = tmp_path / "sweep"
    proc = _cli("-m", "gpus=1,2,4", *TINY_2D, f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    lines: list[str] = []
    _read_until(proc, "gpus=1: LB", lines)  # point 1 complete; point 2 about to start
    os.kill(proc.pid, signal.SIGINT)  # the command only, as `kill -INT` does
    out = "".join(lines) + proc.communicate(timeout=240)[0]
    assert proc.returncode == 130, out
    assert _no_survivor(proc.pid)
    runs = {read_run(d)["gpus"]: read_run(d) for d in sorted(p.parent for p in sweep.glob("**/run.json"))}
    assert sorted(runs) == [1, 2, 4], sorted(runs)  # every point has its record
    assert runs[1]["status"] == "complete"
    not_run = "not run: the sweep was interrupted (SIGINT) before this point started"
    said = "the point that was running is recorded as failed in its run folder"
    if runs[2]["status"] == "failed":  # the signal landed once point 2 had started
        assert runs[2]["error"].startswith("interrupted (SIGINT)")
        assert said in out, out[-3000:]
    else:  # between the points: no point was running, and no line says one was
        assert runs[2]["status"] == layout.STATUS_NOT_RUN and runs[2]["error"] == not_run, runs[2]
        assert said not in out, out[-3000:]
    assert runs[4]["status"] == layout.STATUS_NOT_RUN and runs[4]["error"] == not_run, runs[4]
    table = pnpscale.load(sweep).query("section == 'all'").set_index("gpus")
    assert sorted(table.index) == [1, 2, 4] and table.loc[4, "status"] == "not_run"
    assert table.loc[4, "error"] == not_run
    readme = (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()
    assert "missing (not_run)" in readme and f"- gpus=4: {not_run} (" in readme, readme
    summary = next((line for line in out.splitlines() if "3 sweep point(s): 1 complete, " in line), "")
    assert "gpus=4" in summary.split(" not run (")[-1], out[-3000:]
    assert f"python -m pnpscale -m gpus=1,2,4 {TINY_2D[0]}" in out and f"hydra.sweep.dir={sweep}" in out
    assert not list(sweep.glob(f"**/{layout.LOCK}"))  # no lock file left behind


def test_1_a_point_not_run_is_recorded_without_hiding_a_measurement(tmp_path, monkeypatch):
    """:func:`pnpscale.sweep.task.record_not_run`: an empty folder gets ``not_run`` with the reason; a complete
    run, and the point this process was running (its ``interrupted`` record), are left as they are; an earlier
    failure is replaced, its error kept in the text; ``pnpscale.load`` and the report list the point."""
    import pnpscale
    from pnpscale.core.record import start_record, write_failure, write_record
    from pnpscale.sweep import task
    from pnpscale.sweep.point import Point

    point = lambda cfg, d, cuda_devices=None: Point(spec("2d", "inference", cfg["gpus"]), "local", d, True)  # noqa: E731
    monkeypatch.setattr(task, "resolve_point", point)
    sweep = tmp_path / "sweep"
    p = lambda g: sweep / layout.point_subdir("2d", "inference", g)  # noqa: E731
    fake_run(p(1), "2d", "inference", {"gradient": [(1.0, 0.0)]})
    reason = "not run: the sweep was interrupted (SIGINT) before this point started"
    assert task.record_not_run({"gpus": 1}, p(1), reason) == "complete"
    assert read_run(p(1))["status"] == "complete"
    mine = start_record(spec("2d", "inference", 2), None).set(pid=os.getpid(), status="failed", error="interrupted")
    write_record(p(2), mine)
    assert task.record_not_run({"gpus": 2}, p(2), reason) == "failed" and read_run(p(2))["error"] == "interrupted"
    write_failure(p(8), spec("2d", "inference", 8), None, "boom: an earlier sweep")
    for g in (4, 8):
        assert task.record_not_run({"gpus": g}, p(g), reason) == layout.STATUS_NOT_RUN
        assert not (p(g) / layout.LOCK).exists()
    assert read_run(p(4))["error"] == reason and read_run(p(4))["status"] == "not_run"
    earlier = read_run(p(8))["error"]
    assert earlier.startswith(reason + " (the folder's earlier run, ") and "failed: boom" in earlier, earlier
    table = pnpscale.load(sweep).query("section == 'all'").set_index("gpus")
    assert table.loc[4, "status"] == "not_run" and table.loc[4, "error"] == reason
    assert table.loc[8, "status"] == "not_run" and table.loc[1, "status"] == "complete"


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 3.0])
def test_1_sigterm_in_the_first_moments_of_a_point_records_it_terminated(tmp_path, delay_s):
    """Right away, and 3 s in (the forkserver starting, ranks being handed over): exit 143, the point
    recorded terminated, no traceback after the last line (a rank that could not start because the
    launcher was gone used to print one: :mod:`pnpscale.rank.forkserver`)."""
    run_dir = tmp_path / "run"
    proc = _cli("gpus=2", *TINY_2D, f"output.root={tmp_path}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    lines: list[str] = []
    _read_until(proc, "2 rank(s), run folder", lines)
    time.sleep(delay_s)
    os.kill(proc.pid, signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=240)[0]  # until every process holding the pipe is gone
    assert proc.returncode == 143, out
    assert _no_survivor(proc.pid)
    assert "Traceback" not in out and "Error" not in out.split("pnpscale: terminated (SIGTERM)")[-1], out
    assert f"the point that was running is recorded as failed in its run folder {run_dir}" in out, out
    run = read_run(run_dir)
    assert run["status"] == "failed" and run["error"].startswith("terminated (SIGTERM)"), run["error"]
    assert not any((run_dir / t).exists() for t in layout.TABLES)
    assert f"hydra.run.dir={run_dir}" in out


@pytest.mark.slow
def test_1_sigterm_while_the_report_is_written_leaves_the_previous_report(tmp_path):
    sweep = tmp_path / "sweep"
    args = ("-m", "gpus=1", *TINY_2D, f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}")
    first = _cli(*args, cwd=tmp_path)
    out = first.communicate(timeout=240)[0]
    assert first.returncode == 0, out
    report = sweep / layout.REPORT_DIR
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    again = _cli(*args, cwd=tmp_path)  # resume: the point is skipped, the report rewritten
    lines: list[str] = []
    _read_until(again, "writing the report", lines)
    os.kill(again.pid, signal.SIGTERM)
    out = "".join(lines) + again.communicate(timeout=240)[0]
    assert again.returncode == 143, out
    assert sorted(p.name for p in report.iterdir()) == sorted(before)  # no staging folder, no file missing
    assert (report / layout.SUMMARY).read_bytes() == before[layout.SUMMARY]
    assert (report / layout.REPORT_README).read_bytes() == before[layout.REPORT_README]
    assert read_run(next(p.parent for p in sweep.glob("**/run.json")))["status"] == "complete"


def test_1_a_stop_swallowed_in_a_weakref_callback_is_raised_at_the_next_checkpoint(tmp_path):
    """A handler's exception raised inside a weakref callback is only "ignored" by Python: it is kept
    (silently) and raised again before a report is published and at the end of a command."""
    import weakref

    from pnpscale.core import signals

    class Obj:
        pass

    def callback(ref):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs here, inside the callback

    hook = sys.unraisablehook
    try:
        with signals.preserved():
            signals.install()
            obj = Obj()
            ref = weakref.ref(obj, callback)
            del obj  # the callback runs, and its Interrupted is swallowed by Python
            assert ref() is None and isinstance(signals.received(), signals.Interrupted)
            dest = tmp_path / "report"
            with pytest.raises(signals.Interrupted):
                layout.commit_files(dest, {"a.txt": lambda p: p.write_text("new")})
            assert not dest.exists()  # nothing published, no folder left
            with pytest.raises(signals.Interrupted, match=r"interrupted \(SIGINT\)"):
                signals.check()
    finally:
        signals._received.clear()
        sys.unraisablehook = hook


@pytest.mark.slow
def test_1_sigint_while_the_report_is_written_is_never_swallowed(tmp_path):
    """``python -m pnpscale.report`` stopped by SIGINT at several moments (its imports, the charts, the
    renames): exit 130 every time with one line, no traceback, no "Exception ignored"; the previous
    report complete and untouched, or the new one complete."""
    sweep = tmp_path / "sweep"
    for g in (1, 2):
        fake_run(sweep / layout.point_subdir("2d", "inference", g), "2d", "inference", {"gradient": [(1.0, 0.1)] * g})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-m", "pnpscale.report", str(sweep)], env=env, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr
    report = sweep / layout.REPORT_DIR
    stopped = 0
    for delay in (0.3, 1.0, 1.8, 2.6, 3.4):
        proc = subprocess.Popen([sys.executable, "-m", "pnpscale.report", str(sweep)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        time.sleep(delay)
        if proc.poll() is not None:  # done before the signal: nothing to check at this delay
            proc.communicate()
            continue
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if proc.returncode == -signal.SIGINT and not err and "report: " in out:
            # the report was written and announced, then the signal came while Python was finalizing (it puts
            # the default handlers back): a death by SIGINT after the work, the report complete (checked below)
            assert {layout.SUMMARY, layout.REPORT_README} <= {p.name for p in report.iterdir()}
            continue
        if proc.returncode == 0 and not err:  # the signal came once the report was published: ignored, as
            # documented (pnpscale.core.signals.published), the report complete
            assert {layout.SUMMARY, layout.REPORT_README} <= {p.name for p in report.iterdir()}
            pd.read_parquet(report / layout.SUMMARY)
            continue
        stopped += 1
        assert proc.returncode == 130, (delay, proc.returncode, err)
        assert "Traceback" not in err and "Exception ignored" not in err, (delay, err)
        assert len(err.strip().splitlines()) == 1 and "interrupted (SIGINT)" in err, (delay, err)
        # whenever it is true (a previous report exists here), the line says it is intact, at 1 s too
        assert "report not written, the previous one is intact" in err or "after the report was written" in err, err
        assert not list(report.glob(f"{layout.STAGING_PREFIX}*"))
        assert {layout.SUMMARY, layout.REPORT_README} <= {p.name for p in report.iterdir()}
        pd.read_parquet(report / layout.SUMMARY)  # whole, never half-written
    assert stopped >= 2, "the report finished before every signal: nothing was tested"


# ---------------------------------------------------------------------------------- 2. locks


def test_2_a_folder_in_use_is_refused_naming_the_holder_and_a_stale_lock_taken_over(tmp_path):
    from pnpscale.core.lock import Busy, FolderLock

    sweep = tmp_path / "sweep"
    with FolderLock(sweep):  # a first sweep holds the folder
        (sweep / "multirun.yaml").write_text("first sweep\n")
        second = run_cli("-m", "gpus=1", *TINY_2D, f"hydra.sweep.dir={sweep}", root=tmp_path, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"is in use by pid {os.getpid()} on host {socket.gethostname()} since " in second.stderr
        assert (sweep / "multirun.yaml").read_text() == "first sweep\n"
        assert not run_dirs(tmp_path)
        with pytest.raises(Busy, match=f"pid {os.getpid()}"):
            FolderLock(sweep).acquire()
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started_at": "2026-01-01T00:00:00+00:00"}
    (sweep / layout.LOCK).write_text(json.dumps(stale))  # its holder died without releasing it
    with FolderLock(sweep) as lock:
        assert lock.previous is not None and lock.previous.pid == stale["pid"]


def test_2_a_released_lock_leaves_no_file_and_no_race(tmp_path, monkeypatch):
    """Released, the lock file is gone (nothing left in the user's folder); a taker that opened the old
    file before its holder removed it, and locked it once released, finds the path no longer names it and
    takes the new file: at no moment do two processes hold the folder."""
    import fcntl

    from pnpscale.core import lock as lock_mod
    from pnpscale.core.lock import Busy, FolderLock

    folder = tmp_path / "run"
    with FolderLock(folder):
        assert json.loads((folder / layout.LOCK).read_text())["pid"] == os.getpid()
    assert not (folder / layout.LOCK).exists() and list(folder.iterdir()) == []

    first = FolderLock(folder).acquire()
    stale_fd = os.open(folder / layout.LOCK, os.O_RDWR)  # a taker opened the file while it was held
    first.release()  # removed while locked, then unlocked
    fcntl.flock(stale_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ... and got the lock of the removed file
    second = FolderLock(folder).acquire()  # the path's new file: free, taken
    real_open, opened = os.open, []

    def open_stale_first(path, flags, mode=0o777, **kw):  # the slow taker's view: its old descriptor
        if Path(path) == folder / layout.LOCK and not opened:
            opened.append(path)
            return os.dup(stale_fd)
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(lock_mod.os, "open", open_stale_first)
    with pytest.raises(Busy, match=f"pid {os.getpid()}"):  # locked the removed file, saw it, took the new one
        FolderLock(folder).acquire()
    assert opened  # the stale file was seen
    monkeypatch.undo()
    second.release()
    os.close(stale_fd)
    assert not (folder / layout.LOCK).exists()


def test_2_a_run_folder_in_use_is_refused_and_left_untouched(tmp_path):
    from pnpscale.core.lock import FolderLock

    run_dir = tmp_path / "run"
    with FolderLock(run_dir):
        (run_dir / layout.RUN_JSON).write_text('{"status": "running"}')
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text("- gpus=2\n")  # the holder's record
        proc = run_cli("gpus=1", "seed=5", *TINY_2D, f"hydra.run.dir={run_dir}", root=tmp_path, timeout=120)
        # refused by the pre-check, before Hydra writes .hydra/ or __main__.log: one line, exit 2
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(
            f"pnpscale: error: hydra.run.dir={run_dir}: is in use by pid {os.getpid()} on host {socket.gethostname()}"
        ), line
        assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- gpus=2\n"
        assert not (run_dir / "__main__.log").exists()
        # in a sweep, the point whose folder is held fails with one line; nothing of its folder is written
        sweep = tmp_path / "sweep"
        with FolderLock(sweep / "problem=2d/mode=inference/num_operators=4/gpus=1"):
            swept = run_cli("-m", "gpus=1", *TINY_2D, f"hydra.sweep.dir={sweep}", "report=false",
                            root=tmp_path, timeout=120)  # fmt: skip
        assert swept.returncode == 1, swept.stderr
        assert "is in use by pid" in swept.stdout + swept.stderr and "Traceback" not in swept.stderr
        # the failed sweep's end: one line naming every failed point and the command that re-runs them
        assert "Error executing job" not in swept.stderr and "HYDRA_FULL_ERROR" not in swept.stderr
        last = swept.stderr.strip().splitlines()[-1]
        assert last.startswith("pnpscale: error: 1 of 1 sweep point(s) failed "
                               "(problem=2d mode=inference num_operators=4 gpus=1); "), last  # fmt: skip
        assert "to re-run only the failed points: python -m pnpscale -m gpus=1 " in last
        assert not (sweep / "problem=2d/mode=inference/num_operators=4/gpus=1/.hydra").exists()
    assert (run_dir / layout.RUN_JSON).read_text() == '{"status": "running"}'


# ------------------------------------------------------------------------------ 3. full disk


def test_3_a_failure_is_recorded_on_a_full_disk(tmpfs):
    from pnpscale.core.record import reserve_space, start_record, write_failure, write_record

    run_dir = tmpfs / "run"
    run_dir.mkdir()
    s = spec("2d", "inference", 2)
    write_record(run_dir, start_record(s, {"x": "y" * 2000}).set(pid=os.getpid(), host=socket.gethostname()))
    reserve_space(run_dir)
    _fill(tmpfs)
    write_failure(run_dir, s, None, OSError(errno.ENOSPC, "No space left on device"))
    run = read_run(run_dir)
    assert run["status"] == "failed" and "No space left on device" in run["error"]


def test_3_no_room_at_all_gives_the_lock_block_to_the_record_or_says_so_in_one_line(tmpfs, capsys):
    """A full disk and no ``run.json`` yet (nothing to overwrite in place): the lock file's holder name is given
    up for the failed record; with no lock either, one line on stderr names the point, the folder and ENOSPC."""
    from pnpscale.core.lock import FolderLock
    from pnpscale.sweep.task import record_failure_or_say

    run_dir = tmpfs / "run"
    lock = FolderLock(run_dir).acquire()  # its holder name takes a block
    filler = _fill(tmpfs)
    s = spec("2d", "inference", 2)
    assert record_failure_or_say(run_dir, s, None, "OSError: [Errno 28] No space left on device", "gpus=2", lock)
    assert read_run(run_dir)["status"] == "failed" and "No space left" in read_run(run_dir)["error"]
    lock.release()
    assert capsys.readouterr().err == ""
    (run_dir / layout.RUN_JSON).unlink()
    filler.unlink()
    _fill(tmpfs)
    assert not record_failure_or_say(run_dir, s, None, "boom", "gpus=2")
    assert capsys.readouterr().err.splitlines() == [
        f"pnpscale: error: gpus=2: no status record could be written in {run_dir} (ENOSPC: No space left on "
        "device); the point failed"
    ]


def test_3_a_complete_run_whose_folder_hydra_cannot_rewrite_stays_complete(tmp_path):
    """Resuming on a full disk: Hydra cannot rewrite a skipped point's ``.hydra/``; its complete run is kept
    (never turned into a failure record), and the point counts as complete."""
    from hydra.core.utils import JobStatus

    from hydra_plugins.pnpscale_plugins.launcher import PnpscaleBasicLauncher

    run_dir = tmp_path / layout.point_subdir("2d", "inference", 1)
    fake_run(run_dir, "2d", "inference", {"gradient": [(1.0, 0.0)]})
    before = (run_dir / layout.RUN_JSON).read_bytes()
    full = OSError(errno.ENOSPC, "No space left on device")
    ret = PnpscaleBasicLauncher._unwritable(None, ["gpus=1"], None, run_dir, full)  # type: ignore[arg-type]
    assert ret.status == JobStatus.COMPLETED
    assert (run_dir / layout.RUN_JSON).read_bytes() == before


def test_3_a_failure_is_recorded_when_the_writer_hits_enospc(tmp_path, monkeypatch):
    from pnpscale.core import record

    s = spec("2d", "inference", 2)
    record.write_record(tmp_path, record.start_record(s, None))
    record.reserve_space(tmp_path)
    real, calls = layout.write_json, []

    def full_once(path, obj):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, obj)

    monkeypatch.setattr(layout, "write_json", full_once)
    record.write_failure(tmp_path, s, None, "interrupted (SIGINT): the ranks were stopped")
    assert read_run(tmp_path)["status"] == "failed" and not (tmp_path / layout.RESERVE).exists()


def test_3_a_running_record_is_overwritten_in_place_when_nothing_else_fits(tmp_path, monkeypatch):
    """No room for a new file at all (not even the short record): the ``running`` record is overwritten in
    place by the failed one (its blocks are already allocated), never left ``running``."""
    from pnpscale.core import record

    s = spec("2d", "inference", 2)
    record.write_record(tmp_path, record.start_record(s, {"x": "y" * 2000}).set(pid=os.getpid()))

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(layout, "write_json", full)
    record.write_failure(tmp_path, s, None, OSError(errno.ENOSPC, "No space left on device"))
    run = read_run(tmp_path)
    assert run["status"] == "failed" and "No space left on device" in run["error"]
    assert record.read_record(tmp_path).status == "failed"


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of ``request.param`` KiB (root only), to run a point on; skipped where it cannot be mounted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}k", "tmpfs", str(mnt)],
                      capture_output=True).returncode:  # fmt: skip
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", [16, 32, 40, 60, 320], indirect=True, ids=lambda k: f"{k}k")
def test_3_a_point_on_a_small_disk_is_recorded_truthfully(tmp_path, small_disk):
    """A 2-rank point on a 16, 32, 40, 60 or 320 KiB disk: complete (exit 0) or failed (exit 1) with the error in
    run.json, never ``running``; below the room a status record needs (16 KiB), refused before anything starts
    with one line naming the folder and ENOSPC (exit 1); no traceback, no '--- Logging error ---', no misleading
    JSON error; no table without its complete record; no rank left. (320 KiB completes: the reserve is sized to
    the disk.)"""
    from pnpscale.sweep.point import MIN_FREE_BYTES

    run_dir = small_disk / "run"
    disk = os.statvfs(small_disk)
    free = disk.f_bavail * disk.f_frsize
    proc = _cli("gpus=2", *TINY_2D, f"output.root={tmp_path}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    out = proc.communicate(timeout=240)[0]
    assert _no_survivor(proc.pid)
    for bad in ("Traceback", "Logging error", "Expecting value", "could not record"):
        assert bad not in out, out
    if free < MIN_FREE_BYTES:  # not even a status record would fit: nothing starts
        assert proc.returncode == 1, out
        assert out.strip().splitlines() == [
            f"pnpscale: error: {run_dir}: {free // 1024} KiB free on its disk, fewer than "
            f"the {MIN_FREE_BYTES // 1024} KiB a point needs to record its status (ENOSPC: No space left on device); "
            "nothing was started"
        ], out
        assert not run_dir.exists()
        return
    run = read_run(run_dir)
    assert run["status"] in ("complete", "failed"), run["status"]
    assert proc.returncode == (0 if run["status"] == "complete" else 1), out
    if run["status"] == "failed":
        assert "No space left" in run["error"] or "no space left" in run["error"], run["error"]
        assert not any((run_dir / t).exists() for t in layout.TABLES)
    if disk.f_blocks * disk.f_frsize >= 300 * 1024:
        assert run["status"] == "complete", run["error"]
    assert not (run_dir / layout.RESERVE).exists() and not (run_dir / layout.LOCK).exists()


@pytest.mark.slow
def test_3_a_full_point_disk_in_a_sweep_is_said_and_the_others_run(tmp_path):
    """A sweep whose gpus=2 folder is a full disk (not even its status record fits): one line on stderr naming
    the point, the folder and ENOSPC; gpus=1 runs and completes, the report is written and lists gpus=2; exit 1."""
    sweep = tmp_path / "sweep"
    with full_point_folder(sweep) as (full, filler):
        proc = _cli("-m", "gpus=1,2", *TINY_2D, f"output.root={tmp_path}", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
        out = proc.communicate(timeout=240)[0]
        assert proc.returncode == 1, out
        assert _no_survivor(proc.pid)
        said = [line for line in out.splitlines() if line.startswith("pnpscale: error: ")]
        assert said[0] == (f"pnpscale: error: problem=2d mode=inference num_operators=4 gpus=2: no status record "
                           f"could be written in {full} (ENOSPC: No space left on device); the point failed"), out
        assert len(said) == 2 and said[1].startswith("pnpscale: error: 1 of 2 sweep point(s) failed (gpus=2 "), out
        assert "Traceback" not in out and "Logging error" not in out
        (done,) = [p.parent for p in sweep.glob("**/run.json")]
        assert read_run(done)["gpus"] == 1 and read_run(done)["status"] == "complete"
        assert "2 sweep point(s): 1 complete, 1 failed" in out
        readme = (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()
        assert "missing (incomplete)" in readme, readme
        assert sorted(p.name for p in full.iterdir()) == [filler.name]  # nothing half-written, no lock left


def test_3_a_report_on_a_full_disk_fails_in_one_line_and_keeps_the_previous_one(tmpfs, capsys):
    from pnpscale.results.report import main

    sweep = tmpfs / "sweep"
    fake_run(sweep / layout.point_subdir("2d", "inference", 1), "2d", "inference", {"gradient": [(1.0, 0.0)]})
    assert main([str(sweep)]) == 0
    report = sweep / layout.REPORT_DIR
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    _fill(tmpfs)
    capsys.readouterr()
    assert main([str(sweep)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pnpscale.report: error: report not written (OSError"), err
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before


def test_8_a_failed_report_leaves_no_report_folder(tmp_path, capsys, monkeypatch):
    from pnpscale.results import report

    sweep = tmp_path / "sweep"
    fake_run(sweep / layout.point_subdir("2d", "inference", 1), "2d", "inference", {"gradient": [(1.0, 0.0)]})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "markdown", full)
    assert report.main([str(sweep)]) == 1
    assert "report not written (OSError" in capsys.readouterr().err
    assert not (sweep / layout.REPORT_DIR).exists()
    # --out into folders that do not exist yet: none of them is left behind either
    assert report.main([str(sweep), "--out", str(tmp_path / "new" / "deeper" / "report")]) == 1
    assert not (tmp_path / "new").exists()


def test_3_a_running_record_whose_process_is_gone_is_reported_failed(tmp_path):
    import pnpscale
    from pnpscale.core.record import start_record, write_record

    sweep = tmp_path / "sweep"
    fake_run(sweep / layout.point_subdir("2d", "inference", 1), "2d", "inference", {"gradient": [(1.0, 0.0)]})
    killed = sweep / layout.point_subdir("2d", "inference", 2)
    write_record(killed, start_record(spec("2d", "inference", 2), None).set(pid=_dead_pid(), host=socket.gethostname()))
    alive = sweep / layout.point_subdir("2d", "inference", 4)
    write_record(alive, start_record(spec("2d", "inference", 4), None).set(pid=os.getpid(), host=socket.gethostname()))
    table = pnpscale.load(sweep).set_index("gpus")
    assert table.loc[2, "status"] == "failed" and table.loc[2, "error"].startswith("failed (process gone): pid ")
    assert table.loc[4, "status"] == "running"  # this very process: still alive


# ------------------------------------------------------------------------- 4. damaged folders


def test_4_damaged_run_folders_are_reported_one_by_one(tmp_path, capsys):
    import pnpscale
    from pnpscale.results.report import main

    sweep = tmp_path / "sweep"
    p = lambda g: sweep / layout.point_subdir("2d", "inference", g)  # noqa: E731
    fake_run(p(1), "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]})
    fake_run(p(2), "2d", "inference", {"gradient": [(0.6, 0.2)] * 2, "denoiser": [(1.6, 0.1)] * 2})
    fake_run(p(4), "2d", "inference", {"gradient": [(0.4, 0.2)] * 4, "denoiser": [(0.9, 0.1)] * 4})
    fake_run(p(8), "2d", "inference", {"gradient": [(0.3, 0.2)] * 8, "denoiser": [(0.6, 0.1)] * 8})
    # an older version's folder: two columns it did not write (and no digests)
    _undigested(p(8))
    old = pd.read_parquet(p(8) / layout.SECTIONS).drop(columns=["main_transfer_s", "other_payload_bytes"])
    old.to_parquet(p(8) / layout.SECTIONS, index=False)
    data = (p(2) / layout.SECTIONS).read_bytes()
    (p(2) / layout.SECTIONS).write_bytes(data[: len(data) // 2])  # truncated
    (p(4) / layout.RUN_JSON).write_text("{garbage")

    table = pnpscale.load(sweep)
    all_ = table[table["section"] == "all"].set_index("gpus")
    assert all_.loc[1, "status"] == "complete" and all_.loc[8, "status"] == "complete"
    assert pd.isna(all_.loc[8, "main_transfer_s"])  # missing column: NA, not a KeyError
    assert all_.loc[2, "status"] == "unreadable"
    assert all_.loc[2, "error"].startswith(f"unreadable: {p(2) / layout.SECTIONS}: ")
    assert all_.loc[4, "status"] == "unreadable"
    assert all_.loc[4, "error"].startswith(f"unreadable: {p(4) / layout.RUN_JSON}: invalid JSON")

    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert f"gpus=2: unreadable: {p(2) / layout.SECTIONS}: " in out and f"gpus=4: unreadable: {p(4)}" in out
    readme = (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()
    assert "missing (unreadable)" in readme
    assert main([str(sweep), "--strict"]) == 1
    assert "2 point(s) unreadable (--strict)" in capsys.readouterr().err


DAMAGES = {
    # label -> (the variant folder and GPU count it damages, how, the file named, the reason's start)
    "truncated ranks": (("all_reduce", 2), lambda d: _truncate(d / layout.RANKS), layout.RANKS, "Could not open"),
    "truncated collectives": (("all_gather", 2), lambda d: _truncate(d / layout.COLLECTIVES), layout.COLLECTIVES,
                              "Could not open"),
    "gpus abc": (("all_reduce", 4), lambda d: _edit_record(d, gpus="abc"), layout.RUN_JSON,
                 "gpus is 'abc' (str): must be an integer"),
    "operators per rank": (("all_gather", 4), lambda d: _edit_record(d, assignment={"operators_per_rank": ["x"]}),
                           layout.RUN_JSON, "assignment.operators_per_rank is ['x']: must be an array of integers"),
    "nccl log": (("all_gather", 1), lambda d: (d / layout.NCCL_DIR / "rank0.log").mkdir(parents=True),
                 f"{layout.NCCL_DIR}/rank0.log", "Is a directory"),
}  # fmt: skip


def _undigested(run_dir: Path) -> None:
    """Drop run.json's digests (a folder written before pnpscale recorded them), so that the content checks
    below the digests answer for an edited table (with them, the digest names the file first:
    :func:`test_4_an_edited_table_or_assignment_is_caught_by_its_digest`)."""
    doc = json.loads((run_dir / layout.RUN_JSON).read_text())
    doc.pop("digests", None)
    (run_dir / layout.RUN_JSON).write_text(json.dumps(doc))


def _truncate(path: Path) -> None:
    _undigested(path.parent)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_record(run_dir: Path, **fields) -> None:
    doc = json.loads((run_dir / layout.RUN_JSON).read_text())
    doc.update(fields)
    (run_dir / layout.RUN_JSON).write_text(json.dumps(doc))


def test_4_every_damaged_file_of_a_run_folder_is_one_unreadable_point(tmp_path, capsys):
    """ranks, collectives, run.json of the wrong shape, NCCL logs: each one point, the others reported."""
    import pnpscale
    from pnpscale.results.report import main
    from tests.test_compare import _dir, write_collective_sweep

    sweep = write_collective_sweep(tmp_path / "sweep")
    damaged = {}
    for label, ((coll, g), damage, name, reason) in DAMAGES.items():
        d = _dir(sweep, "2d", g, coll)
        damage(d)
        damaged[(f"denoiser_collective={coll}", g)] = (label, f"unreadable: {d / name}: {reason}")

    table = pnpscale.load(sweep)  # never raises for one damaged folder
    all_ = table[table["section"] == "all"].set_index(["variant", "gpus"])
    assert len(all_) == 6 and not all_.index.duplicated().any()
    for key, (label, error) in damaged.items():
        assert all_.loc[key, "status"] == "unreadable", label
        assert all_.loc[key, "error"].startswith(error), (label, all_.loc[key, "error"])
    assert all_.loc[("denoiser_collective=all_reduce", 1), "status"] == "complete"

    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    for label, error in damaged.values():
        assert error in out, label
    readme = (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()
    series, side_by_side = readme.split("## Side by side")
    assert series.count("missing (unreadable)") == side_by_side.count("missing (unreadable)") == len(DAMAGES)
    assert main([str(sweep), "--strict"]) == 1
    assert f"{len(DAMAGES)} point(s) unreadable (--strict)" in capsys.readouterr().err


def _edit_table(path: Path, edit) -> None:
    _undigested(path.parent)
    edit(pd.read_parquet(path)).to_parquet(path, index=False)


def _edit_nested(run_dir: Path, path: str, value) -> None:
    doc = json.loads((run_dir / layout.RUN_JSON).read_text())
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[part]
    node[last] = value
    (run_dir / layout.RUN_JSON).write_text(json.dumps(doc))


ONE_SCHEMA = {
    # label -> (how the 2-rank point is damaged, the file named, the reason's start)
    "ranks without rank": (lambda d: _edit_table(d / layout.RANKS, lambda t: t.drop(columns="rank")),
                           layout.RANKS, "missing column(s) rank"),
    "collectives without seq": (lambda d: _edit_table(d / layout.COLLECTIVES, lambda t: t.drop(columns="seq")),
                                layout.COLLECTIVES, "missing column(s) seq"),
    "rank as text": (lambda d: _edit_table(d / layout.RANKS, lambda t: t.assign(rank=t["rank"].astype(str))),
                     layout.RANKS, "column rank is "),
    "a rank missing": (lambda d: _edit_table(d / layout.RANKS, lambda t: t[t["rank"] != 1]),
                       layout.RANKS, "ranks [0], expected 0..1 (gpus=2)"),
    "one operator entry for 2 ranks": (lambda d: _edit_nested(d, "assignment.operators_per_rank", [4]),
                                       layout.RUN_JSON, "assignment.operators_per_rank is [4]: 1 entry for gpus=2"),
    "anomalies not objects": (lambda d: _edit_record(d, anomalies="x"), layout.RUN_JSON,
                              "anomalies is 'x': must be an array of objects"),
    "an anomaly without count": (lambda d: _edit_record(d, anomalies=[{"kind": "k", "count": "x"}]), layout.RUN_JSON,
                                 "anomalies[0].count is 'x': must be an integer"),
    "spec.sizes not an object": (lambda d: _edit_nested(d, "spec.sizes", "big"), layout.RUN_JSON,
                                 "spec.sizes is 'big': must be an object"),
    "hosts not strings": (lambda d: _edit_record(d, hosts=[1]), layout.RUN_JSON,
                          "hosts is [1]: must be an array of strings"),
    "metrics.sections an array": (lambda d: _edit_nested(d, "metrics.sections", []), layout.RUN_JSON,
                                  "metrics.sections is []: must be an object"),
    # the invariants the writer checks, re-checked on read by its own functions, and run.json against the tables
    "compute x10 (C + T + W != S)": (lambda d: _edit_last(d / layout.SECTIONS, "compute_s", lambda v: v * 10),
                                     layout.SECTIONS, "iteration 1 section 'denoiser': compute + transfer + wait = "),
    "negative wait": (lambda d: _edit_last(d / layout.SECTIONS, "wait_s", lambda v: -1.0), layout.SECTIONS,
                      "iteration 1 section 'denoiser': wait_s = -1 s is negative"),
    "compute above its maximum": (lambda d: _edit_table(d / layout.SECTIONS, lambda t: t.assign(
        compute_s=t["compute_s"] + 1, section_s=t["section_s"] + 1)), layout.SECTIONS,
        "iteration 0 section 'gradient': compute_s = 1.4 s exceeds compute_max_s = 0.4 s"),
    "collectives past the section": (lambda d: _edit_last(d / layout.RANKS, "comm_s", lambda v: 10.0), layout.RANKS,
                                     "iteration 1 section 'denoiser' rank 1: collectives take 10 s of a 1.6 s section"),
    "sections not the ranks decomposed": (lambda d: _edit_last(d / layout.RANKS, "section_s", lambda v: v * 2),
                                          layout.SECTIONS, "iteration 1 section 'denoiser': section_s = 1.6 s, but "
                                          "the mean over ranks of the ranks table is 2.4 s"),
    "metrics.lb edited": (lambda d: _edit_nested(d, "metrics.lb", 0.1), layout.RUN_JSON,
                          "metrics.lb = 0.1, the tables give 1 (run.json's metrics are computed from them)"),
    "a section total edited": (lambda d: _edit_nested(d, "metrics.sections.gradient.compute_total_s", 99.0),
                               layout.RUN_JSON, "metrics.sections.gradient.compute_total_s = 99, the tables give 0.4"),
}  # fmt: skip


def _edit_last(path: Path, column: str, change) -> None:
    """Change ``column`` of the table's last row of iteration 1, section ``denoiser`` (rank 1 in ``ranks``)."""
    _undigested(path.parent)
    t = pd.read_parquet(path)
    rows = t.index[(t["iteration"] == 1) & (t["section"] == "denoiser") & ((t["rank"] == 1) if "rank" in t else True)]
    t.loc[rows[-1], column] = change(t.loc[rows[-1], column])
    t.to_parquet(path, index=False)


@pytest.mark.parametrize("label", list(ONE_SCHEMA))
def test_4_a_damaged_point_is_unreadable_for_load_and_the_report_alike(tmp_path, capsys, label):
    """One schema (:func:`pnpscale.core.record.check_nested`, the required columns of
    :mod:`pnpscale.columns`) for ``pnpscale.load`` and the report: the damaged point is ``unreadable`` in
    both with the same reason, the other point is reported, the report is written."""
    import pnpscale
    from pnpscale.results.report import main

    sweep = tmp_path / "sweep"
    p = lambda g: sweep / layout.point_subdir("2d", "inference", g)  # noqa: E731
    fake_run(p(1), "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]})
    fake_run(p(2), "2d", "inference", {"gradient": [(0.6, 0.2)] * 2, "denoiser": [(1.6, 0.1)] * 2})
    damage, name, reason = ONE_SCHEMA[label]
    damage(p(2))
    error = f"unreadable: {p(2) / name}: {reason}"

    all_ = pnpscale.load(sweep).query("section == 'all'").set_index("gpus")
    assert all_.loc[1, "status"] == "complete"
    assert all_.loc[2, "status"] == "unreadable" and all_.loc[2, "error"].startswith(error), all_.loc[2, "error"]
    capsys.readouterr()
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert f"gpus=2: {error}" in out, out
    readme = (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()
    assert "missing (unreadable)" in readme and "| complete " in readme  # --strict's exit 1: the tests above


EDITS = {
    # label -> (how the 2-rank point is edited, the file named, the reason's start); run.json's digests kept
    "collectives' durations halved": (
        lambda d: (lambda t: t.assign(duration_s=t["duration_s"] * 0.5).to_parquet(d / layout.COLLECTIVES,
                                                                                   index=False))(
            pd.read_parquet(d / layout.COLLECTIVES)), layout.COLLECTIVES, "edited since the run wrote it: its sha256"),
    "assignment [2,2] -> [3,1]": (lambda d: _edit_nested(d, "assignment.operators_per_rank", [3, 1]), layout.RUN_JSON,
                                  "assignment {'operators_per_rank': [3, 1]"),
    "sections rewritten identical": (lambda d: pd.read_parquet(d / layout.SECTIONS).to_parquet(
        d / layout.SECTIONS, index=False, compression="gzip"), layout.SECTIONS, "edited since the run wrote it"),
    "ranks removed": (lambda d: (d / layout.RANKS).unlink(), layout.RANKS, "missing (no such file)"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(EDITS))
def test_4_an_edited_table_or_assignment_is_caught_by_its_digest(tmp_path, capsys, label):
    """run.json holds a sha256 per table and of the assignment (written last, with the record): an edit the
    content checks cannot see (durations x0.5 keep every invariant; [2,2] -> [3,1] is a valid assignment)
    makes the point unreadable, naming the file, in ``load`` and the report alike."""
    import pnpscale
    from pnpscale.core.record import read_record
    from pnpscale.results.report import main

    sweep = tmp_path / "sweep"
    p = lambda g: sweep / layout.point_subdir("2d", "inference", g)  # noqa: E731
    fake_run(p(1), "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]})
    fake_run(p(2), "2d", "inference", {"gradient": [(0.6, 0.2)] * 2, "denoiser": [(1.6, 0.1)] * 2}, operators=4)
    digests = read_record(p(2)).digests
    assert digests["algorithm"] == "sha256" and set(digests["files"]) == set(read_record(p(2)).files)
    assert read_record(p(2)).assignment["operators_per_rank"] == [2, 2]
    assert pnpscale.load(sweep).query("section == 'all'")["status"].eq("complete").all()  # as written: complete
    edit, name, reason = EDITS[label]
    edit(p(2))
    error = f"unreadable: {p(2) / name}: {reason}"

    all_ = pnpscale.load(sweep).query("section == 'all'").set_index("gpus")
    assert all_.loc[1, "status"] == "complete"
    assert all_.loc[2, "status"] == "unreadable" and all_.loc[2, "error"].startswith(error), all_.loc[2, "error"]
    if label == "collectives' durations halved":  # the report reads through the same check (one report: ~6 s)
        capsys.readouterr()
        assert main([str(sweep)]) == 0
        out = capsys.readouterr().out
        assert f"gpus=2: {error}" in out, out
        assert "missing (unreadable)" in (sweep / layout.REPORT_DIR / layout.REPORT_README).read_text()


def test_4_a_rewritten_record_keeps_the_digests_of_the_tables_as_written(tmp_path):
    """The digests are taken once, by the write that makes a record complete: a later rewrite (the SLURM
    block, :func:`pnpscale.core.record.update_record`) after a table was edited does not bless the edit."""
    from pnpscale.core.record import check_digests, read_record, update_record

    d = tmp_path / "run"
    fake_run(d, "2d", "inference", {"gradient": [(0.6, 0.2)] * 2, "denoiser": [(1.6, 0.1)] * 2})
    before = read_record(d).digests
    (d / layout.COLLECTIVES).write_bytes((d / layout.COLLECTIVES).read_bytes() + b"\0")
    update_record(d, slurm={"job_id": "1"})
    assert read_record(d).digests == before
    path, reason = check_digests(d, read_record(d))
    assert path == d / layout.COLLECTIVES and reason.startswith("edited since the run wrote it"), reason


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"gpus": "abc"}, "gpus is 'abc' (str): must be an integer"),
        ({"gpus": True}, "gpus is True (bool): must be an integer"),
        ({"gpus": 0}, "gpus is 0: must be >= 1"),
        ({"problem": 2}, "problem is 2 (int): must be a string"),
        ({"mode": ["inference"]}, "mode is ['inference'] (list): must be a string"),
        ({"status": None}, "no status"),
        ({"spec": "x"}, "spec is 'x' (str): must be an object"),
        ({"assignment": {"num_tiles": 1.5}}, "assignment.num_tiles is 1.5: must be an integer"),
    ],
)
def test_4_run_record_refuses_wrong_typed_fields(tmp_path, fields, message):
    from pnpscale.core.record import RecordError, read_record

    d = tmp_path / "run"
    fake_run(d, "2d", "inference", {"gradient": [(1.0, 0.0)], "denoiser": [(3.0, 0.0)]})
    _edit_record(d, **fields)
    with pytest.raises(RecordError) as info:
        read_record(d)
    assert str(info.value) == f"{d / layout.RUN_JSON}: {message}"


# ----------------------------------------------------------------------- 5. command line


@pytest.fixture
def read_only_dir(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        return None
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_5_command_line_faults_exit_2_with_one_line(tmp_path, read_only_dir):
    (tmp_path / "a_file").write_text("x")
    cases = [
        ("hydra.run.dir=/proc/pnpscale", "gpus=1"),
        (f"hydra.run.dir={tmp_path / 'a_file'}", "gpus=1"),
        ("-m", f"hydra.sweep.dir={tmp_path / 'a_file' / 'sub'}", "gpus=1"),
        ("-m", "gpus=1,2", "--cfg", "job"),
        ("gpus=1,2",),
    ]
    if read_only_dir is not None:
        cases.append(("-m", f"hydra.sweep.dir={read_only_dir / 'sweep'}", "gpus=1"))
    for args in cases:
        proc = run_cli(*args, *TINY_2D, root=tmp_path, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith("pnpscale: error: "), (args, proc.stderr)
    assert "add -m" in proc.stderr if args == ("gpus=1,2",) else True


BAD_INPUTS = {
    # label -> (the command line, the start of its one line)
    "nccl without CUDA": (("gpus=2", "dist.backend=nccl"), "dist.backend=nccl: this machine has no CUDA device"),
    "nccl without CUDA, a sweep": (("-m", "gpus=1,2", "dist.backend=nccl"), "invalid sweep, nothing was started"),
    "a problem class that does not import": (("gpus=2", "problem.impl=nonexistent.module:Cls"),
                                             "problem.impl=nonexistent.module:Cls: cannot import nonexistent.module"),
    "the sweep folder as a point's folder": (("-m", "gpus=1", "hydra.sweep.subdir=."),
                                             "hydra.sweep.subdir=.: must name a sub-folder of the sweep folder"),
    "a training key in an inference sweep": (("-m", "gpus=1,2", "problem.unroll=3"),
                                             "invalid sweep, nothing was started"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(BAD_INPUTS))
def test_5_bad_input_is_refused_before_any_rank_starts(tmp_path, label):
    """nccl on a machine without CUDA, a problem class that cannot be imported, ``hydra.sweep.subdir=.``:
    exit 2, ``pnpscale: error:`` lines only (no traceback), no rank started, no run folder."""
    if label.startswith("nccl") and _cuda_devices():
        pytest.skip("this machine has CUDA: nccl is allowed")
    args, first = BAD_INPUTS[label]
    proc = run_cli(*args, *TINY_2D, f"hydra.sweep.dir={tmp_path / 'sweep'}", root=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[0] == f"pnpscale: error: {first}" or lines[0].startswith(f"pnpscale: error: {first}"), lines
    assert all(line.startswith("pnpscale: error: ") for line in lines), lines
    assert "Traceback" not in proc.stderr + proc.stdout and "[rank" not in proc.stdout
    assert not run_dirs(tmp_path) and not list(tmp_path.glob("**/logs"))
    if label == "a training key in an inference sweep":
        line = lines[1]
        assert "problem.unroll=3: takes effect only in mode=training; the sweep's points are mode=inference" in line
        assert "(sweep points: gpus=1 problem.unroll=3" in line, lines


def test_5_a_single_run_with_a_key_its_mode_ignores_is_refused_before_hydra():
    from pnpscale.sweep.cli import CommandLineError, check_single_point

    with pytest.raises(CommandLineError) as hit:
        check_single_point(["gpus=1", "problem.unroll=3"])
    assert hit.value.problems == [
        "problem.unroll=3: takes effect only in mode=training; this point is mode=inference: drop it, "
        "or run mode=training"
    ]


def test_5_a_single_run_says_that_hydra_sweep_dir_is_not_where_it_writes(tmp_path, monkeypatch, capsys):
    """``hydra.sweep.dir`` on a single run (no ``-m``): accepted (scripts give both folders), said in one note
    naming where the run writes; with ``-m`` nothing is said."""
    from pnpscale.sweep.cli import check_single_point

    monkeypatch.chdir(tmp_path)
    check_single_point(["gpus=1", f"hydra.sweep.dir={tmp_path / 's'}", f"hydra.run.dir={tmp_path / 'r'}"])
    assert capsys.readouterr().err == (
        f"pnpscale: note: hydra.sweep.dir={tmp_path / 's'} applies to sweeps (-m) only: this single run writes to "
        f"hydra.run.dir ({tmp_path / 'r'})\n"
    )
    check_single_point(["-m", "gpus=1,2", f"hydra.sweep.dir={tmp_path / 's'}"])
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "s").exists() and not (tmp_path / "r").exists()


def _cuda_devices() -> int:
    from pnpscale.cluster.resources import cuda_device_count

    return cuda_device_count()


@pytest.mark.slow
def test_5_a_read_only_working_folder_with_explicit_output_folders(tmp_path, read_only_dir):
    """``cd <read-only> && python -m pnpscale ... hydra.sweep.dir=<writable>`` (or ``hydra.run.dir``) runs:
    the default ``output.root`` (``outputs``, relative to the working folder) is not used."""
    if read_only_dir is None:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    sweep, run = f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra.run.dir={tmp_path / 'run'}"
    for args in (("-m", "gpus=1", sweep), ("gpus=1", run)):
        proc = subprocess.run([sys.executable, "-m", "pnpscale", *args, *TINY_2D], cwd=read_only_dir, env=env,
                              capture_output=True, text=True, timeout=240)  # fmt: skip
        assert proc.returncode == 0, (args, proc.stderr[-2000:])
    assert read_run(tmp_path / "run")["status"] == "complete"
    assert read_run(next(p.parent for p in (tmp_path / "sweep").glob("**/run.json")))["status"] == "complete"
    assert (tmp_path / "sweep" / layout.REPORT_DIR / layout.REPORT_README).is_file()


def test_5_help_is_quick_with_a_big_folder_in_the_repository_root(tmp_path):
    import shutil

    for name in ("pnpscale", "hydra_plugins", "conf", "sweeps"):  # a checkout's layout
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def help_run() -> tuple[subprocess.CompletedProcess[str], float]:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pnpscale", "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        return proc, time.monotonic() - t0

    help_run()  # compiles the copied package: not part of either figure
    first, plain = help_run()  # the same checkout without the big folder: the load this machine is under now
    assert first.returncode == 0, first.stderr
    venv = tmp_path / ".venv"
    for i in range(300):  # a fake virtual environment: many folders with yaml files
        d = venv / "lib" / f"pkg{i}" / "conf" / "group"
        d.mkdir(parents=True)
        (d / "opt.yaml").write_text("a: 1\n")
    proc, elapsed = help_run()
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "sweeps: comm_inference_2d" in groups and ".venv" not in groups and "conf/" not in groups
    assert "Examples:" in proc.stdout and "gpus: 1" in proc.stdout
    # side by side, not against a wall-clock figure (a shared CI machine moves the absolute time by 2x): the
    # big folder may add at most half the plain time and a second
    assert elapsed < 1.5 * plain + 1.0, f"--help took {elapsed:.1f} s with the big folder, {plain:.1f} s without"


# --------------------------------------------------------------------------- 6. hung rank


@pytest.mark.slow
def test_6_a_hung_rank_is_named_with_the_timeout_that_fired(tmp_path):
    proc = run_cli("gpus=2", *TINY_2D, "inject.rank=1", "inject.section=denoiser", "inject.delay_s=120",
                   "dist.timeout_s=5", root=tmp_path, timeout=240)  # fmt: skip
    assert proc.returncode == 1
    assert "rank 1 did not arrive within dist.timeout_s=5 s: last seen in section 'denoiser' of iteration 0" in (
        proc.stderr
    ), proc.stderr[-2000:]
    (d,) = run_dirs(tmp_path)
    assert read_run(d)["status"] == "failed" and "rank 1 did not arrive" in read_run(d)["error"]


def _rank_pid(run_dir: Path, rank: int, timeout_s: float = 120) -> int:
    """The pid of rank ``rank`` of a running point, from its heartbeat, once it entered its first iteration."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            beat = json.loads(layout.progress_file(run_dir, rank).read_text())
            if int(beat.get("iteration", -1)) >= 1:
                return int(beat["pid"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    pytest.fail(f"rank {rank} of {run_dir} never reached iteration 1")


SLOW_2D = [*TINY_2D, "iterations=40", "warmup=1", "inject.rank=0", "inject.section=gradient", "inject.delay_s=0.3"]


@pytest.mark.slow
def test_6_a_killed_rank_is_blamed_on_itself(tmp_path):
    """SIGKILL of rank 1 (no error file: its peer's 'Connection reset by peer' may be seen first) is
    reported as rank 1's failure; the point is recorded failed, no process survives."""
    run_dir = tmp_path / "run"
    proc = _cli("gpus=2", *SLOW_2D, f"output.root={tmp_path}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    os.kill(_rank_pid(run_dir, 1), signal.SIGKILL)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, out
    assert _no_survivor(proc.pid)
    run = read_run(run_dir)
    assert run["status"] == "failed" and "rank 1 failed: " in run["error"].splitlines()[0], run["error"]
    assert "Traceback" not in out


@pytest.mark.slow
def test_6_a_killed_rank_among_four_is_blamed_on_itself_not_on_its_peers(tmp_path, monkeypatch):
    """4 real ranks through the launcher: rank 2 is SIGKILLed, ranks 0 and 3 then fail in a gloo recv from it
    ("Connection closed/reset by peer"), rank 1 is stopped by the agent: two ranks left no error, and torch
    elastic may name rank 0. Blamed on rank 2, the rank the launcher saw end first, by its signal.

    The agent looks at its ranks every 1.5 s here, not 0.1 s: with 0.1 s a loaded machine (a CI run) let it
    stop ranks 0 and 3 before they wrote their errors, and the case this test is for (peers' errors that
    echo the lost rank, all seen at once) did not happen."""
    from pnpscale.cluster import local
    from pnpscale.cluster.exits import pidfd_exit_status
    from pnpscale.cluster.local import RankFailed, run_ranks
    from tests.toy_problem import dying_rank

    monkeypatch.setattr(local, "MONITOR_INTERVAL_S", 1.5)

    logs = tmp_path / "logs"
    with pytest.raises(RankFailed) as hit:
        run_ranks(4, dying_rank, (2, [0, 3], str(logs)), logs, 1)
    failed = hit.value
    assert failed.rank == 2, (str(failed), failed.failures)
    lost = [m for r, m in failed.failures.items() if r in (0, 3)]
    assert lost and all("by peer" in m for m in lost), failed.failures  # the peers' real gloo errors
    probe = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    fd = os.pidfd_open(probe.pid)
    probe.kill()
    probe.wait()
    if pidfd_exit_status(fd) is not None:  # the kernel gives the status (Linux >= 6.15): its signal is named
        assert str(failed).startswith("rank 2 failed: Signal 9 (SIGKILL)"), str(failed)
    os.close(fd)


@pytest.mark.slow
def test_6_a_stopped_rank_is_named_within_the_timeout_and_stopped(tmp_path):
    """A rank stopped by SIGSTOP under ``dist.timeout_s=5``: named within seconds of the timeout (the elastic
    agent's SIGTERM cannot end a stopped process: it is continued once a rank failed), nothing survives."""
    run_dir = tmp_path / "run"
    proc = _cli("gpus=2", *SLOW_2D, "dist.timeout_s=5", f"output.root={tmp_path}", f"hydra.run.dir={run_dir}",
                cwd=tmp_path)  # fmt: skip
    pid = _rank_pid(run_dir, 1)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    out = proc.communicate(timeout=240)[0]
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, out
    assert _no_survivor(proc.pid)
    run = read_run(run_dir)
    assert run["status"] == "failed", run["status"]
    assert "rank 1 did not arrive within dist.timeout_s=5 s" in run["error"].splitlines()[0], run["error"]
    assert elapsed < 5 + 12, f"named after {elapsed:.1f} s"


# ---------------------------------------------------------------- 7. paths and Markdown


def test_7_paths_that_leave_the_folder_are_refused_and_report_text_is_escaped(tmp_path):
    for args in (("hydra.job.name=../../x", "gpus=1"), ("-m", "hydra.sweep.subdir=../../x", "gpus=1")):
        proc = run_cli(*args, *TINY_2D, root=tmp_path, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("pnpscale: error: hydra."), proc.stderr
    assert not (tmp_path.parent / "x").exists() and not (tmp_path / "x").exists()

    from pnpscale.core.record import write_failure
    from pnpscale.results.report import write_report

    sweep = tmp_path / "sweep"
    fake_run(sweep / layout.point_subdir("2d", "inference", 1), "2d", "inference", {"gradient": [(1.0, 0.0)]})
    run2 = sweep / layout.point_subdir("2d", "inference", 2)
    write_failure(run2, spec("2d", "inference", 2), None, "boom | <script>alert(1)</script>")
    readme = (write_report(sweep, echo=lambda s: None) / layout.REPORT_README).read_text()
    assert "boom \\| &lt;script&gt;alert(1)&lt;/script&gt;" in readme and "<script>" not in readme


# ----------------------------------------------------------------------------- 8. resources


def test_8_a_local_point_that_does_not_fit_is_refused_before_anything_starts(monkeypatch):
    from pnpscale.cluster import local, resources
    from pnpscale.cluster.local import LocalCluster
    from pnpscale.core.config import ConfigError

    monkeypatch.setattr(local, "rank_footprint", lambda measure=True: (400 * 10**6, 300 * 10**6))
    monkeypatch.setattr(resources, "available_bytes", lambda: 20 * 10**9)
    LocalCluster().check({}, spec("2d", "inference", 16), 0)
    with pytest.raises(ConfigError) as hit:
        LocalCluster().check({}, spec("2d", "inference", 64), 0)
    msg = str(hit.value)
    assert msg.startswith("gpus=64: needs about ") and "GB is available" in msg and "cluster=slurm, or gpus<=" in msg
    with pytest.raises(ConfigError, match=r"this machine has 2 CUDA device\(s\): allowed 1..2 locally"):
        LocalCluster().check({}, dataclasses.replace(spec("2d", "inference", 4), backend="auto"), 2)
    fits = int(msg.split("gpus<=")[1].split()[0])
    LocalCluster().check({}, spec("2d", "inference", fits), 0)


@pytest.mark.slow
def test_8_the_footprint_is_measured_on_forked_ranks_and_the_design_card_fits(tmp_path, monkeypatch):
    """The footprint comes from a real 2-rank point started the launcher's way (private pages per rank,
    shared pages once), not from a standalone process (0.40 GB per rank here): the design card's 64-rank
    2D point fits in the ~22 GB a 24 GB machine has available."""
    from pnpscale.cluster import local, resources
    from pnpscale.cluster.local import rank_start_method
    from pnpscale.core.config import resolve_spec
    from pnpscale.sweep.cli import compose_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # measured now, in a fresh process
    footprint = local.rank_footprint()
    assert footprint is not None
    per_rank, once = footprint
    kept = json.loads((tmp_path / "pnpscale" / layout.RANK_FOOTPRINT).read_text())
    assert kept["start_method"] == rank_start_method() and kept["per_rank_bytes"] == per_rank
    assert 0 < per_rank < 150 * 10**6 < once, footprint  # forked ranks share torch and deepinv
    spec64 = resolve_spec(compose_config(["gpus=64", "problem=2d"]), cuda_available=False)
    assert resources.memory_refusal(64, footprint, resources.problem_bytes(spec64), 22 * 10**9) is None
    assert local.rank_footprint(measure=False) == footprint  # kept: measured once


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from pnpscale.core import layout

def build(stage):
    (stage / "summary.parquet").write_bytes(b"half")
    print("writing", flush=True)
    time.sleep(60)

layout.commit_folder(Path(sys.argv[1]), build)
"""


def test_8_a_report_killed_mid_write_leaves_staging_the_next_one_removes(tmp_path, caplog):
    """SIGKILL of a writer (the report, a run's tables: both stage through ``layout.commit_folder``) leaves its
    ``.staging-*`` folder; the next write into that folder removes it (its writer is gone: the staging lock is
    free) with one warning line, and never a live writer's."""
    report = tmp_path / "sweep" / layout.REPORT_DIR
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(report)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert writer.stdout.readline().strip() == "writing"
    (live,) = report.glob(layout.STAGING_PREFIX + "*")
    assert layout.stale_staging(report) == []  # its writer holds it: never stale
    writer.kill()
    writer.wait(timeout=30)
    writer.stdout.close()
    assert live.is_dir() and layout.stale_staging(report) == [live]  # SIGKILL: left, its lock free
    with caplog.at_level("WARNING", logger="pnpscale"):
        layout.commit_folder(report, lambda stage: (stage / layout.SUMMARY).write_bytes(b"whole"))
    assert not live.exists() and not list(report.glob(layout.STAGING_PREFIX + "*"))
    assert f"{live}: removed a staging folder left by a writer that ended mid-write" in caplog.text
    assert sorted(p.name for p in report.iterdir()) == [layout.SUMMARY]
    assert (report / layout.SUMMARY).read_bytes() == b"whole"


def test_8_a_staging_folder_is_stale_only_when_its_writer_is_gone(tmp_path):
    """Held lock: live (whatever its age); free lock naming its writer: stale at once; no named lock (a writer
    killed before it locked, a version before the lock): stale only after STAGING_GRACE_S seconds."""

    seen = {}

    def build(stage: Path) -> None:
        os.utime(stage, (0, 0))  # very old, still live: its writer holds the lock
        seen["during"] = layout.stale_staging(tmp_path)
        (stage / "a.txt").write_text("a")

    assert layout.commit_folder(tmp_path, build) == ["a.txt"]  # the lock file is never published
    assert seen["during"] == [] and not list(tmp_path.glob(layout.STAGING_PREFIX + "*"))
    unnamed = tmp_path / f"{layout.STAGING_PREFIX}unnamed"
    unnamed.mkdir()
    (unnamed / layout.STAGING_OWNER).touch()  # created, its writer killed before it locked it
    young = tmp_path / f"{layout.STAGING_PREFIX}young"
    young.mkdir()
    now = time.time()
    assert layout.stale_staging(tmp_path, now=now) == []
    later = now + layout.STAGING_GRACE_S + 1
    assert layout.stale_staging(tmp_path, now=later) == [unnamed, young]
    (unnamed / layout.STAGING_OWNER).write_text("123\n")  # named, lock free: its writer locked it and died
    assert layout.stale_staging(tmp_path, now=now) == [unnamed]


def test_8_a_temporary_file_of_a_killed_writer_is_removed_by_the_next_write(tmp_path, caplog):
    """``layout.atomic_path``'s temporary file, left by a writer killed between its write and its rename: removed
    by the next commit into that folder once older than STAGING_GRACE_S (a live writer's is fresh), one line."""
    with pytest.raises(KeyboardInterrupt), layout.atomic_path(tmp_path / layout.RUN_JSON) as tmp:
        tmp.write_text("{half")
        raise KeyboardInterrupt
    assert not list(tmp_path.iterdir())  # an exception removes it; only SIGKILL leaves one:
    old, young = tmp_path / ".run.abcd1234.tmp.json", tmp_path / ".timeline.efgh5678.tmp.png"
    for path in (old, young):
        path.write_text("half")
    os.utime(old, (time.time() - layout.STAGING_GRACE_S - 5,) * 2)
    assert layout.stale_temporaries(tmp_path) == [old]
    with caplog.at_level("WARNING", logger="pnpscale"):
        layout.commit_files(tmp_path, {layout.SECTIONS: lambda p: p.write_bytes(b"t")})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([young.name, layout.SECTIONS])
    assert f"{old}: removed a temporary file left by a writer that ended mid-write" in caplog.text


def test_2_a_stop_signal_as_a_lock_is_released_leaves_no_lock_file(tmp_path):
    """Ctrl-C landing as ``release()`` is called, before its first statement (seen: a sweep interrupted just as
    its first point ended kept that point's lock file): the release never ran, and the lock is released when the
    process exits (:func:`pnpscale.core.lock.release_held`). A child process sends itself SIGINT from a trace
    function at ``release``'s call event, where Python would run the handler of a signal arriving then."""
    import subprocess
    import sys

    from pnpscale.core.lock import FolderLock

    run = tmp_path / "run"
    script = f"""
import os, signal, sys
from pathlib import Path
from pnpscale.core import signals
from pnpscale.core.lock import FolderLock
signals.install()
lock = FolderLock(Path({str(run)!r})).acquire()
def at_release(frame, event, arg):
    if event == "call" and frame.f_code is FolderLock.release.__code__:
        sys.settrace(None)
        os.kill(os.getpid(), signal.SIGINT)  # its handler raises here, in the call of release()
    return None
sys.settrace(at_release)
try:
    lock.release()
except KeyboardInterrupt:
    left = (Path({str(run)!r}) / {layout.LOCK!r}).exists()
    sys.exit(7 if left else 8)  # 7: the release was cut short, as in the sweep
sys.exit(9)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert proc.returncode == 7, (proc.returncode, proc.stderr[-2000:])  # interrupted before the release began
    assert not (run / layout.LOCK).exists()  # released as the process exited
    with FolderLock(run) as again:  # and free
        assert again.previous is None


def test_2_a_forked_child_leaves_its_parents_locks_alone(tmp_path):
    """:func:`pnpscale.core.lock.release_held` in a process forked while a lock is held (its ``atexit``): releases
    nothing, the parent's lock file stays and stays locked."""
    from pnpscale.core.lock import FolderLock, in_use, release_held

    with FolderLock(tmp_path / "run"):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(release_held())
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # released none
        assert in_use(tmp_path / "run") is not None  # the file is there, still locked
    assert not (tmp_path / "run" / layout.LOCK).exists()


def test_2_a_stop_signal_while_a_lock_is_taken_leaves_no_lock_file(tmp_path):
    """Ctrl-C while the lock file is created and taken (seen once: a sweep's complete point kept its lock file):
    the signal is held until the lock is known, then raised with the lock released and its file removed. Run in a
    child process: the signal is sent to the process itself, right after ``flock``."""
    import subprocess
    import sys

    script = f"""
import fcntl, os, signal, sys
from pathlib import Path
from pnpscale.core.lock import FolderLock
real = fcntl.flock
def interrupted_here(fd, how):
    real(fd, how)
    os.kill(os.getpid(), signal.SIGINT)  # delivered now: the file exists and is locked, acquire() not done
fcntl.flock = interrupted_here
try:
    FolderLock(Path({str(tmp_path / "run")!r})).acquire()
except KeyboardInterrupt:
    left = (Path({str(tmp_path / "run")!r}) / {layout.LOCK!r}).exists()
    fcntl.flock = real
    with FolderLock(Path({str(tmp_path / "run")!r})):  # and it can be taken again
        pass
    sys.exit(8 if left else 7)
"""
    lock_file = tmp_path / "run" / layout.LOCK
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert proc.returncode == 7, (proc.returncode, proc.stderr[-2000:])  # interrupted, no lock file left (8: left)
    assert not lock_file.exists()


def test_a_stop_while_the_sweep_report_is_written_says_what_is_lost_and_how_to_rebuild(tmp_path, monkeypatch, caplog):
    """Ctrl-C while a sweep writes its report (after every point ran): the stop goes on (exit 128 + signal), and
    one logged line says the report was not written (the previous one intact when there was one) and gives the
    command that writes it from the intact run folders."""
    from omegaconf import OmegaConf

    from hydra_plugins.pnpscale_plugins import launcher
    from pnpscale.results import report

    sweep = tmp_path / "sweep"
    fake_run(sweep / layout.point_subdir("2d", "inference", 1), "2d", "inference", {"gradient": [(1.0, 0.0)]})

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "write_report", stopped)
    config = OmegaConf.create({"report": True, "hydra": {"sweep": {"dir": str(sweep)}}})
    with caplog.at_level("ERROR"), pytest.raises(KeyboardInterrupt):
        launcher.finish_sweep(config, [], total=0)
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line == (f"report not written (stopped while it was written); the run folders are intact: "
                    f"python -m pnpscale.report {sweep}")  # fmt: skip
    (sweep / layout.REPORT_DIR).mkdir()
    (sweep / layout.REPORT_DIR / layout.REPORT_README).write_text("the previous report\n")
    caplog.clear()
    with caplog.at_level("ERROR"), pytest.raises(KeyboardInterrupt):
        launcher.finish_sweep(config, [], total=0)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"][0].startswith(
        "report not written, the previous one is intact (stopped while it was written); "
    )
