"""Offline analysis: the same compute / transfer / wait tables as a live run, from any job's traces.

Usage::

    python -m pnpscale.analyze TRACE_DIR [TRACE ...] --sections gradient,denoiser
        [--warmup N] [--rank FILE=RANK ...] [--partial] [--out DIR] [--jobs N]

One Kineto trace per rank (``*.json`` or ``*.json.gz``; folders are listed, not searched
recursively; a pnpscale run folder stands for its ``traces/``). The rank of a trace is, in order:
``--rank FILE=RANK``, the trace's ``distributedInfo``, or ``rank<N>``/``rank-<N>``/``rank_<N>`` in
its file name. Every rank of the world size must be there exactly once (``--partial`` analyses the
ranks present, e.g. a sampled pair of a 128-rank job). Sections are range names, or
``NAME=PATTERN`` (``step=ProfilerStep#*``).

The traces are streamed (:mod:`pnpscale.analysis.trace.read`), reduced per rank to section records
(:func:`pnpscale.analysis.section.records.section_records`), matched across ranks
(:func:`pnpscale.analysis.section.align.align_collectives`), and decomposed by the live run's own code
(:func:`pnpscale.analysis.tables.frames`, :func:`pnpscale.analysis.metrics.decompose`). ``ranks.parquet``,
``collectives.parquet``, ``sections.parquet`` and ``timeline.json`` (:mod:`pnpscale.analysis.timeline_slices`) are
written together (:func:`pnpscale.core.layout.commit_files`), then ``analysis.json`` (provenance and run metrics; not
``run.json``, so that an analysis folder is never taken for a sweep point). Default output:
``<first TRACE_DIR>/analysis``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnpscale import columns as K
from pnpscale.analysis.anomalies import Anomalies, summary_lines
from pnpscale.analysis.events import DecompositionError, NoMeasuredIteration, SectionError, SectionRecord, rank_rows
from pnpscale.analysis.kineto import END_MARKER, GPU_CATS
from pnpscale.analysis.section import (
    align_collectives,
    drop_bad_iterations,
    drop_cut_iterations,
    drop_empty_iterations,
    match_steps,
    nested_sections,
    section_records,
)
from pnpscale.analysis.section.p2p import pair_rates
from pnpscale.analysis.trace import (
    NotATraceError,
    TraceError,
    TraceInfo,
    iter_trace_files,
    parse_sections,
    read_header,
    read_trace,
)
from pnpscale.analysis.trace.cut import drop_unvouched_end
from pnpscale.core import layout
from pnpscale.core.errors import InputError, PnpscaleError, command_prog
from pnpscale.core.record import RecordError, now_iso, read_record

if TYPE_CHECKING:
    import pandas as pd

    from pnpscale.analysis.tables import TimelineJob

#: the table stage's modules (pandas, pyarrow: a third of a second to import), imported while the ranks' traces are
#: read (:func:`_import_table_stage`): this module and the readers need none of them, so that the readers fork
#: (and start) before they are imported
TABLE_STAGE = ("pnpscale.analysis.clocks", "pnpscale.analysis.metrics", "pnpscale.analysis.tables")

ANALYSIS_JSON = layout.ANALYSIS_JSON
ANALYSIS_DIR = layout.ANALYSIS_DIR
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
#: sections columns that are unknown (NaN) when a multi-rank job shows no collective at all
UNKNOWN_WHEN_NO_COLLECTIVE = (K.TRANSFER_S, K.WAIT_S, K.MAIN_TRANSFER_S, *K.WAIT_CAUSES, K.HIDDEN_S)


class AnalyzeError(PnpscaleError, ValueError):
    """Traces that cannot be analysed together (missing/duplicate ranks, unmatched sections)."""


class AnalyzeOptionError(InputError, AnalyzeError):
    """An option that the traces refuse (``--rank`` naming no trace, or a rank outside the world; ``--warmup``
    leaving no measured iteration): the user's input, exit 2 like a bad option value."""


@dataclass(frozen=True)
class RankedTrace:
    """A trace file and the rank it belongs to.

    Attributes:
        rank: the rank. path: the file. source: ``"explicit"``, ``"distributedInfo"`` or
        ``"file name"``. info: the trace's header (:func:`pnpscale.analysis.trace.read.read_header`).
    """

    rank: int
    path: Path
    source: str
    info: TraceInfo


