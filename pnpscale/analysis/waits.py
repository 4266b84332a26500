"""Why ranks wait: the POP wait split exactly into late start, uneven work and jitter (pure functions).

The study's three causes of waiting ("Communication under the hood: transfer vs wait"), measured per
iteration i, section s, rank r and collective c (matched across ranks by ``seq``):

* ``A_rc``: arrival of rank r at c = the start of its gloo work range or NCCL kernel
  (``collectives.start_s``); ``D_rc``: its duration. Ranks leave a collective together, at
  ``E_c = A_rc + D_rc``, so the POP wait of r at c, ``w_rc = D_rc − min_r' D_r'c``
  (:mod:`pnpscale.analysis.metrics`), equals ``max_r' A_r'c − A_rc``. ``w_rc`` is what is split, so
  the three parts always sum to the section's POP wait ``W = mean_r Σ_c w_rc``. Where compute overlaps
  the collective (:mod:`pnpscale.analysis.overlap`), ``w_rc`` is the rank's blocked time before the last
  rank entered (``ω_rc``); the jitter part takes the difference, so the parts still sum to ``W``.
* Anchor: the last moment the ranks were together before c — the exit of the rank's previous
  collective in the section, or, for the section's first collective, the exit of the rank's last
  collective of an earlier section in the same iteration, else the start of the iteration's first
  section (every iteration ends with a barrier outside the sections, so ranks enter the first section
  together: its late start is 0 by construction).
* Entry skew ``g_r = s_r − anchor`` for the first collective of the section (``s_r`` the section's
  start on rank r), 0 for the later ones (the ranks just left a collective together).
* Work before c: ``x_rc = A_rc − s_r`` for the first collective, ``A_rc − E_r,c−1`` for later ones.
  ``x̄_rc``: its mean over the measured (non-warm-up) iterations — the rank's *systematic* work.

Split (sequential attribution: uneven work first, then late start, then the rest)::

    uneven work  I_rc = max_r' x̄_r'c − x̄_rc                      (>= 0; 0 for the slowest rank)
    late start   L_rc = max_r' (g_r' + x̄_r'c) − (g_r + x̄_rc) − I_rc
    jitter       J_rc = w_rc − L_rc − I_rc                          (the rest)

``I`` is the wait r would have if every rank did its usual work and all started together; ``L`` what
the measured entry skew adds to that (negative when starting late *saved* r some wait); ``J`` what
this iteration's deviation from the usual work adds (either sign). Section values are
``mean_r Σ_c`` of each part, seconds per iteration, and sum to ``W`` exactly (up to rounding).

On CUDA, ``s_r`` is the host's entry into the section's range and ``A_rc`` the NCCL kernel's start on
the GPU, so ``x`` includes the host's lead over the GPU; the split stays exact, late start is measured
at host entry. Tables without collective starts (run folders written before they were recorded) give
NaN parts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.overlap import split_blocked

_KEY = [K.ITERATION, K.SECTION]
#: per-collective columns of :func:`wait_parts`.
PART_COLUMNS = (K.ITERATION, K.SECTION, K.RANK, K.SEQ, K.WARMUP, K.WAIT_S, *K.WAIT_CAUSES)
CRITICAL_ITERATIONS = "critical_iterations"
CRITICAL_SHARE = "critical_share"
CRITICAL = "critical"
OPERATORS = "operators"
TILES = "tiles"
#: columns of :func:`rank_table`.
RANK_TABLE_COLUMNS = (
    K.SECTION, K.RANK, OPERATORS, TILES, K.COMPUTE_S, CRITICAL_ITERATIONS, CRITICAL_SHARE, CRITICAL, K.WAIT_S,
    *K.WAIT_CAUSES,
)  # fmt: skip


def _starts(df: pd.DataFrame) -> pd.Series:
    return df[K.START_S].astype("float64") if K.START_S in df.columns else pd.Series(np.nan, index=df.index)


def wait_parts(ranks: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Measured wait of every rank at every collective and its split by cause (see module doc).

    Args:
        ranks: ``ranks.parquet`` rows (RANK, ITERATION, SECTION, WARMUP, START_S, seconds).
        collectives: ``collectives.parquet`` rows (RANK, ITERATION, SECTION, SEQ, DURATION_S and
            START_S, seconds); collectives matched across ranks by SEQ. Without START_S (or with NaN
            starts) the parts are NaN.

    Returns:
        One row per iteration x section x rank x collective, columns :data:`PART_COLUMNS`:
        WAIT_S = ``w_rc`` and WAIT_LATE_START_S + WAIT_IMBALANCE_S + WAIT_JITTER_S = WAIT_S (seconds).

    >>> ranks = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "warmup": False,
    ...                       "start_s": [0.0, 0.0]})
    >>> coll = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "seq": 0,
    ...                      "start_s": [0.3, 0.1], "duration_s": [0.1, 0.3]})
    >>> wait_parts(ranks, coll)[["rank", "wait_s", "wait_imbalance_s", "wait_jitter_s"]].round(9).values.tolist()
    [[0.0, 0.0, 0.0, 0.0], [1.0, 0.2, 0.2, 0.0]]
    """
    if collectives.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in PART_COLUMNS})
    c = collectives[[K.RANK, K.ITERATION, K.SECTION, K.SEQ, K.DURATION_S]].copy()
    c[K.SECTION] = c[K.SECTION].astype(str)
    c[K.DURATION_S] = c[K.DURATION_S].astype("float64")
    c[K.START_S] = _starts(collectives)
    c[K.WAIT_S] = split_blocked(collectives)[K.WAIT_S].to_numpy()  # D_rc - min_r D_rc when blocking throughout
    c["_end"] = c[K.START_S] + c[K.DURATION_S]

    r = ranks[[K.RANK, K.ITERATION, K.SECTION, K.WARMUP]].copy()
    r[K.SECTION] = r[K.SECTION].astype(str)
    r["_s"] = _starts(ranks)
    r = r.merge(c.groupby([*_KEY, K.RANK])["_end"].max().rename("_last").reset_index(), on=[*_KEY, K.RANK], how="left")
    r["_g"] = _entry_skew(r)

    c = c.merge(r[[*_KEY, K.RANK, K.WARMUP, "_s", "_g"]], on=[*_KEY, K.RANK], how="left")
    c = c.sort_values([*_KEY, K.RANK, K.START_S, K.SEQ], kind="stable")
    by_rank = [c[k] for k in (*_KEY, K.RANK)]
    prev_end = c["_end"].groupby(by_rank).shift().groupby(by_rank).cummax()  # latest end before each start
    first = c.groupby([*_KEY, K.RANK]).cumcount() == 0
    c["_x"] = c[K.START_S] - np.where(first, c["_s"], prev_end)
    c["_gc"] = np.where(first, c["_g"], 0.0)

    measured = c[~c[K.WARMUP].astype(bool)]
    base = measured if not measured.empty else c
    xbar = base.groupby([K.SECTION, K.SEQ, K.RANK])["_x"].mean().rename("_xbar").reset_index()
    c = c.merge(xbar, on=[K.SECTION, K.SEQ, K.RANK], how="left")
    fallback = c.groupby([K.SECTION, K.SEQ, K.RANK])["_x"].transform("mean")
    c["_xbar"] = c["_xbar"].fillna(fallback)

    per_c = [*_KEY, K.SEQ]
    c[K.WAIT_IMBALANCE_S] = c.groupby(per_c)["_xbar"].transform("max") - c["_xbar"]
    reach = c["_gc"] + c["_xbar"]
    c[K.WAIT_LATE_START_S] = reach.groupby([c[k] for k in per_c]).transform("max") - reach - c[K.WAIT_IMBALANCE_S]
    c[K.WAIT_JITTER_S] = c[K.WAIT_S] - c[K.WAIT_LATE_START_S] - c[K.WAIT_IMBALANCE_S]
    unknown = c[K.WAIT_LATE_START_S].isna().groupby([c[k] for k in per_c]).transform("any")
    c.loc[unknown, list(K.WAIT_CAUSES)] = np.nan
    c[K.WARMUP] = c[K.WARMUP].astype(bool)
    out = c.sort_values([*_KEY, K.RANK, K.SEQ], kind="stable")
    return out[list(PART_COLUMNS)].reset_index(drop=True)


