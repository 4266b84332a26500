"""The one-call GPU check behind ``scripts/device-check.sh``.

``python -m pnpscale.validation.device_check [--cpu] [--out DIR] [--work DIR] [--budget S] [--only A,B]``
runs the steps of :data:`STEPS` in order, each in a subprocess (``... device_check step NAME[,NAME]``; adjacent
steps marked ``warm`` share one process) with its time limit, continues after a failed step, prints a pass/fail
table and a summary line. Everything bulky (run folders, traces, step logs) goes under ``--work`` (default
``$TMPDIR/pnpscale-device-check``); ``--out`` (``$OUT``) receives only :func:`bring_back`'s files: the table
(``device-check.md``, ``device-check.json``), the NCCL probe's result (``nccl-probe.json``), rank 0's NCCL log
(``nccl-rank0.log``) and one small log archive (``device-check-logs.tar.gz``): at most :data:`OUT_MAX_FILES`
files and :data:`OUT_MAX_BYTES` bytes.

``--plan --gpus N --nccl X.Y.Z --torch A.B`` prints, without running anything, which steps a machine with those
facts would run, skip or cut at the budget, each one's limit, and the total (:func:`plan`); the run itself
decides with the same rules, on the facts its ``versions`` step reads.

Steps, in the order of what they prove (CPU mode, ``--cpu``: the same steps on gloo CPU ranks at tiny sizes,
the GPU-only ones skipped, to test this orchestration without a GPU):

* ``versions``: Python, torch, CUDA, NCCL, deepinv, the GPUs; the facts the later steps' rules read.
* ``nccl_probe``: two processes, one NCCL communicator on ONE GPU (each rank its own ``NCCL_HOSTID``, socket
  transport on loopback: NCCL 2.28 refuses two ranks of one host on one GPU, ``init.cc``; else
  ``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL >= 2.30), all_reduce, all_gather, reduce_scatter and send/recv of
  4 MiB, every value checked; the first method that works is the one the next step uses.
* ``nccl_two_ranks``: pnpscale's own 2-rank points over NCCL on that one GPU (profiler, sections,
  decomposition): blocking all_reduce, the pipelined point (chunked async all_reduces), reduce_scatter with
  the halo all_gather and the all_gather denoiser: collectives as expected, every payload known and paired
  across ranks, the main all_reduce's bytes equal to the signal's, no kernel or pairing anomaly, NCCL logs
  parsed with an algorithm for the main all_reduce. Timings meaningless (two ranks time-slice one GPU).
  Skipped, naming the probe's errors, when the probe found no method.
* ``two_gpus``: on a machine with two GPUs or more, one 2-rank NCCL point, one GPU per rank.
* ``busy_wait``, ``kineto`` (one process): the injected delay's accuracy with CUDA events; a profiled
  matmul's events, every GPU event launched before it starts.
* ``run_2d``, ``run_3d``: 1-rank runs (inference and training in one warm ``python -m pnpscale -m``) at
  a mid scale (paper widths, smaller image): device, GPU spans, CUDA peak memory, NCCL version.
* ``offline_equals_live``: ``python -m pnpscale.analyze`` (its ``main``, in the step's process) of those runs'
  exported CUDA traces equals their live tables.
* ``injected_delay``: a delay on rank 0's denoiser, each run right after its own baseline in one multirun:
  +D on 1 rank's GPU span; 2 gloo ranks, +D/2 of mean wait.
* ``paper_2d_inference``: one paper-scale 2D inference iteration: section times, CUDA peak memory.

Each result is a :class:`StepResult`; :func:`format_table` / :func:`parse_table` are the plain text table
both ways (tested without a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pnpscale import columns as K
from pnpscale.analysis.events import Kind
from pnpscale.analysis.nccl_log import parse_nccl_log
from pnpscale.analysis.offline import main as analyze_main
from pnpscale.core import layout
from pnpscale.core.config import resolve_spec
from pnpscale.core.errors import PnpscaleError, command_prog
from pnpscale.core.record import provenance
from pnpscale.rank.gpus import NCCL_HOSTID_PER_RANK_ENV
from pnpscale.rank.group import SHARED_GPU_ENV
from pnpscale.rank.loop import busy_wait, sleep_rate_hz
from pnpscale.rank.problems import make_problem
from pnpscale.results.transfer import transfer_inputs
from pnpscale.sweep.cli import compose_config

PASS, FAIL, SKIP, TIMEOUT, CUT = "pass", "FAIL", "skip", "TIMEOUT", "cut"
TABLE_MD = layout.DEVICE_CHECK_MD
TABLE_JSON = layout.DEVICE_CHECK_JSON
DELAY_S = 0.2
#: the injected delay in CPU mode: CPU ranks sharing a few cores with other jobs vary by tens of ms
#: between two runs, so the delay is made large enough for 10 % to stand above that
DELAY_CPU_S = 1.0
TOLERANCE = 0.10


@dataclass(frozen=True)
class StepResult:
    """One step: ``status`` (pass, FAIL, skip, TIMEOUT, cut), wall ``seconds``, one-line ``detail``."""

    name: str
    status: str
    seconds: float
    detail: str


class CheckFailed(PnpscaleError, AssertionError):
    """A step's check did not hold (its message is the table's detail)."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


def within(measured: float, target: float, rel: float = TOLERANCE) -> bool:
    """``|measured - target| <= rel x target``.

    >>> within(0.21, 0.2), within(0.23, 0.2)
    (True, False)
    """
    return abs(measured - target) <= rel * target


def format_table(results: Sequence[StepResult]) -> str:
    """A Markdown table: step, status, seconds, detail (``|`` in details escaped).

    >>> print(format_table([StepResult("versions", "pass", 1.25, "torch 2.14.1")]))
    | step | status | seconds | detail |
    |---|---|---|---|
    | versions | pass | 1.2 | torch 2.14.1 |
    """
    lines = ["| step | status | seconds | detail |", "|---|---|---|---|"]
    for r in results:
        detail = " ".join(r.detail.split()).replace("|", "\\|")
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {detail} |")
    return "\n".join(lines)


def parse_table(text: str) -> list[StepResult]:
    """The results of a :func:`format_table` table (other lines ignored).

    >>> parse_table(format_table([StepResult("a", "FAIL", 2.0, "x | y")]))
    [StepResult(name='a', status='FAIL', seconds=2.0, detail='x | y')]
    """
    out = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| step |", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").replace("\\|", "\0").split("|")]
        if len(cells) != 4:
            continue
        name, status, seconds, detail = (c.replace("\0", "|") for c in cells)
        out.append(StepResult(name, status, float(seconds), detail))
    return out


def exit_status(results: Sequence[StepResult]) -> int:
    """1 when a step failed or timed out; else 3 when the budget cut a step (it proved nothing, found no
    defect either); else 0 (skipped steps, each saying why, do not fail the check).

    >>> exit_status([StepResult("a", "pass", 0, ""), StepResult("b", "skip", 0, "")])
    0
    >>> exit_status([StepResult("a", "pass", 0, ""), StepResult("b", "cut", 0, "")])
    3
    """
    if any(r.status in (FAIL, TIMEOUT) for r in results):
        return 1
    return 3 if any(r.status == CUT for r in results) else 0


def summary_line(results: Sequence[StepResult], budget_s: float) -> str:
    """The last line of a check: how many steps passed, were skipped, failed, timed out, or were cut by the
    budget (named: they were not run, so they prove nothing and found no defect).

    >>> print(summary_line([StepResult("a", "pass", 1, ""), StepResult("b", "cut", 0, "")], 330))
    1 of 2 steps passed, 0 skipped, 0 failed, 0 timed out; cut by the 330 s budget (not run, no defect found): b
    """
    n = {s: [r.name for r in results if r.status == s] for s in (PASS, SKIP, FAIL, TIMEOUT, CUT)}
    failed = f" ({', '.join(n[FAIL])})" if n[FAIL] else ""
    late = f" ({', '.join(n[TIMEOUT])})" if n[TIMEOUT] else ""
    line = (f"{len(n[PASS])} of {len(results)} steps passed, {len(n[SKIP])} skipped, {len(n[FAIL])} failed{failed}, "
            f"{len(n[TIMEOUT])} timed out{late}")  # fmt: skip
    if n[CUT]:
        line += f"; cut by the {budget_s:.0f} s budget (not run, no defect found): {', '.join(n[CUT])}"
    return line