@dataclass(frozen=True)
class Analysis:
    """Tables of an offline analysis (columns of :mod:`pnpscale.columns`) and its traces.

    Attributes:
        anomalies: what was dropped, assumed or repaired (:mod:`pnpscale.analysis.anomalies`).
        nested: section -> the section enclosing it (left out of the ``all`` row).
        point_to_point: per (section, src, dst) over the measured iterations, the paired point-to-point
            transfers' count, bytes and rate (:func:`pnpscale.analysis.section.p2p.pair_rates`); empty without any.
        timeline: the run's timeline text being computed in another process (:class:`~pnpscale.analysis.tables.
            TimelineJob`, started when the traces were read by several), or ``None``: computed when written.
    """

    ranks: pd.DataFrame
    collectives: pd.DataFrame
    sections: pd.DataFrame
    traces: list[RankedTrace]
    world_size: int
    anomalies: Anomalies
    nested: dict[str, str]
    collectives_seen: bool = False
    point_to_point: tuple[dict[str, Any], ...] = ()
    timeline: TimelineJob | None = None

    @property
    def no_collectives(self) -> bool:
        """A multi-rank job in which no collective was seen (also in iterations dropped later): transfer and
        wait are unknown, not zero."""
        return self.world_size > 1 and self.collectives.empty and not self.collectives_seen


def rank_from_name(name: str) -> int | None:
    """Rank written in a trace's file name (``rank3``, ``rank-34``, ``sampled_rank_0``), if any.

    >>> rank_from_name("rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"), rank_from_name("trace.json")
    (34, None)
    """
    m = _RANK_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def assign_ranks(
    headers: Sequence[TraceInfo], explicit: Mapping[str, int] | None = None, partial: bool = False
) -> tuple[list[RankedTrace], int]:
    """Give every trace its rank and check that the ranks make a whole world.

    Args:
        headers: one header per trace file. explicit: file name (or path) -> rank, overriding the
            trace. partial: accept a subset of the world's ranks.

    Returns:
        (traces sorted by rank, world size): the world size is ``distributedInfo``'s, else the
        highest rank + 1.

    Raises:
        AnalyzeError: no trace; a trace whose rank cannot be told; a file-name rank that contradicts
            the trace's ``distributedInfo``; an explicit name matching no trace; two traces of one rank;
            traces disagreeing on the world size; a rank outside it; missing ranks (unless ``partial``).
    """
    if not headers:
        raise AnalyzeError("no trace files (*.json, *.json.gz) given")
    explicit = dict(explicit or {})
    unused = set(explicit)
    out: list[RankedTrace] = []
    for h in headers:
        key = next((k for k in (str(h.path), h.path.name) if k in explicit), None)
        if key is not None:
            unused.discard(key)
            out.append(RankedTrace(int(explicit[key]), h.path, "explicit", h))
        elif h.rank is not None:
            named = rank_from_name(h.path.name)
            if named is not None and named != h.rank:
                raise AnalyzeError(
                    f"{h.path}: the trace states rank {h.rank} (distributedInfo) but its file name says rank "
                    f"{named}: pass --rank {h.path.name}=R to say which"
                )
            out.append(RankedTrace(h.rank, h.path, "distributedInfo", h))
        elif (r := rank_from_name(h.path.name)) is not None:
            out.append(RankedTrace(r, h.path, "file name", h))
        else:
            raise AnalyzeError(
                f"{h.path}: rank unknown (no distributedInfo, no rank<N> in the file name): pass --rank {h.path.name}=R"
            )
    if unused:
        raise AnalyzeOptionError(f"--rank names no given trace: {', '.join(sorted(unused))}")
    by_rank: dict[int, list[Path]] = {}
    for t in out:
        by_rank.setdefault(t.rank, []).append(t.path)
    dups = {r: ps for r, ps in by_rank.items() if len(ps) > 1}
    if dups:
        r, ps = min(dups.items())
        raise AnalyzeError(f"rank {r} appears in {len(ps)} traces: {', '.join(p.name for p in ps)}")
    sizes = {t.info.world_size for t in out if t.info.world_size is not None}
    if len(sizes) > 1:
        raise AnalyzeError(f"traces disagree on the world size: {sorted(sizes)}")
    world = sizes.pop() if sizes else max(by_rank) + 1
    outside = sorted(r for r in by_rank if not 0 <= r < world)
    if outside:
        given = sorted(f"{t.path.name}={t.rank}" for t in out if t.rank in outside and t.source == "explicit")
        if given:
            raise AnalyzeOptionError(f"--rank {', '.join(given)}: outside the world size {world}")
        raise AnalyzeError(f"rank(s) {outside} outside the world size {world}")
    missing = sorted(set(range(world)) - set(by_rank))
    if missing and not partial:
        raise AnalyzeError(
            f"{len(missing)} of {world} ranks missing (rank {_ranges(missing)}); traces of rank "
            f"{_ranges(sorted(by_rank))}: pass --partial to analyse the {len(by_rank)} present"
        )
    return sorted(out, key=lambda t: t.rank), world


