"""Validation suite: does the compute / transfer / wait split hold on this machine?

``python -m pnpscale.validate [--gpus W] [--delay-s D] [--slurm] [overrides...]`` runs the real
pipeline (local ranks: gloo on CPU, NCCL on a GPU node; with ``--slurm``, as one job on one node of
a SLURM cluster) on known perturbations and checks the decomposition against what they must
produce:

* **Injected imbalance** (``inject.delay_s = D`` on the last rank, inside one section, every
  iteration): the late rank arrives D late at the section's collectives, so the section's mean wait
  grows by ``D (W-1)/W``, its transfer does not change, the delayed rank computes ``D`` more than the
  undelayed ranks' mean ``C_o`` and load balance falls to ``(C_o + D/W) / (C_o + D)`` (``C_o`` from the
  injected run itself: compute levels of two runs differ with the machine's load). The delayed rank's
  own work differs from the others' by timing noise of equal work, so each check's expected value is a
  band as wide as the ranks' compute spread without injection.
* **Payload sweep**: one probe section (a fixed busy compute of equal length on every rank, then
  one ``all_reduce`` of P bytes), measured by the same profiler/section/decomposition code as a run,
  at payloads spanning three orders of magnitude. Only the payload changes, so transfer must grow
  linearly in bytes (least squares: slope = 1/rate, intercept = latency, R²) and wait must not
  (its slope stays small against transfer's). The real sections cannot serve here: their compute
  grows with the image, and so does their timing noise.
* **Noise floor**: without injection, wait as % of compute per section: the study's "timing
  noise" level of this machine (reported, not judged).

Checks read the runs' ``ranks.parquet`` / ``collectives.parquet`` and decompose them with
:func:`pnpscale.analysis.metrics.decompose` (or any function passed instead, so that a wrong decomposition is
seen to fail). Results: a printed pass/fail table and ``validate.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from torch.distributed.elastic.multiprocessing.errors import record

from pnpscale import columns as K
from pnpscale.analysis.events import rank_rows
from pnpscale.analysis.metrics import decompose
from pnpscale.analysis.section import section_records
from pnpscale.analysis.tables import frames, table_writers
from pnpscale.cluster.local import run_ranks
from pnpscale.cluster.slurm import executor_parameters
from pnpscale.core import layout
from pnpscale.core.config import ConfigError, plain
from pnpscale.core.errors import InputError, command_prog
from pnpscale.rank.group import Group
from pnpscale.rank.loop import busy_wait, sleep_rate_hz, sync
from pnpscale.rank.process import threads_per_rank
from pnpscale.rank.profiling import check_trace_complete, make_profiler, profiler_events
from pnpscale.sweep.cli import check_overrides, compose_config
from pnpscale.sweep.task import run

Decompose = Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame]
Tables = tuple[pd.DataFrame, pd.DataFrame]  # (ranks, collectives) of one run

#: The validation problem: 2D inference, tiny DRUNet, tiles of 48 + 2*8 = 64 pixels.
BASE_OVERRIDES = [
    "problem=2d",
    "mode=inference",
    "scale=small",
    "problem.num_operators=4",
    "problem.patch_size=48",
    "problem.overlap=8",
    "problem.max_batch_size=8",
    "problem.nc=[4,8,8,8]",
    "problem.nb=1",
    "report=false",
]


@dataclass
class Check:
    """One validation check.

    Attributes:
        name: what is checked.
        measured: the measured figure (unit in ``unit``).
        expected: the figure the perturbation must produce (``None`` for informational rows).
        tolerance: allowed ``|measured - expected|`` (same unit); a one-sided check (its note says so) allows
            any ``measured`` up to ``expected + tolerance``.
        passed: ``True``/``False``; ``None`` for informational rows.
        unit: ``s``, ``%``, ``GB/s``, ``R²``, ...
        note: how the expectation was derived.
    """

    name: str
    measured: float
    expected: float | None
    tolerance: float | None
    passed: bool | None
    unit: str
    note: str = ""


def _judge(name: str, measured: float, expected: float, tol: float, unit: str, note: str) -> Check:
    ok = bool(np.isfinite(measured) and abs(measured - expected) <= tol)
    return Check(name, float(measured), float(expected), float(tol), ok, unit, note)


def _measured(sections: pd.DataFrame, section: str) -> pd.DataFrame:
    s = sections[(sections[K.SECTION] == section) & ~sections[K.WARMUP].astype(bool)]
    if s.empty:
        raise ValueError(f"section {section!r} has no measured iteration")
    return s


def imbalance_checks(base: Tables, injected: Tables, section: str, delay_s: float, world: int,
                     decompose_fn: Decompose = decompose, rel_tol: float = 0.25) -> list[Check]:  # fmt: skip
    """Checks of an injected busy delay ``delay_s`` on one rank inside ``section``.

    Args:
        base, injected: (ranks, collectives) tables of the same point without and with injection.
        section: the injected section.
        delay_s: the injected delay, seconds.
        world: ranks W.
        decompose_fn: the decomposition under test.
        rel_tol: tolerance as a fraction of the expected change (the study's noise is a few
            percent of compute; the delay is chosen much larger than the section's own time).

    Returns:
        checks on wait (+D(W-1)/W against the base run), transfer (unchanged), the delayed rank's compute
        (``D`` above the other ranks', within the injected run) and LB (predicted within the injected run).
        The delayed rank's own work ``C_d`` differs from the others' mean ``C_o`` by timing noise of equal
        work, ``|C_d - C_o| <= s`` with ``s`` the base run's median spread (:func:`imbalance_spread`): its
        compute is ``C_o + D + (C_d - C_o)``, C_max too (``D`` exceeds the spread), and
        ``LB = (C_o + (D + C_d - C_o)/W) / (C_o + D + C_d - C_o)``. Each check's tolerance is half its band
        plus the noise tolerance. Compute levels are compared within one run, never across runs: a
        machine's load changes between two runs, and a clean CI run read the base's C_max 0.11 s against
        the injected run's undelayed 0.013 s, so C_max "grew" by 0.115 s for D = 0.2 s while both runs
        were right. ``C_o = (W C - C_max)/(W - 1)`` per iteration, the mean over the undelayed ranks.

    Raises:
        ValueError: ``world < 2`` (a 1-rank run has no collective to wait in).
    """
    if world < 2:
        raise ValueError(f"injected imbalance needs at least 2 ranks, got {world}")
    b = _measured(decompose_fn(*base), section)
    i = _measured(decompose_fn(*injected), section)
    # medians over the measured iterations: robust to an iteration disturbed by the machine
    d_wait = i[K.WAIT_S].median() - b[K.WAIT_S].median()
    d_transfer = i[K.TRANSFER_S].median() - b[K.TRANSFER_S].median()
    c_others = (world * i[K.COMPUTE_S] - i[K.COMPUTE_MAX_S]) / (world - 1)
    excess = (i[K.COMPUTE_MAX_S] - c_others).median()
    c_o = float(c_others.median())
    c, cmax = b[K.COMPUTE_S].median(), b[K.COMPUTE_MAX_S].median()
    spread = min(max(imbalance_spread(*base, section), 0.0), cmax)
    lb_ends = [(c_o + (delay_s + d) / world) / (c_o + delay_s + d) for d in (-spread, spread)]
    lb_band = (min(lb_ends), max(lb_ends))
    lb_meas = (i[K.COMPUTE_S] / i[K.COMPUTE_MAX_S]).median()
    expect_wait = delay_s * (world - 1) / world
    base_text = f"C={c:.4g} s, C_max={cmax:.4g} s without injection"
    return [
        _judge(f"imbalance: wait grows by D(W-1)/W [{section}]", d_wait, expect_wait - spread / 2,
               rel_tol * expect_wait + spread / 2, "s", f"D={delay_s:g} s on 1 of W={world} ranks; {base_text}"),
        _judge(f"imbalance: transfer unchanged [{section}]", d_transfer, 0.0, rel_tol * expect_wait, "s",
               "the late rank waits for nobody: min over ranks is unchanged"),
        _judge(f"imbalance: delayed rank computes D more [{section}]", excess, delay_s, rel_tol * delay_s + spread,
               "s", f"C_max - C_o in the injected run, C_o={c_o:.4g} s the undelayed ranks' mean"),
        _judge(f"imbalance: LB = (C_o + D/W)/(C_o + D) [{section}]", lb_meas, sum(lb_band) / 2,
               0.05 + (lb_band[1] - lb_band[0]) / 2, "", f"C_o={c_o:.4g} s; C_d - C_o in +-{spread:.4g} s"),
    ]  # fmt: skip


def imbalance_spread(ranks: pd.DataFrame, collectives: pd.DataFrame, section: str) -> float:
    """The spread of the ranks' compute in ``section`` of a run without injection: seconds, median over measured
    iterations of ``max_r C_r - min_r C_r``, with ``C_r = S_r - sum_c D_rc`` (the study's rule: collectives
    blocking throughout, as a pnpscale run's are). It bounds how far below ``C_max`` the delayed rank's own
    compute can lie.

    Raises:
        ValueError: ``section`` has no measured iteration.

    >>> r = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "warmup": False, "section_s": [1.0, 1.0]})
    >>> c = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "duration_s": [0.5, 0.1]})
    >>> round(imbalance_spread(r, c, "s"), 9)
    0.4
    """
    s = _measured(ranks, section).set_index([K.ITERATION, K.RANK])[K.SECTION_S].astype("float64")
    c = collectives[collectives[K.SECTION] == section].groupby([K.ITERATION, K.RANK])[K.DURATION_S].sum()
    compute = (s - c.reindex(s.index, fill_value=0.0)).groupby(level=0)
    return float((compute.max() - compute.min()).median())


def linear_fit(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = slope * x + intercept``; returns ``(slope, intercept, R²)``.

    >>> [round(v, 6) for v in linear_fit([1, 2, 3], [3, 5, 7])]
    [2.0, 1.0, 1.0]
    """
    xa, ya = np.asarray(x, float), np.asarray(y, float)
    slope, intercept = np.polyfit(xa, ya, 1)
    resid = ya - (slope * xa + intercept)
    ss_tot = float(((ya - ya.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return float(slope), float(intercept), r2


#: The payload sweep's bar: at least this many sizes, the largest this many times the smallest.
MIN_PAYLOAD_SIZES, MIN_PAYLOAD_SPAN = 3, 100


def split_cluster(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``overrides`` as (``cluster*`` ones, which shape a SLURM job, the others, which go to the suite's runs)."""
    cluster = [o for o in overrides if o.lstrip("+").startswith("cluster")]
    return cluster, [o for o in overrides if o not in cluster]


def payload_checks(runs: Sequence[Tables], section: str, decompose_fn: Decompose = decompose,
                   min_r2: float = 0.9, max_wait_ratio: float = 0.25) -> list[Check]:  # fmt: skip
    """Transfer linear in payload bytes, wait not, over runs of one section at several sizes.

    For each run: the median over measured iterations of the section's transfer and wait, and its
    main payload bytes. Fit ``transfer = bytes / rate + latency``.

    Returns:
        checks: payload span (>= 100x), R² of transfer vs bytes (>= ``min_r2``), slope > 0 (rate
        in GB/s = 1e9 B/s, latency in s reported), and wait slope <= ``max_wait_ratio`` x transfer
        slope. That last check is one-sided: a decomposition that books the bytes' time as wait makes wait
        grow with bytes; a wait that falls across the sweep is timing noise of the separate runs, not bytes
        (a CI run read -0.66x: wait about 26 ms lower at 32 MiB than at 16 KiB).

    Raises:
        ValueError: fewer than 3 runs.
    """
    if len(runs) < MIN_PAYLOAD_SIZES:
        raise ValueError(f"the payload sweep needs at least {MIN_PAYLOAD_SIZES} sizes, got {len(runs)}")
    pts = []
    for ranks, colls in runs:
        s = _measured(decompose_fn(ranks, colls), section)
        main = colls[colls[K.MAIN].astype(bool) & (colls[K.SECTION] == section)] if K.MAIN in colls else colls
        pts.append((float(main[K.PAYLOAD_BYTES].max()), float(s[K.TRANSFER_S].median()), float(s[K.WAIT_S].median())))
    pts.sort()
    x = [p[0] for p in pts]
    slope, intercept, r2 = linear_fit(x, [p[1] for p in pts])
    w_slope, _, _ = linear_fit(x, [p[2] for p in pts])
    span = x[-1] / x[0]
    rate = 1e-9 / slope if slope > 0 else float("nan")
    return [
        Check("payload: bytes span (max/min)", span, None, None, span >= MIN_PAYLOAD_SPAN, "x",
              "at least two orders of magnitude"),
        Check(f"payload: transfer linear in bytes, R² [{section}]", r2, 1.0, 1.0 - min_r2, r2 >= min_r2, "R²",
              f"rate {rate:.3g} GB/s (1/slope), latency {intercept * 1e6:.3g} µs (intercept)"),
        Check(f"payload: transfer grows with bytes [{section}]", rate, None, None, slope > 0, "GB/s",
              "1/slope of transfer vs bytes"),
        Check(f"payload: wait does not grow with bytes [{section}]", w_slope / slope if slope > 0 else float("nan"),
              0.0, max_wait_ratio, bool(slope > 0 and w_slope <= max_wait_ratio * slope), "x transfer slope",
              "wait slope relative to transfer slope, at most (one-sided)"),
    ]  # fmt: skip


def noise_checks(base: Tables, decompose_fn: Decompose = decompose) -> list[Check]:
    """Wait as % of compute per section without injection (informational: the noise floor)."""
    s = decompose_fn(*base)
    s = s[~s[K.WARMUP].astype(bool)]
    out = []
    for section, grp in s.groupby(K.SECTION, sort=False):
        pct = 100.0 * grp[K.WAIT_S].sum() / grp[K.COMPUTE_S].sum()
        out.append(Check(f"noise: wait % of compute, no injection [{section}]", pct, None, None, None, "%",
                         "timing noise of equal work on this machine"))  # fmt: skip
    return out


def evaluate(base: Tables, injected: Tables, payload_runs: Sequence[Tables], *, section: str, delay_s: float,
             world: int, decompose_fn: Decompose = decompose) -> list[Check]:  # fmt: skip
    """Every check of the suite from already measured tables (pure)."""
    return (
        imbalance_checks(base, injected, section, delay_s, world, decompose_fn)
        + payload_checks(payload_runs, PROBE, decompose_fn)
        + noise_checks(base, decompose_fn)
    )


def passed(checks: Sequence[Check]) -> bool:
    """All judged checks passed (informational rows do not count)."""
    return all(c.passed for c in checks if c.passed is not None)


def format_table(checks: Sequence[Check]) -> str:
    """The printed pass/fail table."""
    rows = []
    for c in checks:
        rows.append(
            {
                "check": c.name,
                "result": {True: "PASS", False: "FAIL", None: "info"}[c.passed],
                "measured": f"{c.measured:.4g} {c.unit}".strip(),
                "expected": "" if c.expected is None else f"{c.expected:.4g} ± {c.tolerance:.2g}",
                "note": c.note,
            }
        )
    return pd.DataFrame(rows).to_markdown(index=False)


def read_tables(run_dir: Path) -> Tables:
    """(ranks, collectives) of a complete run folder."""
    return pd.read_parquet(run_dir / layout.RANKS), pd.read_parquet(run_dir / layout.COLLECTIVES)


# ------------------------------------------------------------------------------------------
# Running the cases (side effects)
# ------------------------------------------------------------------------------------------


def run_probe(out: Path, *, gpus: int, payloads: Sequence[int], compute_s: float, iterations: int,
              overrides: Sequence[str] = ()) -> list[Tables]:  # fmt: skip
    """Launch the payload probe on ``gpus`` local ranks; (ranks, collectives) per payload."""

    backend = next((o.split("=", 1)[1] for o in overrides if o.startswith("dist.backend=")), "auto")
    args = (list(payloads), compute_s, iterations, 1, backend, 300.0, str(out))
    run_ranks(gpus, probe_main, args, out / layout.LOGS_DIR, threads_per_rank(1, gpus))
    return [read_tables(out / f"payload={p}") for p in payloads]


def _run_case(overrides: list[str], run_dir: Path) -> Tables:

    check_overrides(overrides)
    run(compose_config(overrides), run_dir)
    return read_tables(run_dir)


PROBE = "probe"
#: Measured iterations per payload of the probe (``--probe-iterations``). A probe iteration costs its
#: compute (20 ms) and one all_reduce, so the medians the fit takes can afford more than the pipeline cases'
#: few: with 3 per payload, a CI run on a loaded 2-core machine (tests beside it) read R² 0.66 (latency 17 ms).
PROBE_ITERATIONS = 10


@record
def probe_main(payloads: list[int], compute_s: float, iterations: int, warmup: int, backend: str, timeout_s: float,
               out: str) -> None:  # fmt: skip
    """One rank of the payload probe: per payload P, ``warmup + iterations`` probe sections.

    Each probe section: ``busy_wait(compute_s)`` then one float32 ``all_reduce`` of P bytes; a
    barrier after each. Rank 0 writes ``out/payload=<P>/{ranks,collectives}.parquet`` (section
    renamed ``probe``).
    """
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function


    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group = Group(backend, timeout_s)  # the solver's device rule (deepinv's) and backend choice
    cuda, device = group.backend == "nccl", group.device
    if cuda:
        sleep_rate_hz(device)  # busy_wait calibrated before the profiler starts
    names = [f"{PROBE}_{p}" for p in payloads]
    try:
        with make_profiler(cuda=cuda, record_shapes=True) as prof:
            for name, p in zip(names, payloads, strict=True):
                x = torch.zeros(max(1, p // 4), dtype=torch.float32, device=device)
                for _ in range(warmup + iterations):
                    with record_function(name):
                        busy_wait(compute_s, device)
                        dist.all_reduce(x)
                        sync(device)
                    group.barrier()
                    prof.step()
        events = profiler_events(prof)
        tables = []
        for n in names:
            records = section_records(events, (n,), require_gpu=cuda, cpu_start=cuda)
            check_trace_complete(records, (n,), warmup + iterations, cuda, group.rank)
            tables.append(rank_rows(group.rank, records, warmup))
        gathered = group.gather(tables)
        if group.rank == 0:
            assert gathered is not None  # rank 0 holds every rank's tables
            for i, p in enumerate(payloads):
                per_rank: list[tuple[dict[str, Any], dict[str, Any]]] = [(t[i], {}) for t in gathered]
                ranks, colls = frames(per_rank, image_bytes=p)
                ranks[K.SECTION] = PROBE
                colls[K.SECTION] = PROBE
                layout.commit_files(Path(out) / f"payload={p}", table_writers(ranks, colls))
        group.barrier()
    finally:
        group.close()


def case_overrides(gpus: int, delay_s: float, section: str, iterations: int, overrides: Sequence[str] = ()
                   ) -> dict[str, list[str]]:  # fmt: skip
    """The pnpscale overrides of the suite's two point cases, ``baseline`` and ``imbalance`` (the last rank
    delayed by ``delay_s`` seconds in ``section``), after the user's ``overrides``."""
    common = [*BASE_OVERRIDES, f"gpus={gpus}", f"iterations={iterations}", "warmup=1", *overrides]
    common.append("problem.image_size=64")
    injected = [f"inject.rank={gpus - 1}", f"inject.section={section}", f"inject.delay_s={delay_s}"]
    return {"baseline": common, "imbalance": [*common, *injected]}


def check_suite(gpus: int, delay_s: float, section: str, payloads: Sequence[int], iterations: int,
                overrides: Sequence[str] = (), probe_iterations: int = PROBE_ITERATIONS) -> None:  # fmt: skip
    """Refuse, before any rank starts, what the suite cannot judge: ``--gpus`` below 2, ``--delay-s`` not above
    0, ``--iterations`` or ``--probe-iterations`` below 1, ``--payloads`` not at least 3 distinct sizes of at
    least 1 byte spanning 100x (the payload check's own bar, :func:`payload_checks`), and each case's config
    (the command line's own checks, :func:`pnpscale.sweep.cli.check_overrides`, then the composed config's).

    Raises:
        InputError: the first problem, naming the option or key and what is allowed (exit 2).
    """
    if gpus < 2:
        raise InputError(f"--gpus={gpus}: must be >= 2 (a 1-rank run has nothing to wait for)")
    if not delay_s > 0:
        raise InputError(f"--delay-s={delay_s}: must be > 0")
    if iterations < 1:
        raise InputError(f"--iterations={iterations}: must be >= 1")
    if probe_iterations < 1:
        raise InputError(f"--probe-iterations={probe_iterations}: must be >= 1")
    sizes = sorted(set(payloads))
    shown = ",".join(map(str, payloads))
    if len(sizes) < MIN_PAYLOAD_SIZES or sizes[0] < 1 or sizes[-1] < MIN_PAYLOAD_SPAN * sizes[0]:
        raise InputError(f"--payloads={shown}: needs at least {MIN_PAYLOAD_SIZES} distinct sizes of at least 1 byte, "
                         f"the largest at least {MIN_PAYLOAD_SPAN} times the smallest "
                         "(default 16384,262144,4194304,33554432)")  # fmt: skip
    for case in case_overrides(gpus, delay_s, section, iterations, overrides).values():
        check_overrides(case)
        compose_config(case)


def run_suite(out: Path, *, gpus: int, delay_s: float, section: str, payloads: Sequence[int], iterations: int,
              probe_iterations: int = PROBE_ITERATIONS, compute_s: float = 0.02, overrides: Sequence[str] = (),
              echo: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Run the cases under ``out`` and write ``out/validate.json``; returns its content.

    ``iterations`` measured iterations per pipeline case, ``probe_iterations`` per payload of the probe."""
    cases = case_overrides(gpus, delay_s, section, iterations, overrides)
    echo(f"validation runs under {out}")
    base = _run_case(cases["baseline"], out / "case=baseline")
    inj = _run_case(cases["imbalance"], out / "case=imbalance")
    payload = run_probe(out / "case=payload", gpus=gpus, payloads=payloads, compute_s=compute_s,
                        iterations=probe_iterations, overrides=overrides)  # fmt: skip
    checks = imbalance_checks(base, inj, section, delay_s, gpus) + payload_checks(payload, PROBE) + noise_checks(base)
    result = {
        "passed": passed(checks),
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpus": gpus,
        "delay_s": delay_s,
        "section": section,
        "payloads_bytes": list(payloads),
        "probe_compute_s": compute_s,
        "iterations": iterations,
        "probe_iterations": probe_iterations,
        "overrides": list(overrides),
        "checks": [asdict(c) for c in checks],
    }
    layout.write_json(out / layout.VALIDATE_JSON, result)
    echo(format_table(checks))
    echo(("PASSED" if result["passed"] else "FAILED") + f": {out / layout.VALIDATE_JSON}")
    return result


def submit_suite(
    out: Path, overrides: Sequence[str], echo: Callable[[str], None] = print, **suite: Any
) -> dict[str, Any]:
    """Run :func:`run_suite` as one SLURM job on one node (``--slurm``), wait, return its result.

    The job holds one task and ``gpus`` GPUs; inside it the suite launches its ranks locally, as on
    any GPU node. ``cluster.*`` overrides (partition, account, timeout_min, ...) shape the job, the
    others go to the suite's runs.
    """
    import submitit


    cluster_ov, run_ov = split_cluster(overrides)
    cfg = compose_config(["cluster=slurm", *[o for o in cluster_ov if o != "cluster=slurm"]])
    cluster = plain(cfg.cluster)
    params = executor_parameters(1, cluster)
    params.update(name="pnpscale-validate", tasks_per_node=1, gpus_per_node=suite["gpus"])
    executor = submitit.AutoExecutor(folder=str(out / ".submitit"), cluster="slurm")
    executor.update_parameters(**params)
    job = executor.submit(run_suite, out, overrides=run_ov, **suite)
    echo(f"validation submitted as SLURM job {job.job_id} (logs: {out / '.submitit'}); waiting")
    result = job.result()
    echo(format_table([Check(**c) for c in result["checks"]]))
    echo(("PASSED" if result["passed"] else "FAILED") + f": {out / layout.VALIDATE_JSON}")
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m pnpscale.validate``: exit 0 when every judged check passes, 1 otherwise."""
    parser = argparse.ArgumentParser(prog=command_prog("pnpscale.validate"), description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks W (>= 2; default 2)")
    parser.add_argument("--delay-s", type=float, default=0.2, help="injected busy delay D, seconds (default 0.2)")
    parser.add_argument("--section", default="denoiser", choices=["gradient", "denoiser"], help="injected section")
    parser.add_argument("--payloads", default="16384,262144,4194304,33554432",
                        help="payload sweep, bytes per all_reduce (default 16 KiB .. 32 MiB)")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=4, help="measured iterations per pipeline case (default 4)")
    parser.add_argument("--probe-iterations", type=int, default=PROBE_ITERATIONS,
                        help=f"measured iterations per payload of the probe (default {PROBE_ITERATIONS})")  # fmt: skip
    parser.add_argument("--out", default=None, help="output folder (default outputs/validate/<timestamp>)")
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="run the suite as one SLURM job (one node, --gpus GPUs) shaped by cluster.*",
    )
    parser.add_argument("overrides", nargs="*", help="pnpscale config overrides, e.g. dist.backend=gloo")
    args = parser.parse_args(argv)
    try:
        payloads = [int(s) for s in args.payloads.split(",")]
    except ValueError:
        parser.error(f"--payloads={args.payloads}: must be comma-separated integers (bytes)")
    cluster_ov, run_ov = split_cluster(args.overrides)
    if cluster_ov and not args.slurm:
        parser.error("cluster overrides need --slurm (the suite's own runs are local to one node)")
    try:
        check_suite(args.gpus, args.delay_s, args.section, payloads, args.iterations, run_ov, args.probe_iterations)
    except InputError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = Path(args.out) if args.out else Path("outputs") / "validate" / stamp

    suite = dict(
        gpus=args.gpus, delay_s=args.delay_s, section=args.section, payloads=payloads, iterations=args.iterations,
        probe_iterations=args.probe_iterations,
    )
    try:
        if args.slurm:
            result = submit_suite(out.resolve(), args.overrides, **suite)
        else:
            result = run_suite(out, overrides=args.overrides, **suite)
    except ConfigError as exc:
        print(f"pnpscale.validate: error: {exc}", file=sys.stderr)
        return 2
    return 0 if result["passed"] else 1