# --- the machine and the plan: which steps run, skip or are cut -----------------------------------------


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"2.28.9"`` -> ``(2, 28, 9)``; ``"2.11.0+cu130"`` -> ``(2, 11, 0)``; ``None`` for none or garbage.

    >>> parse_version("2.28.9"), parse_version("2.11.0+cu130"), parse_version("2.11"), parse_version(None)
    ((2, 28, 9), (2, 11, 0), (2, 11), None)
    """
    if not text:
        return None
    parts = []
    for piece in str(text).split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits or digits != piece:
            break
        parts.append(int(digits))
    return tuple(parts) or None


@dataclass(frozen=True)
class Machine:
    """What the step rules read: ``cuda`` (a GPU check, else CPU mode), ``gpus`` (CUDA devices), torch's
    ``nccl`` version and the ``torch`` version (tuples, ``None`` when unknown)."""

    cuda: bool
    gpus: int
    nccl: tuple[int, ...] | None = None
    torch: tuple[int, ...] | None = None


#: the first NCCL that lets two ranks of one communicator share a GPU with ``NCCL_MULTI_RANK_GPU_ENABLE=1``
#: (earlier ones refuse with "Duplicate GPU detected" when host hash and bus id of two ranks match)
MULTI_RANK_MIN_NCCL = (2, 30)
#: the ways two NCCL ranks may share one GPU: ``hostid`` (each rank its own ``NCCL_HOSTID``, so NCCL sees two
#: hosts and connects them by its socket transport on loopback) and ``multi_rank`` (``NCCL_MULTI_RANK_GPU_ENABLE=1``)
SHARED_GPU_METHODS = ("hostid", "multi_rank")


def shared_gpu_methods(nccl: tuple[int, ...] | None) -> list[str]:
    """The methods to try, most likely first: ``multi_rank`` first from NCCL 2.30, ``hostid`` only before.

    >>> shared_gpu_methods((2, 28, 9)), shared_gpu_methods((2, 30, 7)), shared_gpu_methods(None)
    (['hostid'], ['multi_rank', 'hostid'], [])
    """
    if nccl is None:
        return []
    return ["multi_rank", "hostid"] if nccl[:2] >= MULTI_RANK_MIN_NCCL else ["hostid"]


def shared_gpu_env(method: str) -> dict[str, str]:
    """The launcher's environment for two pnpscale ranks sharing one GPU by ``method``: pnpscale's consent
    (:data:`pnpscale.rank.group.SHARED_GPU_ENV`), and for ``hostid`` the request that each rank set its own
    host id (:func:`pnpscale.rank.gpus.per_rank_nccl_env`).

    >>> sorted(shared_gpu_env("hostid"))
    ['NCCL_MULTI_RANK_GPU_ENABLE', 'PNPSCALE_NCCL_HOSTID_PER_RANK']
    """
    env = {SHARED_GPU_ENV: "1"}
    if method == "hostid":
        env[NCCL_HOSTID_PER_RANK_ENV] = "1"
    return env


def _always(m: Machine) -> str | None:
    return None


def _needs_nccl(m: Machine) -> str | None:
    if not m.cuda:
        return None  # CPU mode: the same step on gloo
    if m.gpus < 1:
        return "no CUDA device"
    return None if m.nccl is not None else "torch has no NCCL"


def _needs_two_gpus(m: Machine) -> str | None:
    if not m.cuda:
        return "needs two GPUs (CPU mode: nccl_two_ranks ran the same point on gloo)"
    return None if m.gpus >= 2 else f"needs two GPUs, this machine has {m.gpus} (nccl_two_ranks shared one)"


def _needs_gpu(m: Machine) -> str | None:
    return None if not m.cuda or m.gpus >= 1 else "no CUDA device"


@dataclass(frozen=True)
class Step:
    """One step: its function, its time limit on CUDA (seconds), what it proves (docs, plan), its rule
    (``applies``: a reason to skip on a machine, else ``None``), and ``warm``: adjacent warm steps share
    one process."""

    name: str
    fn: Callable[[Ctx], str]
    limit_s: float
    proves: str
    applies: Callable[[Machine], str | None] = _always
    warm: bool = False


class Skipped(Exception):  # noqa: N818 - a step outcome, not an error
    """The step does not apply here (its message is the detail)."""


@dataclass(frozen=True)
class Ctx:
    """What a step gets: ``cuda`` (a GPU check, else CPU mode), ``runs`` (the work folder: run folders,
    the probe's files), ``timeout`` seconds for the step, ``machine`` (what ``versions`` found)."""

    cuda: bool
    runs: Path
    timeout: float
    machine: Machine | None = None
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Seconds left of the step's limit (at least 1)."""
        return max(1.0, self.timeout - (time.monotonic() - self.t0))


# --- run overrides ----------------------------------------------------------------------------------

#: 1-rank runs: paper DRUNet widths at a smaller image on CUDA; the tests' ``scale=tiny`` preset on CPU. Inference
#: and training of one problem share their size on CUDA, so that one multirun (one warm process) runs both.
MID = {"2d": ["scale=paper", "problem.image_size=1024"], "3d": ["scale=paper", "problem.image_size=128"]}
TINY = {"2d": ["scale=tiny"], "3d": ["scale=tiny"]}
RUNS = [("2d", "inference"), ("2d", "training"), ("3d", "inference"), ("3d", "training")]


def run_overrides(problem: str, mode: str, cuda: bool) -> list[str]:
    """Overrides of a 1-rank check run (3 measured iterations, 1 warm-up, traces exported); ``mode`` may be
    a sweep (``inference,training``, with ``-m``).

    >>> run_overrides("2d", "inference", cuda=True)[:4]
    ['problem=2d', 'mode=inference', 'gpus=1', 'iterations=3']
    """
    size = MID[problem] if cuda else TINY[problem]
    return [f"problem={problem}", f"mode={mode}", "gpus=1", "iterations=3", "warmup=1",
            "profile.export_traces=true", "report=false", *size]  # fmt: skip


def run_group(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a process group of its own, output captured; past ``timeout`` s the whole group
    is killed (SIGKILL: the command, its ranks, their forkserver), so no run outlives its step.

    Raises:
        subprocess.TimeoutExpired: after the kill, with the output so far.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_app(
    overrides: Sequence[str], root: Path, timeout: float, env: dict[str, str] | None = None, runs: int = 1
) -> list[Path]:
    """``python -m pnpscale OVERRIDES output.root=ROOT`` (with ``-m`` when ``runs > 1``: one process, one
    forkserver, for every point); the run folders (one ``run.json`` each), in path order.

    Raises:
        CheckFailed: non-zero exit (last stderr line), or not exactly ``runs`` complete run folders.
    """
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # a rerun starts clean
    root.mkdir(parents=True)
    multi = ["-m"] if runs > 1 else []
    cmd = [sys.executable, "-m", "pnpscale", *multi, *overrides, f"output.root={root}"]
    proc = run_group(cmd, timeout, env={**os.environ, **(env or {})})
    (root / layout.COMMAND_STDOUT).write_text(proc.stdout)
    (root / layout.COMMAND_STDERR).write_text(proc.stderr)
    tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    check(proc.returncode == 0, f"exit {proc.returncode}: {tail}")
    found = sorted(p.parent for p in root.glob(f"**/{layout.RUN_JSON}"))
    check(len(found) == runs, f"{len(found)} run folders under {root}, expected {runs}")
    for run in found:
        status = layout.run_status(run)
        check(status == layout.STATUS_COMPLETE, f"{run.relative_to(root)}: {layout.RUN_JSON} status {status}")
    return found


def _ranks(run: Path) -> Any:
    import pandas as pd

    return pd.read_parquet(run / layout.RANKS)


def _anomalies(run: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """A run's anomalies (``run.json``), all or one ``kind``."""
    found = layout.read_json(run / layout.RUN_JSON).get("anomalies") or []
    return [a for a in found if kind is None or a.get("kind") == kind]


def nccl_version() -> tuple[int, ...] | None:
    """torch's NCCL version (``torch.cuda.nccl.version()``), ``None`` when it has none."""
    try:
        import torch

        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this build
        return None
    return tuple(int(x) for x in v) if isinstance(v, tuple) else None


# --- steps ----------------------------------------------------------------------------------------------


#: the packages ``scripts/device-wheels.sh`` provides on the GPU machine besides deepinv (reported by ``versions``)
DEVICE_PACKAGES = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher",
                   "ijson", "natsort", "pandas", "pyarrow")  # fmt: skip
#: the file ``versions`` leaves in the work folder: the :class:`Machine` the later steps' rules read
MACHINE_JSON = layout.DEVICE_CHECK_MACHINE


def step_versions(ctx: Ctx) -> str:
    import importlib.metadata as md

    import deepinv
    import torch

    v = provenance("nccl" if ctx.cuda else "gloo")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)}) if gpus else ["no CUDA"]
    nccl = nccl_version()
    machine = Machine(ctx.cuda, gpus, nccl if gpus else None, parse_version(torch.__version__))
    ctx.runs.mkdir(parents=True, exist_ok=True)
    layout.write_json(ctx.runs / MACHINE_JSON, asdict(machine))
    if ctx.cuda:
        check(gpus > 0, f"torch {torch.__version__}: CUDA not available")

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "missing"

    others = ", ".join(f"{n} {version(n)}" for n in DEVICE_PACKAGES)
    return (
        f"python {v['python']}, torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {v['nccl']}, "
        f"deepinv {deepinv.__version__}, {gpus} GPU(s) {', '.join(names)}; {others}"
    )


