"""Where one rank computes, and each collective's blocked and hidden time (pure, no torch): :class:`Busy`,
the events side of :mod:`pnpscale.analysis.overlap` for :func:`pnpscale.analysis.section.records.section_records`."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Sequence

from pnpscale.analysis.events import Collective, Event, Kind
from pnpscale.analysis.kineto import is_collective_kernel, step_number
from pnpscale.analysis.overlap import (
    C10D_PREFIX,
    Span,
    communicating,
    compute_spans,
    intersect,
    length,
    rank_blocked,
    spans_text,
    subtract,
    union,
)


class Busy:
    """Where one rank computes, for :mod:`pnpscale.analysis.overlap`: CPU threads' compute operators
    (innermost operator neither a ``c10d::`` call nor enclosing one) and GPU compute events."""

    def __init__(self, evs: Sequence[Event], sections: Sequence[str], gpu_events: Sequence[Event]) -> None:
        per_tid: dict[int, list[Event]] = defaultdict(list)
        self.c10d: dict[int, list[int]] = defaultdict(list)
        self.calls: dict[int, list[Span]] = defaultdict(list)
        for e in evs:
            if e.kind is Kind.OP and e.name not in sections and step_number(e.name) is None:
                per_tid[e.tid].append(e)
                if e.name.startswith(C10D_PREFIX):
                    self.c10d[e.tid].append(e.start_ns)
                    self.calls[e.tid].append((e.start_ns, e.end_ns))
        self.spans: dict[int, list[Span]] = {}
        for tid, ops in per_tid.items():
            flags = communicating([(e.start_ns, e.end_ns, e.name) for e in ops])
            self.spans[tid] = compute_spans([(e.start_ns, e.end_ns, f) for e, f in zip(ops, flags, strict=True)])
        for starts in self.c10d.values():
            starts.sort()
        self.gpu = union(
            (e.start_ns, e.end_ns) for e in gpu_events if not is_collective_kernel(e.name) and e.bad is None
        )
        self._gpu_ends = [hi for _, hi in self.gpu]

    def gpu_near(self, spans: Sequence[Span]) -> list[Span]:
        """The GPU compute spans (:attr:`gpu`, sorted, disjoint) that overlap ``[min lo, max hi)`` of ``spans``:
        all that :func:`~pnpscale.analysis.overlap.rank_blocked` subtracts from them (``[]`` for no spans)."""
        if not spans:
            return []
        lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
        i = bisect_right(self._gpu_ends, lo)
        j = bisect_left(self.gpu, (hi,), lo=i)
        return self.gpu[i:j]

    def cpu(self, section: Event, works: Sequence[Event]) -> tuple[list[Span], list[Span]]:
        """(compute spans, c10d call spans) inside ``section`` on its thread and on every thread that issued a
        collective in it."""
        if not works:
            return [], []
        lo, hi = section.start_ns, section.end_ns
        tids = {section.tid} | {
            t for t, starts in self.c10d.items() if bisect_right(starts, hi) > bisect_left(starts, lo)
        }
        busy = union(s for t in tids for s in intersect(self.spans.get(t, []), [(lo, hi)]))
        return busy, union(s for t in tids for s in intersect(union(self.calls.get(t, [])), [(lo, hi)]))

    @staticmethod
    def split(
        colls: list[Collective],
        evs: Sequence[Event],
        busy: Sequence[Span],
        window: Span | None,
        waits: bool,
        activity: Sequence[Span] | None = None,
        calls: Sequence[Span] = (),
    ) -> int:
        """Fill each collective's blocked and hidden time (``colls`` aligned with their events ``evs``, clipped
        to ``window``); returns the section's hidden time (ns). With ``waits`` (a CPU thread: gloo), the thread
        is blocked only while it waits for a collective to end (:func:`pnpscale.analysis.overlap.waited`).
        ``activity``: each collective's span when not its event's (gloo: from its c10d call to its end);
        ``calls``: the thread's time inside ``c10d::`` calls (blocked)."""
        if not colls:
            return 0
        activity = activity if activity is not None else [(e.start_ns, e.end_ns) for e in evs]
        per, hidden = rank_blocked(activity, busy, window, waits=waits, calls=calls)
        blocked = union(s for spans in per for s in spans)
        for c, e, spans, act in zip(colls, evs, per, activity, strict=True):
            lo, hi = (max(act[0], window[0]), min(act[1], window[1])) if window else act
            c.blocked_s = length(spans) * 1e-9
            c.blocked_spans = spans_text(spans, e.start_ns)
            c.hidden_s = length(subtract([(lo, hi)] if hi > lo else [], blocked)) * 1e-9
        return hidden
