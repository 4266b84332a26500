"""Point-to-point operations and collectives waited in another section, matched across ranks (pure, no torch).

Two rules used by :func:`pnpscale.analysis.section.align.align_collectives` before it numbers collectives:

* **Point-to-point** (:func:`pair_point_to_point`): ``send``/``recv`` (``isend``/``irecv``,
  ``batch_isend_irecv``: the same ``c10d::send``/``c10d::recv_`` calls, the same ``gloo:send``/``gloo:recv``
  ranges; NCCL's from their descriptors, run in ``SendRecv`` kernels) are typed operations matched by peer, tag
  and order: in each section occurrence, the k-th send of rank ``s`` to ``d`` with tag ``t`` is the k-th receive
  of ``d`` from ``s`` with tag ``t``. Both become one operation ``send_recv`` keyed ``("p2p:s->d", seq)``, held by
  those two ranks only, so that the metrics treat it as a transfer between two ranks: with
  ``t_c = min(D_send, D_recv)`` the receiver's blocked time splits into wait (before the sender's data came:
  the sender arrives late) and transfer (the last ``t_c``). Its payload (bytes of the tensor sent) and ``t_c``
  give the pair's rate (GB/s = 1e9 B/s): :func:`pair_rates`.
  Peers: Kineto's gloo and NCCL ranges do not name them; the ``c10d::`` call does with ``record_shapes``
  (:func:`pnpscale.analysis.kineto.p2p_peer`: its peer in the call's process group, read as a global rank),
  carried to the gloo range (:attr:`~pnpscale.analysis.events.Collective.peer`). Without it the peer is known
  only in a 2-rank job (each rank's peer is the other); among more ranks it is refused, naming rank, iteration
  and section and asking for ``record_shapes=True``.
* **Carried** collectives (:func:`fill_carried`): a collective issued in one section and waited in a later one
  (the prefetch pattern) belongs to the section that issued it (its ``c10d::`` call), and the time the rank
  waits for it in a later section is a *carried* entry of that later section
  (:attr:`~pnpscale.analysis.events.Collective.carried`). A rank on which it completed before that section
  began has no carried entry: it gets one blocked 0 s (the same duration, so the transfer ``t_c`` stays the
  collective's), so that every rank holds the same entries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace

from pnpscale.analysis.events import Collective, SectionError, SectionRecord

#: collective types that are one half of a point-to-point transfer
P2P_TYPES = frozenset({"send", "recv"})
#: the type both halves get once paired
SEND_RECV = "send_recv"
#: prefix of the group of a paired point-to-point operation: ``p2p:<src>-><dst>``
P2P_GROUP = "p2p:"


def is_p2p(c: Collective) -> bool:
    """Whether ``c`` is a paired point-to-point operation (keyed by its pair and sequence, whatever the rest)."""
    return c.group is not None and c.group.startswith(P2P_GROUP)


def pair_point_to_point(records: Mapping[int, Sequence[SectionRecord]]) -> dict[int, list[SectionRecord]]:
    """Pair every rank's sends with its peer's receives, per section occurrence (see module doc).

    A send of rank ``s`` to ``d`` with tag ``t`` (peer and tag from the trace, :attr:`Collective.peer`; in a 2-rank
    job without them the peer is the other rank and the tag unknown) is the k-th of channel ``(s, d, t)`` in ``s``'s
    order; the k-th receive of ``d`` from ``s`` with tag ``t`` is its other half (gloo delivers in order per peer and
    tag). The pair's ``group_seq`` is the position of ``(t, k)`` among the channel keys of ``s -> d`` in the
    occurrence (= k with one tag), the same on both ranks.

    Args:
        records: rank -> that rank's records (:func:`~pnpscale.analysis.section.records.section_records`).

    Returns:
        rank -> records (inputs untouched) in which each send/recv is ``send_recv`` with group ``p2p:<src>-><dst>``
        and ``group_seq`` as above; only the two ranks of a pair hold its entry.

    Raises:
        SectionError: point-to-point in a job of more than 2 ranks whose trace does not name the peer (recorded
            without ``record_shapes``), a peer that is not another rank of the job, or sends of ``s`` to ``d`` and
            receives of ``d`` from ``s`` that differ in number or tags in an occurrence (iteration, section, ranks
            and counts named).

    >>> s = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "send", 0.001, 8)])]
    >>> r = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "recv", 0.06, 8)])]
    >>> c = pair_point_to_point({0: s, 1: r})[1][0].collectives[0]
    >>> c.name, c.group, c.group_seq
    ('send_recv', 'p2p:0->1', 0)
    """
    has = any(c.name in P2P_TYPES for recs in records.values() for s in recs for c in s.collectives)
    if not has:
        return {r: list(recs) for r, recs in records.items()}
    ranks = sorted(records)
    # (iteration, section) -> (src, dst) -> "send"/"recv" -> channel keys (tag, k) in that rank's order
    halves: dict[tuple[int, str], dict[tuple[int, int], dict[str, list[tuple[int | None, int]]]]] = {}
    staged: dict[int, list[tuple[SectionRecord, list[tuple[Collective, tuple[int, int, int | None, int] | None]]]]]
    staged = {r: [] for r in ranks}
    for r in ranks:
        for s in records[r]:
            occ = (s.iteration, s.section)
            count: dict[tuple[str, int, int, int | None], int] = defaultdict(int)
            items: list[tuple[Collective, tuple[int, int, int | None, int] | None]] = []
            for c in sorted(s.collectives, key=lambda c: c.seq):
                if c.name not in P2P_TYPES:
                    items.append((c, None))
                    continue
                peer = _peer_of(c, r, ranks, s)
                src, dst = (r, peer) if c.name == "send" else (peer, r)
                k = count[c.name, src, dst, c.tag]
                count[c.name, src, dst, c.tag] += 1
                halves.setdefault(occ, {}).setdefault((src, dst), {"send": [], "recv": []})[c.name].append((c.tag, k))
                items.append((c, (src, dst, c.tag, k)))
            staged[r].append((s, items))
    order: dict[tuple[int, str], dict[tuple[int, int], dict[tuple[int | None, int], int]]] = {}
    for occ, pairs in halves.items():
        for (src, dst), sides in sorted(pairs.items()):
            if sorted(sides["send"], key=_channel) != sorted(sides["recv"], key=_channel):
                raise SectionError(
                    f"iteration {occ[0]} section {occ[1]!r}: rank {src} sent {_tally(sides['send'])} to rank {dst}, "
                    f"rank {dst} received {_tally(sides['recv'])} from rank {src}: point-to-point transfers must be "
                    f"sent and received in the same section occurrence, with the same tags"
                )
            keys = sorted(sides["send"], key=_channel)
            order.setdefault(occ, {})[(src, dst)] = {key: i for i, key in enumerate(keys)}
    out: dict[int, list[SectionRecord]] = {r: [] for r in ranks}
    for r in ranks:
        for s, items in staged[r]:
            colls = []
            for c, ch in items:
                if ch is None:
                    colls.append(c)
                    continue
                src, dst, tag, k = ch
                seq = order[(s.iteration, s.section)][(src, dst)][(tag, k)]
                colls.append(replace(c, name=SEND_RECV, group=f"{P2P_GROUP}{src}->{dst}", group_seq=seq))
            out[r].append(replace(s, collectives=colls))
    return out


def _channel(key: tuple[int | None, int]) -> tuple[bool, int, int]:
    """Sort key of a channel key ``(tag, k)``: unknown tags first."""
    return (key[0] is not None, key[0] or 0, key[1])


def _tally(keys: Sequence[tuple[int | None, int]]) -> str:
    """``"3 time(s) (tag 0: 2, tag 7: 1)"`` of channel keys (tags named when known)."""
    tags: dict[int | None, int] = defaultdict(int)
    for tag, _ in keys:
        tags[tag] += 1
    named = ", ".join(f"tag {t}: {n}" for t, n in sorted(tags.items(), key=lambda x: (x[0] is not None, x[0] or 0))
                      if t is not None)  # fmt: skip
    return f"{len(keys)} time(s)" + (f" ({named})" if named else "")


def _peer_of(c: Collective, r: int, ranks: Sequence[int], s: SectionRecord) -> int:
    """The other rank of rank ``r``'s send/recv ``c`` in occurrence ``s``: its recorded peer, else (2 ranks) the
    other rank.

    Raises:
        SectionError: no peer recorded in a job of more than 2 ranks, or a peer that is not another rank of the job.
    """
    where = f"rank {r} iteration {s.iteration} section {s.section!r}"
    if c.peer is None:
        if len(ranks) == 2:
            return ranks[1] if r == ranks[0] else ranks[0]
        raise SectionError(
            f"{where}: a point-to-point {c.name} whose peer the trace does not name, in a job of {len(ranks)} ranks: "
            f"Kineto writes the peer (and tag) of c10d::send / c10d::recv_ only in their 'Concrete Inputs', with "
            f"shapes recorded: profile the job with torch.profiler.profile(..., record_shapes=True) (peers are also "
            f"not read where the trace lists a process group that renumbers ranks: anomaly p2p_peer_ambiguous)"
        )
    if c.peer == r or c.peer not in ranks:
        raise SectionError(
            f"{where}: a point-to-point {c.name} whose peer is rank {c.peer}, not another rank of the job "
            f"(ranks {list(ranks)}): the trace gives the peer's rank in the call's process group, read as a global "
            f"rank (a process group other than the default one?)"
        )
    return c.peer


def p2p_ranks(key: tuple) -> tuple[int, ...] | None:
    """The two ranks of a paired point-to-point match key ``("pg", "p2p:<src>-><dst>", seq)``, else ``None`` (every
    rank holds the entry); carried keys by their issuing key.

    >>> p2p_ranks(("pg", "p2p:2->3", 0)), p2p_ranks(("carried", 0, "f", ("pg", "p2p:0->1", 1)))
    ((2, 3), (0, 1))
    >>> p2p_ranks(("pg", "0", 4)) is None
    True
    """
    if key and key[0] == "carried":
        return p2p_ranks(key[3])
    if len(key) >= 2 and key[0] == "pg" and str(key[1]).startswith(P2P_GROUP):
        src, dst = str(key[1])[len(P2P_GROUP) :].split("->")
        return int(src), int(dst)
    return None


def fill_carried(
    colls: Mapping[int, list[Collective]],
    keys: Mapping[int, list[tuple]],
    issuing: Mapping[int, Mapping[tuple[int, str], Mapping[int, Collective]]],
    where: tuple[int, str],
) -> None:
    """Give every rank the carried entries some rank has in one section occurrence (in place; see module doc).

    Args:
        colls: rank -> the occurrence's collectives; keys: rank -> their match keys (aligned), carried ones
            ``("carried", iteration, section, issuing key)``.
        issuing: rank -> (iteration, section) -> issuing key -> that rank's collective there.
        where: (iteration, section) of the occurrence, for the error.

    Raises:
        SectionError: a rank lacks the issuing collective of a carried entry.
    """
    wanted = {k for ks in keys.values() for k in ks if k and k[0] == "carried"}
    for r in colls:
        have = set(keys[r])
        for k in sorted(wanted - have, key=repr):
            _, it, sec, ikey = k
            pair = p2p_ranks(ikey)
            if pair is not None and r not in pair:
                continue  # a point-to-point transfer between two other ranks
            src = issuing[r].get((it, sec), {}).get(ikey)
            if src is None:
                raise SectionError(
                    f"iteration {where[0]} section {where[1]!r}: a collective issued in iteration {it} section "
                    f"{sec!r} and waited here on another rank has no counterpart on rank {r}"
                )
            colls[r].append(
                replace(
                    src, seq=len(colls[r]), blocked_s=0.0, hidden_s=0.0, blocked_spans="", carried=(it, sec, src.seq)
                )
            )
            keys[r].append(k)


def pair_rates(records: Mapping[int, Sequence[SectionRecord]], warmup: int = 0) -> list[dict]:
    """Per point-to-point pair and section: transfers, bytes and rate, from paired records.

    Args:
        records: rank -> records after :func:`pair_point_to_point` (or
            :func:`~pnpscale.analysis.section.align.align_collectives`).
        warmup: iterations ``< warmup`` are left out (warm-up; default none).

    Returns:
        One dict per (section, src, dst), sorted: ``section``, ``src``, ``dst``, ``transfers`` (count over all
        iterations), ``bytes`` (sum of the payloads, either side's, ``None`` when one is unknown on both: no shapes),
        ``transfer_s`` (sum of ``t_c = min(D_send, D_recv)``, seconds) and ``rate_gb_s`` (bytes / transfer_s /
        1e9; ``None`` without bytes or time).

    >>> s = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "send", 0.001, 8_000_000)])]
    >>> r = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "recv", 0.06, 8_000_000)])]
    >>> pair_rates(pair_point_to_point({0: s, 1: r}))
    [{'section': 'f', 'src': 0, 'dst': 1, 'transfers': 1, 'bytes': 8000000, 'transfer_s': 0.001, 'rate_gb_s': 8.0}]
    """
    per: dict[tuple[str, int, int, int, int], list[Collective]] = {}
    for recs in records.values():
        for s in recs:
            for c in s.collectives:
                if is_p2p(c) and c.carried is None and s.iteration >= warmup:
                    src, dst = (int(x) for x in str(c.group)[len(P2P_GROUP) :].split("->"))
                    per.setdefault((s.section, src, dst, s.iteration, int(c.group_seq or 0)), []).append(c)
    rows: dict[tuple[str, int, int], dict] = {}
    for (section, src, dst, _, _), halves in sorted(per.items()):
        row = rows.setdefault(
            (section, src, dst),
            {"section": section, "src": src, "dst": dst, "transfers": 0, "bytes": 0, "transfer_s": 0.0},
        )
        row["transfers"] += 1
        known = [c.payload_bytes for c in halves if c.payload_bytes is not None]  # the same tensor on both sides
        payload = max(known) if known else None
        row["bytes"] = None if row["bytes"] is None or payload is None else row["bytes"] + payload
        row["transfer_s"] += min(c.duration_s for c in halves)
    for row in rows.values():
        ok = row["bytes"] is not None and row["transfer_s"] > 0
        row["rate_gb_s"] = row["bytes"] / row["transfer_s"] / 1e9 if ok else None
    return [rows[k] for k in sorted(rows)]