def read_machine(runs: Path, cuda: bool) -> Machine | None:
    """The :class:`Machine` ``versions`` recorded in ``runs``, ``None`` when it did not run."""
    try:
        d = layout.read_json(runs / MACHINE_JSON)
        return Machine(bool(d["cuda"]), int(d["gpus"]), tuple(d["nccl"]) if d.get("nccl") else None,
                       tuple(d["torch"]) if d.get("torch") else None)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- nccl_probe: two processes, one communicator, one GPU -------------------------------------------------

#: elements (float32) of each probe collective: 4 MiB
PROBE_ELEMENTS = 1 << 20
#: the probe's result in the work folder (also brought back)
PROBE_JSON = layout.DEVICE_CHECK_PROBE


def probe_rank_env(method: str, rank: int, log: Path) -> dict[str, str]:
    """The environment of probe rank ``rank`` for ``method`` (see :data:`SHARED_GPU_METHODS`), with NCCL's
    INIT, GRAPH and ENV lines to ``log``.

    >>> e = probe_rank_env("hostid", 1, Path("/w/p.log"))
    >>> e["NCCL_HOSTID"], e["NCCL_SOCKET_IFNAME"], "NCCL_MULTI_RANK_GPU_ENABLE" in e
    ('pnpscale-probe-rank1', 'lo', False)
    """
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,ENV", "NCCL_DEBUG_FILE": str(log)}
    if method == "hostid":
        env.update({"NCCL_HOSTID": f"pnpscale-probe-rank{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"})
    elif method == "multi_rank":
        env[SHARED_GPU_ENV] = "1"
    return env


