"""Where each rank's section time went, at its measured times: the slices behind ``timeline.json``.

Pure functions over the ``ranks`` and ``collectives`` tables (:mod:`pnpscale.columns`); writing is
:func:`pnpscale.analysis.tables.table_writers`' job.

Placement rule, per rank r, iteration i and section s, with the study's split ("Communication under
the hood: transfer vs wait") of each collective c on rank r, ``D_rc`` (its measured duration, from its
measured start ``A_rc``, ``collectives.start_s``):

* ``D_rc = transfer part (min_r' D_r'c) + wait part (D_rc − min_r' D_r'c)``;
* ranks leave a collective together, so the **wait comes first** (``[A_rc, A_rc + w_rc)``: waiting for
  the last rank) and the **transfer last** (``[A_rc + w_rc, A_rc + D_rc)``);
* **compute fills the rest** of ``[section start, section start + S_r)``: before the first collective,
  between collectives and after the last.

So for each rank the slices of a section add up to its section time ``S_r`` (to the nanosecond:
every boundary is an integer of nanoseconds), and summed over slices of a kind, averaged over ranks,
they give the section's POP compute, transfer and wait (:func:`pnpscale.analysis.metrics.decompose`).
Two extensions, for decompositions of overlapped communication: when the collectives table has the
optional column :data:`pnpscale.columns.HIDDEN_S` (communication time of that collective overlapped by
compute), the first ``hidden_s`` of the collective's interval is a ``hidden`` slice and the rest is
split wait first (at most ``w_rc``), transfer last; collectives of one rank that overlap each other
(concurrent streams) are drawn as their union: a collective starting before the previous one ended is
drawn from that end (its earliest parts, the hidden then the wait, are cut first). A collective running
past its section's end is cut at the end (its transfer first). Sections whose collectives have no recorded start (run
folders written before starts were recorded) get no slices (:func:`unplaced` lists them).

Clocks: every rank's times are seconds from its own first section start. Ranks leave each collective
together, so :func:`clock_offsets` puts every rank on the lowest rank's clock: the median over the
collectives of the difference of their exits ``A_rc + D_rc``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K

COMPUTE, TRANSFER, WAIT, HIDDEN = "compute", "transfer", "wait", "hidden"
#: slice kinds, in the order they are drawn within a collective (compute fills the gaps).
KINDS = (COMPUTE, HIDDEN, WAIT, TRANSFER)
_KEY = [K.ITERATION, K.SECTION]
_NS = 1e9


def _ns(x: pd.Series) -> np.ndarray:
    return np.rint(x.astype("float64").to_numpy() * _NS)


def slices(ranks: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Every rank's compute / hidden / wait / transfer slices of every iteration and section.

    Args:
        ranks: ``ranks.parquet`` rows (RANK, ITERATION, SECTION, WARMUP, START_S, SECTION_S; seconds, on
            the rank's clock).
        collectives: ``collectives.parquet`` rows (RANK, ITERATION, SECTION, SEQ, COLLECTIVE, START_S,
            DURATION_S, PAYLOAD_BYTES; optionally HIDDEN_S); may be empty (one rank).

    Returns:
        :data:`pnpscale.columns.TIMELINE_COLUMNS`, one row per slice of positive length, in time order
        per rank; START_S on the rank's own clock (see :func:`clock_offsets`), DURATION_S > 0; SEQ,
        COLLECTIVE and PAYLOAD_BYTES NA on compute slices. See the module doc for the placement rule.

    Raises:
        KeyError: a required column is missing.

    >>> r = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "warmup": False,
    ...                   "start_s": 0.0, "section_s": [1.0, 1.0]})
    >>> c = pd.DataFrame({"rank": [0, 1], "iteration": 0, "section": "s", "seq": 0, "collective": "all_reduce",
    ...                   "start_s": [0.5, 0.8], "duration_s": [0.4, 0.1], "payload_bytes": 8})
    >>> t = slices(r, c)
    >>> t[t["rank"] == 0][["kind", "start_s", "duration_s"]].round(9).values.tolist()
    [['compute', 0.0, 0.5], ['wait', 0.5, 0.3], ['transfer', 0.8, 0.1], ['compute', 0.9, 0.1]]
    """
    rows: list[tuple[Any, ...]] = []
    by_key = _collectives_by_rank(collectives)
    for r in ranks.itertuples(index=False) if K.START_S in ranks else ():
        rank, it, sec = int(getattr(r, K.RANK)), int(getattr(r, K.ITERATION)), str(getattr(r, K.SECTION))
        warm = bool(getattr(r, K.WARMUP))
        start = getattr(r, K.START_S)
        if pd.isna(start):
            continue
        s0 = int(round(float(start) * _NS))
        s1 = s0 + int(round(float(getattr(r, K.SECTION_S)) * _NS))
        colls = by_key.get((it, sec, rank), [])
        if any(c["a"] is None for c in colls):
            continue  # no recorded start: cannot be placed (unplaced())
        cursor = s0
        for c in colls:
            a = min(max(c["a"], cursor), s1)
            e = min(max(c["a"] + c["d"], a), s1)
            if a > cursor:
                rows.append((rank, it, warm, sec, COMPUTE, cursor, a - cursor, None))
            front = min(a - c["a"], c["d"])  # overlapped by the previous collective: hidden first, then wait
            back = c["d"] - front - (e - a)  # past the section's end: the transfer's end first
            parts = [[HIDDEN, c["h"]], [WAIT, c["w"]], [TRANSFER, c["t"]]]
            for cut, order in ((front, parts), (back, parts[::-1])):
                for part in order:
                    take = min(cut, part[1])
                    cut -= take
                    part[1] -= take
            t = a
            for kind, length in parts:
                if length > 0:
                    rows.append((rank, it, warm, sec, kind, t, length, c))
                    t += length
            cursor = max(cursor, e)
        if s1 > cursor:
            rows.append((rank, it, warm, sec, COMPUTE, cursor, s1 - cursor, None))
    out = pd.DataFrame(
        {
            K.RANK: pd.array([x[0] for x in rows], dtype="int64"),
            K.ITERATION: pd.array([x[1] for x in rows], dtype="int64"),
            K.SECTION: pd.array([x[3] for x in rows], dtype="string"),
            K.WARMUP: pd.array([x[2] for x in rows], dtype="bool"),
            K.KIND: pd.array([x[4] for x in rows], dtype="string"),
            K.START_S: np.array([x[5] for x in rows], dtype="float64") / _NS,
            K.DURATION_S: np.array([x[6] for x in rows], dtype="float64") / _NS,
            K.SEQ: pd.array([None if x[7] is None else x[7]["seq"] for x in rows], dtype="Int64"),
            K.COLLECTIVE: pd.array([None if x[7] is None else x[7]["name"] for x in rows], dtype="string"),
            K.PAYLOAD_BYTES: pd.array([None if x[7] is None else x[7]["bytes"] for x in rows], dtype="Int64"),
        }
    )
    return out[list(K.TIMELINE_COLUMNS)]


