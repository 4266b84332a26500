"""Communication that overlaps computation: the time a rank is blocked on its collectives (pure functions).

The study ("Communication under the hood: transfer vs wait") takes a collective's cost on a rank as the
length of its range or kernel, ``D_rc``. That is right when the collective blocks the rank from its start
to its end; it is wrong as soon as communication overlaps computation (DDP's gradient buckets, an async
``all_reduce`` hidden behind compute, collectives in flight together). pnpscale measures instead, per rank
r and section occurrence:

* the collectives' **activity** ``a_rc = [A_rc, E_rc]``: the gloo work range (on a gloo worker thread),
  from the start of the ``c10d::`` call that issued it when the trace pairs them (the calling thread is
  inside the collective from then on), or the NCCL kernel (on a GPU stream); clipped to the section;
* the rank's **busy** time ``B_r``: where the rank computes. CPU/gloo: where the innermost profiled
  operator (``cpu_op``) on a thread that issued the collectives (or holds the section range) is a
  compute operator, i.e. neither a ``c10d::`` call nor an operator that encloses one (an autograd node
  that runs a collective and waits for it); time in no operator at all (the thread is inside
  ``Work.wait()``, or in Python between operators) is not busy. CUDA: the union of the rank's other
  GPU events (compute kernels, memcpy, memset);
* **blocked** ``b_r = (∪_c a_rc) − B_r`` (concurrent collectives count once: a union), and **hidden**
  ``h_r = (∪_c a_rc) ∩ B_r`` (communication overlapped by compute).

Each piece of blocked time is given to one collective: among those in flight, the one that ends first
(the one the rank waits for), so ``Σ_c b_rc = |b_r|``. Within collective c, with ``t_c = min_r D_rc``
(its duration on the last rank to arrive, who waits for nobody), the blocked time of rank r in
``[E_rc − t_c, E_rc]`` (after the last rank entered) is transfer ``τ_rc``, the rest wait ``ω_rc``::

    T = mean_r Σ_c τ_rc      W = mean_r Σ_c ω_rc      C = mean_r (S_r − Σ_c b_rc)      C + T + W = mean_r S_r

For a collective that blocks every rank from start to end (``b_rc = D_rc``) this is the study's rule
exactly: ``τ_rc = t_c``, so ``T = Σ_c min_r D_rc`` and ``W = mean_r Σ_c (D_rc − min_r D_rc)``.

Blocked pieces travel in the tables as text (:data:`pnpscale.columns.BLOCKED_SPANS_NS`): ``"lo-hi,lo-hi"``,
integer nanoseconds from the collective's start (negative: inside the c10d call, before the gloo work
started); ``""`` = never blocked; missing (NA) = blocked from start to end (tables written before this rule,
which assumed it).
"""

from __future__ import annotations

import bisect
import heapq
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pnpscale import columns as K

# pandas is imported where it is used: reading a rank's trace needs none of it (an offline analysis starts its
# trace readers before it imports pandas: pnpscale.analysis.offline)
if TYPE_CHECKING:
    import pandas as pd

Span = tuple[int, int]
_SPAN = re.compile(r"(-?\d+)-(-?\d+)")