def probe_rank(rank: int, world: int, port: int, backend: str, out: Path, timeout_s: float) -> None:
    """One probe rank: a process group on ``127.0.0.1:port``, then all_reduce, all_gather, reduce_scatter
    and a send/recv exchange of :data:`PROBE_ELEMENTS` float32 (CUDA device 0 on ``nccl``), each value
    checked; writes ``{"rank", "ok", "ops": {name: {"bytes", "seconds", "ok"}}, "error"}`` to ``out``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank, "ok": False, "ops": {}, "error": None}
    try:
        dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=dev if backend == "nccl" else None)  # fmt: skip
        n = PROBE_ELEMENTS

        def timed(name: str, run: Callable[[], bool], nbytes: int) -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            ok = bool(run())
            result["ops"][name] = {"bytes": nbytes, "seconds": round(time.perf_counter() - t0, 6), "ok": ok}
            check(ok, f"{name}: wrong values on rank {rank}")

        def all_reduce() -> bool:
            x = torch.full((n,), float(rank + 1), device=dev)
            dist.all_reduce(x)
            return bool((x == world * (world + 1) / 2).all())

        def all_gather() -> bool:
            out_t = torch.empty(world * n, device=dev)
            dist.all_gather_into_tensor(out_t, torch.full((n,), float(rank + 1), device=dev))
            return all(bool((out_t[i * n : (i + 1) * n] == i + 1).all()) for i in range(world))

        def reduce_scatter() -> bool:
            inp = torch.arange(world, device=dev, dtype=torch.float32).repeat_interleave(n) + rank
            out_t = torch.empty(n, device=dev)
            dist.reduce_scatter_tensor(out_t, inp)
            return bool((out_t == world * rank + world * (world - 1) / 2).all())

        def send_recv() -> bool:
            peer = (rank + 1) % world
            src = (rank - 1) % world
            got = torch.empty(n, device=dev)
            mine = torch.full((n,), float(rank), device=dev)
            if rank % 2 == 0:
                dist.send(mine, peer)
                dist.recv(got, src)
            else:
                dist.recv(got, src)
                dist.send(mine, peer)
            return bool((got == src).all())

        timed("all_reduce", all_reduce, 4 * n)
        timed("all_gather", all_gather, 4 * n * world)
        timed("reduce_scatter", reduce_scatter, 4 * n * world)
        timed("send_recv", send_recv, 4 * n)
        dist.barrier()
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure becomes the probe's result
        result["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    finally:
        out.write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound, read, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_probe(work: Path, backend: str, method: str, timeout: float, world: int = 2) -> dict[str, Any]:
    """Run ``world`` probe ranks (:func:`probe_rank`) as processes of one group, killed past ``timeout``;
    one attempt's record: ``method``, ``ok``, ``ranks`` (each rank's result), ``error``, ``transports``
    (NCCL's connection kinds in rank 0's log), ``log`` (rank 0's NCCL log, when any)."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    procs, files, logs = [], [], []
    for r in range(world):
        out, log = work / f"probe-{method}-rank{r}.json", work / f"probe-{method}-rank{r}.nccl.log"
        out.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        env = {**os.environ, **(probe_rank_env(method, r, log) if backend == "nccl" else {})}
        cmd = [sys.executable, "-m", "pnpscale.validation.device_check", "probe-rank", str(r), str(world), str(port),
               backend, str(out), str(max(5.0, timeout - 5))]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # fmt: skip
        files.append(out)
        logs.append(log)
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            outputs.append(p.communicate()[0])
    ranks = []
    for r, f in enumerate(files):
        try:
            ranks.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            tail = (outputs[r].strip().splitlines() or [f"exit {procs[r].returncode}"])[-1] if r < len(outputs) else ""
            ranks.append({"rank": r, "ok": False, "ops": {}, "error": f"no result (killed or crashed): {tail[:300]}"})
    (work / f"probe-{method}.out").write_text("\n".join(f"--- rank {r}\n{o}" for r, o in enumerate(outputs)))
    errors = [f"rank {x['rank']}: {x['error']}" for x in ranks if x.get("error")]
    transports: dict[str, int] = {}
    if logs[0].is_file():
        with open(logs[0], errors="replace") as fh:
            transports = dict(parse_nccl_log(fh).transports)
    return {"method": method if backend == "nccl" else "gloo", "ok": all(x.get("ok") for x in ranks) and not errors,
            "ranks": ranks, "error": "; ".join(errors) or None, "transports": transports,
            "log": str(logs[0]) if logs[0].is_file() else None}  # fmt: skip


def step_nccl_probe(ctx: Ctx) -> str:
    """See the module doc. CPU mode: the same four collectives on gloo (the probe's own code tested)."""
    m = ctx.machine or Machine(ctx.cuda, 1 if ctx.cuda else 0, nccl_version() if ctx.cuda else None)
    methods = shared_gpu_methods(m.nccl) if ctx.cuda else ["gloo"]
    check(bool(methods), "torch has no NCCL")
    attempts = []
    for method in methods:
        backend = "nccl" if ctx.cuda else "gloo"
        attempts.append(run_probe(ctx.runs / "probe", backend, method, ctx.left() / len(methods)))
        if attempts[-1]["ok"]:
            break
    good = next((a for a in attempts if a["ok"]), None)
    doc = {"nccl": ".".join(map(str, m.nccl)) if m.nccl else None, "method": good["method"] if good else None,
           "attempts": attempts}  # fmt: skip
    layout.write_json(ctx.runs / PROBE_JSON, doc)
    tried = "; ".join(f"{a['method']}: {'ok' if a['ok'] else a['error']}" for a in attempts)
    check(good is not None, f"no way found for two ranks on one GPU: {tried}")
    assert good is not None
    ops = good["ranks"][0]["ops"]
    rates = ", ".join(f"{k} {v['bytes'] / max(v['seconds'], 1e-9) / 1e9:.2f} GB/s" for k, v in ops.items())
    via = ", ".join(f"{k} x{n}" for k, n in good["transports"].items()) or "no connection lines"
    return (f"method {good['method']} ({tried}): {', '.join(ops)} correct on 2 ranks, 4 MiB each (rank 0's wall "
            f"time with the value check, ranks sharing one device: no bandwidth): {rates}; via {via}")  # fmt: skip


def probe_method(runs: Path) -> str | None:
    """The method :func:`step_nccl_probe` found (``hostid``, ``multi_rank``), ``None`` when it found none or
    did not run."""
    try:
        return layout.read_json(runs / PROBE_JSON).get("method")
    except (OSError, ValueError):
        return None


# --- nccl_two_ranks: pnpscale's own 2-rank points over NCCL on one GPU --------------------------------------

#: 2-rank points (2D inference, tiny on CPU, a small image on a GPU): (name, overrides, runs of the multirun)
TWO_RANK_POINTS = (
    ("blocking_and_pipelined", ["solver.overlap=none,pipelined"], 2),
    ("reduce_scatter_all_gather",
     ["solver.gradient_collective=reduce_scatter", "solver.denoiser_collective=all_gather"], 1),
)  # fmt: skip
#: anomaly kinds that say the kernels, payloads or timings of a run were not read right
BAD_ANOMALIES = ("payload_unmatched", "collective_without_kernel", "kernel_name_disagrees",
                 "collective_kernel_unrecognised", "non_physical_timing", "no_collectives",
                 "launch_unknown_by_start")  # fmt: skip


def two_rank_base(cuda: bool) -> list[str]:
    """The overrides of the 2-rank points: 2 measured iterations, 1 warm-up, 2D inference, tiny on CPU, a 256²
    image on a GPU (kernels long enough to be profiled, seconds in all).

    >>> two_rank_base(True)[:3]
    ['problem=2d', 'mode=inference', 'gpus=2']
    """
    size = [*TINY["2d"], "problem.image_size=256", "problem.patch_size=64", "problem.overlap=8"] if cuda else TINY["2d"]
    return ["problem=2d", "mode=inference", "gpus=2", "iterations=2", "warmup=1", "report=false",
            f"dist.backend={'nccl' if cuda else 'gloo'}", "profile.export_traces=false", *size]  # fmt: skip


def check_two_rank_run(run: Path, expect: set[str], signal_bytes: int | None) -> str:
    """The checks of one 2-rank run: the collectives ``expect`` all present, every payload known and the same
    on both ranks at the same place (iteration, section, seq), the blocking main all_reduce moving
    ``signal_bytes``, none of :data:`BAD_ANOMALIES`; its one-line account.

    Raises:
        CheckFailed: naming the run folder and what differs.
    """
    import pandas as pd

    c = pd.read_parquet(run / layout.COLLECTIVES)
    name = run.parent.name + "/" + run.name
    kinds = dict(c[K.COLLECTIVE].astype(str).value_counts().sort_index())
    check(expect <= set(kinds), f"{name}: collectives {kinds}, expected {sorted(expect)}")
    check(bool(c[K.PAYLOAD_BYTES].notna().all()), f"{name}: {int(c[K.PAYLOAD_BYTES].isna().sum())} payload(s) NA")
    key = [K.ITERATION, K.SECTION, K.SEQ, K.COLLECTIVE, K.PAYLOAD_BYTES]
    per_rank = [g[key].astype(str).values.tolist() for _, g in c.sort_values([K.RANK, *key[:3]]).groupby(K.RANK)]
    check(len(per_rank) == 2 and per_rank[0] == per_rank[1], f"{name}: ranks 0 and 1 differ in collectives/payloads")
    bad = [a for a in _anomalies(run) if a.get("kind") in BAD_ANOMALIES]
    check(not bad, f"{name}: anomalies {[(a['kind'], a.get('rank'), a.get('example')) for a in bad]}")
    if signal_bytes is not None:
        main = c[(c[K.MAIN]) & (c[K.COLLECTIVE] == "all_reduce")] if K.MAIN in c else c.iloc[:0]
        sizes = sorted(set(main[K.PAYLOAD_BYTES].astype(int)))
        check(sizes == [signal_bytes], f"{name}: main all_reduce payloads {sizes}, expected {signal_bytes}")
    others = sorted({str(a["kind"]) for a in _anomalies(run)})
    return f"{', '.join(f'{k} x{n}' for k, n in kinds.items())}; anomalies {others or 'none'}"


def _signal_bytes(overrides: Sequence[str], cuda: bool) -> int:
    """The signal's bytes of the point ``overrides`` (the blocking main all_reduce's payload)."""
    return int(make_problem(resolve_spec(compose_config(list(overrides)), cuda_available=cuda)).signal_bytes())


def nccl_account(run: Path) -> str:
    """NCCL's logs of a run: both ranks' present, version, TUNING lines, transports, and an algorithm for
    the main all_reduce (:func:`pnpscale.results.transfer.transfer_inputs`).

    Raises:
        CheckFailed: a log missing, or no algorithm found.
    """
    logs = [layout.nccl_log(run, r) for r in range(2) if layout.nccl_log(run, r).is_file()]
    check(len(logs) == 2, f"{len(logs)} NCCL logs in {run / layout.NCCL_DIR}")
    with open(logs[0], errors="replace") as f:
        log = parse_nccl_log(f)
    inputs = transfer_inputs([run])
    main = inputs[inputs[K.COLLECTIVE] == "all_reduce"]
    check(not main.empty, "no all_reduce main collective")
    algos = main[K.ALGORITHM].tolist()
    detail = f"NCCL {log.version}, {len(log.tuning)} TUNING lines, via {dict(log.transports)}, algorithms {algos}"
    check(all(isinstance(a, str) and a for a in algos), f"{detail}; notes {main[K.ALGORITHM_NOTE].tolist()}")
    return detail


def step_nccl_two_ranks(ctx: Ctx) -> str:
    """See the module doc. CPU mode: the same points on 2 gloo ranks (gloo issues the reduce-scatter as an
    all_to_all, pnpscale's rule in :mod:`pnpscale.rank.gradient`)."""
    env: dict[str, str] = {}
    if ctx.cuda:
        method = probe_method(ctx.runs)
        if method is None and (ctx.runs / PROBE_JSON).is_file():  # the probe ran and no method worked
            tried = layout.read_json(ctx.runs / PROBE_JSON).get("attempts") or []
            raise Skipped("not run: the NCCL probe found no way for two ranks to share the GPU ("
                          + "; ".join(f"{a.get('method')}: {a.get('error')}" for a in tried) + ")")
        if method is None:  # the probe did not run (--only): the first method for this NCCL
            m = ctx.machine or Machine(True, 1, nccl_version())
            method = next(iter(shared_gpu_methods(m.nccl)), None)
            check(method is not None, "torch has no NCCL")
        assert method is not None
        env = shared_gpu_env(method)
        if (ctx.machine and ctx.machine.gpus > 1) or "," in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    base = two_rank_base(ctx.cuda)
    scatter = "reduce_scatter" if ctx.cuda else "all_to_all"
    expects = {"blocking_and_pipelined": {"all_reduce"}, "reduce_scatter_all_gather": {scatter, "all_gather"}}
    signal_bytes = _signal_bytes(base, ctx.cuda)
    parts, nccl_run = [], None
    for name, over, n in TWO_RANK_POINTS:
        runs = run_app([*base, *over], ctx.runs / f"two_ranks_{name}", ctx.left(), env=env, runs=n)
        for run in runs:
            spec = layout.read_json(run / layout.RUN_JSON)["spec"]
            how = (spec["overlap"], spec["gradient_collective"], spec["denoiser_collective"])
            blocking = how == ("none", "all_reduce", "all_reduce")
            account = check_two_rank_run(run, expects[name], signal_bytes if blocking else None)
            label = "blocking" if blocking else f"overlap {how[0]}, gradient {how[1]}, denoiser {how[2]}"
            parts.append(f"{label}: {account}{f' (main all_reduce {signal_bytes} B)' if blocking else ''}")
            nccl_run = nccl_run or (run if blocking else None)
    detail = "; ".join(parts)
    if ctx.cuda:
        assert nccl_run is not None
        detail = f"{env.get(NCCL_HOSTID_PER_RANK_ENV) and 'per-rank NCCL_HOSTID' or 'NCCL_MULTI_RANK_GPU_ENABLE'}: " + (
            f"{nccl_account(nccl_run)}; {detail}")  # fmt: skip
    return detail


def step_two_gpus(ctx: Ctx) -> str:
    """One 2-rank NCCL point, one GPU per rank (default collectives): the NCCL logs, the algorithm and the
    checks of :func:`check_two_rank_run`."""
    base = two_rank_base(True)
    (run,) = run_app(base, ctx.runs / "two_gpus", ctx.left())
    account = check_two_rank_run(run, {"all_reduce"}, _signal_bytes(base, True))
    return f"{nccl_account(run)}; {account}"


# --- one-process steps --------------------------------------------------------------------------------------


def step_busy_wait(ctx: Ctx) -> str:
    """The injected delay's accuracy: on CUDA the sleep kernel's rate is calibrated (:func:`sleep_rate_hz`,
    with the GPU clocked up) and three 0.2 s delays are timed with CUDA events, each within 10 %."""
    import torch

    if not ctx.cuda:
        t0 = time.perf_counter()
        busy_wait(DELAY_S, torch.device("cpu"))
        s = time.perf_counter() - t0
        check(within(s, DELAY_S), f"CPU spin of {DELAY_S} s took {s:.4f} s")
        return f"CPU spin {s:.4f} s for {DELAY_S} s"
    dev = torch.device("cuda", 0)
    rate = sleep_rate_hz(dev)
    clock = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) * 1e3
    measured = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        busy_wait(DELAY_S, dev)
        b.record()
        b.synchronize()
        measured.append(a.elapsed_time(b) * 1e-3)
    detail = f"{', '.join(f'{m:.4f}' for m in measured)} s for {DELAY_S} s; sleep rate {rate / 1e9:.3f} GHz"
    detail += f" (max clock {clock / 1e9:.3f} GHz)" if clock else ""
    check(all(within(m, DELAY_S) for m in measured), detail)
    return detail


