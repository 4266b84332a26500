"""Where each rank's section time went, at its measured times: the slices behind ``timeline.json``.

Pure functions over the ``ranks`` and ``collectives`` tables (:mod:`pnpscale.columns`); writing is
:func:`pnpscale.analysis.tables.table_writers`' job.

Placement rule, per rank r, iteration i and section s, with the decomposition's split of each collective
c on rank r (:mod:`pnpscale.analysis.overlap`): ``D_rc`` its measured duration from its measured start
``A_rc`` (``collectives.start_s``), ``b_rc`` the pieces of time the rank was blocked on it
(``collectives.blocked_spans_ns``; a folder without them: blocked throughout, the study's rule), and
``t_c = min_r D_rc``:

* the blocked time in the collective's last ``t_c`` (after the last rank entered it) is **transfer**, the
  rest of its blocked time **wait**: for a blocking collective the wait comes first (waiting for the last
  rank) and the transfer last, ``D_rc − t_c`` and ``t_c``, the study's split;
* **compute fills the rest** of ``[section start, section start + S_r)``;
* what is in flight but not blocked is **hidden** (overlapped by compute): its slices lie over the compute
  they overlap (their own track in ``timeline.json``, a strip in ``timeline.png``), outside the tiling.

So for each rank the slices of a section add up to its section time ``S_r`` (to the nanosecond:
every boundary is an integer of nanoseconds), and summed over slices of a kind, averaged over ranks,
they give the section's POP compute, transfer and wait (:func:`pnpscale.analysis.metrics.decompose`).
Blocked pieces of concurrent collectives are disjoint (each is given to one collective), and a piece past
the section's end is cut there. Sections whose collectives have no recorded start (run
folders written before starts were recorded) get no slices (:func:`unplaced` lists them).

Clocks: every rank's times are seconds from its own first section start. Ranks leave each collective
together, so :func:`clock_offsets` puts every rank on the lowest rank's clock: the median over the
collectives of the difference of their exits ``A_rc + D_rc``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.overlap import parse_spans, subtract

COMPUTE, TRANSFER, WAIT, HIDDEN = "compute", "transfer", "wait", "hidden"
#: slice kinds: the three that tile a rank's section time, and hidden (lying over compute).
KINDS = (COMPUTE, WAIT, TRANSFER, HIDDEN)
#: the kinds whose slices add up to a rank's section time.
TILING = (COMPUTE, WAIT, TRANSFER)
_KEY = [K.ITERATION, K.SECTION]
_NS = 1e9
#: ``timeline.json``'s process of rank r is ``pid = r + PID_BASE``; its threads: the section ranges (``SECTIONS_TID``),
#: the compute / wait / transfer slices (``SLICES_TID``, + the nesting depth of a nested section). No pid or tid
#: is 0: Perfetto reserves pid / tid 0 for the idle ("swapper") process, and some of its versions map a trace's
#: pid / tid 0 onto it (a process the UI leaves out of its views).
PID_BASE, SECTIONS_TID, SLICES_TID = 1, 1, 2
#: ``timeline.json``'s thread of the iteration slices (one per rank and iteration).
ITERATIONS_TID = 90
#: the ``timeline.json`` thread of the hidden slices (overlapping the compute of the slice track); hidden
#: slices of collectives in flight together go to the next threads (99, 100, ...: no thread holds two
#: slices that overlap, which Perfetto's and Chrome's importers would not show as written).
HIDDEN_TID = 99


def _values(frame: pd.DataFrame, column: str) -> list[Any]:
    """A column's values as Python objects, missing ones (``NA``, ``NaN``) as ``None``: what iterating its rows
    gives, at a fraction of ``itertuples``'s cost (an Arrow string column iterates element by element)."""
    col = frame[column]
    values = col.astype(object).tolist()
    if col.hasnans:
        return [None if na else v for v, na in zip(values, col.isna().tolist(), strict=True)]
    return values