def _ranges(xs: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)


def analyze_traces(
    traces: Sequence[RankedTrace],
    sections: Mapping[str, str],
    warmup: int,
    world_size: int | None = None,
    anomalies: Anomalies | None = None,
    cpu_start: bool = False,
    jobs: int | None = None,
) -> Analysis:
    """Stream each rank's trace, reduce it to section records, match collectives, decompose.

    Steps are matched by ``ProfilerStep#N`` number (:func:`pnpscale.analysis.section.iterations.match_steps`);
    iterations holding a non-physical event are dropped on every rank
    (:func:`pnpscale.analysis.section.iterations.drop_bad_iterations`); nested sections are found
    (:func:`pnpscale.analysis.section.align.nested_sections`). Everything dropped, assumed or repaired is
    in ``Analysis.anomalies``.

    Args:
        traces: from :func:`assign_ranks`. sections: :func:`pnpscale.analysis.trace.read.parse_sections`.
        warmup: iterations ``< warmup`` are warm-up (excluded from the run metrics).
        world_size: the job's world size (default: the number of traces); it is the WORLD_SIZE
            column even when only some ranks are analysed.
        anomalies: anomalies found before (e.g. skipped files), to extend.
        cpu_start: CUDA section time from the CPU range start to the last GPU end, as the live run
            measures it (a pnpscale run's traces), instead of the GPU span (foreign traces).
        jobs: processes reading the traces in parallel (default :func:`default_jobs`: one per CPU,
            at most one per trace); results and errors are taken in rank order as with one.

    Returns:
        :class:`Analysis` with the live run's ``ranks``, ``collectives`` and ``sections`` tables
        (peak memory is unknown offline: NA).

    Raises:
        TraceError: an unreadable trace.
        AnalyzeError: a trace without the sections (the message lists the 20 most frequent range
            names), a trace stating another rank than the one it was given by its file name, or ranks
            whose sections/collectives cannot be matched.
    """
    anomalies = anomalies if anomalies is not None else Anomalies()
    world = world_size if world_size is not None else len(traces)
    records: dict[int, list[SectionRecord]] = {}
    done: list[RankedTrace] = []
    reading = _map_ranks(traces, sections, jobs, cpu_start, meanwhile=_import_table_stage)
    for t, (recs, info, found) in zip(traces, reading, strict=True):
        anomalies.extend(found)
        records[t.rank] = recs
        done.append(RankedTrace(t.rank, t.path, t.source, info))
    from pnpscale.analysis import clocks, metrics, tables  # deferred: TABLE_STAGE, imported as the ranks were read

    seen = any(s.collectives for recs in records.values() for s in recs)
    timeline: TimelineJob | None = None
    try:
        unclosed = {t.rank: t.path.name for t in done if not t.info.end_marker}
        records = drop_cut_iterations(records, unclosed, anomalies)
        unvouched = {t.rank: t.path.name for t in done if t.info.kineto_header and not t.info.end_marker
                     and not t.info.profiler_span}  # fmt: skip
        records = drop_unvouched_end(records, unvouched, anomalies)
        records = drop_empty_iterations(drop_bad_iterations(match_steps(records, anomalies), anomalies), anomalies)
        nested = nested_sections(records)
        aligned = align_collectives(records)
        ranks, colls = tables.frames([(rank_rows(r, recs, warmup), {}) for r, recs in sorted(aligned.items())])
        if _resolved_jobs(len(traces), jobs) > 1:  # the timeline on another core while this one decomposes
            timeline = tables.TimelineJob(ranks, colls)
        table = metrics.decompose(
            ranks, colls, world, on_negative_compute=lambda m: anomalies.add("negative_compute", None, m)
        )
    except (SectionError, DecompositionError) as exc:
        if timeline is not None:
            timeline.close()
        steps = [a for a in anomalies.records() if a["kind"] == "step_not_on_every_rank"]
        hint = ""
        if steps:
            hint = (f"; note: iterations were matched by ProfilerStep number and the ranks' step numbers differ "
                    f"(rank {steps[0]['rank']}: {steps[0]['example']}): a rank whose profiler counted from another "
                    f"step pairs different iterations")  # fmt: skip
        raise AnalyzeError(f"{exc}{hint}") from exc
    for inner, outer in nested.items():
        anomalies.add("nested_sections", None, f"{inner!r} inside {outer!r}")
    for conflict in clocks.clock_conflicts(colls):
        anomalies.add("rank_clocks_inconsistent", conflict.blamed, clocks.conflict_text(conflict))
    pairs = tuple(pair_rates(aligned, warmup))
    analysis = Analysis(ranks, colls, table, done, world, anomalies, nested, seen, pairs, timeline)
    if analysis.no_collectives:
        anomalies.add("no_collectives", None, no_collectives_text(done, world))
    if len(done) == 1 and world > 1:
        anomalies.add("transfer_includes_wait", done[0].rank, f"rank {done[0].rank} alone of {world}")
    return analysis