def step_kineto(ctx: Ctx) -> str:
    import torch
    from torch.profiler import record_function

    from pnpscale.rank.profiling import make_profiler, profiler_events  # deferred: torch only in the step that profiles

    dev = torch.device("cuda", 0) if ctx.cuda else torch.device("cpu")
    x = torch.randn(512, 512, device=dev)
    with make_profiler(cuda=ctx.cuda, record_shapes=True) as prof:
        for _ in range(2):
            with record_function("probe"):
                y = x @ x
                (y + 1).sum().item()
            prof.step()
    types = sorted({str(e.activity_type()) for e in prof.profiler.kineto_results.events()})
    events = profiler_events(prof)
    kinds = {k: sum(1 for e in events if e.kind is k) for k in Kind}
    check(sum(1 for e in events if e.kind is Kind.CPU and e.name == "probe") == 2, "not 2 'probe' ranges")
    detail = f"types {types}; " + ", ".join(f"{k.value} {n}" for k, n in kinds.items())
    if ctx.cuda:
        gpu = [e for e in events if e.kind is Kind.GPU]
        check(bool(gpu) and kinds[Kind.RUNTIME] > 0, f"no GPU or runtime events: {detail}")
        late = [e.name for e in gpu if e.launch_ns is None or e.launch_ns > e.start_ns]
        check(not late, f"{len(late)} GPU event(s) without a launch before their start, e.g. {late[:2]}; {detail}")
    return detail


# --- 1-rank runs and their offline analysis ----------------------------------------------------------------


def _step_run(problem: str) -> Callable[[Ctx], str]:
    def run(ctx: Ctx) -> str:
        import pandas as pd

        folders = run_app(run_overrides(problem, "inference,training", ctx.cuda), ctx.runs / f"run_{problem}",
                          ctx.left(), runs=2)  # fmt: skip
        parts = []
        for folder in folders:
            doc = layout.read_json(folder / layout.RUN_JSON)
            ranks = _ranks(folder)
            device = doc["device_names"][0]
            nccl = doc.get("versions", {}).get("nccl")
            measured = ranks[~ranks[K.WARMUP]]
            spans = measured.groupby(K.SECTION)[K.GPU_SPAN_S].mean()
            peak = measured[K.PEAK_MEM_BYTES].max()
            reserved = (doc.get("peak_memory") or {}).get("max_reserved_bytes")
            mode = doc.get("mode") or folder.parent.name
            detail = (
                f"{mode}: S_r {measured.groupby(K.SECTION)[K.SECTION_S].mean().round(4).to_dict()} s, GPU span "
                f"{spans.round(4).to_dict()} s; peak {int(peak) / 2**30 if pd.notna(peak) else float('nan'):.2f} GiB"
                f"{f' (reserved {reserved / 2**30:.2f} GiB)' if reserved is not None else ''}"
            )
            check(not any(p.get("cuda_bad_fork") for p in doc.get("processes") or []), f"a bad fork: {detail}")
            if ctx.cuda:
                check(not device.startswith("cpu"), f"ran on {device}")
                check(bool(spans.notna().all()) and bool((spans > 0).all()), f"GPU span missing: {detail}")
                check(pd.notna(peak) and peak > 0, f"no CUDA peak memory: {detail}")
                check(bool(nccl), f"no NCCL version in run.json: {detail}")
                check(reserved is not None, f"no max_memory_reserved in run.json: {detail}")
            parts.append(detail)
        return f"{device}, NCCL {nccl}; " + "; ".join(parts)

    return run


def step_offline_equals_live(ctx: Ctx) -> str:
    import numpy as np
    import pandas as pd

    runs = sorted(p.parent for p in ctx.runs.glob(f"run_*/**/{layout.RUN_JSON}"))
    check(bool(runs), "no run folder (the run_* steps failed)")
    done = []
    for run in runs:
        sections = ",".join(dict.fromkeys(_ranks(run)[K.SECTION].astype(str)))
        label = f"{run.relative_to(ctx.runs).parts[0]}/{layout.read_json(run / layout.RUN_JSON).get('mode', '')}"
        out = ctx.runs / "offline" / label.replace("/", "_")
        said = io.StringIO()  # python -m pnpscale.analyze's own main, in this warm process (no cold start each)
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            code = analyze_main([str(run), "--sections", sections, "--out", str(out)])
        check(code == 0, f"{label}: pnpscale.analyze exit {code}: {said.getvalue().strip()[-300:]}")
        for name in (layout.RANKS, layout.COLLECTIVES, layout.SECTIONS):
            live, off = pd.read_parquet(run / name), pd.read_parquet(out / name)
            check(list(off.columns) == list(live.columns) and len(off) == len(live), f"{label}: {name} shape")
            for c in live.columns:
                if c == K.PEAK_MEM_BYTES:
                    continue
                if live[c].dtype.kind == "f":
                    rtol, atol = (1e-5, 0.0) if c == K.LB else (0.0, 1e-8)
                    ok = np.allclose(off[c], live[c], rtol=rtol, atol=atol, equal_nan=True)
                    worst = float(np.nanmax(np.abs(off[c].to_numpy() - live[c].to_numpy()), initial=0.0))
                    check(bool(ok), f"{label}/{name} {c}: offline differs by up to {worst:.3g}")
                else:
                    check(off[c].astype(str).tolist() == live[c].astype(str).tolist(), f"{label}: {name} {c} differs")
        done.append(label)
    return f"{len(done)} run(s) equal: {', '.join(done)}"


