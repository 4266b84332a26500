"""The command ``python -m pnpscale.project``: its options checked, the projection they ask for made
(:func:`projection_for`), written (:func:`pnpscale.results.projection.output.write`) with the options recorded, and a
report's recorded projection made again with them (:func:`user_projection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.core import layout
from pnpscale.core.errors import command_prog
from pnpscale.results.projection.base import NodeSizeUnknown, TimeShared, local_cores, recorded_cores
from pnpscale.results.projection.model import (
    Options,
    Projection,
    ProjectionError,
    parse_algorithms,
    parse_rates,
    project,
)
from pnpscale.results.projection.output import default_targets, rank_samples, with_algorithms, write
from pnpscale.results.runs import NoRunsError, build_table


def _parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(
        prog=command_prog("pnpscale.project"), description="Project a sweep's scaling curve to unmeasured GPU counts."
    )
    parser.add_argument("path", help="folder holding run folders (a sweep)")
    parser.add_argument("--gpus", default=None, help="GPU counts to project, comma-separated (default: powers of "
                        "two above the largest measured, up to 16 times it)")  # fmt: skip
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: as measured; "
                        "single-node sweeps: every N on one node)")  # fmt: skip
    parser.add_argument("--rate", action="append", default=[], metavar="ROUTE=GBps",
                        help="a route's rate in GB/s (1e9 B/s): intra (every one-node GPU count), intra:G "
                             "(G GPUs on one node), tree or ring; repeatable")  # fmt: skip
    parser.add_argument("--algorithm", action="append", default=[], metavar="NODES=ALGO",
                        help="the all_reduce algorithm (ring, tree) on NODES nodes (default: NCCL's log at that "
                             "node count, else ring); repeatable")  # fmt: skip
    parser.add_argument("--pe-min", type=float, default=0.8, help="PE threshold (default 0.8)")
    parser.add_argument("--devices", type=int, default=None, help="the cores CPU ranks share (default: this "
                        "machine's, for gloo sweeps): points past them not fitted nor projected")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=0.10, help="relative error above which the fit is said "
                        "to miss its own points (default 0.10)")  # fmt: skip
    parser.add_argument("--fit-gpus", default=None, help="fit only on these measured GPU counts (comma-separated)")
    parser.add_argument("--out", default=None, help="output folder (default: PATH/report)")
    return parser


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ProjectionError(f"{what}={text}: give positive integers, comma-separated")
    return vals


def check_options(args: Any) -> None:
    """The command's option values, before anything is read.

    Raises:
        ProjectionError: one line naming the option and what it must be.
    """
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ProjectionError(f"--gpus-per-node={args.gpus_per_node}: must be >= 1")
    if args.devices is not None and args.devices < 1:
        raise ProjectionError(f"--devices={args.devices}: must be >= 1")
    if not 0 < args.pe_min <= 1:  # NaN fails too
        raise ProjectionError(f"--pe-min={args.pe_min:g}: must be in (0, 1] (a parallel efficiency)")
    if not 0 < args.tolerance < 10:
        raise ProjectionError(f"--tolerance={args.tolerance:g}: must be a positive relative error (0.1 = 10 %)")
    for what, text in (("--gpus", args.gpus), ("--fit-gpus", args.fit_gpus)):
        if text:
            _ints(text, what)
    parse_rates(args.rate)
    parse_algorithms(args.algorithm)


def projection_for(args: Any, table: pd.DataFrame) -> Projection:
    """The projection the command's options (``args``, :func:`check_options` passed) ask for, of ``table``
    (:func:`pnpscale.results.runs.build_table`'s rows): the command and a report rebuilding a user's
    projection (:func:`user_projection`) run this same code.

    Raises:
        ProjectionError: no complete run, ``--fit-gpus`` without complete runs, nothing projectable.
    """
    options = Options(args.gpus_per_node, parse_rates(args.rate), parse_algorithms(args.algorithm), args.pe_min,
                      args.devices, args.tolerance)  # fmt: skip
    targets = _ints(args.gpus, "--gpus") if args.gpus else None
    fit_gpus = _ints(args.fit_gpus, "--fit-gpus") if args.fit_gpus else None
    table = table[table["status"] == "complete"]
    if table.empty:
        raise ProjectionError(f"{args.path}: no complete run to fit on")
    if fit_gpus:
        measured = sorted({int(g) for g in table[K.GPUS]})
        never = sorted(set(fit_gpus) - set(measured))
        if never:
            raise ProjectionError(
                f"--fit-gpus={args.fit_gpus}: no complete run at {', '.join(map(str, never))} GPU(s) "
                f"(measured: {', '.join(map(str, measured))})"
            )
        table = table[table[K.GPUS].isin(fit_gpus)]
    gpus = targets or default_targets(int(table[K.GPUS].max()))
    p = project(with_algorithms(table), gpus, options, samples=rank_samples(table))
    if not p.findings:
        why = "; ".join(f"{k[0]} {k[1]}: {v}" for k, v in sorted(p.skipped.items()))
        raise ProjectionError(f"nothing could be projected ({why or 'no (problem, mode)'}); nothing written"
                              + fix_hint(args, table, p))  # fmt: skip
    return p


def fix_hint(args: Any, table: pd.DataFrame, p: Projection) -> str:
    """What to run instead, for a refusal the command can name a fix of: past the largest measured node with no
    node size (the node size and the inter-node rate are facts of the machine: the command with them, and one
    that works now, within the measured node); past the cores of CPU ranks (no flag fixes it: said plainly, and
    the command that works, within the cores)."""
    import shlex

    reasons = " ".join(p.skipped.values())
    measured = sorted({int(g) for g in table[K.GPUS]})
    base = ["python", "-m", "pnpscale.project", str(args.path)]
    if "is not assumed" in reasons or NodeSizeUnknown.__name__ in reasons:
        top = measured[-1]
        within = [n for n in measured if n > 1] or [top]
        return ("\nthe node size is a fact of the machine: give it, with the inter-node rate you measured "
                f"(nccl-tests' busbw), e.g. {shlex.join([*base, '--gpus-per-node', 'G', '--rate', 'ring=GBps'])}"
                f" (G >= {top}); within the measured node (measured counts: the fit checked, nothing past it), "
                f"this works now: {shlex.join([*base, '--gpus', ','.join(map(str, within))])}")  # fmt: skip
    if "cores the CPU ranks share" in reasons or TimeShared.__name__ in reasons:
        cores = args.devices or recorded_cores(table) or local_cores()
        within = [n for n in measured if 1 < n <= cores]
        return (f"\non CPU ranks that time-share the cores there is no honest projection past the cores ({cores}): "
                "measure on a machine with a core per rank thread, or on GPUs (--devices D only corrects the count "
                "of cores the runs' machine had; a larger D hides the time-sharing, it does not remove it)"
                + (f"; within them this runs, checking the fit at the measured counts: "
                   f"{shlex.join([*base, '--gpus', ','.join(map(str, within))])}"
                   if len(within) and len([n for n in measured if n <= cores]) >= 2 else ""))  # fmt: skip
    return ""


def _options_only(argv: Sequence[str]) -> list[str]:
    """The command line's options without the sweep folder and ``--out`` (what a rebuilt report re-runs).

    >>> _options_only(["SWEEP", "--devices", "64", "--out", "R", "--rate=ring=10"])
    ['--devices', '64', '--rate=ring=10']
    """
    args = _parser().parse_args(list(argv))
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--out":
            skip = True
            continue
        if item.startswith("--out=") or item == args.path:
            continue
        out.append(item)
    return out


def user_projection(report_dir: Any, table: pd.DataFrame) -> tuple[Projection, list[str]] | None:
    """A projection made by ``python -m pnpscale.project`` into the report folder ``report_dir``, made again
    on ``table`` with the options it recorded (:data:`pnpscale.core.layout.PROJECTION_OPTIONS`), so that
    rebuilding the report keeps it (with the numbers of the runs now there); ``None`` when the report
    holds none.

    Raises:
        ProjectionError: the recorded options cannot be read, or no longer give a projection (why).
    """
    import json
    from pathlib import Path


    path = Path(report_dir) / layout.PROJECTION_OPTIONS
    if not path.is_file():
        return None
    try:
        options = [str(o) for o in json.loads(path.read_text())["options"]]
        args = _parser().parse_args([str(report_dir), *options])
    except (OSError, ValueError, KeyError, TypeError, SystemExit) as exc:
        raise ProjectionError(f"{path}: cannot be read ({exc})") from None
    check_options(args)
    return projection_for(args, table), options


def options_command(options: Sequence[str]) -> str:
    """The command a recorded projection came from, for the README (``python -m pnpscale.project SWEEP ...``)."""
    import shlex

    return shlex.join(["python", "-m", "pnpscale.project", "SWEEP", *options])


def main(argv: list[str] | None = None) -> int:
    """``python -m pnpscale.project SWEEP_DIR --gpus 128,256,512,1024 ...``; exit 2 on bad input or no projection.

    Written into a report folder (the default ``--out``), the options are recorded there
    (:data:`pnpscale.core.layout.PROJECTION_OPTIONS`): rebuilding the report projects again with them."""
    import json
    import shlex
    import sys
    from pathlib import Path


    argv = list(argv if argv is not None else sys.argv[1:])
    args = _parser().parse_args(argv)
    try:
        problem = layout.report_out_problem(args.path, args.out)
        if problem is not None:  # refused before any run folder is read
            raise ProjectionError(problem)
        check_options(args)
        table = build_table(args.path, echo=lambda s: print(s, file=sys.stderr))
        p = projection_for(args, table)
    except (NoRunsError, ProjectionError) as exc:
        print(f"pnpscale.project: error: {exc}", file=sys.stderr)
        return 2
    for key, notes in sorted(p.notes.items()):
        for note in notes:
            if "not used" in note or "not projected" in note or note.startswith(("warning:", "caveat:")):
                print(f"pnpscale.project: {key[0]} {key[1]}: {note}", file=sys.stderr)
    out = Path(args.out) if args.out else Path(args.path) / layout.REPORT_DIR
    command = shlex.join(["python", "-m", "pnpscale.project", *argv])
    made_by = "Written by `" + command.replace("`", "'") + "`"
    record = {"options": _options_only(argv), "command": command}
    try:
        lines = write(p, out, made_by, extra={layout.PROJECTION_OPTIONS: json.dumps(record, indent=1) + "\n"})
    except OSError as exc:
        print(f"pnpscale.project: error: projection not written ({exc}); {out} is as it was", file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"projection: {out / layout.PROJECTION}")
    return 0