def no_collectives_text(traces: Sequence[RankedTrace], world: int) -> str:
    """What a multi-rank job without any collective holds: the descriptors and the events of unknown
    categories seen (the usual causes), so that the warning names the cause.

    >>> from pnpscale.analysis.trace import TraceInfo
    >>> info = TraceInfo(Path("r0.json"), 0, 2, "nccl", None, descriptors=6, unknown_categories=(("Kernel", 12),))
    >>> no_collectives_text([RankedTrace(0, Path("r0.json"), "distributedInfo", info)], 2)  # doctest: +ELLIPSIS
    "1 rank(s) of 2, no gloo:* range or collective GPU kernel in any section; seen: 6 collective descriptor(s) ..."
    """
    descs = sum(t.info.descriptors for t in traces)
    gpu = sum(t.info.gpu_events for t in traces)
    cats: dict[str, int] = {}
    for t in traces:
        for c, n in t.info.unknown_categories:
            cats[c] = cats.get(c, 0) + n
    seen = [f"{descs} collective descriptor(s) (record_param_comms / nccl:* / xccl:*)", f"{gpu} GPU event(s)"]
    if cats:
        seen.append("events of categories not read: " + ", ".join(f"{c!r} ({n})" for c, n in sorted(cats.items())))
    if descs and not gpu:
        why = "the profiler dropped every GPU record"
    elif descs:
        why = "the collectives' kernels are not in the trace or not recognised (another device's kernels?)"
    elif cats:
        why = "the device events are of categories pnpscale does not read"
    else:
        why = "communication outside NCCL/gloo, e.g. NVSHMEM/DeepEP, or kernels not recorded"
    return (f"{len(traces)} rank(s) of {world}, no gloo:* range or collective GPU kernel in any section; seen: "
            f"{'; '.join(seen)}: {why}")  # fmt: skip


def section_hint(missing: Sequence[str], info: TraceInfo) -> str:
    """Where to look when section names are not found: the trace's user annotations (``record_function``
    names) first, then its most frequent ranges, and ``NAME=PATTERN*`` when a range name starts with a
    missing name (a step number or suffix after it), else the closest of those names to a misspelt one.

    >>> info = TraceInfo(Path("r.json"), 0, 1, None, None, range_names=(("aten::mm", 9), ("ProfilerStep#3", 1)),
    ...                  user_annotations=(("ProfilerStep#3", 1),))
    >>> section_hint(["ProfilerStep"], info)
    "; the trace's user annotations: 'ProfilerStep#3' (1); its most frequent range names: 'aten::mm' (9), \
'ProfilerStep#3' (1); a missing '*'? try --sections ProfilerStep=ProfilerStep*"
    >>> section_hint(["aten::nm"], info).rsplit("; ", 1)[-1]  # a near name (difflib, ratio >= 0.75)
    "'aten::nm': did you mean 'aten::mm'?"
    """
    out = ""
    if info.user_annotations:
        out += "; the trace's user annotations: " + ", ".join(f"{n!r} ({c})" for n, c in info.user_annotations)
    if info.range_names:
        out += ("; its" if out else "; the trace's") + " most frequent range names: "
        out += ", ".join(f"{n!r} ({c})" for n, c in info.range_names)
    names = [n for n, _ in (*info.user_annotations, *info.range_names)]
    for m in missing:
        if any(n.startswith(m) and n != m for n in names) and "*" not in m:
            out += f"; a missing '*'? try --sections {m}={m}*"
        else:
            near = difflib.get_close_matches(m, dict.fromkeys(names), n=1, cutoff=0.75)  # a misspelt name
            if near:
                out += f"; {m!r}: did you mean {near[0]!r}?"
    return out


