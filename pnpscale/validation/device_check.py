"""The one-call GPU check behind ``scripts/device-check.sh`` (issue 13, section 2).

``python -m pnpscale.validation.device_check [--cpu] [--out DIR] [--budget S]`` runs every step
in its own subprocess (``... device_check step NAME``), each with a time limit, continues after a
failed step, prints a pass/fail table and writes it (``device-check.md``, ``device-check.json``)
and the run folders (``runs/<step>/``) under ``--out``. Exit status 1 when any step failed or
timed out, else 0.

Steps on a one-GPU machine (``--cpu``: the same steps on CPU ranks at tiny sizes where they make
sense, the others skipped, to test this orchestration without a GPU):

* ``versions``: Python, torch, CUDA, NCCL, deepinv, GPU.
* ``busy_wait``: a 0.2 s busy wait measured with CUDA events (CPU: ``perf_counter``), within 10 %.
* ``kineto``: a profiled matmul: event types, every GPU event has a launch no later than its start.
* ``run_{2d,3d}_{inference,training}``: 1-rank runs at a mid scale (paper widths, smaller image):
  complete, device name, GPU spans, CUDA peak memory, NCCL version in ``run.json``.
* ``offline_equals_live``: ``python -m pnpscale.analyze`` of each run's exported traces equals its
  live tables (10 ns on seconds, 1e-5 relative on LB).
* ``two_ranks_shared_gpu``: 2 gloo ranks (every payload known, no ``payload_unmatched``), then 2 ranks
  on the one GPU over NCCL (``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL >= 2.30; an older NCCL refuses,
  and the step is skipped saying so; timings meaningless): per iteration the same collectives and
  payloads as on gloo, NCCL logs parsed, an algorithm found for the main all_reduce.
* ``injected_delay``: ``inject.delay_s=0.2`` (CPU mode: 1 s) in rank 0's denoiser, each run right
  after its own baseline, 5 iterations, both complete: 1 rank, +D (10 %) on its GPU span; 2 gloo
  ranks, +D/2 (10 %) of mean wait (``D (W-1)/W``).
* ``paper_2d_inference``: one paper-scale 2D inference iteration completes: section times, CUDA peak
  memory allocated and reserved (CPU mode: the small preset).

Each result is a :class:`StepResult`; :func:`format_table` / :func:`parse_table` are the plain
text table both ways (tested without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pnpscale import columns as K
from pnpscale.analysis.events import Kind
from pnpscale.analysis.nccl_log import parse_nccl_log
from pnpscale.core import layout
from pnpscale.core.errors import PnpscaleError
from pnpscale.core.record import provenance
from pnpscale.rank.loop import busy_wait, sleep_rate_hz

PASS, FAIL, SKIP, TIMEOUT = "pass", "FAIL", "skip", "TIMEOUT"
TABLE_MD = layout.DEVICE_CHECK_MD
TABLE_JSON = layout.DEVICE_CHECK_JSON
DELAY_S = 0.2
#: the injected delay in CPU mode: CPU ranks sharing a few cores with other jobs vary by tens of ms
#: between two runs, so the delay is made large enough for 10 % to stand above that
DELAY_CPU_S = 1.0
TOLERANCE = 0.10


@dataclass(frozen=True)
class StepResult:
    """One step: ``status`` (pass, FAIL, skip, TIMEOUT), wall ``seconds``, one-line ``detail``."""

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
    """1 when a step failed or timed out, else 0 (skipped steps do not fail the check).

    >>> exit_status([StepResult("a", "pass", 0, ""), StepResult("b", "skip", 0, "")])
    0
    """
    return int(any(r.status in (FAIL, TIMEOUT) for r in results))


# --- run overrides ----------------------------------------------------------------------------------

#: 1-rank runs: paper DRUNet widths at a smaller image on CUDA; tiny on CPU.
MID = {
    ("2d", "inference"): ["scale=paper", "problem.image_size=2048"],
    ("2d", "training"): ["scale=paper", "problem.image_size=1024"],
    ("3d", "inference"): ["scale=paper", "problem.image_size=128"],
    ("3d", "training"): ["scale=paper", "problem.image_size=128"],
}
TINY = {
    "2d": ["scale=small", "problem.image_size=32", "problem.num_operators=4", "problem.patch_size=8",
           "problem.overlap=4", "problem.nc=[4,8,8,8]", "problem.nb=1"],
    "3d": ["scale=small", "problem.image_size=16", "problem.patch_size=8", "problem.overlap=4",
           "problem.nc=[4,8,8,8]", "problem.nb=1"],
}  # fmt: skip
RUNS = [("2d", "inference"), ("2d", "training"), ("3d", "inference"), ("3d", "training")]


def run_overrides(problem: str, mode: str, cuda: bool) -> list[str]:
    """Overrides of a 1-rank check run (3 measured iterations, 1 warm-up, traces exported).

    >>> run_overrides("2d", "inference", cuda=True)[:4]
    ['problem=2d', 'mode=inference', 'gpus=1', 'iterations=3']
    """
    size = MID[(problem, mode)] if cuda else TINY[problem]
    return [f"problem={problem}", f"mode={mode}", "gpus=1", "iterations=3", "warmup=1",
            "profile.export_traces=true", "report=false", *size]  # fmt: skip


def run_group(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a process group of its own, output captured; past ``timeout`` s the whole group
    is killed (SIGKILL: the command, its ranks, their forkserver), so no run outlives its step.

    Raises:
        subprocess.TimeoutExpired: after the kill, with the output so far.
    """
    import signal

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