#: prefix of the c10d operators a thread calls to issue a collective (``c10d::allreduce_``,
#: ``c10d::_reduce_scatter_base_``...): their time is communication, never compute.
C10D_PREFIX = "c10d::"


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint union of half-open spans ``[lo, hi)`` (empty spans dropped).

    >>> union([(5, 9), (0, 2), (1, 3), (9, 10), (4, 4)])
    [(0, 3), (5, 10)]
    """
    out: list[Span] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def intersect(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    """Intersection of two sorted disjoint span lists (as :func:`union` returns).

    >>> intersect([(0, 10), (20, 30)], [(5, 25)])
    [(5, 10), (20, 25)]
    """
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    """``a − b`` for sorted disjoint span lists.

    >>> subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)])
    [(0, 2), (4, 8), (22, 30)]
    """
    out: list[Span] = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def length(spans: Iterable[Span]) -> int:
    """Total length of disjoint spans (ns)."""
    return sum(hi - lo for lo, hi in spans)


def compute_spans(ops: Sequence[tuple[int, int, bool]]) -> list[Span]:
    """Where the innermost operator of one thread is a compute operator.

    Args:
        ops: ``(start_ns, end_ns, communicates)`` of every profiled operator of one thread (nested ranges,
            any order); ``communicates``: a ``c10d::`` call, or an operator enclosing one (see
            :func:`communicating`).

    Returns:
        Sorted disjoint spans: each operator's own time (its span minus its children's) where it computes.

    >>> compute_spans([(0, 100, False), (10, 20, False), (30, 60, True), (40, 50, False)])
    [(0, 30), (40, 50), (60, 100)]
    """
    out: list[Span] = []
    stack: list[tuple[int, int, bool, int]] = []  # (start, end, communicates, covered up to)

    def close(until: int) -> None:
        while stack and stack[-1][1] <= until:
            s, e, comm, cur = stack.pop()
            if not comm and cur < e:
                out.append((cur, e))
            if stack:
                ps, pe, pc, pcur = stack[-1]
                stack[-1] = (ps, pe, pc, max(pcur, e))

    for s, e, comm in sorted(ops, key=lambda o: (o[0], -o[1])):
        close(s)
        if stack:
            ps, pe, pc, pcur = stack[-1]
            if not pc and pcur < s:
                out.append((pcur, s))
            e = min(e, pe)  # a child never outlives its parent (rounding of microsecond timestamps)
            stack[-1] = (ps, pe, pc, max(pcur, s))
        stack.append((s, e, comm, s))
    close(1 << 62)
    return union(out)


def communicating(ops: Sequence[tuple[int, int, str]]) -> list[bool]:
    """Which operators of one thread communicate: a ``c10d::`` call, an operator inside one, or an operator
    that encloses one.

    Everything inside a ``c10d::`` call on the calling thread is communication: the copies gloo makes inside
    ``c10d::_reduce_scatter_base_`` (``aten::clone``/``aten::copy_``, FSDP's gradients) are part of the
    collective, not the rank's compute. An operator enclosing a collective call
    (``autograd::engine::evaluate_function: ...Backward`` of an autograd-aware all_reduce, whose backward
    issues the collective and waits for it) spends its own time waiting, not computing; its other children
    (the backward's compute) stay compute.

    Args:
        ops: ``(start_ns, end_ns, name)`` per operator of one thread.

    Returns:
        One flag per operator, aligned with ``ops``.

    >>> communicating([(0, 100, "autograd::engine::evaluate_function: X"), (10, 20, "c10d::allreduce_"),
    ...                (12, 15, "aten::clone"), (30, 40, "aten::mm"), (200, 300, "aten::mm")])
    [True, True, True, False, False]
    """
    order = sorted(range(len(ops)), key=lambda i: (ops[i][0], -ops[i][1]))
    calls = [ops[i][2].startswith(C10D_PREFIX) for i in range(len(ops))]
    flags = list(calls)
    stack: list[int] = []
    for i in order:
        s, e, _ = ops[i]
        while stack and ops[stack[-1]][1] <= s:
            stack.pop()
        if calls[i]:
            for j in stack:
                flags[j] = True
        if any(calls[j] for j in stack):  # inside a c10d call: part of the collective
            flags[i] = True
        stack.append(i)
    return flags


def attribute(activity: Sequence[Span], blocked: Sequence[Span]) -> list[list[Span]]:
    """Give each blocked piece to one collective: of those in flight, the one that ends first.

    Args:
        activity: one span per collective (its work range or kernel), in the rank's collective order.
        blocked: sorted disjoint blocked spans (inside the union of ``activity``).

    Returns:
        Per collective (aligned with ``activity``), its sorted disjoint blocked spans; together they are
        ``blocked`` exactly.

    >>> attribute([(0, 10), (2, 20)], [(0, 4), (8, 16)])
    [[(0, 4), (8, 10)], [(10, 16)]]
    """
    out: list[list[Span]] = [[] for _ in activity]
    if not blocked:
        return out
    cuts = sorted({p for a in activity for p in a} | {p for b in blocked for p in b})
    starts = sorted(range(len(activity)), key=lambda i: activity[i][0])
    heap: list[tuple[int, int]] = []  # (end, index) of collectives in flight
    k = 0
    j = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        while k < len(starts) and activity[starts[k]][0] <= lo:
            heapq.heappush(heap, (activity[starts[k]][1], starts[k]))
            k += 1
        while heap and heap[0][0] <= lo:
            heapq.heappop(heap)
        while j < len(blocked) and blocked[j][1] <= lo:
            j += 1
        if not heap or j >= len(blocked) or blocked[j][0] >= hi:
            continue
        piece = out[heap[0][1]]
        if piece and piece[-1][1] == lo:
            piece[-1] = (piece[-1][0], hi)
        else:
            piece.append((lo, hi))
    return out


#: how long after the calling thread resumed a gloo worker may still close the collective's range (ns): gloo
#: completes the work (the waiting thread resumes) before it closes its ``gloo:*`` range; 0.1-19 ms were
#: measured on loaded CPU/gloo jobs (issue 34), 25 ms is the bound :func:`waited` allows.
LATE_CLOSE_NS = 25_000_000


def waited(idle: Sequence[Span], busy: Sequence[Span], ends: Sequence[int]) -> list[Span]:
    """The part of a thread's idle time (collectives in flight, no compute) spent waiting for one to end.

    From the calling thread's view: ``Work.wait()`` / ``Future.wait()`` returns when its collective
    completes, so the thread waits from some moment of an idle gap (a gap between compute spans) until it
    resumes. The idle time of a gap up to the last collective end in it is blocked; so is the whole idle
    time of a gap after which a collective's range closes late, i.e. the first end after the gap lies in
    the compute span that resumes it, at most :data:`LATE_CLOSE_NS` after the gap (gloo's worker closes its
    range after it completed the work and the waiting thread went on). Idle time in a gap where no
    collective ends (Python between two operators while a collective is in flight) and after the last end
    is not blocked.

    Limits: a long stretch of un-profiled work (Python, ``time.sleep``) in the last gap before a collective
    whose range ends less than :data:`LATE_CLOSE_NS` into the following compute counts as blocked; a range
    closed later than that bound after the thread resumed leaves its wait uncounted.

    Args:
        idle: sorted disjoint spans (collectives in flight, not busy). busy: sorted disjoint compute spans.
        ends: the collectives' ends (ns).

    >>> waited([(10, 20), (30, 40), (50, 60)], [(0, 10), (20, 30), (40, 50)], [35])
    [(30, 35)]
    >>> waited([(10, 20)], [(0, 10), (20, 30)], [25])  # the range closed 5 ns after the thread resumed
    [(10, 20)]
    >>> waited([(10, 20)], [(0, 10), (20, 30), (40, 50)], [45])  # it ended in a later compute span: hidden
    []
    """
    ordered = sorted(ends)
    starts = [b[0] for b in busy]
    out: list[Span] = []
    for lo, hi in idle:
        k = bisect.bisect_right(starts, lo)  # busy[k - 1] ends at or before lo, busy[k] starts at or after hi
        gap_hi = starts[k] if k < len(starts) else 1 << 62
        j = bisect.bisect_right(ordered, gap_hi) - 1
        last = ordered[j] if j >= 0 else None
        late = ordered[j + 1] if j + 1 < len(ordered) else None
        if late is not None and k < len(starts) and late <= min(busy[k][1], gap_hi + LATE_CLOSE_NS):
            out.append((lo, hi))  # closed late, in the compute that resumed the thread
        elif last is not None and last > lo:
            out.append((lo, min(hi, last)))
    return out


def rank_blocked(
    activity: Sequence[Span],
    busy: Sequence[Span],
    window: Span | None = None,
    waits: bool = False,
    calls: Sequence[Span] = (),
) -> tuple[list[list[Span]], int]:
    """Blocked spans of each collective of one rank's section occurrence, and the hidden time (ns).

    ``b = (∪ activity) − busy`` (clipped to ``window``, the section), with ``waits`` (CPU threads) only its
    part spent waiting for a collective to end (:func:`waited`; a collective whose range closes more than
    :data:`LATE_CLOSE_NS` after the window was not waited for inside it: the thread closed the section meanwhile,
    and waits for it in a later one) plus the time inside collective calls
    (``calls``: the thread's ``c10d::`` operators); attributed by :func:`attribute`; hidden ``= |∪ activity| − |b|``.

    >>> rank_blocked([(0, 100)], [])  # a collective that blocks: the whole range
    ([[(0, 100)]], 0)
    >>> rank_blocked([(0, 100), (50, 120)], [(0, 90)])  # two in flight, compute until 90
    ([[(90, 100)], [(100, 120)]], 90)
    >>> ms = 1_000_000  # ended in compute 55 ms after the thread resumed: hidden
    >>> rank_blocked([(0, 100 * ms)], [(0, 40 * ms), (45 * ms, 100 * ms)], waits=True)
    ([[]], 100000000)
    >>> rank_blocked([(0, 100)], [(5, 100)], waits=True, calls=[(0, 5)])  # the c10d call itself is blocked
    ([[(0, 5)]], 95)
    """
    clipped = [(max(lo, window[0]), min(hi, window[1])) if window else (lo, hi) for lo, hi in activity]
    active = union(clipped)
    busy_u = union(busy)
    blocked = subtract(active, busy_u)
    if waits:
        in_calls = intersect(blocked, union(calls))
        # the real ends: a collective still in flight when the window (its section) closes was not waited for in
        # it, unless its range closes within LATE_CLOSE_NS after the window (a wait at the section's very end)
        late = window[1] + LATE_CLOSE_NS if window else 1 << 62
        ends = [min(a[1], c[1]) for a, c in zip(activity, clipped, strict=True) if c[1] > c[0] and a[1] <= late]
        blocked = union([*waited(blocked, busy_u, ends), *in_calls])
    return attribute(clipped, blocked), length(active) - length(blocked)


def spans_text(spans: Sequence[Span], origin: int) -> str:
    """``"lo-hi,..."`` of ``spans`` relative to ``origin`` (ns): the :data:`pnpscale.columns.BLOCKED_SPANS_NS` text.

    >>> spans_text([(105, 110), (120, 130)], 100)
    '5-10,20-30'
    """
    return ",".join(f"{lo - origin}-{hi - origin}" for lo, hi in spans)


def parse_spans(text: object) -> list[Span] | None:
    """The spans of a :data:`pnpscale.columns.BLOCKED_SPANS_NS` value; ``None`` for NA (blocked throughout).

    Raises:
        ValueError: text that is not ``lo-hi`` pairs of integers with ``lo < hi`` (``lo`` is negative for
            time in the c10d call before the work started).

    >>> parse_spans("5-10,20-30"), parse_spans(""), parse_spans(None), parse_spans("-40-10")
    ([(5, 10), (20, 30)], [], None, [(-40, 10)])
    """
    if text is None:
        return None
    if not isinstance(text, str):
        import pandas as pd

        if pd.isna(text):
            return None
    out = []
    for part in str(text).split(","):
        if not part:
            continue
        m = _SPAN.fullmatch(part)
        if m is None or int(m.group(2)) <= int(m.group(1)):
            raise ValueError(f"blocked span {part!r}: expected lo-hi, integers with lo < hi (ns)")
        lo, hi = int(m.group(1)), int(m.group(2))
        out.append((lo, hi))
    return out


def split_blocked(collectives: pd.DataFrame) -> pd.DataFrame:
    """Per collective row: blocked, wait and transfer of that rank (seconds), from the blocked spans.

    Args:
        collectives: rows with ITERATION, SECTION, SEQ, RANK, DURATION_S and optionally
            BLOCKED_SPANS_NS (missing or NA: blocked from start to end, the study's assumption).

    Returns:
        DataFrame aligned with ``collectives`` (same index): BLOCKED_S ``b_rc``, WAIT_S ``ω_rc`` and
        TRANSFER_S ``τ_rc`` with ``ω_rc + τ_rc = b_rc``; with ``t_c = min_r D_rc``, ``τ_rc`` is the blocked
        time in ``[D_rc − t_c, D_rc]`` of the collective. A fully blocked row gives ``τ_rc = t_c`` and
        ``ω_rc = D_rc − t_c`` exactly (the study's rule).

    Raises:
        ValueError: an unreadable BLOCKED_SPANS_NS value.

    >>> import pandas as pd
    >>> c = pd.DataFrame({"iteration": 0, "section": "s", "seq": 0, "rank": [0, 1], "duration_s": [0.5, 0.1]})
    >>> split_blocked(c).round(9).values.tolist()  # blocking: transfer 0.1 on both, rank 0 waited 0.4
    [[0.5, 0.4, 0.1], [0.1, 0.0, 0.1]]
    >>> split_blocked(c.assign(blocked_spans_ns=["", None])).round(9).values.tolist()  # rank 0: hidden
    [[0.0, 0.0, 0.0], [0.1, 0.0, 0.1]]
    """
    import pandas as pd

    d = collectives[K.DURATION_S].astype("float64")
    keys = [collectives[K.ITERATION], collectives[K.SECTION], collectives[K.SEQ]]
    t = d.groupby(keys).transform("min").clip(lower=0.0)
    texts = collectives[K.BLOCKED_SPANS_NS] if K.BLOCKED_SPANS_NS in collectives else pd.Series(None, index=d.index)
    blocked = np.empty(len(d))
    transfer = np.empty(len(d))
    for i, (dur, tc, text) in enumerate(zip(d.to_numpy(), t.to_numpy(), texts.to_numpy(), strict=True)):
        spans = parse_spans(text)
        if spans is None:  # blocked from start to end
            blocked[i], transfer[i] = dur, tc
            continue
        lo = round((dur - tc) * 1e9)
        blocked[i] = length(spans) * 1e-9
        transfer[i] = sum(max(0, hi - max(a, lo)) for a, hi in spans) * 1e-9
    out = pd.DataFrame({K.BLOCKED_S: blocked, K.TRANSFER_S: transfer}, index=collectives.index)
    out[K.WAIT_S] = (out[K.BLOCKED_S] - out[K.TRANSFER_S]).clip(lower=0.0)
    full = texts.isna().to_numpy()
    out.loc[full, K.WAIT_S] = (d - t)[full]
    return out[[K.BLOCKED_S, K.WAIT_S, K.TRANSFER_S]]