def default_jobs(n_traces: int) -> int:
    """Processes reading traces: this process's CPUs (``sched_getaffinity``), at most one per trace.

    >>> default_jobs(1)
    1
    """
    return max(
        1, min(n_traces, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


def _resolved_jobs(n_traces: int, jobs: int | None) -> int:
    """Processes that read ``n_traces`` traces when ``jobs`` were asked (``None``: :func:`default_jobs`)."""
    return default_jobs(n_traces) if jobs is None else max(1, min(jobs, n_traces))


def _import_table_stage() -> None:
    """Import the :data:`TABLE_STAGE` modules into this process (a no-op for those already imported)."""
    for name in TABLE_STAGE:
        importlib.import_module(name)


def _map_ranks(
    traces: Sequence[RankedTrace],
    sections: Mapping[str, str],
    jobs: int | None,
    cpu_start: bool = False,
    meanwhile: Callable[[], None] | None = None,
) -> Iterator[tuple[list[SectionRecord], TraceInfo, list[dict[str, Any]]]]:
    """:func:`_rank_records` of every trace, in order; over a pool of ``jobs`` processes when above 1.

    ``meanwhile`` is called once, at the first result asked for: after every trace was given to the pool (the
    workers fork with this process's modules as they are then, and start reading), before the first result is
    awaited; before the first trace is read when there is one job. The first failure in rank order is raised (as
    the serial loop would).
    """
    jobs = _resolved_jobs(len(traces), jobs)
    if jobs == 1:
        if meanwhile is not None:
            meanwhile()
        for t in traces:
            yield _rank_records(t, sections, cpu_start)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    method = "fork" if "fork" in mp.get_all_start_methods() else None  # the parent's imports are reused
    import gc

    # the parent's objects out of the workers' collections while they fork: their pages stay shared, not copied
    # (a collection writes to every tracked object's header); 238 MB peak PSS instead of 265 on 8 x 200 MB
    gc.freeze()
    try:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context(method)) as pool:
            futures = [pool.submit(_rank_records, t, dict(sections), cpu_start) for t in traces]
            try:
                if meanwhile is not None:
                    meanwhile()
                for f in futures:
                    yield f.result()
            finally:
                for f in futures:
                    f.cancel()
    finally:
        gc.unfreeze()


def _rank_records(
    t: RankedTrace, sections: Mapping[str, str], cpu_start: bool = False
) -> tuple[list[SectionRecord], TraceInfo, list[dict[str, Any]]]:
    """Read one rank's trace and reduce it to section records: (records, trace header, anomalies).

    Raises:
        TraceError, AnalyzeError: as :func:`analyze_traces`.
    """
    anomalies = Anomalies()
    trace = read_trace(t.path, sections, anomalies=anomalies, rank=t.rank)
    stated = trace.info.rank
    if stated is not None and stated != t.rank:
        if t.source != "explicit":
            raise AnalyzeError(
                f"{t.path}: the trace states rank {stated} (distributedInfo) but was taken as rank {t.rank} "
                f"from its {t.source}: pass --rank {t.path.name}=R to say which"
            )
        anomalies.add("rank_overridden", t.rank, f"{t.path.name}: states rank {stated}, --rank {t.rank}")
    info = trace.info
    if info.gpu_events == 0 and (info.runtime_events or (info.descriptors and (info.backend or "gloo") != "gloo")):
        if info.unknown_categories:
            cats = ", ".join(f"{c!r} ({n})" for c, n in info.unknown_categories)
            raise AnalyzeError(
                f"rank {t.rank} ({t.path.name}): {info.descriptors} collective descriptor(s) and "
                f"{info.runtime_events} runtime call(s), but no GPU event of a category pnpscale reads; the trace "
                f"holds events of categories not read: {cats}: another device's kernels? (pnpscale reads "
                f"{', '.join(sorted(GPU_CATS))})"
            )
        raise AnalyzeError(
            f"rank {t.rank} ({t.path.name}): {info.descriptors} collective descriptor(s) (record_param_comms / "
            f"nccl:*) and {info.runtime_events} runtime call(s) (launches), but no GPU event: the profiler dropped "
            f"every GPU record (kineto#996: a full CUPTI buffer, or a new profiler session per iteration), so "
            f"transfer and wait cannot be measured (a live run refuses this too); fix: one profiler session for "
            f"every iteration"
            + ("" if info.end_marker else f"; or the file was cut short before its GPU events (Kineto writes them "
                                          f"after the CPU's) and closed by another tool: no {END_MARKER!r}")
        )  # fmt: skip
    try:
        records = section_records(
            trace.events,
            list(sections),
            anomalies,
            t.rank,
            cpu_start=cpu_start,
            file_end_ns=None if info.end_marker else info.last_ns,
            missing_gpu=trace.missing_gpu,
            orphan_gpu=trace.orphan_gpu,
            copies_without_gpu=trace.copies_without_gpu,
        )
    except SectionError as exc:
        missing = [pat for name, pat in sections.items() if (exc.counts or {}).get(name) == 0]
        hint = section_hint(missing, info) if missing else ""
        raise AnalyzeError(f"rank {t.rank} ({t.path.name}): {exc}{hint}") from exc
    return records, trace.info, anomalies.records()


def write_analysis(out_dir: Path, analysis: Analysis, meta: Mapping[str, Any]) -> dict[str, Any]:
    """Check the invariants, write the three tables and ``timeline.json`` together, then ``analysis.json`` last.

    ``analysis.json`` holds provenance, run metrics (CommE and PE ``None`` when no collective was
    seen in a multi-rank job), the nested sections and the ``anomalies`` list (empty: none).

    Returns:
        the ``analysis.json`` content.

    Raises:
        AnalyzeError: no measured iteration (every iteration is warm-up), or a table that breaks an
            invariant (:func:`pnpscale.analysis.metrics.check_invariants`); nothing is written then.
    """
    try:
        return _write_analysis(out_dir, analysis, meta)
    finally:
        if analysis.timeline is not None:
            analysis.timeline.close()  # its text written or not wanted: the child released either way


def _write_analysis(out_dir: Path, analysis: Analysis, meta: Mapping[str, Any]) -> dict[str, Any]:
    from pnpscale.analysis import metrics, tables  # deferred: TABLE_STAGE (pandas), imported by analyze_traces

    n = len(analysis.traces)
    try:
        metrics.check_invariants(analysis.ranks, analysis.sections)
        if analysis.no_collectives:  # unknown, not zero: NaN in every table
            analysis.sections.loc[:, list(UNKNOWN_WHEN_NO_COLLECTIVE)] = float("nan")
            analysis.ranks.loc[:, [c for c in (K.COMM_S, K.HIDDEN_S) if c in analysis.ranks]] = float("nan")
        run = metrics.run_metrics(analysis.sections, n, analysis.nested)
    except DecompositionError as exc:
        if isinstance(exc, NoMeasuredIteration):
            raise AnalyzeError(f"{exc}: lower --warmup") from exc
        raise AnalyzeError(str(exc)) from exc
    if analysis.no_collectives:
        for m in (run, *run["sections"].values()):
            m["comm_e"] = m["pe"] = None
    writers = tables.table_writers(analysis.ranks, analysis.collectives, analysis.sections, analysis.timeline)
    layout.commit_files(out_dir, writers)
    infos = [t.info for t in analysis.traces]
    doc = {
        "status": layout.STATUS_COMPLETE,
        "source": "offline",
        **dict(meta),
        "world_size": analysis.world_size,
        "ranks": [t.rank for t in analysis.traces],
        "partial": n != analysis.world_size,
        "backend": next((i.backend for i in infos if i.backend), None),
        "nccl_version": next((i.nccl_version for i in infos if i.nccl_version), None),
        "traces": [
            {
                "rank": t.rank,
                "file": str(t.path),
                "rank_from": t.source,
                "time_base": "baseTimeNanoseconds" if t.info.base_ns is not None else "absolute",
                "events_read": t.info.events_read,
                "events_kept": t.info.events_kept,
            }
            for t in analysis.traces
        ],
        "metrics": run,
        "nested_sections": dict(analysis.nested),
        "point_to_point": [dict(p) for p in analysis.point_to_point],
        "anomalies": analysis.anomalies.records(),
        "files": sorted(writers),
        "finished_at": now_iso(),
    }
    layout.write_json(out_dir / ANALYSIS_JSON, doc)
    return doc


# --- command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=command_prog("pnpscale.analyze"),
        description="Compute / transfer / wait per section from one Kineto trace per rank (any job).",
    )
    p.add_argument("paths", nargs="+", metavar="TRACE_DIR", help="folders of traces (*.json, *.json.gz) or files")
    p.add_argument(
        "--sections",
        required=True,
        help="comma-separated section range names, or NAME=PATTERN (e.g. gradient,denoiser or step=ProfilerStep#*)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up iterations to exclude (default: the run's, when TRACE_DIR/../run.json exists, else 0)",
    )
    p.add_argument("--rank", action="append", default=[], metavar="FILE=RANK", help="the rank of a trace file")
    p.add_argument("--partial", action="store_true", help="analyse the ranks present when some are missing")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: TRACE_DIR/analysis)")
    p.add_argument("--jobs", type=int, default=None, help="processes reading traces in parallel (default: one per CPU)")
    return p


