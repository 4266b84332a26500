"""gloo rules of :func:`pnpscale.analysis.section.records.section_records` (pure, no torch): the collective type
of each ``gloo:*`` work range, and when it was issued, from the ``c10d::`` call that issued it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event, Kind
from pnpscale.analysis.kineto import collective_type
from pnpscale.analysis.overlap import C10D_PREFIX

#: collectives gloo runs as another algorithm, named after it in its range (FSDP's reduce_scatter)
_GLOO_RUNS_AS = {"reduce_scatter": {"all_reduce"}, "all_gather": {"all_reduce"}}


def typed_by_c10d(
    works: list[Event], evs: Sequence[Event], anomalies: Anomalies, rank: int | None
) -> tuple[list[Event], dict[int, tuple[int, int]]]:
    """Collective types of gloo work ranges from the ``c10d::`` calls that issued them, and when each was issued.

    The gloo range is named after the algorithm that ran (FSDP's ``reduce_scatter`` runs as
    ``gloo:all_reduce``); the ``c10d::`` operator on the calling thread names the collective that was
    asked for. A process group runs its work in issue order: the work ranges, by start, are paired in order
    with the calls, each with the first call not yet paired that started before it and asked for the
    collective the range ran (or one gloo runs as it: :data:`_GLOO_RUNS_AS`); calls passed over have no gloo
    work range (another backend's). A work range with no call (issued before the profiler started) keeps its
    own name. Each disagreement is recorded (``range_name_disagrees``). A point-to-point range takes its call's
    peer and tag (:attr:`~pnpscale.analysis.events.Event.peer`).

    Returns:
        (the work ranges, typed; ``id(range) -> (start, end) of its c10d call`` (ns) for the paired ones: the
        calling thread is inside the collective from that start, and still inside it until that end, also
        when the work range ended earlier: a buffered ``gloo:send`` inside a longer ``c10d::send``).
    """
    calls = sorted(
        (e for e in evs if e.kind is Kind.OP and e.name.startswith(C10D_PREFIX) and collective_type(e.name)),
        key=lambda e: (e.start_ns, e.tid),
    )
    if not calls:
        return works, {}
    out = []
    issued: dict[int, tuple[int, int]] = {}
    differ: list[str] = []
    k = 0
    for w in sorted(works, key=lambda e: (e.start_ns, e.tid)):
        ran = w.collective or collective_type(w.name)
        while k < len(calls) and calls[k].start_ns <= w.start_ns:
            call = calls[k]
            k += 1
            asked = collective_type(call.name)
            if asked != ran and ran not in _GLOO_RUNS_AS.get(asked or "", ()):
                continue  # a call without a gloo work range (another backend's, or not recorded)
            if asked and asked != ran:
                differ.append(f"{w.name} issued by {call.name}")
                w = replace(w, collective=asked)
            if call.peer is not None or call.tag is not None:  # a send/recv's peer and tag (record_shapes)
                w = replace(w, peer=call.peer, tag=call.tag)
            issued[id(w)] = (call.start_ns, call.end_ns)
            break
        out.append(w)
    if differ:
        anomalies.add("range_name_disagrees", rank, f"{differ[0]} (type taken from the c10d call)", len(differ))
    return out, issued