#: measured iterations of each injected-delay run (the fastest is compared: other load only adds time)
DELAY_ITERATIONS = 5


def step_injected_delay(ctx: Ctx) -> str:
    """A busy delay of :data:`DELAY_S` (CPU mode: :data:`DELAY_CPU_S`) on rank 0's denoiser, each run
    right after its own baseline (one multirun: ``inject.delay_s=0,D``), both ``complete``,
    :data:`DELAY_ITERATIONS` each:

    * 1 rank (CUDA: the GPU sleep kernel): the section grows by the delay (GPU span on CUDA);
    * 2 gloo ranks (CPU spin; on one GPU two NCCL ranks time-slice it, so the delay would not be
      ``D``): it is recovered as wait, the section's mean wait growing by ``D (W-1) / W``.
    """
    import pandas as pd

    delay = DELAY_S if ctx.cuda else DELAY_CPU_S
    inj = ["inject.rank=0", "inject.section=denoiser", f"inject.delay_s=0.0,{delay}",
           "hydra.sweep.subdir='gpus=${gpus}/delay_s=${inject.delay_s}'"]  # one run folder per delay
    # tiny on CUDA too: the delay is what is measured, and the runs must fit the check's minutes
    over = [*run_overrides("2d", "inference", cuda=False), f"iterations={DELAY_ITERATIONS}",
            "profile.export_traces=false"]
    col = K.GPU_SPAN_S if ctx.cuda else K.SECTION_S

    def delay_of(r: Path) -> float:
        return float(layout.read_json(r / layout.RUN_JSON)["spec"]["inject"]["delay_s"])

    base, run = sorted(run_app([*over, *inj], ctx.runs / "injected_delay", ctx.left(), runs=2), key=delay_of)

    def fastest(r: Path) -> float:
        t = _ranks(r)
        return float(t[(~t[K.WARMUP]) & (t[K.SECTION] == "denoiser")][col].min())

    added = fastest(run) - fastest(base)
    one = f"1 rank: denoiser {col} +{added:.4f} s"
    two = ["problem=2d", "mode=inference", "gpus=2", f"iterations={DELAY_ITERATIONS}", "warmup=1", "report=false",
           "dist.backend=gloo", *TINY["2d"]]  # fmt: skip
    base2, run2 = sorted(run_app([*two, *inj], ctx.runs / "injected_wait", ctx.left(), runs=2), key=delay_of)

    def least_wait(r: Path) -> float:
        t = pd.read_parquet(r / layout.SECTIONS)
        return float(t[(~t[K.WARMUP]) & (t[K.SECTION] == "denoiser")][K.WAIT_S].min())

    waited = least_wait(run2) - least_wait(base2)
    expected = delay * (2 - 1) / 2
    detail = f"{one}; 2 gloo ranks: denoiser wait +{waited:.4f} s (expected {expected:g}), for {delay} s"
    check(within(added, delay), detail)
    check(within(waited, expected), detail)
    return detail


def step_paper_2d_inference(ctx: Ctx) -> str:
    """One paper-scale 2D inference iteration (8192² x 3, 8 operators, full DRUNet) on one GPU: its
    section times and its CUDA peak memory, allocated and reserved (the measured value of what
    ``benchmarks/README.md`` computes). CPU mode: the same point at the small preset (a paper-scale
    iteration takes over 15 min on 2 CPU cores)."""
    scale = "scale=paper" if ctx.cuda else "scale=small"
    over = ["problem=2d", "mode=inference", "gpus=1", scale, "iterations=1", "warmup=0", "report=false"]
    (run,) = run_app(over, ctx.runs / "paper_2d_inference", ctx.left())
    t = _ranks(run)
    peak = layout.read_json(run / layout.RUN_JSON).get("peak_memory") or {}
    spans = t.groupby(K.SECTION)[K.SECTION_S].mean().round(3).to_dict()
    reserved = peak.get("max_reserved_bytes")
    held = f", reserved {reserved / 2**30:.1f} GiB" if reserved is not None else ""
    detail = f"{scale}: S_r {spans} s, peak {t[K.PEAK_MEM_BYTES].max() / 2**30:.2f} GiB ({peak.get('source')}){held}"
    if ctx.cuda:
        check(reserved is not None, f"no max_memory_reserved in run.json: {detail}")
    return detail


#: The steps in the order they run (what they prove first); limits in seconds on CUDA. A step past its limit is
#: killed with its process group (its pnpscale runs too) and the next one starts.
STEPS: dict[str, Step] = {s.name: s for s in (
    Step("versions", step_versions, 10, "Python, torch, CUDA, NCCL, deepinv, the GPUs, the other packages"),
    Step("nccl_probe", step_nccl_probe, 30, "one NCCL communicator of 2 processes on one GPU: all_reduce, "
         "all_gather, reduce_scatter, send/recv correct", _needs_nccl),
    Step("nccl_two_ranks", step_nccl_two_ranks, 65, "pnpscale's 2-rank NCCL points on one GPU: kernels, payloads "
         "paired, bytes, anomalies, NCCL logs and algorithms (blocking, pipelined, reduce_scatter + all_gather)",
         _needs_nccl),
    Step("two_gpus", step_two_gpus, 30, "a 2-rank NCCL point, one GPU per rank", _needs_two_gpus),
    Step("busy_wait", step_busy_wait, 8, "the injected delay: 0.2 s +- 10 % (CUDA events)", _needs_gpu, warm=True),
    Step("kineto", step_kineto, 12, "a profiled matmul: event types, every GPU event launched before it starts",
         _needs_gpu, warm=True),
    Step("run_2d", _step_run("2d"), 30, "1-rank 2D inference and training at paper widths: GPU spans, CUDA peak "
         "memory, NCCL version", _needs_gpu),
    Step("run_3d", _step_run("3d"), 25, "1-rank 3D inference and training at paper widths", _needs_gpu),
    Step("offline_equals_live", step_offline_equals_live, 25, "python -m pnpscale.analyze of the CUDA traces "
         "equals the live tables"),
    Step("injected_delay", step_injected_delay, 35, "+D on 1 rank's GPU span, +D/2 of mean wait on 2 ranks"),
    Step("paper_2d_inference", step_paper_2d_inference, 60, "one paper-scale 2D inference iteration: section "
         "times, CUDA peak memory", _needs_gpu),
)}  # fmt: skip
#: seconds for all steps: on one GPU (with :data:`SETUP_S` for the wheels' install, Python's start and the
#: header: under 6 minutes) and in CPU mode (tiny sizes on a shared 2-core machine: generous)
BUDGET_S = {True: 330.0, False: 2400.0}
#: seconds before the first step: wheels installed, Python and torch imported, nvidia-smi
SETUP_S = 30.0
#: a step's time limit in CPU mode
CPU_STEP_LIMIT_S = 420.0


@dataclass(frozen=True)
class PlanRow:
    """One step of a plan: ``action`` (``run``, ``skip``, ``cut``), its ``limit_s``, ``reason`` (why skipped or
    cut; for ``run``, what it proves)."""

    name: str
    action: str
    limit_s: float
    reason: str