def run_app(overrides: Sequence[str], root: Path, timeout: float, env: dict[str, str] | None = None) -> Path:
    """``python -m pnpscale OVERRIDES output.root=ROOT``; the run folder (the one ``run.json``).

    Raises:
        CheckFailed: non-zero exit (last stderr line), or not exactly one complete run folder.
    """
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # a rerun starts clean
    root.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pnpscale", *overrides, f"output.root={root}"]
    proc = run_group(cmd, timeout, env={**os.environ, **(env or {})})
    (root / layout.COMMAND_STDOUT).write_text(proc.stdout)
    (root / layout.COMMAND_STDERR).write_text(proc.stderr)
    tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    check(proc.returncode == 0, f"exit {proc.returncode}: {tail}")
    runs = sorted(p.parent for p in root.glob(f"**/{layout.RUN_JSON}"))
    check(len(runs) == 1, f"{len(runs)} run folders under {root}")
    status = layout.run_status(runs[0])
    check(status == layout.STATUS_COMPLETE, f"{layout.RUN_JSON} status {status}")
    return runs[0]


def _ranks(run: Path) -> Any:
    import pandas as pd

    return pd.read_parquet(run / layout.RANKS)


def _anomalies(run: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """A run's anomalies (``run.json``), all or one ``kind``."""
    found = layout.read_json(run / layout.RUN_JSON).get("anomalies") or []
    return [a for a in found if kind is None or a.get("kind") == kind]


#: the first NCCL that lets two ranks of one communicator share a GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1);
#: earlier versions refuse with "Duplicate GPU detected"
SHARED_GPU_MIN_NCCL = (2, 30)


def nccl_version() -> tuple[int, ...] | None:
    """torch's NCCL version (``torch.cuda.nccl.version()``), ``None`` when it has none."""
    try:
        import torch

        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this build
        return None
    return tuple(int(x) for x in v) if isinstance(v, tuple) else None


def shared_gpu_refusal(version: tuple[int, ...] | None) -> str | None:
    """Why two NCCL ranks cannot share this machine's one GPU, ``None`` when they can.

    >>> shared_gpu_refusal((2, 30, 7)) is None, shared_gpu_refusal((2, 27, 3)).split(";")[0]
    (True, 'NCCL 2.27.3 refuses two ranks on one GPU (Duplicate GPU detected)')
    """
    if version is None:
        return "torch has no NCCL"
    if version[:2] < SHARED_GPU_MIN_NCCL:
        return (
            f"NCCL {'.'.join(map(str, version))} refuses two ranks on one GPU (Duplicate GPU detected); NCCL >= "
            f"{'.'.join(map(str, SHARED_GPU_MIN_NCCL))} with NCCL_MULTI_RANK_GPU_ENABLE=1 allows it"
        )
    return None


# --- steps (each runs in its own process) ----------------------------------------------------------------


#: the packages ``scripts/device-wheels.sh`` carries to the GPU machine besides deepinv (reported by ``versions``)
DEVICE_PACKAGES = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "hydra-submitit-launcher",
                   "ijson", "natsort", "pandas", "pyarrow")  # fmt: skip