def _ns(x: pd.Series) -> np.ndarray:
    return np.rint(x.astype("float64").to_numpy() * _NS)


def placement(ranks: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Where each ``ranks`` row's section time ``S_r`` lies on the rank's clock: integer nanoseconds
    ``(start, end)``, ``end − start = round(S_r · 1e9)`` (NaN where the row has no start).

    The decomposition's interval: on CUDA (GPU_START_S and GPU_SPAN_S known) ``S_r`` ends at the last GPU end
    ``GPU_START_S + GPU_SPAN_S`` (pnpscale's runs: ``S_r`` runs from the CPU range start to it; other jobs'
    traces: ``S_r`` is the GPU span, from the first GPU start), so GPU work is placed at its GPU times; on CPU
    (and in folders written before GPU_START_S) ``S_r`` starts at START_S, the range start.

    >>> r = pd.DataFrame({"start_s": [0.0, 0.0], "section_s": [4e-5, 1.0], "gpu_start_s": [5e-5, float("nan")],
    ...                   "gpu_span_s": [4e-5, float("nan")]})
    >>> [v.tolist() for v in placement(r)]
    [[50000.0, 0.0], [90000.0, 1000000000.0]]
    """
    start = _ns(ranks[K.START_S]) if K.START_S in ranks else np.full(len(ranks), np.nan)
    length = _ns(ranks[K.SECTION_S])
    if K.GPU_START_S in ranks and K.GPU_SPAN_S in ranks:
        gpu_end = _ns(ranks[K.GPU_START_S]) + _ns(ranks[K.GPU_SPAN_S])
        start = np.where(np.isfinite(gpu_end), gpu_end - length, start)
    return start, start + length


def slices(ranks: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Every rank's compute / wait / transfer slices of every iteration and section, and its hidden ones.

    Args:
        ranks: ``ranks.parquet`` rows (RANK, ITERATION, SECTION, WARMUP, START_S, SECTION_S, optionally
            GPU_START_S and GPU_SPAN_S; seconds, on the rank's clock; placed by :func:`placement`).
        collectives: ``collectives.parquet`` rows (RANK, ITERATION, SECTION, SEQ, COLLECTIVE, START_S,
            DURATION_S, PAYLOAD_BYTES; optionally BLOCKED_SPANS_NS); may be empty (one rank).

    Returns:
        :data:`pnpscale.columns.TIMELINE_COLUMNS`, one row per slice of positive length, in time order
        per rank; START_S on the rank's own clock (see :func:`clock_offsets`), DURATION_S > 0; SEQ,
        COLLECTIVE and PAYLOAD_BYTES NA on compute slices. The compute, wait and transfer slices of a rank's
        section tile it; ``hidden`` slices lie over compute (see the module doc).

    Raises:
        KeyError: a required column is missing.
        ValueError: an unreadable BLOCKED_SPANS_NS value.

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
    lo_ns, hi_ns = placement(ranks)
    rows_of = zip(*(_values(ranks, c) for c in (K.RANK, K.ITERATION, K.SECTION, K.WARMUP)), strict=True)
    for i, (rank_v, it_v, sec_v, warm_v) in enumerate(rows_of if K.START_S in ranks else ()):
        rank, it, sec, warm = int(rank_v), int(it_v), str(sec_v), bool(warm_v)
        if not np.isfinite(lo_ns[i]):
            continue
        s0, s1 = int(lo_ns[i]), int(hi_ns[i])
        colls = by_key.get((it, sec, rank), [])
        if any(c["a"] is None for c in colls):
            continue  # no recorded start: cannot be placed (unplaced())
        pieces = sorted((p for c in colls for p in _blocked_pieces(c)), key=lambda p: (p[0], p[1]))
        cursor, blocked = s0, []
        for lo, hi, kind, c in pieces:
            lo, hi = max(lo, cursor, s0), min(hi, s1)  # clipped to the section; overlaps cut (the union)
            if hi <= lo:
                continue
            if lo > cursor:
                rows.append((rank, it, warm, sec, COMPUTE, cursor, lo - cursor, None))
            rows.append((rank, it, warm, sec, kind, lo, hi - lo, c))
            blocked.append((lo, hi))
            cursor = hi
        if s1 > cursor:
            rows.append((rank, it, warm, sec, COMPUTE, cursor, s1 - cursor, None))
        for c in colls:  # in flight, not blocked: hidden behind compute (drawn over it)
            lo, hi = max(c["a"], s0), min(c["a"] + c["d"], s1)
            for x0, x1 in subtract([(lo, hi)], blocked) if hi > lo else []:
                if x1 > x0:
                    rows.append((rank, it, warm, sec, HIDDEN, x0, x1 - x0, c))
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


def _blocked_pieces(c: Mapping[str, Any]) -> list[tuple[int, int, str, Mapping[str, Any]]]:
    """Collective ``c``'s blocked pieces (absolute ns) as wait or transfer: the blocked time in its last
    ``t_c = min_r D_rc`` is transfer, the rest wait (:func:`pnpscale.analysis.overlap.split_blocked`)."""
    a, d, t = c["a"], c["d"], c["t_c"]
    spans = c["spans"] if c["spans"] is not None else [(0, d)]  # none recorded: blocked throughout
    edge = a + d - t
    out = []
    for lo, hi in spans:
        x0, x1 = a + lo, a + hi
        if min(x1, edge) > x0:
            out.append((x0, min(x1, edge), WAIT, c))
        if x1 > max(x0, edge):
            out.append((max(x0, edge), x1, TRANSFER, c))
    return out


def _collectives_by_rank(collectives: pd.DataFrame) -> dict[tuple[int, str, int], list[dict[str, Any]]]:
    """(iteration, section, rank) -> its collectives in start order: integer-ns start ``a``, duration ``d``,
    ``t_c = min_r D_rc`` and its blocked spans (ns from ``a``; ``None``: blocked throughout)."""
    if collectives.empty:
        return {}
    c = collectives.copy()
    c[K.SECTION] = c[K.SECTION].astype(str)
    d = _ns(c[K.DURATION_S])
    dmin = pd.Series(d, index=c.index).groupby([c[K.ITERATION], c[K.SECTION], c[K.SEQ]]).transform("min").to_numpy()
    starts = _ns(c[K.START_S]) if K.START_S in c else np.full(len(c), np.nan)
    spans = [parse_spans(v) for v in c[K.BLOCKED_SPANS_NS]] if K.BLOCKED_SPANS_NS in c else [None] * len(c)
    payload = c[K.PAYLOAD_BYTES].astype("Float64").tolist() if K.PAYLOAD_BYTES in c else [None] * len(c)
    names = c[K.COLLECTIVE].astype(object).tolist() if K.COLLECTIVE in c else [None] * len(c)
    out: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    keys = zip(c[K.ITERATION].tolist(), c[K.SECTION].tolist(), c[K.RANK].tolist(), c[K.SEQ].tolist(), strict=True)
    for i, (it, sec, rank, seq) in enumerate(keys):
        a = None if np.isnan(starts[i]) else int(starts[i])
        name, size = names[i], payload[i]
        entry = {
            "a": a, "d": int(d[i]), "t_c": int(max(dmin[i], 0)), "spans": spans[i],
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
        (the sum of the :data:`TILING` kinds: the rank's section time by construction; compare with
        ``ranks.section_s``; hidden lies over compute and is not in it).
    """
    keys = [K.RANK, K.ITERATION, K.SECTION]
    wide = table.pivot_table(index=keys, columns=K.KIND, values=K.DURATION_S, aggfunc="sum", fill_value=0.0)
    wide = wide.reindex(columns=list(KINDS), fill_value=0.0)
    wide.columns = [str(c) for c in wide.columns]
    wide[K.SECTION_S] = wide[list(TILING)].sum(axis=1)
    return wide.reset_index()


def chrome_trace(
    table: pd.DataFrame, ranks: pd.DataFrame, offsets: Mapping[int, float] | None = None, note: str | None = None
) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of a run: one process per rank, a thread per kind of track.

    Args:
        table: :func:`slices` output.
        ranks: ``ranks.parquet`` rows (for the section ranges, placed by :func:`placement`: RANK, ITERATION,
            SECTION, WARMUP, START_S, SECTION_S, optionally GPU_START_S, GPU_SPAN_S).
        offsets: :func:`clock_offsets` (default: none); the times written are ``rank's time + offset``,
            shifted so that the earliest is 0.
        note: a line for ``otherData`` (e.g. sections that could not be placed).

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``: metadata events naming
        each process ``rank <r>`` (pid r + 1: :data:`PID_BASE`, ordered by rank) and its threads
        ``iterations`` (tid :data:`ITERATIONS_TID`: one ``X`` event per iteration, first section start to last
        section end of that iteration number on the rank), ``sections`` (tid 1: one ``X`` event per section
        occurrence at the decomposition's interval, named after the section; nested sections nest on it) and
        ``compute / transfer / wait`` (tid 2: one ``X`` event per slice, named after its kind; the slices of a
        section nested ``d`` deep in others, e.g. ``gradient`` inside ``ProfilerStep#*`` in an offline
        analysis, go to tid 2 + d); hidden slices on ``hidden: communication overlapped by compute`` (tid 99,
        and 99 + k for the k-th further lane when collectives in flight together overlap:
        :func:`_hidden_lanes`); every rank names the same threads, so that a tid has one name in every process.
        No two slices of a thread overlap without nesting (:func:`nesting_problems`: a slice that would is
        moved to an overflow thread, tid + :data:`OVERFLOW_TID` x k, named so). Flow events (``ph`` ``s`` /
        ``t`` / ``f``, ``cat`` ``collective``, ``bp`` ``e``) link each collective's slices across the ranks,
        in rank order, at the middle of its transfer slice (its hidden one where it has none).
        ``ts``/``dur`` in microseconds (integer nanoseconds / 1000); every ``args`` has ``section``,
        ``iteration``, ``warmup``, and on communication slices ``collective``, ``seq`` and ``bytes`` (the
        payload; ``null`` when unknown).

    Raises:
        ValueError: a written section's SECTION_S or a clock offset that is not a finite number (JSON has
            none; every other float is integer ns / 1000), a time that is NaN.
        OverflowError: an infinite time.
    """
    offsets = dict(offsets or {})
    if not all(math.isfinite(v) for v in offsets.values()):
        raise ValueError(f"clock offsets {offsets}: not all finite")
    off_ns = {int(r): int(round(offsets.get(int(r), 0.0) * _NS)) for r in ranks[K.RANK].unique()}
    lo, hi = placement(ranks)
    r_off = np.array([off_ns[int(r)] for r in ranks[K.RANK]], dtype=float)
    r_start, r_end = lo + r_off, hi + r_off
    t_start = _ns(table[K.START_S]) + np.array([off_ns.get(int(r), 0) for r in table[K.RANK]], dtype=float)
    finite = r_start[np.isfinite(r_start)]
    shift = int(finite.min()) if finite.size else 0
    depth = _depths(ranks)
    dur_ns = _ns(table[K.DURATION_S])
    lanes = _hidden_lanes(table, t_start, dur_ns)
    n_lanes = max(lanes.values(), default=-1) + 1  # every rank names the same hidden threads
    names: dict[int, str] = {ITERATIONS_TID: "iterations", SECTIONS_TID: "sections"}
    for d in sorted(set(depth.values()) | {0}):
        names[SLICES_TID + d] = "compute / transfer / wait" + (f" (sections nested {d} deep)" if d else "")
    for lane in range(n_lanes):
        names[HIDDEN_TID + lane] = "hidden: communication overlapped by compute" + (f" ({lane + 1})" if lane else "")
    spans: list[dict[str, Any]] = []  # the X events; their ts and dur are written from span_lo, span_hi (ns) below
    span_lo: list[int] = []
    span_hi: list[int] = []
    iters: dict[tuple[int, int], list[Any]] = {}
    lengths = ranks[K.SECTION_S].astype("float64").tolist()  # NaN kept: refused below, never written as null
    rows = zip(*(_values(ranks, c) for c in (K.RANK, K.SECTION, K.ITERATION, K.WARMUP)), lengths, strict=True)
    for i, (rank_v, sec_v, it_v, warm_v, length) in enumerate(rows):
        if not np.isfinite(r_start[i]):
            continue
        rank, sec, it, warm = int(rank_v), str(sec_v), int(it_v), bool(warm_v)
        if not math.isfinite(length):  # (written as a number: JSON has no NaN; every other float here is ns / 1000)
            raise ValueError(f"rank {rank} iteration {it} section {sec!r}: {K.SECTION_S} {length} is not a number")
        a, b = int(r_start[i]) - shift, int(r_end[i]) - shift
        spans.append({"ph": "X", "pid": rank + PID_BASE, "tid": SECTIONS_TID, "name": sec, "cat": "section",
                      "ts": 0.0, "dur": 0.0, "args": {"section": sec, "iteration": it, "warmup": warm,
                                                      K.SECTION_S: float(length)}})  # fmt: skip
        span_lo.append(a)
        span_hi.append(b)
        box = iters.setdefault((rank, it), [a, b, warm])
        box[0], box[1], box[2] = min(box[0], a), max(box[1], b), box[2] and warm
    for (rank, it), (a, b, warm) in sorted(iters.items()):
        spans.append({"ph": "X", "pid": rank + PID_BASE, "tid": ITERATIONS_TID, "name": f"iteration {it}",
                      "cat": "iteration", "ts": 0.0, "dur": 0.0,
                      "args": {"iteration": it, "warmup": bool(warm)}})  # fmt: skip
        span_lo.append(a)
        span_hi.append(b)
    columns = (K.KIND, K.RANK, K.SECTION, K.ITERATION, K.WARMUP, K.COLLECTIVE, K.SEQ, K.PAYLOAD_BYTES)
    for i, (kind_v, rank_v, sec_v, it_v, warm_v, coll, seq, payload) in enumerate(
        zip(*(_values(table, c) for c in columns), strict=True)
    ):
        kind, rank = str(kind_v), int(rank_v)
        args: dict[str, Any] = {"section": str(sec_v), "iteration": int(it_v), "warmup": bool(warm_v)}
        if kind != COMPUTE:
            args.update(
                collective=None if coll is None else str(coll),
                seq=None if seq is None else int(seq),
                bytes=None if payload is None else int(payload),
            )
        tid = HIDDEN_TID + lanes[i] if kind == HIDDEN else SLICES_TID + depth.get((rank, args["iteration"],
                                                                                   args["section"]), 0)
        a = int(t_start[i]) - shift
        spans.append({"ph": "X", "pid": rank + PID_BASE, "tid": tid, "name": kind, "cat": kind, "ts": 0.0, "dur": 0.0,
                      "args": args})  # fmt: skip
        span_lo.append(a)
        span_hi.append(a + int(dur_ns[i]))
    _untangle(spans, span_lo, span_hi, names)
    events: list[dict[str, Any]] = []
    for rank in sorted(off_ns):
        meta = {"ph": "M", "pid": rank + PID_BASE}
        events += [
            {**meta, "tid": SECTIONS_TID, "name": "process_name", "args": {"name": f"rank {rank}"}},
            {**meta, "tid": SECTIONS_TID, "name": "process_sort_index", "args": {"sort_index": rank}},
        ]
        for tid, name in sorted(names.items()):
            events.append({**meta, "tid": tid, "name": "thread_name", "args": {"name": name}})
            events.append({**meta, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = {}  # the X events written, in ns: nesting_problems
    for e, a, b in zip(spans, span_lo, span_hi, strict=True):
        e["ts"], e["dur"] = a / 1000, (b - a) / 1000
        tracks.setdefault((e["pid"], e["tid"]), []).append((a, b, e["name"]))
    events += spans
    events += _flows(spans, span_lo, span_hi)
    other: dict[str, Any] = {
        "source": "pnpscale",
        "clock": "seconds from the lowest rank's first section start; each rank shifted by its clock offset "
        "(ranks leave a collective together: median difference of collective exits)",
        "clock_offsets_s": {str(k): float(v) for k, v in sorted(offsets.items())},
        "placement": "each section at the decomposition's interval (CUDA: ending at its last GPU end, GPU work at "
        "its GPU times; CPU: from its range start); per collective, the rank's blocked time in its last "
        "min-over-ranks duration is transfer, the rest of its blocked time wait (a blocking collective: wait "
        "first, transfer last); compute fills the rest of the section; compute, wait and transfer slices of a "
        "section add up to the rank's section time; hidden slices (in flight, not blocked) lie over compute on "
        "their own tracks (one lane per collective in flight at the same time); flows link each collective "
        "across ranks",
    }
    if note:
        other["note"] = note
    problems = _track_problems(tracks)
    if problems:  # _untangle guarantees none: a bug, never written
        raise ValueError(f"timeline.json would hold slices that overlap without nesting: {problems[0]}")
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


#: a slice that would overlap another on its thread without nesting goes to thread ``tid + OVERFLOW_TID * k``.
OVERFLOW_TID = 1000


def _untangle(spans: list[dict[str, Any]], lo: Sequence[int], hi: Sequence[int], names: dict[int, str]) -> None:
    """Move every span (``pid``, ``tid``; from ``lo[i]`` to ``hi[i]``, ns) that would overlap an earlier one of its
    thread without nesting to the first overflow thread (``tid + OVERFLOW_TID x k``) where it nests; names them in
    ``names``. In place; spans that nest are left where they are (the usual case: none moves)."""
    tracks: dict[tuple[int, int], list[int]] = {}
    for i, e in enumerate(spans):
        tracks.setdefault((e["pid"], e["tid"]), []).append(i)
    for (_, tid), idx in tracks.items():
        stacks: list[list[int]] = []  # per lane, the open spans' ends
        for a, neg_b, i in sorted([(lo[j], -hi[j], j) for j in idx]):  # by start, the longer first, then in order
            b = -neg_b
            k = 0
            while True:
                if k == len(stacks):
                    stacks.append([])
                st = stacks[k]
                while st and st[-1] <= a:
                    st.pop()
                if not st or b <= st[-1]:
                    st.append(b)
                    break
                k += 1
            if k:
                spans[i]["tid"] = tid + OVERFLOW_TID * k
                names[tid + OVERFLOW_TID * k] = f"{names[tid]} (overlapping, {k})"


def _flows(spans: list[dict[str, Any]], lo: Sequence[int], hi: Sequence[int]) -> list[dict[str, Any]]:
    """Flow events linking each collective (iteration, section, seq) across ranks, in rank order: bound
    (``bp`` ``e``) to the middle of the rank's transfer slice of it (from ``lo[i]`` to ``hi[i]``, ns), or of its
    first hidden slice."""
    at: dict[tuple[int, str, int], dict[int, tuple[dict[str, Any], int]]] = {}
    for i, e in enumerate(spans):
        if e["cat"] not in (TRANSFER, HIDDEN) or e["args"].get("seq") is None:
            continue
        key = (e["args"]["iteration"], e["args"]["section"], e["args"]["seq"])
        mine = at.setdefault(key, {})
        old = mine.get(e["pid"])
        if old is None or (old[0]["cat"] == HIDDEN and e["cat"] == TRANSFER):
            mine[e["pid"]] = (e, (lo[i] + hi[i]) // 2)
    out: list[dict[str, Any]] = []
    for n, (_, by_pid) in enumerate(sorted(at.items())):
        if len(by_pid) < 2:
            continue
        pids = sorted(by_pid)
        for j, pid in enumerate(pids):
            e, mid = by_pid[pid]
            ph = "s" if j == 0 else ("f" if j == len(pids) - 1 else "t")
            name = e["args"].get("collective") or "collective"
            out.append({"ph": ph, "id": n + 1, "pid": pid, "tid": e["tid"], "name": str(name), "cat": "collective",
                        "ts": mid / 1000, "bp": "e"})  # fmt: skip
    return out


def nesting_problems(events: list[dict[str, Any]]) -> list[str]:
    """The ``X`` events of a Chrome trace that overlap another of their (pid, tid) without nesting (Perfetto
    and Chrome do not show such slices as written), one line each naming pid, tid, both names and times (us);
    empty when every thread's slices nest.

    >>> x = lambda ts, dur: {"ph": "X", "pid": 1, "tid": 1, "name": "s", "ts": ts, "dur": dur}
    >>> nesting_problems([x(0, 10), x(2, 3)]), len(nesting_problems([x(0, 10), x(5, 10)]))
    ([], 1)
    """
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for e in events:
        if e.get("ph") == "X":
            a = int(round(float(e["ts"]) * 1000))
            tracks.setdefault((e["pid"], e["tid"]), []).append((a, a + int(round(float(e["dur"]) * 1000)), e["name"]))
    return _track_problems(tracks)


def _track_problems(tracks: Mapping[tuple[int, int], Sequence[tuple[int, int, str]]]) -> list[str]:
    """:func:`nesting_problems` of the slices of each (pid, tid): ``(start, end, name)``, integer ns."""
    out = []
    for (pid, tid), spans in sorted(tracks.items()):
        stack: list[tuple[int, int, str]] = []
        for a, b, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= a:
                stack.pop()
            if stack and b > stack[-1][1]:
                top = stack[-1]
                out.append(f"pid {pid} tid {tid}: {name!r} [{a / 1000}, {b / 1000}] us overlaps {top[2]!r} "
                           f"[{top[0] / 1000}, {top[1] / 1000}] us without nesting")  # fmt: skip
            stack.append((a, b, name))
    return out


def _hidden_lanes(table: pd.DataFrame, start_ns: np.ndarray, dur_ns: np.ndarray) -> dict[int, int]:
    """Row position of each hidden slice -> its lane (0, 1, ...): per rank, the lowest lane whose last slice
    ended by the slice's start (interval partitioning, fewest lanes), so that no lane holds overlapping slices.

    >>> t = pd.DataFrame({"rank": 0, "kind": ["hidden", "compute", "hidden", "hidden"]})
    >>> _hidden_lanes(t, np.array([0.0, 0.0, 5.0, 20.0]), np.array([10.0, 30.0, 10.0, 5.0]))
    {0: 0, 2: 1, 3: 0}
    """
    out: dict[int, int] = {}
    hidden = np.flatnonzero((table[K.KIND] == HIDDEN).to_numpy(dtype=bool))
    ranks = table[K.RANK].to_numpy()
    for rank in np.unique(ranks[hidden]) if hidden.size else []:
        mine = [int(i) for i in hidden if ranks[i] == rank]
        ends: list[float] = []  # each lane's last end
        for i in sorted(mine, key=lambda j: (start_ns[j], -dur_ns[j])):
            free = next((k for k, e in enumerate(ends) if e <= start_ns[i]), None)
            if free is None:
                free = len(ends)
                ends.append(0.0)
            ends[free] = start_ns[i] + dur_ns[i]
            out[i] = free
    return out


def _depths(ranks: pd.DataFrame) -> dict[tuple[int, int, str], int]:
    """(rank, iteration, section) -> how many of the rank's other section intervals (:func:`placement`)
    enclose it (0: top level)."""
    out: dict[tuple[int, int, str], int] = {}
    if K.START_S not in ranks:
        return out
    lo, hi = placement(ranks)
    r = ranks.assign(_s=lo, _e=hi)
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