def step_limit(name: str, cuda: bool) -> float:
    return STEPS[name].limit_s if cuda else CPU_STEP_LIMIT_S


def plan(machine: Machine, budget_s: float, names: Sequence[str] | None = None) -> list[PlanRow]:
    """What a check on ``machine`` does: each step (of ``names``, default all) runs, is skipped by its rule, or
    is cut because the limits of the steps before it and its own pass ``budget_s``.

    >>> rows = plan(Machine(True, 1, (2, 28, 9), (2, 11)), 330)
    >>> [(r.name, r.action) for r in rows][1:4]
    [('nccl_probe', 'run'), ('nccl_two_ranks', 'run'), ('two_gpus', 'skip')]
    """
    rows, used = [], 0.0
    for name in names or list(STEPS):
        step, limit = STEPS[name], step_limit(name, machine.cuda)
        why = step.applies(machine)
        if why is not None:
            rows.append(PlanRow(name, "skip", limit, why))
        elif used + limit > budget_s + 1e-9:
            rows.append(PlanRow(name, "cut", limit, f"{used:.0f} s + {limit:.0f} s > the {budget_s:.0f} s budget"))
        else:
            used += limit
            rows.append(PlanRow(name, "run", limit, step.proves))
    return rows


def format_plan(machine: Machine, budget_s: float, names: Sequence[str] | None = None) -> str:
    """:func:`plan` as text: one line per step, then the totals (the steps' limits against the budget, and
    with :data:`SETUP_S` the whole check)."""
    rows = plan(machine, budget_s, names)
    nccl = ".".join(map(str, machine.nccl)) if machine.nccl else "none"
    torch_v = ".".join(map(str, machine.torch)) if machine.torch else "?"
    out = [f"plan: {'GPU' if machine.cuda else 'CPU mode'}, {machine.gpus} GPU(s), NCCL {nccl}, torch {torch_v}"]
    for r in rows:
        extra = ""
        if r.name in ("nccl_probe", "nccl_two_ranks") and r.action == "run" and machine.cuda:
            extra = f" [two ranks on one GPU by: {', '.join(shared_gpu_methods(machine.nccl))}]"
        out.append(f"{r.name:<20} {r.action:<4} {r.limit_s:>5.0f} s  {r.reason}{extra}")
    steps = sum(r.limit_s for r in rows if r.action == "run")
    setup = SETUP_S if machine.cuda else 0.0
    count = {a: sum(r.action == a for r in rows) for a in ("run", "skip", "cut")}
    out.append(f"total: {steps:.0f} s of step limits (budget {budget_s:.0f} s) + {setup:.0f} s setup = "
               f"{steps + setup:.0f} s; {count['run']} run, {count['skip']} skipped, {count['cut']} cut")  # fmt: skip
    return "\n".join(out)


# --- running the steps ---------------------------------------------------------------------------------------


def run_steps(names: Sequence[str], cuda: bool, runs: Path, timeout: float) -> int:
    """Run steps in this process, one after the other (each gets ``timeout`` s at most); print one JSON line
    per step (``step``, ``detail``, ``code``: 0 pass, 1 fail, 3 skip, ``seconds``); exit status of the last."""
    code = 0
    for name in names:
        t0 = time.monotonic()
        try:
            detail, code = STEPS[name].fn(Ctx(cuda, runs, timeout, read_machine(runs, cuda))), 0
        except Skipped as exc:
            detail, code = str(exc), 3
        except subprocess.TimeoutExpired as exc:
            detail, code = f"a command ran over {exc.timeout:.0f} s", 1
        except Exception as exc:  # noqa: BLE001 - every failure becomes a table row
            detail, code = f"{type(exc).__name__}: {exc}", 1
        line = {"step": name, "detail": detail, "code": code, "seconds": round(time.monotonic() - t0, 3)}
        print(json.dumps(line), flush=True)
    return code


def run_step(name: str, cuda: bool, runs: Path, timeout: float) -> int:
    """One step in this process (:func:`run_steps`): exit status 0 pass, 1 fail, 3 skip."""
    return run_steps([name], cuda, runs, timeout)


def _groups(rows: Sequence[PlanRow]) -> list[list[PlanRow]]:
    """Consecutive steps that run, adjacent warm ones together (one process each group)."""
    out: list[list[PlanRow]] = []
    for r in rows:
        if out and STEPS[r.name].warm and STEPS[out[-1][-1].name].warm and out[-1][-1].action == "run":
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _step_lines(stdout: str) -> dict[str, dict[str, Any]]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith('{"step"'):
            try:
                d = json.loads(line)
                out[str(d["step"])] = d
            except (ValueError, KeyError):
                continue
    return out


def run_all(work: Path, cuda: bool, budget_s: float, names: Sequence[str] | None = None) -> list[StepResult]:
    """Every step of ``names`` (default all) in order, in subprocesses (adjacent warm steps in one) with their
    limits; a step is skipped by its rule (on the machine ``versions`` read, else what the rules assume) or
    cut when the budget left is below its limit. Step logs under ``work/logs``."""
    work.mkdir(parents=True, exist_ok=True)
    runs = work / "runs"
    (work / layout.LOGS_DIR).mkdir(exist_ok=True)
    deadline = time.monotonic() + budget_s
    results: list[StepResult] = []
    todo = list(names or STEPS)
    while todo:
        # before (or without) ``versions``: the rules assume one GPU whose torch has NCCL; the steps find out
        machine = read_machine(runs, cuda) or Machine(cuda, 1 if cuda else 0, (2, 28) if cuda else None)
        left = deadline - time.monotonic()
        row = plan(machine, max(0.0, left), todo[:1])[0]
        if row.action != "run":
            status = SKIP if row.action == "skip" else CUT
            reason = row.reason if status == SKIP else f"{max(0.0, left):.0f} s of the {budget_s:.0f} s budget left"
            results.append(StepResult(row.name, status, 0.0, reason))
            print(format_table(results[-1:]).splitlines()[-1], flush=True)
            todo.pop(0)
            continue
        group = [todo.pop(0)]
        while todo and STEPS[group[-1]].warm and STEPS[todo[0]].warm:
            nxt = plan(machine, max(0.0, left - sum(step_limit(g, cuda) for g in group)), todo[:1])[0]
            if nxt.action != "run":
                break
            group.append(todo.pop(0))
        limit = min(sum(step_limit(g, cuda) for g in group), left)
        cmd = [sys.executable, "-m", "pnpscale.validation.device_check", "step", ",".join(group), "--runs", str(runs),
               "--timeout", str(max(1.0, limit - 3))] + ([] if cuda else ["--cpu"])  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = run_group(cmd, limit)
            out, err, timed_out = proc.stdout, proc.stderr, False
        except subprocess.TimeoutExpired as exc:  # the group (its pnpscale runs too) was killed
            out, err, timed_out = str(exc.output or ""), str(exc.stderr or ""), True
        seconds = time.monotonic() - t0
        (work / layout.LOGS_DIR / f"{'+'.join(group)}.log").write_text(out + "\n--- stderr ---\n" + err)
        lines = _step_lines(out)
        for g in group:
            d = lines.get(g)
            if d is None:
                tail = (err.strip().splitlines() or ["no output"])[-1]
                status, detail = (TIMEOUT, f"over {limit:.0f} s") if timed_out else (FAIL, tail)
                spent = seconds - sum(r.seconds for r in results if r.name in group)
                results.append(StepResult(g, status, spent, detail))
            else:
                status = {0: PASS, 3: SKIP}.get(int(d.get("code", 1)), FAIL)
                results.append(StepResult(g, status, float(d.get("seconds", seconds)), str(d["detail"])))
            print(format_table(results[-1:]).splitlines()[-1], flush=True)
    return results


# --- what comes back ------------------------------------------------------------------------------------------

#: what ``--out`` may receive in all
OUT_MAX_FILES = 8
OUT_MAX_BYTES = 16 * 2**20
#: rank 0's NCCL log brought back: its first and last halves of this many bytes
NCCL_LOG_MAX_BYTES = 2 * 2**20
#: the log archive's members: each cut to this many bytes (its head and tail), the archive to the total
ARCHIVE_MEMBER_MAX_BYTES = 256 * 2**10
ARCHIVE_MAX_BYTES = 8 * 2**20