def _explicit_ranks(items: Sequence[str]) -> dict[str, int]:
    """``--rank FILE=RANK`` options -> ``{FILE: RANK}``.

    Raises:
        AnalyzeError: an item not ``FILE=RANK`` (RANK a non-negative integer), or one file given two ranks (the
            last would win in silence).
    """
    out: dict[str, int] = {}
    for item in items:
        name, sep, rank = item.rpartition("=")
        if not sep or not name or not rank.strip().isdigit():
            raise AnalyzeError(f"--rank {item}: expected FILE=RANK with RANK a non-negative integer")
        if name in out and out[name] != int(rank):
            raise AnalyzeError(f"--rank {name}={out[name]} and --rank {item}: one file, two ranks; give it once")
        out[name] = int(rank)
    return out


def _traces_of_run(path: Path) -> Path:
    """A run folder given in place of its ``traces/`` folder means that folder."""
    if path.is_dir() and (path / layout.RUN_JSON).is_file() and (path / layout.TRACES_DIR).is_dir():
        return path / layout.TRACES_DIR
    return path


def _pnpscale_run(paths: Sequence[Path]) -> bool:
    """Whether the traces are a pnpscale run's (``traces/`` beside a ``run.json``)."""
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    return (first.parent / layout.RUN_JSON).is_file()


