"""Section records matched across ranks (pure, no torch): the same collective numbered alike on every rank
(:func:`align_collectives`), and each nested section's enclosing section (:func:`nested_sections`)."""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pnpscale.analysis.events import Collective, SectionError, SectionRecord
from pnpscale.analysis.section.p2p import fill_carried, is_p2p, p2p_ranks, pair_point_to_point


def align_collectives(records: Mapping[int, Sequence[SectionRecord]]) -> dict[int, list[SectionRecord]]:
    """Number every rank's collectives so that the same collective has the same ``seq`` everywhere.

    :func:`pnpscale.analysis.metrics.decompose` matches collectives across ranks by ``seq``. Per section
    occurrence (iteration, section), collectives are keyed:

    * by ``(group, group_seq, type)`` when every collective of that occurrence, on every rank, carries
      both (the trace recorded the process group and its sequence number), else
    * by ``(stream ordinal, type, position among that stream's collectives of that type)``: streams are
      numbered in increasing stream id on each rank (one stream per rank for gloo), positions by start time.

    Never by position alone: the type (``all_reduce``, ``all_to_all``... from the descriptor whose range holds
    the kernel's launch, :func:`pnpscale.analysis.section.gpu.pair_descriptors`; else the kernel's name) is part
    of every key, so collectives issued in different orders on two ranks (two threads) are matched by what they
    are; point-to-point types (``send``, ``recv``, ``send_recv``) count as one (``p2p``: a send meets a recv).
    A paired point-to-point transfer (:func:`~pnpscale.analysis.section.p2p.pair_point_to_point`) is held by its
    two ranks only; the others hold every other key.
    The new ``seq`` is the key's position in the lowest rank's start order (then the transfers that rank is not
    part of, in the next ranks' orders), so a trace with one
    stream, one type and no sequence numbers keeps the order-in-section numbering of
    :func:`section_records` unchanged.

    Args:
        records: rank -> that rank's records (from :func:`section_records`).

    Returns:
        rank -> new records (inputs untouched; a record or collective that needs no change is the input's
        own), collectives sorted by the new ``seq``.

    Raises:
        SectionError: ranks disagree on the section occurrences, or a collective of one rank has
            no counterpart on another (different counts per stream and type, or unmatched sequence numbers): the
            message names both ranks' keys.

    >>> a = [SectionRecord(0, "s", 0.0, 1.0, [Collective(0, "all_reduce", 0.1, 8, 7),
    ...                                        Collective(1, "broadcast", 0.2, 4, 9)])]
    >>> b = [SectionRecord(0, "s", 0.0, 1.0, [Collective(0, "broadcast", 0.3, 4, 9),
    ...                                        Collective(1, "all_reduce", 0.4, 8, 7)])]
    >>> [(c.seq, c.name) for c in align_collectives({0: a, 1: b})[1][0].collectives]
    [(0, 'all_reduce'), (1, 'broadcast')]
    """
    if not records:
        return {}
    records = pair_point_to_point(records)
    ranks = sorted(records)
    index = {r: {(s.iteration, s.section): s for s in records[r]} for r in ranks}
    occurrences = list(index[ranks[0]])
    for r in ranks[1:]:
        if set(index[r]) != set(occurrences):
            missing = sorted(set(occurrences) ^ set(index[r]))[0]
            raise SectionError(
                f"rank {r} and rank {ranks[0]} disagree on section occurrences (e.g. iteration {missing[0]} "
                f"section {missing[1]!r})"
            )
    out: dict[int, list[SectionRecord]] = {r: [] for r in ranks}
    new_seq: dict[int, dict[tuple[int, str], list[Collective]]] = {r: {} for r in ranks}
    issuing: dict[int, dict[tuple[int, str], dict]] = {r: {} for r in ranks}  # rank -> occ -> key -> collective
    key_of: dict[int, dict[tuple[int, str], dict[int, tuple]]] = {r: {} for r in ranks}  # rank -> occ -> seq -> key
    for occ in occurrences:
        colls = {r: list(index[r][occ].collectives) for r in ranks}
        own = {r: [c for c in colls[r] if c.carried is None and not is_p2p(c)] for r in ranks}
        by_pg = all(c.group is not None and c.group_seq is not None for r in ranks for c in own[r])
        if not by_pg and len(ranks) > 1:
            _refuse_untyped(own, occ)
        keys = {r: _match_keys(colls[r], by_pg, key_of[r]) for r in ranks}
        fill_carried(colls, keys, issuing, occ)
        for r in ranks:
            key_of[r][occ] = {c.seq: k for c, k in zip(colls[r], keys[r], strict=True) if c.carried is None}
            issuing[r][occ] = {k: c for c, k in zip(colls[r], keys[r], strict=True) if c.carried is None}
        ref = [k for _, k in sorted(zip((c.seq for c in colls[ranks[0]]), keys[ranks[0]], strict=True))]
        if len(set(ref)) != len(ref):
            raise SectionError(f"iteration {occ[0]} section {occ[1]!r}: rank {ranks[0]} repeats a collective key")
        for r in ranks[1:]:
            if _shared(keys[r]) != _shared(ref):
                for rr in (r, ranks[0]):
                    rec = index[rr][occ]
                    if rec.missing_kernels:
                        raise SectionError(
                            f"iteration {occ[0]} section {occ[1]!r}: rank {rr} has {rec.missing_kernels} "
                            f"collective(s) on the CPU side (record_param_comms / nccl:*) without a GPU kernel in "
                            f"the trace ({len(rec.collectives)} kernel(s) for them): the profiler dropped kernels "
                            f"(seen with repeated profiler sessions); fix: profile every iteration in one profiler "
                            f"session (prof.step() per iteration)"
                        )
                how = "process group, sequence number and type" if by_pg else "type and order within each stream"
                raise SectionError(
                    f"iteration {occ[0]} section {occ[1]!r}: rank {r} ran {len(keys[r])} collective(s), rank "
                    f"{ranks[0]} ran {len(ref)}, and they cannot be matched by {how} "
                    f"(rank {r}: {sorted(keys[r])}; rank {ranks[0]}: {sorted(ref)})"
                )
        order, placed = list(ref), set(ref)  # then the point-to-point transfers rank ranks[0] is not part of
        for r in ranks[1:]:
            for _, k in sorted(zip((c.seq for c in colls[r]), keys[r], strict=True)):
                if k not in placed:
                    order.append(k)
                    placed.add(k)
        position = {k: i for i, k in enumerate(order)}
        for r in ranks:  # a collective whose seq is unchanged is shared with the input (none is changed later)
            renum = [c if c.seq == position[k] else replace(c, seq=position[k])
                     for c, k in zip(colls[r], keys[r], strict=True)]  # fmt: skip
            new_seq[r][occ] = sorted(renum, key=lambda c: c.seq)
    for r in ranks:
        for s in records[r]:
            colls_out = new_seq[r][(s.iteration, s.section)]
            same = len(colls_out) == len(s.collectives) and all(map(operator.is_, colls_out, s.collectives))
            out[r].append(s if same else replace(s, collectives=colls_out))
    return out


