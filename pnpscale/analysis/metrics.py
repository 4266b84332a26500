"""POP decomposition of section time into compute, transfer and wait (pure functions).

Formulas (POP methodology, as stated in the study "Communication under the hood: transfer vs wait"),
per iteration i and section s, ranks r = 0..W-1, collectives c matched across ranks by their
order inside the section:

* ``S_r``: section time of rank r; ``D_rc``: duration of collective c on rank r (seconds).
* transfer ``T = sum_c min_r D_rc`` (the last rank to arrive waits for nobody).
* wait ``W = mean_r sum_c (D_rc - min_r D_rc)``.
* compute ``C = mean_r (S_r - sum_c D_rc)``; ``C_max = max_r (S_r - sum_c D_rc)``.
* additivity: ``C + T + W = mean_r S_r``.
* per-section load balance ``LB = C / C_max``.
* wait by cause (:mod:`pnpscale.analysis.waits`): ``W = late start + uneven work + jitter``.

Over the measured iterations (warm-up excluded), summed per section and over all sections:
``LB = sum C / sum C_max``, ``CommE = sum C_max / sum S_max`` with ``S_max = max_r S_r`` (POP: the
section's elapsed time is its slowest rank's; the study divides by ``sum mean_r S_r``, the same where
ranks leave a section together), ``PE = sum C / sum S_max = LB x CommE``.

Collectives that overlap computation (:mod:`pnpscale.analysis.overlap`): ``D_rc`` above is the
collective's range or kernel; its cost is the rank's *blocked* time ``b_rc`` (``= D_rc`` for a collective
that blocks from start to end), split into wait (before the last rank entered) and transfer, so
``C = mean_r (S_r - sum_c b_rc)``; the rest of ``D_rc`` is hidden (HIDDEN_S, outside C + T + W).
GPU-seconds of a run: ``gpus x sum of section times`` (here per measured iteration).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.events import DecompositionError, NoMeasuredIteration
from pnpscale.analysis.overlap import split_blocked
from pnpscale.analysis.waits import wait_by_cause

_KEY = [K.ITERATION, K.SECTION]


class InvariantError(DecompositionError):
    """A decomposed table breaks a physical invariant (negative time, comm longer than its section)."""


#: tolerance of :func:`check_invariants`: 1 ns absolute plus 1e-9 of the section time (float rounding
#: of sums of integer-nanosecond times).
INVARIANT_ABS_S = 1e-9
INVARIANT_REL = 1e-9


def check_invariants(ranks: pd.DataFrame, sections: pd.DataFrame) -> None:
    """Check, before anything is written, that every row is physical (the readers re-check the same:
    :func:`check_rank_rows`, :func:`check_section_rows`).

    Args:
        ranks: the ``ranks`` table (RANK, ITERATION, SECTION, SECTION_S, COMM_S; seconds).
        sections: the :func:`decompose` output.

    Raises:
        InvariantError: the first violation, naming iteration, section, rank and the numbers.
    """
    check_rank_rows(ranks)
    check_section_rows(sections)


def _tol(seconds: pd.Series) -> pd.Series:
    return INVARIANT_ABS_S + INVARIANT_REL * seconds.abs()


def _first(table: pd.DataFrame, bad: pd.Series) -> pd.Series:
    return table[bad.fillna(False).astype(bool)].iloc[0]


def _fail(row: pd.Series, text: str, rank: Any = None) -> InvariantError:
    where = f"iteration {row[K.ITERATION]} section {row[K.SECTION]!r}" + ("" if rank is None else f" rank {rank}")
    it = row[K.ITERATION]
    return InvariantError(f"{where}: {text}", iteration=int(it) if pd.notna(it) else None,
                          rank=None if rank is None else int(rank))  # fmt: skip


def check_rank_rows(ranks: pd.DataFrame) -> None:
    """Per rank row, with ``tol = 1e-9 s + 1e-9 x S`` (:data:`INVARIANT_ABS_S`, :data:`INVARIANT_REL`):
    ``S_r >= 0`` and finite, ``0 <= sum_c b_rc <= S_r + tol`` (COMM_S: the time blocked on the collectives,
    :mod:`pnpscale.analysis.overlap`; skipped for a table without COMM_S, written before it existed).

    Raises:
        InvariantError: the first violation, naming iteration, section, rank and the numbers.
    """
    s = ranks[K.SECTION_S].astype("float64")
    comm = ranks[K.COMM_S].astype("float64") if K.COMM_S in ranks else pd.Series(0.0, index=ranks.index)
    tol = _tol(s)
    bad = (s < -tol) | (comm < -tol) | (comm > s + tol) | ~np.isfinite(s) | ~np.isfinite(comm)
    if bad.any():
        row = _first(ranks, bad)
        raise _fail(
            row,
            f"collectives take {comm[bad].iloc[0]:.9g} s of a {row[K.SECTION_S]:.9g} s section (need 0 <= sum_c "
            f"b_rc <= S_r, the time blocked on them; they run past the section): compute would be negative",
            row[K.RANK],
        )


def check_section_rows(sections: pd.DataFrame) -> None:
    """Per section row, with ``tol = 1e-9 s + 1e-9 x S``: ``T, W, C >= -tol`` and finite,
    ``|C + T + W - mean_r S_r| <= tol``, ``C <= C_max + tol`` (a mean never exceeds its maximum),
    ``C_max <= S_max + tol`` and ``S <= S_max + tol`` (where SECTION_MAX_S is known), and
    ``LB = C / C_max`` (where both are known and ``C_max > 0``, to 1e-6).

    Raises:
        InvariantError: the first violation, naming iteration, section and the numbers.
    """
    m = sections[K.SECTION_S].astype("float64")
    tol = _tol(m)
    c, t, w = (sections[k].astype("float64") for k in (K.COMPUTE_S, K.TRANSFER_S, K.WAIT_S))
    for name, v in ((K.COMPUTE_S, c), (K.TRANSFER_S, t), (K.WAIT_S, w)):
        neg = (v < -tol) | ~np.isfinite(v)
        if neg.any():
            row = _first(sections, neg)
            raise _fail(row, f"{name} = {row[name]:.9g} s is negative or not finite: not physical")
    off = (c + t + w - m).abs() > tol
    if off.any():
        row = _first(sections, off)
        raise _fail(
            row,
            f"compute + transfer + wait = {row[K.COMPUTE_S] + row[K.TRANSFER_S] + row[K.WAIT_S]:.9g} s differs "
            f"from the mean section time {row[K.SECTION_S]:.9g} s (C + T + W = mean_r S_r)",
        )
    cmax = sections[K.COMPUTE_MAX_S].astype("float64") if K.COMPUTE_MAX_S in sections else None
    smax = sections[K.SECTION_MAX_S].astype("float64") if K.SECTION_MAX_S in sections else None
    pairs = [(K.COMPUTE_S, c, K.COMPUTE_MAX_S, cmax), (K.COMPUTE_MAX_S, cmax, K.SECTION_MAX_S, smax),
             (K.SECTION_S, m, K.SECTION_MAX_S, smax)]  # fmt: skip
    for low_name, low, high_name, high in pairs:
        if low is None or high is None:
            continue
        over = high.notna() & low.notna() & (low > high + tol)
        if over.any():
            row = _first(sections, over)
            raise _fail(row, f"{low_name} = {row[low_name]:.9g} s exceeds {high_name} = {row[high_name]:.9g} s "
                             "(a mean over ranks never exceeds their maximum)")  # fmt: skip
    if cmax is not None and K.LB in sections:
        lb = sections[K.LB].astype("float64")
        with np.errstate(divide="ignore", invalid="ignore"):
            off = lb.notna() & (cmax > 0) & ((lb - c / cmax).abs() > 1e-6)
        if off.any():
            row = _first(sections, off)
            raise _fail(row, f"lb = {row[K.LB]:.9g} is not compute / compute_max = "
                             f"{row[K.COMPUTE_S] / row[K.COMPUTE_MAX_S]:.9g}")  # fmt: skip


def check_tables_agree(ranks: pd.DataFrame, sections: pd.DataFrame) -> None:
    """The sections table is the decomposition of the ranks table (:func:`decompose`): per iteration and
    section, SECTION_S is ``mean_r S_r`` and SECTION_MAX_S (where known) ``max_r S_r`` of the ranks rows,
    within ``1e-9 s + 1e-9 x S``, and each has the other's (iteration, section) rows.

    Raises:
        InvariantError: the first disagreement, naming iteration, section and both numbers.
    """
    s = ranks[K.SECTION_S].astype("float64")
    by = s.groupby([ranks[K.ITERATION], ranks[K.SECTION].astype(str)], sort=False)
    per = pd.DataFrame({"mean": by.mean(), "max": by.max()})
    sec = sections.assign(**{K.SECTION: sections[K.SECTION].astype(str)}).set_index([K.ITERATION, K.SECTION])
    only = sorted(set(sec.index) ^ set(per.index), key=str)
    if only:
        it, name = only[0]
        side = "sections" if (it, name) in sec.index else "ranks"
        raise InvariantError(f"iteration {it} section {name!r}: in the {side} table only (the sections table "
                             "is the ranks table decomposed)", iteration=int(it))  # fmt: skip
    per = per.reindex(sec.index)
    checks = [(K.SECTION_S, "mean")] + ([(K.SECTION_MAX_S, "max")] if K.SECTION_MAX_S in sec else [])
    for col, agg in checks:
        mine = sec[col].astype("float64")
        off = mine.notna() & ((mine - per[agg]).abs() > _tol(mine))
        if off.any():
            it, name = off[off].index[0]
            raise InvariantError(
                f"iteration {it} section {name!r}: {col} = {mine[(it, name)]:.9g} s, but the {agg} over ranks of "
                f"the ranks table is {per[agg][(it, name)]:.9g} s",
                iteration=int(it),
            )


def check_collectives_agree(collectives: pd.DataFrame, sections: pd.DataFrame) -> None:
    """The sections table's main-collective columns are the collectives table's (:func:`_main_info`, the
    decomposition's own code, on the recorded ``main`` flags): per iteration and section, MAIN_COLLECTIVE,
    MAIN_PAYLOAD_BYTES (bytes), N_MAIN and OTHER_PAYLOAD_BYTES (bytes), where both tables have them. The
    transfer model takes its bytes per GPU from MAIN_PAYLOAD_BYTES: an edited value would change the rates.

    Args:
        collectives: a ``collectives`` table with its ``main`` column (else nothing is checked: older
            folders' flags were decided by older rules). sections: a ``sections`` table.

    Raises:
        InvariantError: the first disagreement, naming iteration, section, the column and both values.
    """
    if collectives.empty or K.MAIN not in collectives or sections.empty:
        return
    dmin = collectives.groupby([*_KEY, K.SEQ])[K.DURATION_S].min()
    mine = _main_info(collectives.assign(**{K.SECTION: collectives[K.SECTION].astype(str)}), dmin)
    sec = sections.assign(**{K.SECTION: sections[K.SECTION].astype(str)}).set_index(_KEY)
    for col in (K.MAIN_COLLECTIVE, K.MAIN_PAYLOAD_BYTES, K.N_MAIN, K.OTHER_PAYLOAD_BYTES):
        if col not in sec:
            continue
        for key, value in sec[col].items():
            theirs = mine[col].get(key) if key in mine.index else None
            if pd.isna(value) or (col == K.N_MAIN and value == 0 and theirs is None):
                continue
            same = (
                theirs is not None
                and not pd.isna(theirs)
                and (str(value) == str(theirs) if col == K.MAIN_COLLECTIVE else float(value) == float(theirs))
            )
            if not same:
                it, name = key
                raise InvariantError(f"iteration {it} section {name!r}: {col} = {value}, but the collectives table "
                                     f"gives {theirs}", iteration=int(it))  # fmt: skip


#: Collectives whose recorded payload is one rank's share of the image (nccl-tests' size = ranks × payload).
GATHERING = ("all_gather", "reduce_scatter")


def band_runs(payloads: list[float], image_bytes: float) -> list[bool]:
    """Which of a section's all_reduce payloads (in ``seq`` order) are row bands of the image: runs of
    consecutive payloads, each smaller than the image, that add up to exactly ``image_bytes``.

    >>> band_runs([8, 1024, 3072, 2048, 2048, 4], 4096)
    [False, True, True, True, True, False]
    >>> band_runs([1024, 1024], 4096)
    [False, False]
    """
    flags = [False] * len(payloads)
    i = 0
    while i < len(payloads):
        total, j = 0.0, i
        while j < len(payloads) and 0 < payloads[j] < image_bytes and total < image_bytes:
            total += payloads[j]
            j += 1
        if j - i > 1 and total == image_bytes:
            flags[i:j] = [True] * (j - i)
            i = j
        else:
            i += 1
    return flags


def _banded(collectives: pd.DataFrame, per_seq: pd.Series, image_bytes: float) -> pd.Series:
    """Rows whose all_reduce is one band of a banded image exchange (:func:`band_runs`), per iteration x section."""
    out = pd.Series(False, index=collectives.index)
    is_ar = collectives[K.COLLECTIVE].astype(str) == "all_reduce"
    rows = collectives[is_ar].assign(_p=per_seq[is_ar])
    for _, grp in rows.groupby([K.ITERATION, K.SECTION]):
        seqs = grp.groupby(K.SEQ)["_p"].first().sort_index()
        flagged = {q for q, f in zip(seqs.index, band_runs(seqs.tolist(), image_bytes), strict=True) if f}
        if flagged:
            out.loc[grp.index[grp[K.SEQ].isin(flagged)]] = True
    return out


#: Collectives that reduce-scatter a whole image-sized input (``solver.gradient_collective=reduce_scatter``: NCCL's
#: ``reduce_scatter``, gloo's ``all_to_all`` of the same blocks); the payload recorded is that whole input.
SCATTERING = ("reduce_scatter", "all_to_all")


def _windowed(collectives: pd.DataFrame, per_seq: pd.Series, image_bytes: float, world_size: int) -> pd.Series:
    """Rows of the windowed gradient exchange (:mod:`pnpscale.rank.gradient`), per iteration x section, in
    ``seq`` order. Forward: a reduce_scatter or all_to_all of at least the image's bytes (the blocks), and the
    all_gather issued right after it (the boundaries that complete each rank's windows) when there is one.
    Backward (its adjoint, :func:`~pnpscale.rank.gradient.windowed_sum_adjoint`): a reduce_scatter or all_to_all
    (the boundaries) issued right before an all_gather of one rank's cores (``payload × world_size`` at least the
    image's bytes)."""
    out = pd.Series(False, index=collectives.index)
    kinds = collectives[K.COLLECTIVE].astype(str)
    scatter = kinds.isin(SCATTERING)
    if not scatter.any():
        return out
    where = pd.MultiIndex.from_frame(collectives[[K.ITERATION, K.SECTION]])
    sel = where.isin(where[scatter.to_numpy()])  # the sections holding one
    rows = collectives[sel].assign(_k=kinds[sel], _p=per_seq[sel])
    for _, grp in rows.groupby([K.ITERATION, K.SECTION]):
        seqs = grp.groupby(K.SEQ).agg(kind=("_k", "first"), payload=("_p", "first")).sort_index()
        order = list(seqs.index)
        flagged = set()
        for j, q in enumerate(order):
            if seqs.at[q, "kind"] not in SCATTERING:
                continue
            nxt = order[j + 1] if j + 1 < len(order) else None
            gather = nxt is not None and seqs.at[nxt, "kind"] == "all_gather"
            if seqs.at[q, "payload"] >= image_bytes:  # forward: the blocks, then the boundaries
                flagged.update([q, nxt] if gather else [q])
            elif gather and seqs.at[nxt, "payload"] * world_size >= image_bytes:  # backward: boundaries, cores
                flagged.update([q, nxt])
        if flagged:
            out.loc[grp.index[grp[K.SEQ].isin(flagged)]] = True
    return out


def mark_main(collectives: pd.DataFrame, image_bytes: int | None = None, world_size: int | None = None) -> pd.Series:
    """Flag the main collectives of each section: those carrying the image.

    The main collective is the study's image-sized ``all_reduce`` (one per inference section;
    ``2K`` in training's forward with K unrolled iterations), or, with
    ``solver.denoiser_collective=all_gather``, the denoiser's ``all_gather`` of the tile cores (and
    the reduce_scatter of its backward on NCCL). Other collectives (deepinv's shape broadcasts and
    flag all_reduce, the weight-gradient all_reduces of training's backward) are recorded but not
    main. Rule, per iteration x section: the collectives that carry the image when any does, else
    those with the section's largest payload. An all_reduce (or broadcast) carries the image when
    its payload equals ``image_bytes``; an all_gather or reduce_scatter records one rank's buffer
    (the cores of its tiles, padded to the longest rank's), so it carries the image when
    ``payload × world_size >= image_bytes`` and ``payload <= 2 × image_bytes``. With
    ``solver.overlap=pipelined`` the image travels in row bands: consecutive all_reduces (by ``seq``)
    whose payloads add up to exactly ``image_bytes`` carry it together (:func:`band_runs`), in a section where
    no collective carries the image by the other rules (training's backward, whose image all_reduces are
    whole, ends in weight-gradient all_reduces that may add up to the image by chance). Payloads are
    taken as the maximum across ranks for each ``seq``, so every rank flags the same ``seq``. With
    ``solver.gradient_collective=reduce_scatter`` the gradient's image travels as a reduce_scatter (NCCL) or
    all_to_all (gloo) of at least the image's bytes and the all_gather of the boundaries right after it, and in
    training's backward (the adjoint) a reduce_scatter or all_to_all of the boundaries and the all_gather of the
    cores right after it: both carry it together (:func:`_windowed`).

    Args:
        collectives: rows of ``collectives.parquet`` (ITERATION, SECTION, SEQ, RANK, PAYLOAD_BYTES,
            optionally COLLECTIVE).
        image_bytes: bytes of the signal (``C * N^dims * itemsize``), when known.
        world_size: ranks of the run (default: the ranks present in ``collectives``).

    Returns:
        Boolean Series aligned with ``collectives``.

    >>> c = pd.DataFrame({"rank": 0, "iteration": 0, "section": "s", "seq": [0, 1, 2],
    ...                   "payload_bytes": [8, 4096, 16384]})
    >>> mark_main(c).tolist(), mark_main(c, image_bytes=4096).tolist()
    ([False, False, True], [False, True, False])
    >>> g = c.assign(collective=["broadcast", "all_reduce", "all_gather"], payload_bytes=[8, 4096, 1100])
    >>> mark_main(g, image_bytes=4096, world_size=4).tolist()  # 4 x 1100 >= 4096: the gather carries the image
    [False, True, True]
    >>> b = pd.DataFrame({"rank": 0, "iteration": 0, "section": "s", "seq": [0, 1, 2, 3],
    ...                   "collective": "all_reduce", "payload_bytes": [8, 1024, 3072, 16]})  # two bands
    >>> mark_main(b, image_bytes=4096).tolist()
    [False, True, True, False]
    >>> t = b.assign(payload_bytes=[4096, 1024, 3072, 16])  # a whole image, then weight gradients adding up to it
    >>> mark_main(t, image_bytes=4096).tolist()
    [True, False, False, False]
    >>> w = b.assign(collective=["broadcast", "all_to_all", "all_gather", "broadcast"],
    ...              payload_bytes=[8, 4160, 512, 8])  # the windowed gradient: blocks, then boundaries
    >>> mark_main(w, image_bytes=4096, world_size=4).tolist()
    [False, True, True, False]
    >>> a = w.assign(payload_bytes=[8, 512, 1040, 8])  # its adjoint: boundaries, then the cores (4 x 1040)
    >>> mark_main(a, image_bytes=4096, world_size=4).tolist()
    [False, True, True, False]
    """
    if collectives.empty:
        return pd.Series([], dtype=bool, index=collectives.index)
    payload = collectives[K.PAYLOAD_BYTES].astype("float64").fillna(-1.0)
    keys = [collectives[K.ITERATION], collectives[K.SECTION], collectives[K.SEQ]]
    per_seq = payload.groupby(keys).transform("max")
    section_keys = [collectives[K.ITERATION], collectives[K.SECTION]]
    largest = per_seq.groupby(section_keys).transform("max")
    is_main = per_seq == largest
    if image_bytes is not None:
        image = per_seq == float(image_bytes)
        if K.COLLECTIVE in collectives:
            n = world_size if world_size is not None else collectives[K.RANK].nunique()
            gathering = collectives[K.COLLECTIVE].isin(GATHERING).fillna(False).astype(bool)
            share = (per_seq * n >= float(image_bytes)) & (per_seq <= 2.0 * float(image_bytes))
            image = image | (gathering & share)
        if K.COLLECTIVE in collectives:
            image = image | _windowed(collectives, per_seq, float(image_bytes), n)
            # row bands only where nothing else carries the image: in training's backward deepinv's
            # weight-gradient all_reduces can add up to exactly the image's bytes by chance
            carried = image.groupby(section_keys).transform("any")
            image = image | (_banded(collectives, per_seq, float(image_bytes)) & ~carried)
        has_image = image.groupby(section_keys).transform("any")
        is_main = is_main.where(~has_image, image)
    return is_main.astype(bool)


def decompose(
    ranks: pd.DataFrame,
    collectives: pd.DataFrame,
    world_size: int | None = None,
    on_negative_compute: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """Compute, transfer and wait per iteration x section from per-rank tables.

    Args:
        ranks: one row per rank x iteration x section with RANK, ITERATION, SECTION, WARMUP,
            SECTION_S (seconds).
        collectives: one row per rank x iteration x section x collective with RANK, ITERATION,
            SECTION, SEQ, COLLECTIVE, DURATION_S (seconds), PAYLOAD_BYTES, and optionally MAIN and
            BLOCKED_SPANS_NS (the blocked time, :func:`pnpscale.analysis.overlap.split_blocked`; absent or NA:
            blocked throughout, the study's rule). May be empty (one rank: no collectives). The ranks' optional
            HIDDEN_S gives the section's HIDDEN_S (mean over ranks; 0 without it).
        world_size: the job's world size for the WORLD_SIZE column (default: the ranks present; a
            partial analysis passes the job's).
        on_negative_compute: called with the message when a rank's collectives last longer than
            its section (negative compute); ``None`` (default) raises instead. The offline analysis of
            foreign traces (asynchronous, overlapping collectives) records an anomaly; a pnpscale run
            refuses.

    Returns:
        ``sections`` table (columns :data:`pnpscale.columns.SECTIONS_COLUMNS`), one row per
        iteration x section, sorted by iteration then order of first appearance. LB is NaN when
        ``C_max`` is 0. The wait split by cause comes from
        :func:`pnpscale.analysis.waits.wait_by_cause` (NaN without collective starts).

    Raises:
        DecompositionError: a rank lacks a section occurrence, ranks disagree on the number
            or types of collectives in a section (they cannot be matched by order), or a rank's
            collectives last longer than its section (negative compute).

    >>> ranks = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "warmup": False,
    ...                       "section_s": [1.0, 1.0]})
    >>> coll = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "seq": 0,
    ...                      "collective": "all_reduce", "duration_s": [0.5, 0.1],
    ...                      "payload_bytes": 8})
    >>> row = decompose(ranks, coll).iloc[0]
    >>> [round(float(row[c]), 9) for c in ("transfer_s", "wait_s", "compute_s", "compute_max_s")]
    [0.1, 0.2, 0.7, 0.9]
    """
    if ranks.empty:
        raise DecompositionError("no section rows: nothing was measured")
    world = sorted(ranks[K.RANK].unique())
    w = len(world)
    per_key = ranks.groupby(_KEY, sort=False)[K.RANK].nunique()
    incomplete = per_key[per_key != w]
    if not incomplete.empty:
        (it, sec), n = incomplete.index[0], incomplete.iloc[0]
        raise DecompositionError(f"iteration {it} section {sec!r}: {n} of {w} ranks have a row")
    s = ranks.set_index([*_KEY, K.RANK])[K.SECTION_S].astype("float64")
    if s.index.duplicated().any():
        raise DecompositionError("duplicate (iteration, section, rank) rows in the rank table")

    if collectives.empty:
        comm = pd.Series(0.0, index=s.index)
        transfer = pd.Series(0.0, index=per_key.index)
        wait = pd.Series(0.0, index=per_key.index)
        n_coll = pd.Series(0, index=per_key.index)
        main_info = pd.DataFrame(
            index=per_key.index,
            columns=[K.MAIN_COLLECTIVE, K.MAIN_PAYLOAD_BYTES, K.N_MAIN, K.MAIN_TRANSFER_S, K.OTHER_PAYLOAD_BYTES],
        )
    else:
        _check_matched(collectives, w)
        d = collectives.pivot_table(index=[*_KEY, K.SEQ], columns=K.RANK, values=K.DURATION_S, aggfunc="first")
        d = d.reindex(columns=world)
        dmin = d.min(axis=1)
        parts = split_blocked(collectives)  # per rank and collective: blocked = wait + transfer
        per_rank = parts.groupby([collectives[k] for k in (*_KEY, K.RANK)]).sum()
        per_rank = per_rank.reindex(s.index, fill_value=0.0)
        transfer = per_rank[K.TRANSFER_S].groupby(level=_KEY, sort=False).sum() / w
        wait = per_rank[K.WAIT_S].groupby(level=_KEY, sort=False).sum() / w
        comm = per_rank[K.BLOCKED_S]
        n_coll = collectives.groupby(_KEY)[K.SEQ].nunique()  # a point-to-point transfer is on its two ranks only
        main_info = _main_info(collectives, dmin)

    compute_r = s - comm
    _check_compute(compute_r, comm, s, on_negative_compute)
    g = compute_r.groupby(level=_KEY, sort=False)
    out = pd.DataFrame(
        {
            K.COMPUTE_S: g.mean(),
            K.COMPUTE_MAX_S: g.max(),
            K.SECTION_S: s.groupby(level=_KEY, sort=False).mean(),
            K.SECTION_MAX_S: s.groupby(level=_KEY, sort=False).max(),
        }
    )
    out[K.TRANSFER_S] = transfer.reindex(out.index, fill_value=0.0)
    out[K.WAIT_S] = wait.reindex(out.index, fill_value=0.0)
    out[K.N_COLLECTIVES] = n_coll.reindex(out.index, fill_value=0).astype("int64")
    if K.HIDDEN_S in ranks:  # tables without it (hand-made, older folders) assume blocking collectives
        hidden = ranks.set_index([*_KEY, K.RANK])[K.HIDDEN_S].astype("float64")
        out[K.HIDDEN_S] = hidden.groupby(level=_KEY, sort=False).mean().reindex(out.index)
    else:
        out[K.HIDDEN_S] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        out[K.LB] = np.where(out[K.COMPUTE_MAX_S] != 0, out[K.COMPUTE_S] / out[K.COMPUTE_MAX_S], np.nan)
    out = out.join(main_info.reindex(out.index))
    warm = ranks.groupby(_KEY, sort=False)[K.WARMUP].first()
    out[K.WARMUP] = warm.reindex(out.index).astype(bool)
    out[K.WORLD_SIZE] = w if world_size is None else int(world_size)
    out = out.reset_index()
    order = {name: i for i, name in enumerate(dict.fromkeys(ranks[K.SECTION]))}
    out = out.sort_values([K.ITERATION, K.SECTION], key=lambda c: c.map(order) if c.name == K.SECTION else c)
    out[K.MAIN_PAYLOAD_BYTES] = out[K.MAIN_PAYLOAD_BYTES].astype("Int64")
    out[K.OTHER_PAYLOAD_BYTES] = out[K.OTHER_PAYLOAD_BYTES].astype("Int64")
    out[K.MAIN_TRANSFER_S] = out[K.MAIN_TRANSFER_S].astype("float64")
    out[K.N_MAIN] = out[K.N_MAIN].fillna(0).astype("int64")
    out[K.MAIN_COLLECTIVE] = out[K.MAIN_COLLECTIVE].astype("string")
    causes = wait_by_cause(ranks, collectives).astype({K.SECTION: out[K.SECTION].dtype})
    out = out.merge(causes, on=_KEY, how="left", validate="one_to_one")
    out[K.TIME_SHARED] = pd.array([pd.NA] * len(out), dtype="boolean")  # a live run sets it (rank.commit)
    return out[list(K.SECTIONS_COLUMNS)].reset_index(drop=True)


#: tolerance on a rank's compute ``S_r - sum_c D_rc`` below zero (seconds): float sums of microseconds.
NEGATIVE_COMPUTE_TOL_S = 1e-6


def _check_compute(
    compute_r: pd.Series, comm: pd.Series, s: pd.Series, report: Callable[[str], None] | None = None
) -> None:
    """Refuse (or report) a negative compute ``S_r - sum_c D_rc``: collectives longer than their section.

    It means the section time does not contain its collectives (overlapping collectives on several
    streams or threads, or a section time that is not the section): the decomposition is wrong there.
    """
    bad = compute_r[compute_r < -NEGATIVE_COMPUTE_TOL_S]
    if bad.empty:
        return
    it, sec, rank = bad.index[0]
    message = (
        f"iteration {it} section {sec!r} rank {rank}: negative compute ({bad.iloc[0]:.6g} s): its collectives "
        f"last {comm.loc[bad.index[0]]:.6g} s in a section of {s.loc[bad.index[0]]:.6g} s "
        f"({len(bad)} such rank x iteration x section row(s); overlapping collectives, or a truncated section)"
    )
    if report is None:
        raise DecompositionError(message)
    report(message)


def point_to_point(collectives: pd.DataFrame) -> pd.Series:
    """Rows of paired point-to-point transfers (PROCESS_GROUP ``p2p:<src>-><dst>``; none without that column).

    >>> point_to_point(pd.DataFrame({"process_group": ["p2p:0->2", None, "0"]})).tolist()
    [True, False, False]
    """
    if K.PROCESS_GROUP not in collectives:
        return pd.Series(False, index=collectives.index)
    return collectives[K.PROCESS_GROUP].astype("string").str.startswith("p2p:").fillna(False).astype(bool)


def _check_matched(collectives: pd.DataFrame, w: int) -> None:
    """Every rank holds the same number of collectives per occurrence, except point-to-point transfers, which
    exactly their two ranks hold (:func:`point_to_point`); one type per collective.

    Raises:
        DecompositionError: naming iteration, section, and the ranks' counts or the transfer.
    """
    p2p = point_to_point(collectives)
    if p2p.any():
        pairs = collectives[p2p]
        held = pairs.groupby([*_KEY, K.SEQ])[K.RANK].agg(lambda r: tuple(sorted(int(x) for x in r)))
        group = pairs.groupby([*_KEY, K.SEQ])[K.PROCESS_GROUP].first().astype(str)
        for key, ranks_held in held.items():
            src, dst = (int(x) for x in group[key][len("p2p:") :].split("->"))
            if ranks_held != tuple(sorted((src, dst))):
                it, sec, seq = key
                raise DecompositionError(
                    f"iteration {it} section {sec!r} collective #{seq}: the point-to-point transfer {group[key]} "
                    f"has rows on ranks {list(ranks_held)}, not on exactly its two ranks"
                )
        collectives = collectives[~p2p]
        if collectives.empty:
            return
    counts = collectives.groupby([*_KEY, K.RANK]).size().unstack(K.RANK)
    if counts.shape[1] != w:
        counts = counts.reindex(columns=range(w))
    bad = counts[counts.nunique(axis=1, dropna=False) > 1]
    if counts.isna().any(axis=None):
        bad = counts[counts.isna().any(axis=1) | (counts.nunique(axis=1) > 1)]
    if not bad.empty:
        (it, sec) = bad.index[0]
        per_rank = ", ".join(f"rank {r}: {0 if pd.isna(n) else int(n)}" for r, n in bad.iloc[0].items())
        raise DecompositionError(
            f"iteration {it} section {sec!r}: ranks ran different numbers of collectives "
            f"({per_rank}); they cannot be matched by order"
        )
    types = collectives.groupby([*_KEY, K.SEQ])[K.COLLECTIVE].nunique()
    if (types > 1).any():
        it, sec, seq = types[types > 1].index[0]
        raise DecompositionError(
            f"iteration {it} section {sec!r} collective #{seq}: ranks ran different collective types"
        )


def _main_info(collectives: pd.DataFrame, dmin: pd.Series) -> pd.DataFrame:
    """Per iteration x section: main collective type, payload, count and transfer; other payload.

    The type is the main collectives' one, or their distinct types joined by ``+`` in issue order
    (``all_to_all+all_gather``: the windowed gradient), for which no single byte model holds (the transfer
    table then says so instead of applying the first type's model to the whole transfer)."""
    main = collectives[K.MAIN].astype(bool) if K.MAIN in collectives else mark_main(collectives)
    rows = collectives.assign(_main=main).sort_values(K.RANK, kind="stable").drop_duplicates([*_KEY, K.SEQ])
    mins = dmin.rename(K.MAIN_TRANSFER_S).reset_index()
    rows = rows.merge(mins, on=[*_KEY, K.SEQ], how="left")
    mrows = rows[rows["_main"]]
    g = mrows.groupby(_KEY, sort=False)
    other = rows[~rows["_main"]].groupby(_KEY)[K.PAYLOAD_BYTES].sum(min_count=1)
    size = g.size()
    types: dict[tuple, list[str]] = {}  # per iteration x section: the distinct types, in issue order
    names = mrows[K.COLLECTIVE].astype(str)
    for key, name in zip(zip(*(mrows[k] for k in _KEY), strict=True), names, strict=True):
        seen = types.setdefault(key, [])
        if name not in seen:
            seen.append(name)
    out = pd.DataFrame(
        {
            K.MAIN_COLLECTIVE: pd.Series(["+".join(types[key]) for key in size.index], index=size.index, dtype=object),
            K.MAIN_PAYLOAD_BYTES: g[K.PAYLOAD_BYTES].max(),
            K.N_MAIN: size,
            K.MAIN_TRANSFER_S: g[K.MAIN_TRANSFER_S].sum(),
        }
    )
    out[K.OTHER_PAYLOAD_BYTES] = other.reindex(out.index)
    return out


def summarize(sections: pd.DataFrame, gpus: int, nested: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Per-section and combined totals over the measured iterations of one run.

    Args:
        sections: a ``sections`` table (see :func:`decompose`).
        gpus: world size, for GPU-seconds.
        nested: section -> the section enclosing it (:func:`pnpscale.analysis.section.align.nested_sections`);
            nested sections are left out of the ``"all"`` row, so it counts non-overlapping time only.

    Returns:
        One row per section plus a row with SECTION ``"all"`` (sums over the top-level sections), columns
        SECTION, ``iterations``, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S, WAIT_S, SECTION_S (sums over
        measured iterations, seconds; plus, when ``sections`` has them, the wait parts of
        :data:`pnpscale.columns.WAIT_CAUSES`, SECTION_MAX_S and HIDDEN_S, NaN where unknown), LB = ΣC/ΣC_max,
        COMM_E = ΣC_max/ΣS_max, PE = ΣC/ΣS_max = LB x CommE, HIDDEN_SHARE = ΣH / (ΣH + ΣT + ΣW) (NaN without
        communication), and GPU_SECONDS = gpus x ΣS / iterations (GPU-seconds per measured iteration).

    POP's elapsed time of a section is its slowest rank's, ``S_max = max_r S_r``: so CommE ≤ 1 always
    (``C_max ≤ S_max``), a section without collectives has CommE 1 and PE = LB, and where the ranks leave
    the section together (the study's sections all end in their all_reduce: ``S_r`` equal) this is the
    study's ``CommE = ΣC_max / Σ mean_r S_r``. Folders older than SECTION_MAX_S use ``mean_r S_r``.

    Raises:
        NoMeasuredIteration: no measured (non-warm-up) iteration (a :class:`DecompositionError`).
    """
    m = sections[~sections[K.WARMUP].astype(bool)]
    if m.empty:
        raise NoMeasuredIteration("no measured iteration (all rows are warm-up)")
    n_it = m[K.ITERATION].nunique()
    # the summed measures (pnpscale.columns.MEASURES); the optional ones are absent in older run folders
    cols = [*K.SUMMED, *(c for c in K.SUMMED_OPTIONAL if c in m.columns)]
    per = m.groupby(K.SECTION, sort=False)[cols].sum(min_count=1)
    per.loc["all"] = per.drop(index=[s for s in (nested or {}) if s in per.index]).sum(skipna=False)
    elapsed = per[K.SECTION_MAX_S] if K.SECTION_MAX_S in per else per[K.SECTION_S]
    with np.errstate(divide="ignore", invalid="ignore"):
        per[K.LB] = np.where(per[K.COMPUTE_MAX_S] != 0, per[K.COMPUTE_S] / per[K.COMPUTE_MAX_S], np.nan)
        per[K.COMM_E] = np.where(elapsed != 0, per[K.COMPUTE_MAX_S] / elapsed, np.nan)
        per[K.PE] = np.where(elapsed != 0, per[K.COMPUTE_S] / elapsed, np.nan)
        if K.HIDDEN_S in per:
            comm = per[K.HIDDEN_S] + per[K.TRANSFER_S] + per[K.WAIT_S]
            per[K.HIDDEN_SHARE] = np.where(comm > 0, per[K.HIDDEN_S] / comm, np.nan)
    per[K.GPU_SECONDS] = gpus * per[K.SECTION_S] / n_it
    per.insert(0, "iterations", n_it)
    return per.reset_index().rename(columns={"index": K.SECTION})


def run_metrics(sections: pd.DataFrame, gpus: int, nested: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run-level figures for ``run.json``: combined LB, CommE, PE, GPU-seconds, per section.

    ``nested``: see :func:`summarize`.

    Returns:
        ``{"lb", "comm_e", "pe", "gpu_seconds_per_iteration", "iterations", "sections": {name:
        {...}}}`` with floats (NaN rendered as ``None``). Per section, the sums over the measured
        iterations of every summed measure (:data:`pnpscale.columns.MEASURES`) carry their
        :func:`pnpscale.columns.total_name` (``compute_total_s``, ``wait_late_start_total_s``,
        ``hidden_total_s``...), never the per-iteration names of the tables.
    """
    summ = summarize(sections, gpus, nested).set_index(K.SECTION)

    totals = {*K.SUMMED, *K.SUMMED_OPTIONAL}  # sums over iterations: run.json names them *_total_s

    def clean(row: pd.Series) -> dict[str, Any]:
        return {
            (K.total_name(k) if k in totals else k): (
                None if pd.isna(v) else (int(v) if k == "iterations" else float(v))
            )
            for k, v in row.items()
        }

    allrow = clean(summ.loc["all"])
    return {
        "lb": allrow[K.LB],
        "comm_e": allrow[K.COMM_E],
        "pe": allrow[K.PE],
        "gpu_seconds_per_iteration": allrow[K.GPU_SECONDS],
        "iterations": allrow["iterations"],
        "sections": {name: clean(row) for name, row in summ.drop(index="all").iterrows()},
    }
