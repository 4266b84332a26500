"""The one owner of file names under ``outputs/`` and of atomic writes.

A run folder (one sweep point, hive style ``problem=2d/mode=inference/gpus=4/``) holds::

    run.json              status, resolved config, versions, backend, devices, timings, metrics
    ranks.parquet         per rank x iteration x section     (see pnpscale.columns)
    collectives.parquet   per rank x iteration x section x collective
    sections.parquet      per iteration x section: compute / transfer / wait, LB
    timeline.json         per rank: every iteration's sections and their compute / transfer / wait slices
                          (Chrome trace format: Perfetto, chrome://tracing; pnpscale.analysis.timeline_slices)
    logs/                 per-rank logs (local launch), nccl/ per-rank NCCL logs (CUDA)
    traces/               per-rank Kineto traces (profile.export_traces=true)
    analysis/             python -m pnpscale.analyze of those traces: the tables + analysis.json
    .hydra/               Hydra's record of the composed config and overrides
    .pnpscale.lock        only while a process runs the point: locked, names it (pnpscale.core.lock; also per sweep)
    .pnpscale.reserve     space set aside while the point runs, freed to record a failure on a full disk

``run.json`` is written last: a folder is complete exactly when its ``run.json`` says
``"status": "complete"``. Parquet files appear only together, by rename from a staging folder,
so a failed run never leaves a half-written table. A staging folder (``.staging-*``, in the run
folder or in ``report/``) is locked by its writer while it writes; one left by a writer killed mid-write
(SIGKILL) is removed by the next write into that folder (:func:`remove_stale_staging`), with one
warning line; so is a temporary file of :func:`atomic_path` its writer never renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pnpscale.core.signals import check, deferred, published

RUN_JSON = "run.json"
RANKS = "ranks.parquet"
SECTIONS = "sections.parquet"
COLLECTIVES = "collectives.parquet"
TIMELINE_JSON = "timeline.json"  # staged with the tables (pnpscale.analysis.tables.table_writers)
TRACES_DIR = "traces"
LOGS_DIR = "logs"
NCCL_DIR = "nccl"
REPORT_DIR = "report"
ANALYSIS_DIR = "analysis"  # python -m pnpscale.analyze output (never holds a run.json)
ANALYSIS_JSON = "analysis.json"
RECONSTRUCTION = "reconstruction.pt"
# python -m pnpscale.project output (also in the report): projection rows, its validation, chart, text
PROJECTION = "projection.parquet"
PROJECTION_VALIDATION = "projection_validation.parquet"
PROJECTION_PNG = "projection.png"
PROJECTION_MD = "projection.md"
#: The options of a ``python -m pnpscale.project`` run written into a report folder: a rebuilt report projects
#: again with them (its projection kept, with the numbers of the runs then present).
PROJECTION_OPTIONS = "projection_options.json"
PROJECTION_OVERLAP = "projection_overlap.parquet"  # the pipelined series projected from the blocking one
LOCK = ".pnpscale.lock"  # pnpscale.core.lock: the holder (pid, host, start) as JSON
SLURM_JOB = ".slurm_job.json"  # the SLURM job of the point, written by its launcher as sbatch returns
RESERVE = ".pnpscale.reserve"  # pnpscale.core.record.reserve_space
STAGING_PREFIX = ".staging-"  # commit_files' staging folders (never read as results)
RANK_FOOTPRINT = "rank_footprint-2.json"  # pnpscale.cluster.local.rank_footprint, under $XDG_CACHE_HOME/pnpscale/

VALIDATE_JSON = "validate.json"
DEVICE_CHECK_MD = "device-check.md"  # scripts/device-check.sh: the pass/fail table
DEVICE_CHECK_JSON = "device-check.json"
DEVICE_CHECK_PROBE = "nccl-probe.json"  # the device check's NCCL probe: the method that let 2 ranks share a GPU
DEVICE_CHECK_NCCL_LOG = "nccl-rank0.log"  # the device check brings back rank 0's NCCL log (head and tail)
DEVICE_CHECK_MACHINE = "machine.json"  # the device check's work folder: the facts its versions step read
DEVICE_CHECK_LOGS = "device-check-logs.tar.gz"  # the device check's small log archive (step logs, run.json's)
COMMAND_STDOUT = "stdout.log"  # a command's output kept beside the run folders it made (device check)
COMMAND_STDERR = "stderr.log"
# report/ (python -m pnpscale.report, end of every multirun)
SUMMARY = "summary.parquet"
TRANSFER = "transfer.parquet"
RATES = "rates.parquet"
COMPARE = "compare.parquet"  # only when the runs vary a compared key (pnpscale.results.compare)
REPORT_README = "README.md"
WAIT_RANKS = "wait_ranks.parquet"
TIMELINE_PNG = "timeline.png"  # one median iteration per rank at the largest GPU count (results.timeline_chart)
TRANSFER_PNG = "transfer.png"  # bytes / rate per route (pnpscale.results.transfer)
COMPARE_PNG = "compare.png"  # the varied keys side by side (pnpscale.results.compare)
#: The study's charts (pnpscale.results.charts.CHARTS draws each under its name here).
SCALED_COST_PNG = "scaled_cost.png"
COMPONENTS_PNG = "compute_transfer_wait.png"
LOAD_BALANCE_PNG = "load_balance.png"
COMM_EFFICIENCY_PNG = "comm_efficiency.png"
WAIT_PCT_PNG = "wait_pct.png"
WAIT_CAUSES_PNG = "wait_causes.png"

STATUS_COMPLETE = "complete"
STATUS_FAILED = "failed"
STATUS_RUNNING = "running"
#: a point the sweep asked for that never started (a stop signal ended the sweep first); ``error`` says why
STATUS_NOT_RUN = "not_run"

TABLES = (RANKS, COLLECTIVES, SECTIONS)


def point_parts(problem: str, mode: str, gpus: int, variant: str = "") -> list[str]:
    """The one naming rule of a sweep point: ``problem=P``, ``mode=M``, its variant's ``key=value`` parts
    (separated by spaces or ``/``, e.g. ``denoiser_collective=all_gather num_operators=2``), ``gpus=N``.

    Its run folder joins them with ``/`` (:func:`point_subdir`, hive partitions), logs and reports with
    spaces (:func:`point_label`).

    >>> point_parts("2d", "inference", 4, "num_operators=2")
    ['problem=2d', 'mode=inference', 'num_operators=2', 'gpus=4']
    """
    extra = [p for p in re.split(r"[ /]+", variant or "") if p]
    return [f"problem={problem}", f"mode={mode}", *extra, f"gpus={gpus}"]


def point_subdir(problem: str, mode: str, gpus: int, variant: str = "") -> str:
    """Hive-style sub-folder of one sweep point (:func:`point_parts` joined by ``/``).

    >>> point_subdir("2d", "inference", 4), point_subdir("2d", "inference", 4, "denoiser_collective=all_gather")
    ('problem=2d/mode=inference/gpus=4', 'problem=2d/mode=inference/denoiser_collective=all_gather/gpus=4')
    """
    return "/".join(point_parts(problem, mode, gpus, variant))


def point_label(problem: str, mode: str, gpus: int, variant: str = "") -> str:
    """How logs and reports name a point (:func:`point_parts` joined by spaces).

    >>> point_label("2d", "inference", 4), point_label("2d", "inference", 4, "num_operators=2")
    ('problem=2d mode=inference gpus=4', 'problem=2d mode=inference num_operators=2 gpus=4')
    """
    return " ".join(point_parts(problem, mode, gpus, variant))


def per_rank(run_dir: Path | str, folder: str, rank: int, suffix: str) -> Path:
    """``run_dir/folder/rank<rank><suffix>``: the one spelling of every per-rank file of a run folder.

    >>> per_rank("r", "logs", 2, ".err").as_posix()
    'r/logs/rank2.err'
    """
    return Path(run_dir) / folder / f"rank{rank}{suffix}"


def nccl_log(run_dir: Path | str, rank: int) -> Path:
    """Rank ``rank``'s NCCL debug log (``NCCL_DEBUG_FILE``).

    >>> nccl_log("r", 3).as_posix()
    'r/nccl/rank3.log'
    """
    return per_rank(run_dir, NCCL_DIR, rank, ".log")


def trace_file(run_dir: Path | str, rank: int) -> Path:
    """Rank ``rank``'s exported Kineto trace (``profile.export_traces=true``).

    >>> trace_file("r", 0).as_posix()
    'r/traces/rank0.pt.trace.json'
    """
    return per_rank(run_dir, TRACES_DIR, rank, ".pt.trace.json")


def rank_log_link(run_dir: Path | str, rank: int, stream: str) -> Path:
    """``logs/rank<r>.out`` (``stream="out"``) or ``.err``: links to a SLURM task's own log files.

    >>> rank_log_link("r", 2, "err").as_posix()
    'r/logs/rank2.err'
    """
    return per_rank(run_dir, LOGS_DIR, rank, f".{stream}")


def failure_file(run_dir: Path | str, rank: int) -> Path:
    """Rank ``rank``'s failure record: the kind of its error, decided where it was raised (local launch reads it).

    >>> failure_file("r", 1).as_posix()
    'r/logs/rank1.failure'
    """
    return per_rank(run_dir, LOGS_DIR, rank, ".failure")


def progress_file(run_dir: Path | str, rank: int) -> Path:
    """Rank ``rank``'s heartbeat: the section and iteration it last entered (local launch).

    >>> progress_file("r", 1).as_posix()
    'r/logs/rank1.progress'
    """
    return per_rank(run_dir, LOGS_DIR, rank, ".progress")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed onto ``path`` when the block succeeds.

    Readers never see a half-written file: on any exception (a full disk, a signal) the temporary
    file is removed and ``path`` keeps its previous content, if any. The suffix is kept (writers
    such as matplotlib choose the format from it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder, fsync, and a rename."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, fsync, and a rename.

    Raises:
        OSError: the folder cannot be written (a full disk: ``path`` keeps its earlier content).
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (NaN written as ``null``)."""
    atomic_write_text(path, json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def commit_files(
    run_dir: Path, writers: dict[str, Callable[[Path], None]], stale: tuple[str, ...] | list[str] = ()
) -> None:
    """Write every file in a staging folder, then move them into ``run_dir`` together.

    Args:
        run_dir: destination folder (created if missing).
        writers: file name -> function writing that file at the given path.
        stale: names of earlier files to remove from ``run_dir`` when they are not rewritten (a report
            that no longer has a chart), in the same step as the renames.

    Nothing changes in ``run_dir`` if any writer raises (a full disk included); see :func:`commit_folder`.
    """

    def build(stage: Path) -> None:
        for name, write in writers.items():
            write(stage / name)

    commit_folder(run_dir, build, stale)


def commit_folder(dest: Path, build: Callable[[Path], None], stale: tuple[str, ...] | list[str] = ()) -> list[str]:
    """``build(stage)`` writes files into a staging folder inside ``dest``; then they move into ``dest`` together.

    Args:
        dest: destination folder (created if missing).
        build: writes every file into the folder it is given (names of its choosing, no sub-folders).
        stale: names of earlier files to remove from ``dest`` when ``build`` did not write them again.

    Returns:
        the names moved into ``dest``.

    Nothing changes in ``dest`` if ``build`` raises (a full disk included), and a ``dest`` this call
    created is removed again, with the parent folders it created for it (no empty folder left behind). The
    renames (and the
    removals) run with SIGINT/SIGTERM/SIGHUP held back (:func:`pnpscale.core.signals.deferred`), so
    a signal never leaves a mix of old and new files.
    """

    created = [p for p in (dest, *dest.parents) if not p.exists()]  # deepest first
    dest.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(dest)
    done = False
    try:
        stage: Path | None = None
        owner: int | None = None
        try:
            with deferred():  # created and named together: a stop in between would leave it behind
                stage = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=dest))
                owner = _own_staging(stage)
            build(stage)
            names = sorted(p.name for p in stage.iterdir() if p.is_file() and p.name != STAGING_OWNER)
            check()  # a stop signal swallowed while building (a weakref callback): publish nothing
            with deferred():
                for name in names:
                    os.replace(stage / name, dest / name)
                for name in stale:
                    if name not in names:
                        (dest / name).unlink(missing_ok=True)
                published()  # a command's output (a report) is in place: its later stops change nothing
            done = True
            return names
        finally:
            if stage is not None:
                with deferred():  # removed by this process, whatever signal arrives meanwhile
                    shutil.rmtree(stage, ignore_errors=True)
                    if owner is not None:
                        os.close(owner)  # after the removal: a live staging folder is never seen free
    finally:
        if created and not done:  # folders made for this commit leave with it (no empty report/ or parents)
            for folder in created:
                try:
                    folder.rmdir()
                except OSError:
                    break  # not empty (something else wrote there): it and its parents stay