def _collectives_by_rank(collectives: pd.DataFrame) -> dict[tuple[int, str, int], list[dict[str, Any]]]:
    """(iteration, section, rank) -> its collectives in start order, with integer-ns start ``a``,
    duration ``d`` and parts ``h`` (hidden), ``w`` (wait), ``t`` (transfer), ``h + w + t = d``."""
    if collectives.empty:
        return {}
    c = collectives.copy()
    c[K.SECTION] = c[K.SECTION].astype(str)
    d = _ns(c[K.DURATION_S])
    dmin = pd.Series(d, index=c.index).groupby([c[K.ITERATION], c[K.SECTION], c[K.SEQ]]).transform("min").to_numpy()
    starts = _ns(c[K.START_S]) if K.START_S in c else np.full(len(c), np.nan)
    hidden = _ns(c[K.HIDDEN_S].fillna(0.0)) if K.HIDDEN_S in c else np.zeros(len(c))
    hidden = np.clip(hidden, 0, d)
    wait = np.clip(d - dmin, 0, d - hidden)
    payload = c[K.PAYLOAD_BYTES].astype("Float64").tolist() if K.PAYLOAD_BYTES in c else [None] * len(c)
    names = c[K.COLLECTIVE].astype(object).tolist() if K.COLLECTIVE in c else [None] * len(c)
    out: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    keys = zip(c[K.ITERATION].tolist(), c[K.SECTION].tolist(), c[K.RANK].tolist(), c[K.SEQ].tolist(), strict=True)
    for i, (it, sec, rank, seq) in enumerate(keys):
        a = None if np.isnan(starts[i]) else int(starts[i])
        name, size = names[i], payload[i]
        entry = {
            "a": a, "d": int(d[i]), "h": int(hidden[i]), "w": int(wait[i]), "t": int(d[i] - hidden[i] - wait[i]),
            "seq": int(seq), "name": None if name is None or pd.isna(name) else str(name),
            "bytes": None if size is None or pd.isna(size) else int(size),
        }  # fmt: skip
        out.setdefault((int(it), str(sec), int(rank)), []).append(entry)
    for lst in out.values():
        lst.sort(key=lambda e: (e["a"] if e["a"] is not None else -1, e["seq"]))
    return out