def step_versions(ctx: Ctx) -> str:
    import deepinv
    import torch


    v = provenance("nccl" if ctx.cuda else "gloo")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    if ctx.cuda:
        check(torch.cuda.is_available(), f"torch {torch.__version__}: CUDA not available")
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "missing"

    others = ", ".join(f"{n} {version(n)}" for n in DEVICE_PACKAGES)
    return (
        f"python {v['python']}, torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {v['nccl']}, "
        f"deepinv {deepinv.__version__}, {gpu}; {others}"
    )


def step_busy_wait(ctx: Ctx) -> str:
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


def _step_run(problem: str, mode: str) -> Callable[[Ctx], str]:
    def run(ctx: Ctx) -> str:
        import pandas as pd


        folder = run_app(run_overrides(problem, mode, ctx.cuda), ctx.runs / f"run_{problem}_{mode}", ctx.timeout)
        doc = layout.read_json(folder / layout.RUN_JSON)
        ranks = _ranks(folder)
        device = doc["device_names"][0]
        nccl = doc.get("versions", {}).get("nccl")
        measured = ranks[~ranks[K.WARMUP]]
        spans = measured.groupby(K.SECTION)[K.GPU_SPAN_S].mean()
        peak = measured[K.PEAK_MEM_BYTES].max()
        reserved = (doc.get("peak_memory") or {}).get("max_reserved_bytes")
        detail = (
            f"{device}; S_r {measured.groupby(K.SECTION)[K.SECTION_S].mean().round(4).to_dict()} s, GPU span "
            f"{spans.round(4).to_dict()} s; peak {int(peak) / 2**30 if pd.notna(peak) else float('nan'):.2f} GiB"
            f"{f' (reserved {reserved / 2**30:.2f} GiB)' if reserved is not None else ''}; NCCL {nccl}"
        )
        check(not any(p.get("cuda_bad_fork") for p in doc.get("processes") or []), f"a bad fork: {detail}")
        if ctx.cuda:
            check(not device.startswith("cpu"), f"ran on {device}")
            check(bool(spans.notna().all()) and bool((spans > 0).all()), f"GPU span missing: {detail}")
            check(pd.notna(peak) and peak > 0, f"no CUDA peak memory: {detail}")
            check(bool(nccl), f"no NCCL version in run.json: {detail}")
            check(reserved is not None, f"no max_memory_reserved in run.json: {detail}")
        return detail

    return run


