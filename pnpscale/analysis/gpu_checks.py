"""Physical checks of one trace's device events and runtime clock (pure functions over integer-ns arrays).

A device event is not physical when (:func:`gpu_faults`):

* its ``ts`` is 0 or negative: an unset timestamp (pytorch/kineto#109 writes kernels with ``ts: 0,
  dur: 0``; a kernel "before the epoch" is one whose time was never converted);
* it starts before the runtime call that launched it (same ``correlation``): work cannot run before it
  is issued, so either the event or the runtime clock is wrong;
* it starts outside the profiled window (Kineto's ``PyTorch Profiler (N)`` span, category ``Trace``) by
  more than :data:`WINDOW_SLACK_NS` (a timestamp in the wrong unit or never converted), when the trace
  has that span;
* it starts before the previous event on its stream ends: one stream runs its work in order (kernels of
  one CUDA-graph launch share a correlation id and may overlap: they are not compared).

Tolerances are the trace's own timestamp resolution (:func:`resolution_ns`): ``ts`` and ``dur`` are each
rounded to it, so an end may pass the next start, or a start precede its launch, by up to one unit (a 1 ns
overlap in a converted trace, 1 us in a trace rounded to microseconds) without any clock being wrong.

The runtime clock (:func:`runtime_offset`): a collective kernel is launched inside its CPU-side
descriptor (``record_param_comms`` / ``nccl:<op>``: PyTorch's ProcessGroupNCCL launches the kernel inside
both ranges, on the calling thread). When no launch lies inside its descriptor but one offset puts every
launch inside, the runtime events are on another clock than the CPU ranges (pytorch/kineto#1082: ROCm's
``hip*`` events): the launches are shifted by the offset nearest zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: fault codes of :func:`gpu_faults`
OK, TS_UNSET, BEFORE_LAUNCH, STREAM_OVERLAP, OUTSIDE_WINDOW = 0, 1, 2, 3, 4
#: how far a device event may start outside the profiler's span (work queued before it started, or
#: flushed after it stopped): 1 s, far more than any real lag, far less than a timestamp in the wrong unit
WINDOW_SLACK_NS = 10**9


def resolution_ns(*values: np.ndarray) -> int:
    """The trace's timestamp resolution in ns: the largest of 1000, 100, 10 that divides every value, else 1.

    >>> resolution_ns(np.array([1_000, 25_000]), np.array([3_000])), resolution_ns(np.array([1_001, 2_000]))
    (1000, 1)
    """
    arrays = [np.asarray(v, dtype=np.int64) for v in values if len(v)]
    if not arrays:
        return 1
    for unit in (1000, 100, 10):
        if all(not np.any(a % unit) for a in arrays):
            return unit
    return 1


def gpu_faults(
    start: np.ndarray,
    end: np.ndarray,
    stream: np.ndarray,
    corr: np.ndarray,
    launch: np.ndarray,
    window: tuple[int, int] | None = None,
    tolerance_ns: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Fault code per device event and, for a stream overlap, the index of the event it overlaps.

    Args:
        start, end: ns as recorded (``ts`` relative to ``baseTimeNanoseconds`` when the trace has it);
            stream: stream id; corr: correlation id (``<= 0``: unknown); launch: launch start in ns on
            the same clock, ``-1`` when unknown. All int64, one entry per event. window: the profiler's
            span ``(start, end)`` in ns on the same clock, when the trace has it. tolerance_ns: an overlap or a
            start before the launch of at most this many ns is rounding, not a fault (:func:`resolution_ns`).

    Returns:
        ``(codes, other)``: ``codes`` int8 (:data:`OK`, :data:`TS_UNSET`, :data:`BEFORE_LAUNCH`,
        :data:`STREAM_OVERLAP`, :data:`OUTSIDE_WINDOW`; the first of unset, outside, overlap,
        before launch), ``other`` the index of the overlapped event
        (``-1`` otherwise).

    >>> s, e = np.array([0, 10, 15, 30]), np.array([0, 20, 25, 40])
    >>> codes, other = gpu_faults(s, e, np.array([7, 7, 7, 7]), np.array([1, 2, 3, 4]), np.array([-1, 5, 12, 31]))
    >>> codes.tolist(), other.tolist()
    ([1, 0, 3, 2], [-1, -1, 1, -1])
    >>> gpu_faults(np.array([10, 20]), np.array([21, 30]), np.array([7, 7]), np.array([1, 2]), np.array([1, 2]),
    ...            tolerance_ns=1)[0].tolist()  # a 1 ns overlap at 1 ns resolution: rounding
    [0, 0]
    """
    n = len(start)
    codes = np.zeros(n, dtype=np.int8)
    other = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return codes, other
    order = np.lexsort((end, start, stream))
    s, e, st, c = start[order], end[order], stream[order], corr[order]
    same = np.zeros(n, dtype=bool)
    same[1:] = st[1:] == st[:-1]
    prev_end = np.empty(n, dtype=np.int64)
    prev_end[0] = np.iinfo(np.int64).min
    prev_end[1:] = e[:-1]
    prev_corr = np.empty(n, dtype=np.int64)
    prev_corr[0] = -1
    prev_corr[1:] = c[:-1]
    graph = (c == prev_corr) & (c > 0)
    overlap = same & (s < prev_end - tolerance_ns) & ~graph
    before = (launch >= 0) & (start < launch - tolerance_ns)
    codes[before] = BEFORE_LAUNCH
    hit = order[np.flatnonzero(overlap)]  # an overlap says more than a start before the launch
    codes[hit] = STREAM_OVERLAP
    other[hit] = order[np.flatnonzero(overlap) - 1]
    if window is not None:
        outside = (start < window[0] - WINDOW_SLACK_NS) | (start > window[1] + WINDOW_SLACK_NS)
        codes[outside] = OUTSIDE_WINDOW
        other[outside] = -1
    unset = start <= 0
    codes[unset] = TS_UNSET
    other[unset] = -1
    return codes, other


def runtime_offset(launches: Sequence[int], descriptors: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Offsets ``[lo, hi]`` (ns) that put every launch inside its descriptor, when they exclude 0.

    The k-th launch (in time order) is paired with the k-th descriptor range ``(start, end)`` (in
    start order). ``None`` when the counts differ, when there is none, when no offset fits every pair
    (the pairing does not hold: coalesced collectives, several issuing threads) or when offset 0 fits
    (the clocks agree).

    >>> runtime_offset([91, 191], [(100, 105), (200, 206)])
    (9, 14)
    >>> runtime_offset([102, 202], [(100, 105), (200, 206)]) is None
    True
    """
    if not launches or len(launches) != len(descriptors):
        return None
    la = np.sort(np.asarray(launches, dtype=np.int64))
    d = np.asarray(sorted(descriptors), dtype=np.int64)
    lo, hi = int(np.max(d[:, 0] - la)), int(np.min(d[:, 1] - la))
    if lo > hi or lo <= 0 <= hi:
        return None
    return lo, hi


def nearest_zero(lo: int, hi: int) -> int:
    """The offset of ``[lo, hi]`` nearest 0.

    >>> nearest_zero(9, 14), nearest_zero(-13, -8), nearest_zero(-2, 3)
    (9, -8, 0)
    """
    return 0 if lo <= 0 <= hi else (lo if lo > 0 else hi)