def unplaced(ranks: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """The rank x iteration x section rows of ``ranks`` that :func:`slices` cannot place: a collective
    without a recorded start, or no section start (RANK, ITERATION, SECTION)."""
    cols = [K.RANK, K.ITERATION, K.SECTION]
    r = ranks[cols].assign(**{K.SECTION: ranks[K.SECTION].astype(str)})
    bad = r[ranks[K.START_S].isna().to_numpy()] if K.START_S in ranks else r
    if collectives.empty:
        return bad.reset_index(drop=True)
    starts = collectives[K.START_S] if K.START_S in collectives else pd.Series(np.nan, index=collectives.index)
    c = collectives.loc[starts.isna(), cols].assign(**{K.SECTION: lambda d: d[K.SECTION].astype(str)})
    hit = r.merge(c.drop_duplicates(), on=cols, how="inner")
    return pd.concat([bad, hit]).drop_duplicates().reset_index(drop=True)


def clock_offsets(collectives: pd.DataFrame) -> dict[int, float]:
    """Seconds to add to each rank's times to put them on the lowest rank's clock.

    Ranks leave a collective together, so the offset of rank r is the median over every collective
    (ITERATION, SECTION, SEQ) with a recorded start on both ranks of ``E_ref,c − E_rc``, ``E = START_S +
    DURATION_S``. A rank without such a collective (one rank, or starts not recorded) gets 0 (every rank's
    clock starts at its first section).

    >>> c = pd.DataFrame({"rank": [0, 1, 0, 1], "iteration": [0, 0, 1, 1], "section": "s", "seq": 0,
    ...                   "start_s": [1.0, 0.5, 2.0, 1.6], "duration_s": [0.1, 0.1, 0.1, 0.1]})
    >>> {r: round(v, 9) for r, v in clock_offsets(c).items()}
    {0: 0.0, 1: 0.45}
    """
    if collectives.empty or K.START_S not in collectives:
        return {int(r): 0.0 for r in collectives[K.RANK].unique()} if not collectives.empty else {}
    c = collectives.assign(_e=collectives[K.START_S].astype("float64") + collectives[K.DURATION_S].astype("float64"))
    c = c.assign(**{K.SECTION: c[K.SECTION].astype(str)})
    exits = c.pivot_table(index=[*_KEY, K.SEQ], columns=K.RANK, values="_e", aggfunc="first")
    ref = min(int(r) for r in c[K.RANK].unique())
    out = {}
    for rank in sorted(int(r) for r in c[K.RANK].unique()):
        diff = (exits[ref] - exits[rank]).dropna() if rank in exits and ref in exits else pd.Series(dtype=float)
        out[rank] = float(diff.median()) if not diff.empty else 0.0
    return out


def section_totals(table: pd.DataFrame) -> pd.DataFrame:
    """Per rank x iteration x section: the sum of each slice kind and of all slices (seconds).

    Returns:
        RANK, ITERATION, SECTION, one column per kind of :data:`KINDS` (0 where absent) and SECTION_S
        (their sum: the rank's section time by construction; compare with ``ranks.section_s``).
    """
    keys = [K.RANK, K.ITERATION, K.SECTION]
    wide = table.pivot_table(index=keys, columns=K.KIND, values=K.DURATION_S, aggfunc="sum", fill_value=0.0)
    wide = wide.reindex(columns=list(KINDS), fill_value=0.0)
    wide.columns = [str(c) for c in wide.columns]
    wide[K.SECTION_S] = wide.sum(axis=1)
    return wide.reset_index()


def chrome_trace(
    table: pd.DataFrame, ranks: pd.DataFrame, offsets: Mapping[int, float] | None = None, note: str | None = None
) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of a run: one process per rank, two threads per process.

    Args:
        table: :func:`slices` output.
        ranks: ``ranks.parquet`` rows (for the section ranges: RANK, ITERATION, SECTION, WARMUP, START_S,
            SECTION_S).
        offsets: :func:`clock_offsets` (default: none); the times written are ``rank's time + offset``,
            shifted so that the earliest is 0.
        note: a line for ``otherData`` (e.g. sections that could not be placed).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: metadata events naming
        each process ``rank <r>`` and its threads ``sections`` (tid 0: one ``X`` event per section
        occurrence, named after the section) and ``compute / transfer / wait`` (tid 1: one ``X`` event per
        slice, named after its kind; the slices of a section nested in another, e.g. ``gradient`` inside
        ``ProfilerStep#*`` in an offline analysis, go to tid 1 + its nesting depth, so that no track holds
        overlapping slices); ``ts``/``dur`` in microseconds (integer nanoseconds / 1000); every
        ``args`` has ``section``, ``iteration``, ``warmup``, and on communication slices ``collective``,
        ``seq`` and ``bytes`` (the payload; ``null`` when unknown).
    """
    offsets = dict(offsets or {})
    off_ns = {int(r): int(round(offsets.get(int(r), 0.0) * _NS)) for r in ranks[K.RANK].unique()}
    r_start = _ns(ranks[K.START_S]) + np.array([off_ns[int(r)] for r in ranks[K.RANK]], dtype=float)
    t_start = _ns(table[K.START_S]) + np.array([off_ns.get(int(r), 0) for r in table[K.RANK]], dtype=float)
    finite = r_start[np.isfinite(r_start)]
    shift = int(finite.min()) if finite.size else 0
    events: list[dict[str, Any]] = []
    depth = _depths(ranks)
    for rank in sorted(off_ns):
        events += [
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
            {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
            {"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "sections"}},
        ]
        for d in sorted({v for (r, _, _), v in depth.items() if r == rank} or {0}):
            name = "compute / transfer / wait" + (f" (sections nested {d} deep)" if d else "")
            events.append({"ph": "M", "pid": rank, "tid": 1 + d, "name": "thread_name", "args": {"name": name}})
    for i, r in enumerate(ranks.itertuples(index=False)):
        if not np.isfinite(r_start[i]):
            continue
        sec, it, warm = str(getattr(r, K.SECTION)), int(getattr(r, K.ITERATION)), bool(getattr(r, K.WARMUP))
        events.append({
            "ph": "X", "pid": int(getattr(r, K.RANK)), "tid": 0, "name": sec, "cat": "section",
            "ts": (int(r_start[i]) - shift) / 1000, "dur": int(round(float(getattr(r, K.SECTION_S)) * _NS)) / 1000,
            "args": {"section": sec, "iteration": it, "warmup": warm, K.SECTION_S: float(getattr(r, K.SECTION_S))},
        })  # fmt: skip
    dur_ns = _ns(table[K.DURATION_S])
    for i, s in enumerate(table.itertuples(index=False)):
        kind = str(getattr(s, K.KIND))
        args: dict[str, Any] = {
            "section": str(getattr(s, K.SECTION)), "iteration": int(getattr(s, K.ITERATION)),
            "warmup": bool(getattr(s, K.WARMUP)),
        }  # fmt: skip
        if kind != COMPUTE:
            coll, seq, payload = getattr(s, K.COLLECTIVE), getattr(s, K.SEQ), getattr(s, K.PAYLOAD_BYTES)
            args.update(
                collective=None if pd.isna(coll) else str(coll),
                seq=None if pd.isna(seq) else int(seq),
                bytes=None if pd.isna(payload) else int(payload),
            )
        events.append({
            "ph": "X", "pid": int(getattr(s, K.RANK)), "name": kind, "cat": kind,
            "tid": 1 + depth.get((int(getattr(s, K.RANK)), args["iteration"], args["section"]), 0),
            "ts": (int(t_start[i]) - shift) / 1000, "dur": int(dur_ns[i]) / 1000, "args": args,
        })  # fmt: skip
    other: dict[str, Any] = {
        "source": "pnpscale",
        "clock": "seconds from the lowest rank's first section start; each rank shifted by its clock offset "
        "(ranks leave a collective together: median difference of collective exits)",
        "clock_offsets_s": {str(k): float(v) for k, v in sorted(offsets.items())},
        "placement": "per collective: wait first (waiting for the last rank), transfer last (min over ranks of "
        "the duration); compute fills the rest of the section; slices of a section add up to the rank's "
        "section time",
    }
    if note:
        other["note"] = note
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _depths(ranks: pd.DataFrame) -> dict[tuple[int, int, str], int]:
    """(rank, iteration, section) -> how many of the rank's other section ranges enclose it (0: top level)."""
    out: dict[tuple[int, int, str], int] = {}
    if K.START_S not in ranks:
        return out
    r = ranks.assign(_s=_ns(ranks[K.START_S]), _e=_ns(ranks[K.START_S]) + _ns(ranks[K.SECTION_S]))
    r = r[np.isfinite(r["_s"])].sort_values([K.RANK, "_s", "_e"], ascending=[True, True, False], kind="stable")
    for rank, grp in r.groupby(K.RANK, sort=False):
        ends: list[float] = []  # the enclosing ranges' ends
        for it, sec, start, end in zip(grp[K.ITERATION], grp[K.SECTION], grp["_s"], grp["_e"], strict=True):
            while ends and ends[-1] <= start:
                ends.pop()
            out[(int(rank), int(it), str(sec))] = len([e for e in ends if e >= end])
            ends.append(end)
    return out


def run_trace(ranks: pd.DataFrame, collectives: pd.DataFrame) -> dict[str, Any]:
    """:func:`chrome_trace` of a run's tables: slices, clock offsets, and a note on unplaced sections."""
    bad = unplaced(ranks, collectives)
    note = (
        f"{len(bad)} rank x iteration x section row(s) without a recorded collective or section start: "
        "only their section range is drawn"
        if not bad.empty
        else None
    )
    return chrome_trace(slices(ranks, collectives), ranks, clock_offsets(collectives), note)