def head_tail(data: bytes, limit: int) -> bytes:
    """``data`` when it fits ``limit`` bytes, else its first and last ``limit/2`` bytes around a line saying
    how many were left out.

    >>> head_tail(b"abcdefgh", 4)
    b'ab\\n[... 4 bytes left out ...]\\ngh'
    """
    if len(data) <= limit:
        return data
    half = limit // 2
    return data[:half] + f"\n[... {len(data) - 2 * half} bytes left out ...]\n".encode() + data[-half:]


def archive_members(work: Path) -> list[Path]:
    """The files of the log archive, most telling first: step logs, then each run's ``run.json``, the
    commands' stderr, the ranks' stderr and NCCL logs, the probe's outputs."""
    groups = [
        sorted((work / layout.LOGS_DIR).glob("*.log")),
        sorted((work / "runs").glob(f"**/{layout.RUN_JSON}")),
        sorted((work / "runs").glob(f"**/{layout.COMMAND_STDERR}")),
        sorted((work / "runs").glob("**/probe-*.out")),
        sorted((work / "runs").glob("**/probe-*.nccl.log")),
        sorted((work / "runs").glob(f"**/{layout.LOGS_DIR}/**/stderr.log")),
        sorted((work / "runs").glob(f"**/{layout.NCCL_DIR}/rank*.log")),
    ]
    seen: dict[Path, None] = {}
    for g in groups:
        seen.update(dict.fromkeys(p for p in g if p.is_file()))
    return list(seen)


def bring_back(work: Path, out: Path, table_md: str, table_json: str) -> list[Path]:
    """Write to ``out`` what a run brings back (see the module doc): the table, the probe's result, rank 0's
    NCCL log (:func:`head_tail`, :data:`NCCL_LOG_MAX_BYTES`), one ``.tar.gz`` of :func:`archive_members` (each
    cut to :data:`ARCHIVE_MEMBER_MAX_BYTES`, members added while the archive stays under
    :data:`ARCHIVE_MAX_BYTES`; the ones left out are named in the archive's ``MANIFEST``). Returns the files.

    Raises:
        CheckFailed: more than :data:`OUT_MAX_FILES` files or :data:`OUT_MAX_BYTES` bytes in ``out`` after.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = [out / TABLE_MD, out / TABLE_JSON]
    written[0].write_text(table_md)
    written[1].write_text(table_json)
    probe = work / "runs" / PROBE_JSON
    if probe.is_file():
        written.append(out / layout.DEVICE_CHECK_PROBE)
        written[-1].write_bytes(head_tail(probe.read_bytes(), ARCHIVE_MEMBER_MAX_BYTES))
    logs = sorted((work / "runs").glob(f"two_ranks_*/**/{layout.NCCL_DIR}/rank0.log")) + sorted(
        (work / "runs").glob("probe/probe-*-rank0.nccl.log"))  # fmt: skip
    if logs:
        written.append(out / layout.DEVICE_CHECK_NCCL_LOG)
        written[-1].write_bytes(head_tail(logs[0].read_bytes(), NCCL_LOG_MAX_BYTES))
    buf, left_out = io.BytesIO(), []
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in archive_members(work):
            data = head_tail(path.read_bytes(), ARCHIVE_MEMBER_MAX_BYTES)
            if buf.tell() + len(data) > ARCHIVE_MAX_BYTES - 64 * 2**10:  # compressed size so far: room kept
                left_out.append(str(path.relative_to(work)))
                continue
            info = tarfile.TarInfo(str(path.relative_to(work)))
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
        manifest = (f"work folder: {work}\nleft out (archive size): {len(left_out)}\n" + "\n".join(left_out)).encode()
        info = tarfile.TarInfo("MANIFEST")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    written.append(out / layout.DEVICE_CHECK_LOGS)
    written[-1].write_bytes(buf.getvalue())
    files = [p for p in out.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    check(len(files) <= OUT_MAX_FILES and size <= OUT_MAX_BYTES,
          f"{out}: {len(files)} files, {size} bytes (at most {OUT_MAX_FILES}, {OUT_MAX_BYTES} bytes)")  # fmt: skip
    return written


def default_work() -> Path:
    import tempfile

    return Path(tempfile.gettempdir()) / "pnpscale-device-check"


def main(argv: Sequence[str] | None = None) -> int:
    prog = command_prog("pnpscale.validation.device_check")
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU mode: tiny sizes, GPU-only steps skipped")
    sub = p.add_subparsers(dest="cmd")
    one = sub.add_parser("step", help="run steps (comma-separated) in this process")
    one.add_argument("name")
    one.add_argument("--runs", type=Path, required=True)
    one.add_argument("--timeout", type=float, default=120.0)
    one.add_argument("--cpu", action="store_true", dest="cpu_step")
    pr = sub.add_parser("probe-rank", help="one rank of the NCCL probe")
    for a in ("rank", "world", "port"):
        pr.add_argument(a, type=int)
    pr.add_argument("backend")
    pr.add_argument("result", type=Path)
    pr.add_argument("timeout", type=float)
    p.add_argument("--out", type=Path, default=None, help="folder for what comes back (the table, the NCCL probe, "
                   "rank 0's NCCL log, a log archive); default: the work folder")  # fmt: skip
    p.add_argument("--work", type=Path, default=None, help="folder for run folders and logs (default "
                   "$TMPDIR/pnpscale-device-check)")  # fmt: skip
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all steps (default {BUDGET_S[True]:.0f} on a GPU: the check under 6 min; "
                   f"{BUDGET_S[False]:.0f} with --cpu)")  # fmt: skip
    p.add_argument("--only", "--steps", dest="only", default=None, help="comma-separated step names, in order")
    p.add_argument("--plan", action="store_true", help="print what would run, skip or be cut; run nothing")
    p.add_argument("--gpus", type=int, default=1, help="--plan: the machine's GPUs")
    p.add_argument("--nccl", default=None, help="--plan: torch's NCCL version (X.Y.Z)")
    p.add_argument("--torch", default=None, help="--plan: torch's version (A.B)")
    args = p.parse_args(argv)
    if args.cmd == "step":
        names = args.name.split(",")
        unknown = [n for n in names if n not in STEPS]
        if unknown:
            p.error(f"unknown step(s) {unknown}; steps: {', '.join(STEPS)}")
        return run_steps(names, not (args.cpu or args.cpu_step), args.runs, args.timeout)
    if args.cmd == "probe-rank":
        probe_rank(args.rank, args.world, args.port, args.backend, args.result, args.timeout)
        return 0
    names = args.only.split(",") if args.only else None
    unknown = [n for n in names or [] if n not in STEPS]
    if unknown:
        p.error(f"unknown step(s) {unknown}; steps: {', '.join(STEPS)}")
    budget = args.budget if args.budget is not None else BUDGET_S[not args.cpu]
    if args.plan:
        nccl = parse_version(args.nccl) if not args.cpu else None
        machine = Machine(not args.cpu, args.gpus if not args.cpu else 0, nccl, parse_version(args.torch))
        print(format_plan(machine, budget, names))
        return 0
    work = args.work or default_work()
    out = args.out or work
    print(format_table([]), flush=True)  # the header; one row per step as it ends
    results = run_all(work, cuda=not args.cpu, budget_s=budget, names=names)
    table = format_table(results)
    mode = "CPU mode, no GPU" if args.cpu else "GPU"
    summary = summary_line(results, budget)
    md = f"# pnpscale device check ({mode})\n\n{table}\n\n{summary}\n"
    try:
        bring_back(work, out, md, json.dumps([asdict(r) for r in results], indent=1) + "\n")
    except CheckFailed as exc:
        print(f"device-check: {exc}", file=sys.stderr)
        return 1
    print(f"\n{summary}\ntable in {out / TABLE_MD}; runs and logs in {work}")
    return exit_status(results)


if __name__ == "__main__":
    raise SystemExit(main())