def _shared(keys: Sequence[tuple]) -> list[tuple]:
    """The match keys every rank must hold (sorted): all but point-to-point transfers, which only their two ranks
    hold (:func:`pnpscale.analysis.section.p2p.pair_point_to_point` checked both halves)."""
    return sorted(k for k in keys if p2p_ranks(k) is None)


def nested_sections(records: Mapping[int, Sequence[SectionRecord]]) -> dict[str, str]:
    """Section -> the section enclosing it, for sections nested in another in every occurrence.

    Raises:
        SectionError: a section is nested in some occurrences and not in others, or in different
            sections (the message names rank and iteration).
    """
    seen: dict[str, tuple[str | None, int, int]] = {}
    for r, recs in sorted(records.items()):
        for s in recs:
            first = seen.setdefault(s.section, (s.parent, r, s.iteration))
            if first[0] != s.parent:
                raise SectionError(
                    f"section {s.section!r} is inside {first[0]!r} on rank {first[1]} iteration {first[2]} but inside "
                    f"{s.parent!r} on rank {r} iteration {s.iteration}: the 'all' row cannot be built from "
                    f"non-overlapping time"
                )
    return {name: parent for name, (parent, _, _) in seen.items() if parent is not None}


def _match_keys(
    colls: Sequence[Collective], by_pg: bool, earlier: Mapping[tuple[int, str], Mapping[int, tuple]]
) -> list[tuple]:
    """Match key of each collective of one rank's section occurrence, aligned with ``colls``: paired
    point-to-point by pair and sequence, carried ones by the key of their issuing entry (``earlier``: occurrence
    -> seq -> key, of this rank; :mod:`pnpscale.analysis.section.p2p`), the others by process group and sequence
    number (``by_pg``) or by order within each stream.

    Raises:
        SectionError: a carried entry whose issuing occurrence was not seen before.
    """
    keys: list[tuple] = [()] * len(colls)
    rest = []
    for i, c in enumerate(colls):
        if is_p2p(c):
            keys[i] = ("pg", str(c.group), int(c.group_seq))  # type: ignore[arg-type]
        elif c.carried is not None:
            it, sec, seq = c.carried
            if seq not in earlier.get((it, sec), {}):
                raise SectionError(
                    f"a collective issued in iteration {it} section {sec!r} is waited in a later section, but that "
                    f"occurrence is not among the iterations kept on every rank (dropped, or before the first "
                    f"matched one): its wait cannot be matched across ranks"
                )
            keys[i] = ("carried", it, sec, earlier[(it, sec)][seq])
        else:
            rest.append(i)
    if by_pg:
        for i in rest:
            c = colls[i]
            keys[i] = ("pg", str(c.group), int(c.group_seq), _match_type(c.name))  # type: ignore[arg-type]
        return keys
    streams = sorted({colls[i].stream for i in rest}, key=lambda s: (s is not None, s or 0))
    ordinal = {s: i for i, s in enumerate(streams)}
    seen: dict[tuple[int | None, str], int] = defaultdict(int)
    for i in sorted(rest, key=lambda i: colls[i].seq):
        c = colls[i]
        kind = _match_type(c.name)
        keys[i] = ("stream", ordinal[c.stream], kind, seen[c.stream, kind])
        seen[c.stream, kind] += 1
    return keys