def _entry_skew(r: pd.DataFrame) -> pd.Series:
    """``g_r = s_r − anchor`` per rank x iteration x section row of ``r`` (columns _s, _last).

    Per iteration x rank, sections in order of start: the anchor is the first section's start, raised to the
    latest end of the collectives of the sections before (``_last``, NaN: none); NaN where the first start is.
    """
    o = r.sort_values("_s", kind="stable")
    keys = [o[K.ITERATION], o[K.RANK]]
    first = o.groupby(keys, sort=False).cumcount() == 0
    s0 = o["_s"].where(first).groupby(keys, sort=False).ffill()
    before = o["_last"].fillna(-np.inf).groupby(keys, sort=False).shift().fillna(-np.inf)
    anchor = np.maximum(s0, before.groupby(keys, sort=False).cummax())
    return (o["_s"] - anchor).reindex(r.index)


def wait_by_cause(ranks: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """The section's wait split by cause, per iteration x section: ``mean_r Σ_c`` of each part.

    Args:
        ranks, collectives: see :func:`wait_parts`.

    Returns:
        ITERATION, SECTION and :data:`pnpscale.columns.WAIT_CAUSES` (seconds), one row per iteration x
        section of ``ranks``; 0.0 for a section without collectives, NaN where collective starts are
        missing. The three sum to :func:`pnpscale.analysis.metrics.decompose`'s WAIT_S.
    """
    keys = ranks[_KEY].drop_duplicates().astype({K.SECTION: str})
    parts = wait_parts(ranks, collectives)
    if parts.empty:
        return keys.assign(**{c: 0.0 for c in K.WAIT_CAUSES}).reset_index(drop=True)
    world = ranks[K.RANK].nunique()
    cols = list(K.WAIT_CAUSES)
    g = parts.groupby(_KEY)[cols]
    per = g.sum() / world
    per[parts[cols].isna().groupby([parts[k] for k in _KEY]).any()] = np.nan
    out = keys.merge(per.reset_index(), on=_KEY, how="left")
    has_coll = out.set_index(_KEY).index.isin(per.index)
    out.loc[~has_coll, cols] = 0.0
    return out.reset_index(drop=True)


def rank_table(
    ranks: pd.DataFrame,
    collectives: pd.DataFrame,
    operators_per_rank: Sequence[int] | None = None,
    tiles_per_rank: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Per section x rank over the measured iterations: who is on the critical path, and why others wait.

    The critical-path rank of an iteration x section is the rank with the largest compute
    ``S_r − Σ_c b_rc`` (POP's ``C_max``, ``b_rc`` the blocked time: ``D_rc`` for a blocking collective;
    ties: the lowest rank).

    Args:
        ranks, collectives: see :func:`wait_parts` (ranks also needs SECTION_S).
        operators_per_rank, tiles_per_rank: the run's assignment (``run.json`` ``assignment``), or None.

    Returns:
        Columns :data:`RANK_TABLE_COLUMNS`: OPERATORS, TILES (NA when unknown), COMPUTE_S (mean per
        iteration), CRITICAL_ITERATIONS (measured iterations in which the rank was critical),
        CRITICAL_SHARE (their fraction), CRITICAL (True for the section's most often critical rank; ties:
        the larger mean compute), WAIT_S and the three parts (mean per iteration of ``Σ_c``, seconds).

    Raises:
        ValueError: an assignment list whose length is not the number of ranks.
    """
    world = sorted(int(x) for x in ranks[K.RANK].unique())
    for name, lst in (("operators_per_rank", operators_per_rank), ("tiles_per_rank", tiles_per_rank)):
        if lst is not None and len(lst) != len(world):
            raise ValueError(f"{name} has {len(lst)} entries for {len(world)} ranks")
    r = ranks.copy()
    r[K.SECTION] = r[K.SECTION].astype(str)
    measured = r[~r[K.WARMUP].astype(bool)]
    r = measured if not measured.empty else r
    comm = (
        collectives.assign(**{K.SECTION: collectives[K.SECTION].astype(str)})
        .assign(_blocked=split_blocked(collectives)[K.BLOCKED_S])
        .groupby([*_KEY, K.RANK])["_blocked"]
        .sum()
        .rename("_comm")
        if not collectives.empty
        else pd.Series(dtype="float64", name="_comm")
    )
    r = r.merge(comm.reset_index(), on=[*_KEY, K.RANK], how="left") if not comm.empty else r.assign(_comm=0.0)
    r[K.COMPUTE_S] = r[K.SECTION_S].astype("float64") - r["_comm"].fillna(0.0)
    crit = r.sort_values([*_KEY, K.COMPUTE_S, K.RANK], ascending=[True, True, False, True]).drop_duplicates(_KEY)
    n_it = r.groupby(K.SECTION)[K.ITERATION].nunique()
    counts = crit.groupby([K.SECTION, K.RANK]).size()
    out = r.groupby([K.SECTION, K.RANK], sort=False)[K.COMPUTE_S].mean().reset_index()
    out[CRITICAL_ITERATIONS] = [int(counts.get((s, k), 0)) for s, k in zip(out[K.SECTION], out[K.RANK], strict=True)]
    out[CRITICAL_SHARE] = out[CRITICAL_ITERATIONS] / out[K.SECTION].map(n_it)
    top = out.sort_values([CRITICAL_ITERATIONS, K.COMPUTE_S], ascending=False).drop_duplicates(K.SECTION)
    out[CRITICAL] = out.index.isin(top.index)
    parts = wait_parts(ranks, collectives)
    pm = parts[~parts[K.WARMUP]] if not parts.empty and (~parts[K.WARMUP]).any() else parts
    cols = [K.WAIT_S, *K.WAIT_CAUSES]
    if pm.empty:
        per_rank = pd.DataFrame(0.0, index=pd.MultiIndex.from_frame(out[[K.SECTION, K.RANK]]), columns=cols)
    else:
        tot = pm.groupby([K.SECTION, K.RANK])[cols].sum(min_count=1)
        per_rank = tot.div(pm.groupby(K.SECTION)[K.ITERATION].nunique(), level=K.SECTION, axis=0)
    out = out.merge(per_rank.reset_index(), on=[K.SECTION, K.RANK], how="left")
    if not pm.empty:
        out[K.WAIT_S] = out[K.WAIT_S].fillna(0.0)
    ops = dict(zip(world, operators_per_rank, strict=True)) if operators_per_rank is not None else {}
    tiles = dict(zip(world, tiles_per_rank, strict=True)) if tiles_per_rank is not None else {}
    out[OPERATORS] = out[K.RANK].map(ops).astype("Int64")
    out[TILES] = out[K.RANK].map(tiles).astype("Int64")
    out[K.RANK] = out[K.RANK].astype("int64")
    return out[list(RANK_TABLE_COLUMNS)].reset_index(drop=True)