def step_offline_equals_live(ctx: Ctx) -> str:
    import numpy as np
    import pandas as pd


    runs = sorted(p.parent for p in ctx.runs.glob(f"run_*/**/{layout.RUN_JSON}"))
    check(bool(runs), "no run folder (the run_* steps failed)")
    done = []
    for run in runs:
        sections = ",".join(dict.fromkeys(_ranks(run)[K.SECTION].astype(str)))
        out = ctx.runs / "offline" / run.relative_to(ctx.runs).parts[0]
        cmd = [sys.executable, "-m", "pnpscale.analyze", str(run), "--sections", sections, "--out", str(out)]
        proc = run_group(cmd, ctx.timeout)
        check(proc.returncode == 0, f"{run.name}: analyze exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
        for name in (layout.RANKS, layout.COLLECTIVES, layout.SECTIONS):
            live, off = pd.read_parquet(run / name), pd.read_parquet(out / name)
            check(list(off.columns) == list(live.columns) and len(off) == len(live), f"{run}: {name} shape")
            for c in live.columns:
                if c == K.PEAK_MEM_BYTES:
                    continue
                if live[c].dtype.kind == "f":
                    rtol, atol = (1e-5, 0.0) if c == K.LB else (0.0, 1e-8)
                    ok = np.allclose(off[c], live[c], rtol=rtol, atol=atol, equal_nan=True)
                    worst = float(np.nanmax(np.abs(off[c].to_numpy() - live[c].to_numpy()), initial=0.0))
                    check(bool(ok), f"{run.parent.name}/{name} {c}: offline differs by up to {worst:.3g}")
                else:
                    check(off[c].astype(str).tolist() == live[c].astype(str).tolist(), f"{name} {c} differs")
        done.append(run.relative_to(ctx.runs).parts[0])
    return f"{len(done)} run(s) equal: {', '.join(done)}"


def step_two_ranks_shared_gpu(ctx: Ctx) -> str:
    import pandas as pd

    from pnpscale.results.transfer import transfer_inputs  # deferred: pandas only in the step that reads a run

    base = ["problem=2d", "mode=inference", "gpus=2", "iterations=2", "warmup=1", "report=false", *TINY["2d"]]
    gloo = run_app([*base, "dist.backend=gloo"], ctx.runs / "two_ranks_gloo", ctx.timeout)
    key = [K.RANK, K.ITERATION, K.SECTION, K.SEQ, K.COLLECTIVE, K.PAYLOAD_BYTES]

    def structure(run: Path) -> list:
        c = pd.read_parquet(run / layout.COLLECTIVES)
        return c[key].astype(str).sort_values(key).values.tolist()

    ref = structure(gloo)
    check(bool(ref), "the gloo run has no collective")
    check(not _anomalies(gloo, "payload_unmatched"), f"gloo run: payload_unmatched {_anomalies(gloo)}")
    check(bool(pd.read_parquet(gloo / layout.COLLECTIVES)[K.PAYLOAD_BYTES].notna().all()), "gloo: a payload is NA")
    if not ctx.cuda:
        return f"gloo only (no GPU): {len(ref)} collective rows, every payload known"
    refusal = shared_gpu_refusal(nccl_version())
    if refusal:
        raise Skipped(f"gloo: {len(ref)} collective rows, payloads known; NCCL part not run: {refusal}")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    nccl = run_app([*base, "dist.backend=nccl"], ctx.runs / "two_ranks_nccl", ctx.timeout, env=env)
    got = structure(nccl)
    check(got == ref, f"NCCL collectives differ from gloo: {len(got)} vs {len(ref)} rows; first {got[:1]} vs {ref[:1]}")
    check(not _anomalies(nccl, "payload_unmatched"), f"NCCL run: {_anomalies(nccl)}")
    logs = [layout.nccl_log(nccl, r) for r in range(2) if layout.nccl_log(nccl, r).is_file()]
    check(len(logs) == 2, f"{len(logs)} NCCL logs in {nccl / layout.NCCL_DIR}")
    with open(logs[0], errors="replace") as f:
        log = parse_nccl_log(f)
    inputs = transfer_inputs([nccl])
    main = inputs[inputs[K.COLLECTIVE] == "all_reduce"]
    check(not main.empty, "no all_reduce main collective")
    algos = main[K.ALGORITHM].tolist()
    detail = (
        f"{len(got)} collective rows as on gloo; NCCL {log.version}, {len(log.tuning)} TUNING lines; algorithms {algos}"
    )
    check(all(isinstance(a, str) and a for a in algos), f"{detail}; notes {main[K.ALGORITHM_NOTE].tolist()}")
    return detail


#: measured iterations of each injected-delay run (the fastest is compared: other load only adds time)
DELAY_ITERATIONS = 5


def step_injected_delay(ctx: Ctx) -> str:
    """A busy delay of :data:`DELAY_S` (CPU mode: :data:`DELAY_CPU_S`) on rank 0's denoiser, each run
    beside its own baseline, run just before it (never an earlier step's run), both required
    ``complete``, :data:`DELAY_ITERATIONS` each:

    * 1 rank (CUDA: the GPU sleep kernel): the section grows by the delay (GPU span on CUDA);
    * 2 gloo ranks (CPU spin; on one GPU two NCCL ranks time-slice it, so the delay would not be
      ``D``): it is recovered as wait, the section's mean wait growing by ``D (W-1) / W``.
    """
    import pandas as pd


    delay = DELAY_S if ctx.cuda else DELAY_CPU_S
    inj = ["inject.rank=0", "inject.section=denoiser", f"inject.delay_s={delay}"]
    # tiny on CUDA too: the delay is what is measured, and the four runs must fit the check's minutes
    over = [*run_overrides("2d", "inference", cuda=False), f"iterations={DELAY_ITERATIONS}"]
    base = run_app(over, ctx.runs / "injected_delay_base", ctx.timeout)
    run = run_app([*over, *inj], ctx.runs / "injected_delay", ctx.timeout)
    col = K.GPU_SPAN_S if ctx.cuda else K.SECTION_S

    def fastest(r: Path) -> float:
        t = _ranks(r)
        return float(t[(~t[K.WARMUP]) & (t[K.SECTION] == "denoiser")][col].min())

    added = fastest(run) - fastest(base)
    one = f"1 rank: denoiser {col} +{added:.4f} s"
    two = ["problem=2d", "mode=inference", "gpus=2", f"iterations={DELAY_ITERATIONS}", "warmup=1", "report=false",
           "dist.backend=gloo", *TINY["2d"]]  # fmt: skip
    base2 = run_app(two, ctx.runs / "injected_wait_base", ctx.timeout)
    run2 = run_app([*two, *inj], ctx.runs / "injected_wait", ctx.timeout)

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
    run = run_app(over, ctx.runs / "paper_2d_inference", ctx.timeout)
    t = _ranks(run)
    peak = layout.read_json(run / layout.RUN_JSON).get("peak_memory") or {}
    spans = t.groupby(K.SECTION)[K.SECTION_S].mean().round(3).to_dict()
    reserved = peak.get("max_reserved_bytes")
    held = f", reserved {reserved / 2**30:.1f} GiB" if reserved is not None else ""
    detail = f"{scale}: S_r {spans} s, peak {t[K.PEAK_MEM_BYTES].max() / 2**30:.2f} GiB ({peak.get('source')}){held}"
    if ctx.cuda:
        check(reserved is not None, f"no max_memory_reserved in run.json: {detail}")
    return detail


class Skipped(Exception):  # noqa: N818 - a step outcome, not an error
    """The step does not apply here (its message is the detail)."""


@dataclass(frozen=True)
class Ctx:
    """What a step gets: ``cuda`` (a GPU check, else CPU mode), ``runs`` folder, ``timeout`` seconds."""

    cuda: bool
    runs: Path
    timeout: float


#: name -> (function, time limit in seconds on CUDA); a step past its limit is killed with its process
#: group (its pnpscale runs too) and the next one starts
STEPS: dict[str, tuple[Callable[[Ctx], str], float]] = {
    "versions": (step_versions, 40),
    "busy_wait": (step_busy_wait, 40),
    "kineto": (step_kineto, 40),
    **{f"run_{p}_{m}": (_step_run(p, m), 60) for p, m in RUNS},
    "offline_equals_live": (step_offline_equals_live, 60),
    "two_ranks_shared_gpu": (step_two_ranks_shared_gpu, 90),
    "injected_delay": (step_injected_delay, 120),
    "paper_2d_inference": (step_paper_2d_inference, 150),
}
#: seconds for all steps: on one GPU (the whole check, wheels installed, under 6 minutes) and in CPU
#: mode (tiny sizes on a shared 2-core machine: generous, so that a slow machine fails no step)
BUDGET_S = {True: 320.0, False: 2400.0}
#: a step's time limit in CPU mode
CPU_STEP_LIMIT_S = 420.0


def run_step(name: str, cuda: bool, runs: Path, timeout: float) -> int:
    """Run one step in this process; print its detail as one JSON line; exit status 0 pass, 1 fail, 3 skip."""
    fn, _ = STEPS[name]
    try:
        detail, code = fn(Ctx(cuda, runs, timeout)), 0
    except Skipped as exc:
        detail, code = str(exc), 3
    except subprocess.TimeoutExpired as exc:
        detail, code = f"a command ran over {exc.timeout:.0f} s", 1
    except Exception as exc:  # noqa: BLE001 - every failure becomes a table row
        detail, code = f"{type(exc).__name__}: {exc}", 1
    print(json.dumps({"step": name, "detail": detail}), flush=True)
    return code


def run_all(out: Path, cuda: bool, budget_s: float, names: Sequence[str] | None = None) -> list[StepResult]:
    """Every step in a subprocess with its time limit (capped by what is left of ``budget_s``)."""
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs"
    deadline = time.monotonic() + budget_s
    results = []
    for name in names or list(STEPS):
        limit = min(STEPS[name][1] if cuda else CPU_STEP_LIMIT_S, deadline - time.monotonic())
        if limit < 5:
            results.append(StepResult(name, SKIP, 0.0, f"budget of {budget_s:.0f} s spent"))
            continue
        cmd = [sys.executable, "-m", "pnpscale.validation.device_check", "step", name, "--runs", str(runs),
               "--timeout", str(max(1.0, limit - 5))] + ([] if cuda else ["--cpu"])  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = run_group(cmd, limit)
        except subprocess.TimeoutExpired:  # the step's process group (its pnpscale runs too) was killed
            results.append(StepResult(name, TIMEOUT, time.monotonic() - t0, f"over {limit:.0f} s"))
            print(format_table(results[-1:]).splitlines()[-1], flush=True)
            continue
        seconds = time.monotonic() - t0
        (out / layout.LOGS_DIR).mkdir(exist_ok=True)
        (out / layout.LOGS_DIR / f"{name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        detail = _detail(proc.stdout) or (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        status = {0: PASS, 3: SKIP}.get(proc.returncode, FAIL)
        results.append(StepResult(name, status, seconds, detail))
        print(format_table(results[-1:]).splitlines()[-1], flush=True)
    return results


def _detail(stdout: str) -> str | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith('{"step"'):
            try:
                return str(json.loads(line)["detail"])
            except (ValueError, KeyError):
                return None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pnpscale.validation.device_check", description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU mode: tiny sizes, GPU-only steps skipped")
    sub = p.add_subparsers(dest="cmd")
    one = sub.add_parser("step", help="run one step in this process")
    one.add_argument("name", choices=list(STEPS))
    one.add_argument("--runs", type=Path, required=True)
    one.add_argument("--timeout", type=float, default=120.0)
    one.add_argument("--cpu", action="store_true", dest="cpu_step")
    p.add_argument("--out", type=Path, default=None, help="folder for the table and run folders ($OUT, else a tmp dir)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all steps (default {BUDGET_S[True]:.0f} on a GPU: the check under 6 min; "
                   f"{BUDGET_S[False]:.0f} with --cpu)")  # fmt: skip
    p.add_argument("--only", default=None, help="comma-separated step names")
    args = p.parse_args(argv)
    if args.cmd == "step":
        return run_step(args.name, not (args.cpu or args.cpu_step), args.runs, args.timeout)
    import tempfile

    out = args.out or Path(tempfile.mkdtemp(prefix="pnpscale-device-check-"))
    names = args.only.split(",") if args.only else None
    print(format_table([]), flush=True)  # the header; one row per step as it ends
    budget = args.budget if args.budget is not None else BUDGET_S[not args.cpu]
    results = run_all(out, cuda=not args.cpu, budget_s=budget, names=names)
    table = format_table(results)
    mode = "CPU mode, no GPU" if args.cpu else "GPU"
    (out / TABLE_MD).write_text(f"# pnpscale device check ({mode})\n\n{table}\n")
    (out / TABLE_JSON).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    failed = [r.name for r in results if r.status in (FAIL, TIMEOUT)]
    print(f"\n{len(results) - len(failed)} of {len(results)} steps passed or skipped; table and runs in {out}")
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out / layout.LOGS_DIR})")
    return exit_status(results)


if __name__ == "__main__":
    raise SystemExit(main())