#: the collective types a record can carry (:func:`pnpscale.analysis.kineto.collective_type`); any other name is a
#: kernel's own name: a collective that could not be typed
TYPES = frozenset({"barrier", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv",
                   "reduce", "gather", "scatter", "send", "recv"})  # fmt: skip


def _refuse_untyped(colls: Mapping[int, Sequence[Collective]], occ: tuple[int, str]) -> None:
    """Refuse a stream holding two collectives or more that could not be typed (no descriptor holds their launch,
    their kernel names do not say), in a job matched without sequence numbers: only their positions would pair
    them across ranks, and collectives issued in different orders would be paired wrongly in silence.

    Raises:
        SectionError: naming the iteration, section, rank, stream and kernels.
    """
    for r, cs in sorted(colls.items()):
        per_stream: dict[int | None, list[str]] = defaultdict(list)
        for c in cs:
            if c.name not in TYPES:
                per_stream[c.stream].append(c.name)
        for stream, names in per_stream.items():
            if len(names) > 1:
                raise SectionError(
                    f"iteration {occ[0]} section {occ[1]!r}: rank {r} ran {len(names)} collectives on stream "
                    f"{stream} whose type is unknown (e.g. {names[0]!r}: no nccl:* / record_param_comms descriptor "
                    f"holds their launch and their kernel names do not say), and the trace has no process group "
                    f"sequence numbers: matching them across ranks by position alone could pair different "
                    f"collectives (record with record_shapes, or profile the CPU side, to keep the descriptors)"
                )


#: collective types that meet each other across ranks (a send on one rank is a recv on its peer)
_P2P = frozenset({"send", "recv", "send_recv"})


def _match_type(name: str) -> str:
    """The type part of a match key: the collective's type, point-to-point ones as ``p2p``."""
    return "p2p" if name in _P2P else name