#: The file inside a staging folder that its writer holds locked (``flock(2)``) while it writes: the kernel
#: drops the lock when the writer ends, SIGKILL included, so a staging folder whose lock is free is stale.
STAGING_OWNER = ".owner"
#: Seconds a staging folder without a held lock must be old before it is taken as stale: its writer locks it
#: right after creating it, and a folder from before the lock (or whose lock file could not be made) is old.
STAGING_GRACE_S = 60.0


def _own_staging(stage: Path) -> int | None:
    """Lock ``stage`` as its writer's (:data:`STAGING_OWNER`); the open descriptor, or ``None`` when the lock
    cannot be taken (a file system without ``flock``: the folder then only ages, see :func:`stale_staging`)."""
    import fcntl

    try:
        fd = os.open(stage / STAGING_OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    try:  # written once locked: a free lock over a non-empty file is a writer gone, never one starting
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:  # a full disk: the folder then only ages
        pass
    return fd


def stale_staging(dest: Path, now: float | None = None) -> list[Path]:
    """The staging folders in ``dest`` whose writer is gone (killed mid-write, SIGKILL or a power cut).

    A staging folder (``.staging-*``, :func:`commit_folder`) is stale when its :data:`STAGING_OWNER` lock is
    free and the file names its writer (written once locked: the writer ended without removing the folder and
    the kernel dropped the lock), or when it has no named lock and is older than :data:`STAGING_GRACE_S`
    seconds (its writer never locked it: killed between creating and locking it, a full disk, or a version
    before the lock). A folder whose lock is held, or that cannot be tested, is a live writer's and is never
    listed.

    Args:
        dest: the folder the staging folders were made in (a run folder, ``report/``).
        now: the time to age folders against (seconds since the epoch; default: now).

    Returns:
        the stale staging folders, sorted (nothing is removed here).
    """
    import fcntl
    import time

    now = time.time() if now is None else now
    out = []
    try:
        candidates = sorted(p for p in dest.glob(STAGING_PREFIX + "*") if p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    for stage in candidates:
        try:
            fd = os.open(stage / STAGING_OWNER, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        except OSError:
            continue
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                named = os.fstat(fd).st_size > 0
            except OSError:  # held: a live writer's (or a file system that cannot tell: left alone)
                continue
            finally:
                os.close(fd)
            if named:
                out.append(stage)
                continue
        try:
            if now - stage.stat().st_mtime > STAGING_GRACE_S:
                out.append(stage)
        except OSError:
            continue
    return out


#: The name :func:`atomic_path` gives its temporary file: ``.<stem>.<8 random characters>.tmp<suffix>``.
_ATOMIC_TMP = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp(\.[^./]+)?$")


def stale_temporaries(dest: Path, now: float | None = None) -> list[Path]:
    """The temporary files of :func:`atomic_path` in ``dest`` older than :data:`STAGING_GRACE_S` seconds: left by
    a writer killed between writing and renaming (a live one writes and renames within a moment, its file's
    modification time fresh while it writes).

    >>> bool(_ATOMIC_TMP.match(".run.k3j_a9zq.tmp.json")), bool(_ATOMIC_TMP.match("run.json"))
    (True, False)
    """
    import time

    now = time.time() if now is None else now
    out = []
    try:
        for p in sorted(dest.iterdir()):
            if not _ATOMIC_TMP.match(p.name) or p.is_symlink() or not p.is_file():
                continue
            if now - p.stat().st_mtime > STAGING_GRACE_S:
                out.append(p)
    except OSError:
        return out
    return out


def remove_stale_staging(dest: Path) -> list[Path]:
    """Remove the stale staging folders of ``dest`` (:func:`stale_staging`) and the temporary files of writers
    killed mid-write (:func:`stale_temporaries`), saying so in one warning line each (logger ``pnpscale``); one
    that cannot be removed is named and left.

    Returns:
        the folders and files removed.
    """
    import logging

    log = logging.getLogger("pnpscale")
    removed = []
    for stale in [*stale_staging(dest), *stale_temporaries(dest)]:
        what = "staging folder" if stale.is_dir() else "temporary file"
        try:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        except OSError as exc:
            log.warning("%s: a %s left by a writer that ended mid-write, not removed: %s", stale, what, exc)
            continue
        removed.append(stale)
        log.warning("%s: removed a %s left by a writer that ended mid-write", stale, what)
    return removed


def run_status(run_dir: Path) -> str | None:
    """``run.json``'s status, or ``None`` when there is no readable ``run.json``."""
    try:
        return read_json(run_dir / RUN_JSON).get("status")
    except (OSError, ValueError):
        return None


def json_problem(path: Path) -> str:
    """Why ``path`` is not a readable JSON object, in a few words (``"empty"``, ``"cut short at byte 120"``,
    ``"not an object"``, an OS error), or ``"readable"``.

    >>> import tempfile; p = Path(tempfile.mkdtemp()) / "run.json"; _ = p.write_text('{"status": "comp')
    >>> json_problem(p)
    'not JSON (Unterminated string starting at: line 1 column 12 (char 11))'
    """
    import json

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read it: {exc}"
    if not text.strip():
        return "empty"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc})"
    return "readable" if isinstance(data, dict) else f"not an object ({type(data).__name__})"


def _jsonable(obj: Any) -> Any:
    import math

    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _jsonable(obj.item())
    return obj


def writable_dir(path: Path | str) -> bool:
    """Whether ``path`` is, or can be created as, a folder this process can write into.

    Nothing is created: a temporary file is written and removed in ``path`` or in its nearest
    existing ancestor (permission bits alone say nothing for root or special file systems).
    """
    p = Path(path).absolute()
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    if not p.is_dir():
        return False
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError:
        return False
    return True


def out_dir_problem(path: Path | str) -> str | None:
    """Why ``path`` cannot be an output folder (``--out`` of ``analyze``, ``report``, ``project``), or ``None``.

    >>> out_dir_problem("/proc/version")
    'is a file, not a folder'
    """
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        return "is a file, not a folder"
    above = p
    while not above.exists() and above.parent != above:
        above = above.parent
    if above.exists() and not above.is_dir():
        return f"{above} is a file, so no folder can be made under it"
    if not writable_dir(p):
        return "must be a folder this user can create and write"
    return None


def report_not_written(out: Path | str) -> str:
    """What a report stopped or failed before its renames leaves: ``report not written, the previous one is
    intact`` when ``out`` holds one (its files are renamed into place only at the end), else ``report not
    written`` (there was none).

    >>> report_not_written("/nonexistent")
    'report not written'
    """
    return "report not written, the previous one is intact" if (Path(out) / REPORT_README).is_file() else (
        "report not written")  # fmt: skip


def report_folder(argv: list[str]) -> Path | None:
    """The report folder a ``python -m pnpscale.report PATH [--out OUT]`` command line names, read without
    argparse (for a stop before the command's own imports); ``None`` when it names none.

    >>> report_folder(["s", "--strict"]), report_folder(["s", "--out", "o"]), report_folder(["--out=o", "s"])
    (PosixPath('s/report'), PosixPath('o'), PosixPath('o'))
    """
    out, path, it = None, None, iter(argv)
    for arg in it:
        if arg == "--out":
            out = next(it, None)
        elif arg.startswith("--out="):
            out = arg.removeprefix("--out=")
        elif not arg.startswith("-") and path is None:
            path = arg
    if out is not None:
        return Path(out)
    return Path(path) / REPORT_DIR if path is not None else None


def report_out_problem(path: str | Path, out: str | Path | None) -> str | None:
    """The one-line refusal of a report or projection output folder, before any run folder is read:
    ``--out`` (or the default ``PATH/report`` when ``PATH`` is a folder) that is a file or cannot be created
    and written (:func:`out_dir_problem`); else ``None``. Shared by ``pnpscale.report`` and ``pnpscale.project``."""
    target = Path(out) if out is not None else Path(path) / REPORT_DIR
    if out is None and not Path(path).is_dir():
        return None  # the folder itself is refused (a file, or no such folder) by the reader
    problem = out_dir_problem(target)
    if problem is None:
        return None
    return f"--out {target}: {problem}" if out is not None else f"{target} (the default --out): {problem}"
