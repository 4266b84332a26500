"""Whether the ranks' clocks can be trusted together, from the matched collectives alone: a causality bound.

A collective whose result on every rank depends on every rank's input (:data:`CAUSAL`: all_reduce,
all_gather, reduce_scatter, all_to_all, barrier) cannot end on one rank before it started on another: in true
time ``end_rc >= start_qc`` for every pair of ranks ``r, q``. Each rank's times are written on its own clock
(and ``collectives.start_s`` counts from the rank's own first section), ``t = true + o_r`` with an unknown
offset ``o_r`` per rank, so every causal collective ``c`` of both ranks bounds the offset between them::

    max_c (start_rc - end_qc)  <=  o_r - o_q  <=  min_c (end_rc - start_qc)

Any constant offset (a skew between the hosts' clocks, another origin, a GPU clock behind its CPU's) fits
these bounds, and changes no number: the decomposition uses each rank's durations only (the study's
``w_rc = D_rc - min_r D_rc``; ``tests/test_trace_properties.py`` draws skews of up to 5 ms and requires the
numbers to the nanosecond and no anomaly). When the bounds cross (lower > upper), **no** constant offset
explains the trace: the clock of one of the two ranks stepped (or drifted) while it was recorded, or the
collectives matched across ranks are not the same ones; either makes a section's time, a duration or a
match, and so a wait, wrong. The crossing is a proof, its size a lower bound of the step: a step of ``Δ``
between two collectives crosses the bounds by at most ``|Δ|``, and by more than the collectives'
durations allow it to hide in.

Pure functions over the ``collectives`` table (:mod:`pnpscale.columns`); the offline analysis records each
conflict as a ``rank_clocks_inconsistent`` anomaly (:func:`conflict_text`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pnpscale import columns as K

#: collective types whose every rank's result depends on every rank's input (a broadcast's root, a reduce's
#: non-roots may finish before the others start: not used)
CAUSAL = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
#: crossings smaller than this are not reported (s): a trace written in integer microseconds rounds each
#: timestamp by up to 0.5 us, and a crossing adds four of them
TOLERANCE_S = 2e-6

_KEY = [K.ITERATION, K.SECTION, K.SEQ]


@dataclass(frozen=True)
class ClockConflict:
    """Two ranks whose clocks no constant offset reconciles.

    Attributes:
        rank, other: the ranks (``other`` the reference: the lowest rank analysed).
        lower_s, upper_s: the crossed bounds of ``o_rank - o_other`` (s; ``lower_s > upper_s``).
        lower_at, upper_at: the collective (iteration, section, seq) each bound comes from.
        blamed: the rank whose clock is found to be the odd one (every conflict involves it, see
            :func:`clock_conflicts`), ``None`` when two ranks alone cannot tell which.
    """

    rank: int
    other: int
    lower_s: float
    upper_s: float
    lower_at: tuple[int, str, int]
    upper_at: tuple[int, str, int]
    blamed: int | None = None

    @property
    def crossing_s(self) -> float:
        """By how much the bounds cross (s, > 0): a lower bound of the clock step."""
        return self.lower_s - self.upper_s


def offset_bounds(
    collectives: pd.DataFrame, rank: int, other: int
) -> tuple[float, float, tuple[int, str, int] | None, tuple[int, str, int] | None]:
    """``(lower, upper, lower_at, upper_at)``: the bounds (s) of ``o_rank - o_other`` from the causal collectives
    both ranks recorded (see module doc) and the collective (iteration, section, seq) each comes from;
    ``(-inf, inf, None, None)`` without one.

    Args:
        collectives: RANK, ITERATION, SECTION, SEQ, COLLECTIVE, START_S, DURATION_S (seconds); matched across
            ranks by (ITERATION, SECTION, SEQ). Rows with a NaN start or another type than :data:`CAUSAL`
            (on either rank) are not used.

    >>> c = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "seq": 0, "collective": "all_reduce",
    ...                   "start_s": [1.0, 0.4], "duration_s": [0.5, 1.0]})
    >>> offset_bounds(c, 1, 0)[:2]  # rank 1 ends at 1.4, rank 0 at 1.5: o1 - o0 in [0.4 - 1.5, 1.4 - 1.0]
    (-1.1, 0.3999999999999999)
    """
    got = _bounds_against(collectives[collectives[K.RANK].isin([rank, other])], other)
    return got.get(rank, (-np.inf, np.inf, None, None))


_Bounds = tuple[float, float, "tuple[int, str, int] | None", "tuple[int, str, int] | None"]


def _bounds_against(collectives: pd.DataFrame, ref: int) -> dict[int, _Bounds]:
    """:func:`offset_bounds` of every other rank against ``ref`` at once (one pivot: O(ranks x collectives));
    only ranks with a causal collective of the same type in common with ``ref``."""
    if collectives.empty or K.START_S not in collectives or K.COLLECTIVE not in collectives:
        return {}
    c = collectives[collectives[K.COLLECTIVE].astype(str).isin(CAUSAL) & collectives[K.START_S].notna()]
    c = c.assign(**{K.SECTION: c[K.SECTION].astype(str), K.COLLECTIVE: c[K.COLLECTIVE].astype(str)})
    c = c.drop_duplicates([*_KEY, K.RANK])
    if c.empty or ref not in set(c[K.RANK].tolist()):
        return {}
    start = c.pivot(index=_KEY, columns=K.RANK, values=K.START_S).astype(float)
    end = start + c.pivot(index=_KEY, columns=K.RANK, values=K.DURATION_S).astype(float)
    kind = c.pivot(index=_KEY, columns=K.RANK, values=K.COLLECTIVE)
    same = kind.eq(kind[ref], axis=0).to_numpy() & start.notna().to_numpy() & start[ref].notna().to_numpy()[:, None]
    upper = np.where(same, end.to_numpy() - start[ref].to_numpy()[:, None], np.inf)  # <= end on r - start on ref
    lower = np.where(same, start.to_numpy() - end[ref].to_numpy()[:, None], -np.inf)  # >= start on r - end on ref
    at = [(int(x), str(sec), int(q)) for x, sec, q in start.index]
    out: dict[int, _Bounds] = {}
    for k, rank in enumerate(int(r) for r in start.columns):
        if rank == ref or not same[:, k].any():
            continue
        i, j = int(np.argmin(upper[:, k])), int(np.argmax(lower[:, k]))
        out[rank] = (float(lower[j, k]), float(upper[i, k]), at[j], at[i])
    return out


def clock_conflicts(collectives: pd.DataFrame, tolerance_s: float = TOLERANCE_S) -> list[ClockConflict]:
    """The ranks whose clock no constant offset reconciles with the lowest rank's (crossing > ``tolerance_s``).

    Each rank is compared with the reference (the lowest rank): O(ranks x collectives). A rank whose clock
    stepped conflicts with the reference alone; the reference's own step makes every rank conflict with it.
    So with three ranks or more the odd clock is ``blamed``: the one rank in conflict when only one is, the
    reference when all are; with two ranks (or a mix) ``None``.

    Args:
        collectives: see :func:`offset_bounds`. tolerance_s: seconds (default :data:`TOLERANCE_S`).

    Returns:
        One :class:`ClockConflict` per conflicting rank, by rank; empty when every pair fits (always for
        constant offsets).

    >>> c = pd.DataFrame({"rank": [0, 1, 0, 1], "iteration": [0, 0, 1, 1], "section": "s", "seq": 0,
    ...                   "collective": "all_reduce", "start_s": [0.0, 0.0, 1.0, 1.5], "duration_s": 0.1})
    >>> [(x.rank, x.other, round(x.crossing_s, 9)) for x in clock_conflicts(c)]  # rank 1 stepped by +0.5 s
    [(1, 0, 0.3)]
    """
    if collectives.empty or K.START_S not in collectives:
        return []
    ranks = sorted(int(r) for r in collectives[K.RANK].unique())
    if len(ranks) < 2:
        return []
    ref = ranks[0]
    found: list[ClockConflict] = []
    for r, (lo, hi, lo_at, hi_at) in sorted(_bounds_against(collectives, ref).items()):
        if lo_at is not None and hi_at is not None and lo - hi > tolerance_s:
            found.append(ClockConflict(r, ref, lo, hi, lo_at, hi_at))
    blamed = _blamed([x.rank for x in found], ranks)
    return [ClockConflict(x.rank, x.other, x.lower_s, x.upper_s, x.lower_at, x.upper_at, blamed) for x in found]


def _blamed(conflicting: Sequence[int], ranks: Sequence[int]) -> int | None:
    """The odd clock (see :func:`clock_conflicts`), else ``None``."""
    if len(ranks) < 3 or not conflicting:
        return None
    if len(conflicting) == 1:
        return conflicting[0]
    if len(conflicting) == len(ranks) - 1:
        return ranks[0]
    return None


def conflict_text(x: ClockConflict) -> str:
    """What an anomaly says of a conflict: the ranks, the crossed bounds in us and where each comes from.

    >>> x = ClockConflict(1, 0, 4e-4, 1e-4, (1, "s", 0), (0, "s", 0))
    >>> conflict_text(x)  # doctest: +NORMALIZE_WHITESPACE
    "no constant offset between the clocks of rank 1 and rank 0 lets every collective end after the other rank
    started it: the clock of rank 1 minus rank 0's must be <= 100 us (iteration 0, section 's', seq 0) and
    >= 400 us (iteration 1, section 's', seq 0): a clock stepped by at least 300 us between them (or those
    collectives are not the same on both ranks)"
    """

    def where(at: tuple[int, str, int]) -> str:
        return f"iteration {at[0]}, section {at[1]!r}, seq {at[2]}"

    def us(s: float) -> str:
        return f"{s * 1e6:.6g} us"

    return (
        f"no constant offset between the clocks of rank {x.rank} and rank {x.other} lets every collective end "
        f"after the other rank started it: the clock of rank {x.rank} minus rank {x.other}'s must be <= "
        f"{us(x.upper_s)} ({where(x.upper_at)}) and >= {us(x.lower_s)} ({where(x.lower_at)}): a clock stepped "
        f"by at least {us(x.crossing_s)} between them (or those collectives are not the same on both ranks)"
    )