def _recorded_time_shared(paths: Sequence[Path]) -> bool | None:
    """The ``time_shared`` of the run folder holding the traces (``None``: not recorded, or unreadable)."""
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    try:
        return read_record(first.parent).time_shared
    except RecordError:
        return None


def _default_warmup(paths: Sequence[Path]) -> tuple[int, str]:
    first = paths[0] if paths[0].is_dir() else paths[0].parent
    run_json = first.parent / layout.RUN_JSON
    try:
        spec = read_record(first.parent).spec or {}
        if "warmup" in spec:
            return int(spec["warmup"]), str(run_json)
    except RecordError:
        pass
    return 0, "default"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status: 0 ok; 2 refused input before any trace is read (a bad
    option value, a trace folder that does not exist; argparse's own usage errors too; an option the traces
    refuse: :class:`AnalyzeOptionError`, a given ``--warmup`` that leaves no measured iteration; a file given
    by name that is no JSON trace; an analysis output folder); 1 an analysis error (a damaged trace)."""
    args = _parser().parse_args(argv)
    try:  # the command line: refused input, nothing read yet
        sections = parse_sections(args.sections)
        if args.warmup is not None and args.warmup < 0:
            raise AnalyzeError(f"--warmup {args.warmup}: must be >= 0")
        if args.jobs is not None and args.jobs < 1:
            raise AnalyzeError(f"--jobs {args.jobs}: must be >= 1 (processes reading traces)")
        explicit = _explicit_ranks(args.rank)
        paths = [_traces_of_run(Path(p)) for p in args.paths]
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise AnalyzeError(f"{missing[0]}: no such file or folder")
        traceless = [p for p in paths if p.is_dir() and (p / layout.RUN_JSON).is_file()]
        if traceless:  # its run.json and timeline.json are no Kineto traces: never read them as ranks
            raise AnalyzeError(
                f"{traceless[0]}: a run folder without {layout.TRACES_DIR}/ (its ranks' Kineto "
                "traces are kept with profile.export_traces=true); its tables are the analysis"
            )
        written = [p for p in paths if p.is_dir() and (p / layout.ANALYSIS_JSON).is_file()]
        if written:  # its timeline.json is a Chrome trace of the analysis, not a rank's Kineto trace
            raise AnalyzeError(f"{written[0]}: an analysis output folder (pnpscale.analyze wrote its "
                               f"{layout.ANALYSIS_JSON}); give the folder of the traces it analysed")  # fmt: skip
        empty = [p for p in paths if p.is_dir() and not any(iter_trace_files([p]))]
        if empty:  # nothing to read: the user's input (exit 2), named, with where traces would be
            runs = sorted(q.parent for q in empty[0].glob(f"**/{layout.RUN_JSON}"))
            hint = (f"; it holds {len(runs)} run folder(s): give one of them, with traces kept "
                    f"(profile.export_traces=true), e.g. {runs[0]}" if runs else "")  # fmt: skip
            raise AnalyzeError(f"{empty[0]}: a folder with no trace files (*.json, *.json.gz){hint}")
        out = args.out or ((paths[0] if paths[0].is_dir() else paths[0].parent) / ANALYSIS_DIR)
        problem = layout.out_dir_problem(out)
        if problem is not None:  # refused before any trace is read
            raise AnalyzeError(f"--out {out}: {problem}" if args.out else f"{out} (the default --out): {problem}")
    except (AnalyzeError, TraceError, ValueError, OSError) as exc:
        print(f"pnpscale.analyze: error: {exc}", file=sys.stderr)
        return InputError.exit_code
    try:
        anomalies = Anomalies()
        headers = _headers(paths, anomalies)
        traces, world = assign_ranks(headers, explicit, args.partial)
        warmup, warmup_from = (args.warmup, "--warmup") if args.warmup is not None else _default_warmup(paths)
        own = _pnpscale_run(paths)  # its sections start with the GPU idle: S_r from the CPU range start
        analysis = analyze_traces(traces, sections, warmup, world, anomalies, cpu_start=own, jobs=args.jobs)
        import pandas as pd  # (imported by analyze_traces: TABLE_STAGE)

        if own:  # a pnpscale run folder says whether its ranks time-shared cores (run.json): the live flag
            flag = _recorded_time_shared(paths)
            analysis.sections[K.TIME_SHARED] = pd.array([flag] * len(analysis.sections), dtype="boolean")
        meta = {"sections": sections, "warmup": warmup, "warmup_from": warmup_from,
                "cuda_section_time": "cpu_start_to_gpu_end" if own else "gpu_span"}  # fmt: skip
        doc = write_analysis(out, analysis, meta)
    except (AnalyzeError, TraceError, ValueError, OSError) as exc:
        given_warmup = isinstance(exc.__cause__, NoMeasuredIteration) and args.warmup is not None
        print(f"pnpscale.analyze: error: {f'--warmup {args.warmup}: ' if given_warmup else ''}{exc}", file=sys.stderr)
        refused = isinstance(exc, AnalyzeOptionError | NotATraceError) or given_warmup
        return InputError.exit_code if refused else 1
    from pnpscale.analysis.metrics import summarize  # deferred: TABLE_STAGE (pandas), imported by analyze_traces

    summ = summarize(analysis.sections, len(analysis.traces), analysis.nested)
    if analysis.no_collectives:
        summ[[K.COMM_E, K.PE]] = float("nan")
    cols = ["section", "iterations", K.COMPUTE_S, K.TRANSFER_S, K.WAIT_S, K.HIDDEN_S, K.LB, K.COMM_E, K.PE]
    for c in (*K.SUMMED, *K.SUMMED_OPTIONAL):  # printed per measured iteration, as the tables' names say
        if c in summ:
            summ[c] = summ[c] / summ["iterations"]
    print(
        f"pnpscale.analyze: {len(traces)} of {world} ranks, warm-up {warmup} ({warmup_from}) -> {out}; "
        "seconds per measured iteration\n"
        + summ[cols].to_string(index=False, float_format=lambda v: f"{v:.6g}", na_rep="n/a")
    )
    if analysis.point_to_point:
        pairs = pd.DataFrame(list(analysis.point_to_point)).rename(columns={"transfer_s": K.TRANSFER_S})
        print("pnpscale.analyze: point-to-point, per pair over the measured iterations (bytes; transfer_s: the "
              "sum of min(D_send, D_recv); GB/s = 1e9 B/s)\n"
              + pairs.to_string(index=False, float_format=lambda v: f"{v:.6g}", na_rep="n/a"))  # fmt: skip
    if analysis.nested:
        inner = ", ".join(f"{i} (inside {o})" for i, o in analysis.nested.items())
        print(f"pnpscale.analyze: 'all' counts non-overlapping time only: nested sections left out: {inner}")
    if doc["partial"]:
        print(f"pnpscale.analyze: partial analysis: ranks {_ranges(doc['ranks'])} of {world}")
    if len(analysis.traces) == 1 and world > 1:
        print("pnpscale.analyze: one rank present: transfer includes the wait for other ranks (no other rank to take "
              "the minimum over); wait_s is only the time blocked before its collectives started")
    if analysis.no_collectives:
        print(
            f"pnpscale.analyze: WARNING: {world}-rank job but no collective was found in any section "
            "(no gloo:* range, no NCCL/RCCL kernel): transfer and wait are unknown (NaN, n/a), not zero; CommE and "
            f"PE are not given (n/a); {no_collectives_text(analysis.traces, world)}",
            file=sys.stderr,
        )
    for line in summary_lines(doc["anomalies"]):
        print(f"pnpscale.analyze: {line}")
    return 0


def _headers(paths: Sequence[Path], anomalies: Anomalies) -> list[TraceInfo]:
    """Headers of the trace files named by ``paths``; JSON files in a folder that are no trace are skipped."""
    out = []
    for p in paths:
        for f in iter_trace_files([p]):
            try:
                out.append(read_header(f))
            except NotATraceError as exc:
                if not p.is_dir():
                    raise
                anomalies.add("non_trace_file", None, str(exc))
                print(f"pnpscale.analyze: note: {exc}: skipped", file=sys.stderr)
    return out
