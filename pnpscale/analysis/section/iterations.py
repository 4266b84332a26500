"""Which iterations an analysis keeps, on every rank alike (pure, no torch): matched by ``ProfilerStep``
number (:func:`match_steps`), without non-physical events (:func:`drop_bad_iterations`), without those a
file cut short lost (:func:`drop_cut_iterations`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import SectionError, SectionRecord
from pnpscale.analysis.kineto import END_MARKER


def _steps_text(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"#1-3, #5"``."""
    parts: list[tuple[int, int]] = []
    for x in sorted(steps):
        if parts and parts[-1][1] == x - 1:
            parts[-1] = (parts[-1][0], x)
        else:
            parts.append((x, x))
    return ", ".join(f"#{a}" if a == b else f"#{a}-{b}" for a, b in parts)


def match_steps(
    records: Mapping[int, Sequence[SectionRecord]], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Match section occurrences across ranks by ``ProfilerStep#N`` number, not by position.

    When every record of every rank lies in a numbered ``ProfilerStep`` range, only the step numbers
    present on every rank are kept (the others are recorded as ``step_not_on_every_rank``) and
    iterations are renumbered from 0 in step order; otherwise the records are returned unchanged.

    Raises:
        SectionError: the ranks have no step number in common (the message lists each rank's steps).

    >>> a = [SectionRecord(0, "s", 0.0, 1.0, step=2), SectionRecord(1, "s", 1.0, 1.0, step=3)]
    >>> b = [SectionRecord(0, "s", 0.0, 1.0, step=1), SectionRecord(1, "s", 1.0, 1.0, step=2)]
    >>> [(s.iteration, s.step) for s in match_steps({0: a, 1: b})[1]]
    [(0, 2)]
    """
    out = {r: list(recs) for r, recs in records.items()}
    if not out or not all(s.step is not None for recs in out.values() for s in recs):
        return out
    steps: dict[int, list[int]] = {
        r: sorted({int(s.step) for s in recs if s.step is not None}) for r, recs in out.items()
    }
    common = set.intersection(*(set(v) for v in steps.values()))
    if not common:
        raise SectionError(
            "the ranks have no ProfilerStep number in common ("
            + "; ".join(f"rank {r}: {_steps_text(v)}" for r, v in sorted(steps.items()))
            + "): steps are matched by number, never by position"
        )
    for r, v in sorted(steps.items()):
        extra = [x for x in v if x not in common]
        if extra and anomalies is not None:
            anomalies.add(
                "step_not_on_every_rank",
                r,
                f"ProfilerStep {_steps_text(extra)} (steps on every rank: {_steps_text(sorted(common))})",
                len(extra),
            )
    for r, recs in out.items():
        occurrence: dict[str, int] = defaultdict(int)
        kept = []
        for s in recs:
            if s.step in common:
                kept.append(replace(s, iteration=occurrence[s.section]))
                occurrence[s.section] += 1
        out[r] = kept
    return out


def drop_bad_iterations(
    records: Mapping[int, Sequence[SectionRecord]], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Drop, on every rank, each iteration in which some rank has a non-physical event (``bad``).

    Each dropped iteration is recorded as ``non_physical_timing`` on the rank that had the event,
    with the event in the example.

    Raises:
        SectionError: every iteration holds a non-physical event, or is dropped for another ``bad_kind`` (the
            message names the first).
    """
    bad: dict[int, tuple[int, SectionRecord]] = {}
    for r, recs in sorted(records.items()):
        for s in recs:
            if s.bad and s.iteration not in bad:
                bad[s.iteration] = (r, s)
    for it, (r, s) in sorted(bad.items()):
        if anomalies is not None:
            anomalies.add(s.bad_kind, r, f"iteration {it} section {s.section!r}: {s.bad}")
    out = {r: [s for s in recs if s.iteration not in bad] for r, recs in records.items()}
    if bad and not any(out.values()):
        it, (r, s) = min(bad.items())
        raise SectionError(
            f"every iteration holds a non-physical event, e.g. rank {r} iteration {it} section {s.section!r}: {s.bad}"
            if s.bad_kind == "non_physical_timing"
            else f"every iteration is dropped ({s.bad_kind}), e.g. rank {r} iteration {it} section {s.section!r}: "
            f"{s.bad}"
        )
    return out


def drop_cut_iterations(
    records: Mapping[int, Sequence[SectionRecord]], unclosed: Mapping[int, str], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Drop, on every rank, the iterations a file cut short lost (the profiler killed while writing, the file
    completed by a tool).

    A rank whose file Kineto did not close (``unclosed``: rank -> file name) and that holds fewer iterations
    than another rank lost its last ones: iterations from its count on are dropped everywhere, and its last
    one too when that one is ``open_end`` (no event of the file starts after it: it may be cut inside). With
    as many iterations everywhere (or iterations matched by ``ProfilerStep`` number), a CPU rank's last
    iteration (step) that is ``open_end`` and holds fewer collectives than another rank's is dropped (on CUDA a
    cut loses the GPU events, written last: found from the launches by :func:`section_records`).
    Recorded as ``trace_cut_short`` naming the file, rank and iterations. Ranks with fewer iterations whose
    file Kineto closed are left alone (their records cannot be matched: :func:`align_collectives` refuses them).

    Raises:
        SectionError: the cut leaves no iteration (the message names the file and rank).

    >>> a = [SectionRecord(i, "s", float(i), 1.0) for i in range(3)]
    >>> b = [SectionRecord(0, "s", 0.0, 1.0), SectionRecord(1, "s", 1.0, 1.0, open_end=True)]
    >>> out = drop_cut_iterations({0: a, 1: b}, {1: "rank1.json"})
    >>> [s.iteration for s in out[0]], [s.iteration for s in out[1]]
    ([0], [0])
    """
    out = {r: list(recs) for r, recs in records.items()}
    count = {r: 1 + max((s.iteration for s in recs), default=-1) for r, recs in out.items()}
    if not out:
        return out
    if all(s.step is not None for recs in out.values() for s in recs):  # matched by step number: a step is cut
        for r in sorted(unclosed):  # when it holds fewer collectives than the same step on another rank
            steps = {int(s.step) for s in out.get(r, []) if s.step is not None}
            if not steps:
                continue
            last = max(steps)
            if any(s.gpu_span_s is not None for s in out[r]):
                continue  # CUDA: a cut loses the GPU tail, found from the launches (section_records)
            mine = {s.section: len(s.collectives) for s in out[r] if s.step == last and s.open_end}
            other = [(o, s.section, len(s.collectives), mine[s.section]) for o in out if o != r for s in out[o]
                     if s.step == last and s.section in mine and len(s.collectives) > mine[s.section]]  # fmt: skip
            if other:
                o, sec, theirs, n = other[0]
                out[r] = [s for s in out[r] if s.step != last]
                message = (f"{unclosed[r]}: rank {r} holds {n} collective(s) in ProfilerStep#{last} section {sec!r}, "
                           f"rank {o} {theirs}, in a file Kineto did not close (no {END_MARKER!r}): cut short; that "
                           f"step dropped")  # fmt: skip
                if not out[r]:
                    raise SectionError(f"{message}: no step left on rank {r}")
                if anomalies is not None:
                    anomalies.add("trace_cut_short", r, message)
        return out
    most = max(count.values())
    cut: int | None = None
    why: list[tuple[int, str]] = []
    short = [r for r, n in count.items() if n < most]
    if short:
        if not all(r in unclosed for r in short):
            return out
        cut = min(count[r] for r in short)
        for r in short:
            final = [s for s in out[r] if s.iteration == count[r] - 1]
            if any(s.open_end for s in final):
                cut = min(cut, count[r] - 1)
            why.append((r, f"holds {count[r]} iteration(s), rank {max(count, key=lambda k: count[k])} {most}"))
    else:
        last_it = most - 1
        n_colls = {
            r: {s.section: len(s.collectives) for s in recs if s.iteration == last_it} for r, recs in out.items()
        }
        for r in sorted(unclosed):
            if r not in out or not any(s.open_end for s in out[r] if s.iteration == last_it):
                continue
            if any(s.gpu_span_s is not None for s in out[r]):
                continue  # CUDA: a cut loses the GPU tail, found from the launches (section_records)
            fewer = [(sec, n, o) for o in out for sec, n in n_colls[r].items() if n < n_colls[o].get(sec, n)]
            if fewer:
                sec, n, o = fewer[0]
                cut = last_it
                why.append((r, f"holds {n} collective(s) in iteration {last_it} section {sec!r}, rank {o} "
                               f"{n_colls[o][sec]}"))  # fmt: skip
    if cut is None:
        return out
    for r, text in why:
        message = (f"{unclosed[r]}: rank {r} {text}, in a file Kineto did not close (no {END_MARKER!r}): cut "
                   f"short; iterations {cut}..{most - 1} dropped on every rank")  # fmt: skip
        if cut == 0:
            raise SectionError(f"{message}: no iteration left")
        if anomalies is not None:
            anomalies.add("trace_cut_short", r, message, most - cut)
    return {r: [s for s in recs if s.iteration < cut] for r, recs in out.items()}


def drop_empty_iterations(
    records: Mapping[int, Sequence[SectionRecord]], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Drop, on every rank, the trailing iterations without any GPU work or collective on any rank, in a trace
    with GPU work (the ``ProfilerStep`` Kineto opens at the last ``prof.step()`` and closes with the file, HTA's
    MI250 sample): kept, such a step would count as a 0 s iteration (GPU span) and lower every mean.

    An iteration is empty when every record of it, on every rank, has no GPU span (``gpu_span_s is None``) and no
    collective; only the last iterations are looked at (an empty one in the middle is kept). Recorded as
    ``empty_iteration`` naming the iterations and their steps.

    Raises:
        SectionError: every iteration is empty (no GPU work in any section of a trace with GPU work).

    >>> recs = [SectionRecord(0, "s", 0.0, 1.0, gpu_span_s=1.0, step=1), SectionRecord(1, "s", 2.0, 0.0, step=2)]
    >>> [s.iteration for s in drop_empty_iterations({0: recs})[0]]
    [0]
    """
    out = {r: list(recs) for r, recs in records.items()}
    all_recs = [s for recs in out.values() for s in recs]
    if not any(s.gpu_span_s is not None for s in all_recs):
        return out  # a CPU trace, or no GPU work at all: nothing to compare with
    empty: dict[int, bool] = {}
    for s in all_recs:
        empty[s.iteration] = empty.get(s.iteration, True) and s.gpu_span_s is None and not s.collectives
    dropped: list[int] = []
    for it in sorted(empty, reverse=True):
        if not empty[it]:
            break
        dropped.append(it)
    if not dropped:
        return out
    if len(dropped) == len(empty):
        raise SectionError("no iteration holds GPU work on any rank, in a trace with GPU work")
    steps = sorted({int(s.step) for s in all_recs if s.iteration in dropped and s.step is not None})
    if anomalies is not None:
        which = f"iteration(s) {min(dropped)}..{max(dropped)}"
        which += f" (ProfilerStep {_steps_text(steps)})" if steps else ""
        anomalies.add("empty_iteration", None, f"{which}: no GPU work and no collective in any section on any rank "
                      "(the step Kineto opens at the last prof.step()?)", len(dropped))  # fmt: skip
    return {r: [s for s in recs if s.iteration not in dropped] for r, recs in out.items()}
