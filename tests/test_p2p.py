"""Point-to-point transfers and collectives waited in a later section (issue 34), on synthetic gloo events whose
shape was read off real traces (tests/overlap_jobs.py ``pipeline`` and ``prefetch``): the pure rules, then the
whole decomposition (CommE <= 1, PE = LB x CommE)."""

from __future__ import annotations

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Collective, Event, Kind, SectionError, SectionRecord, rank_rows
from pnpscale.analysis.metrics import DecompositionError, check_invariants, decompose, summarize
from pnpscale.analysis.section.align import align_collectives
from pnpscale.analysis.section.p2p import SEND_RECV, pair_point_to_point, pair_rates
from pnpscale.analysis.section.records import in_flight, placement, section_records
from pnpscale.analysis.tables import frames

MS = 1_000_000  # ns


def _decompose(per_rank: dict[int, list[Event]], sections: list[str]):
    recs = {r: section_records(evs, sections, rank=r) for r, evs in per_rank.items()}
    aligned = align_collectives(recs)
    ranks, colls = frames([(rank_rows(r, rr, 0), {}) for r, rr in sorted(aligned.items())])
    table = decompose(ranks, colls)
    check_invariants(ranks, table)
    summary = summarize(table, gpus=len(per_rank))
    assert (summary[K.COMM_E] <= 1 + 1e-12).all()
    assert summary[K.PE].to_numpy() == pytest.approx((summary[K.LB] * summary[K.COMM_E]).to_numpy())
    return aligned, ranks, colls, table


def _pipeline_rank(rank: int, it: int) -> list[Event]:
    """Stage 0 computes 60 ms then sends (gloo:send buffered, 0.05 ms); stage 1 receives (waits 60 ms), computes
    20 ms. Both on the calling thread, as gloo records them."""
    t0 = it * 100 * MS
    evs = [Event("forward", Kind.CPU, t0, t0 + 81 * MS, tid=1)]
    if rank == 0:
        send = t0 + 60 * MS
        evs += [Event("aten::mm", Kind.OP, t0, send, tid=1), Event("c10d::send", Kind.OP, send, send + 400_000, tid=1),
                Event("gloo:send", Kind.CPU, send + 300_000, send + 350_000, tid=1, payload_bytes=1 << 20)]  # fmt: skip
    else:
        recv = t0 + MS // 2
        evs += [Event("c10d::recv_", Kind.OP, recv, recv + 40_000, tid=1),
                Event("gloo:recv", Kind.CPU, recv + 30_000, t0 + 60 * MS + 360_000, tid=1, payload_bytes=1 << 20),
                Event("aten::mm", Kind.OP, t0 + 60 * MS + 400_000, t0 + 80 * MS, tid=1)]  # fmt: skip
    return evs


def test_send_recv_pair_by_peer_and_sequence_and_the_receiver_waits_for_the_sender():
    per_rank = {r: [e for it in range(3) for e in _pipeline_rank(r, it)] for r in (0, 1)}
    aligned, ranks, colls, table = _decompose(per_rank, ["forward"])
    c = colls[colls[K.ITERATION] == 1].set_index(K.RANK)
    assert (c[K.COLLECTIVE] == SEND_RECV).all()
    # the receiver: blocked from its call (0.5 ms) to the end of its gloo:recv (60.36 ms)
    assert c.loc[1, K.BLOCKED_S] == pytest.approx(59.86e-3, abs=1e-5)
    assert c.loc[0, K.BLOCKED_S] == pytest.approx(0.4e-3, abs=1e-6)  # the sender: its c10d::send call, whole
    row = table[table[K.ITERATION] == 1].iloc[0]
    # transfer: t_c = min(D) = the sender's 0.05 ms gloo:send: the receiver's last 0.05 ms, the rest its wait; the
    # sender's call after its gloo:send is transfer too (0.1 ms from the start of its gloo:send), its start wait
    assert row[K.TRANSFER_S] == pytest.approx((0.05e-3 + 0.1e-3) / 2, abs=1e-6)
    assert row[K.WAIT_S] == pytest.approx((59.86e-3 - 0.05e-3 + 0.3e-3) / 2, abs=1e-5)
    (pair,) = pair_rates(aligned)  # 3 transfers of 1 MiB, each in the sender's 0.05 ms
    assert (pair["src"], pair["dst"], pair["transfers"], pair["bytes"]) == (0, 1, 3, 3 << 20)
    assert pair["rate_gb_s"] == pytest.approx((1 << 20) / 0.05e-3 / 1e9)
    (measured,) = pair_rates(aligned, warmup=1)  # the warm-up iteration left out, the rate unchanged
    assert (measured["transfers"], measured["bytes"]) == (2, 2 << 20)
    assert measured["rate_gb_s"] == pytest.approx(pair["rate_gb_s"])


def test_point_to_point_refusals_name_the_occurrence():
    send = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "send", 1e-3, 8)])]
    recv = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "recv", 1e-3, 8)])]
    none = [SectionRecord(0, "f", 0.0, 1.0, [])]
    with pytest.raises(SectionError, match=r"iteration 0 section 'f'.*3 ranks"):
        pair_point_to_point({0: send, 1: recv, 2: none})
    with pytest.raises(SectionError, match=r"iteration 0 section 'f': rank 0 sent 1 time\(s\) to rank 1, rank 1 rec"):
        pair_point_to_point({0: send, 1: none})
    # both directions in one occurrence, a collective between: keyed by pair, the collective by order
    a = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "send", 1e-3, 8), Collective(1, "all_reduce", 1e-3, 8),
                                          Collective(2, "recv", 1e-3, 8)])]  # fmt: skip
    b = [SectionRecord(0, "f", 0.0, 1.0, [Collective(0, "recv", 1e-3, 8), Collective(1, "send", 1e-3, 8),
                                          Collective(2, "all_reduce", 1e-3, 8)])]  # fmt: skip
    out = align_collectives({0: a, 1: b})
    names = {r: [(c.name, c.group) for c in out[r][0].collectives] for r in (0, 1)}
    assert names[0] == names[1]
    assert sorted(names[0], key=str) == sorted(
        [(SEND_RECV, "p2p:0->1"), ("all_reduce", None), (SEND_RECV, "p2p:1->0")], key=str
    )


def _stage(rank: int, world: int, it: int) -> list[Event]:
    """Stage ``rank`` of a ``world``-stage pipeline, as gloo records it with ``record_shapes`` (the peer and tag on
    the c10d calls, :attr:`Event.peer`): stage 0 computes 60 ms and sends to 1; stage i receives from i-1 (it
    arrives at 0.5 ms, the data when stage i-1 sends), computes 20 ms and sends to i+1."""
    t0 = it * 200 * MS
    evs = [Event("forward", Kind.CPU, t0, t0 + 150 * MS, tid=1)]
    sent = t0 + (60 + 20 * rank) * MS  # when this stage sends
    if rank > 0:
        got = t0 + (60 + 20 * (rank - 1)) * MS + 350_000  # the previous stage's gloo:send ends
        evs += [Event("c10d::recv_", Kind.OP, t0 + MS // 2, t0 + MS // 2 + 40_000, tid=1, peer=rank - 1, tag=0),
                Event("gloo:recv", Kind.CPU, t0 + MS // 2 + 30_000, got, tid=1, payload_bytes=1 << 20),
                Event("aten::mm", Kind.OP, got + 40_000, sent, tid=1)]  # fmt: skip
    else:
        evs += [Event("aten::mm", Kind.OP, t0, sent, tid=1)]
    if rank < world - 1:
        evs += [Event("c10d::send", Kind.OP, sent, sent + 400_000, tid=1, peer=rank + 1, tag=0),
                Event("gloo:send", Kind.CPU, sent + 300_000, sent + 350_000, tid=1, payload_bytes=1 << 20)]  # fmt: skip
    return evs


@pytest.mark.parametrize("world", [3, 4])
def test_a_pipeline_of_more_than_two_stages_pairs_by_the_recorded_peers(world):
    per_rank = {r: [e for it in range(3) for e in _stage(r, world, it)] for r in range(world)}
    aligned, ranks, colls, table = _decompose(per_rank, ["forward"])
    c = colls[colls[K.ITERATION] == 1]
    assert (c[K.COLLECTIVE] == SEND_RECV).all()
    held = c.groupby(K.PROCESS_GROUP)[K.RANK].agg(sorted).to_dict()
    assert held == {f"p2p:{i}->{i + 1}": [i, i + 1] for i in range(world - 1)}  # each transfer on its two ranks
    assert c.groupby(K.PROCESS_GROUP)[K.SEQ].nunique().eq(1).all() and c[K.SEQ].nunique() == world - 1
    recv = c[c[K.RANK] == c[K.PROCESS_GROUP].str.split("->").str[1].astype(int)].set_index(K.RANK)
    for r in range(1, world):  # stage r waits from its call (0.5 ms) until stage r-1's data (60 + 20 (r-1) ms)
        assert recv.loc[r, K.BLOCKED_S] == pytest.approx((60 + 20 * (r - 1)) * 1e-3 + 0.35e-3 - 0.5e-3, abs=1e-5)
    row = table[table[K.ITERATION] == 1].iloc[0]
    assert row[K.N_COLLECTIVES] == world - 1
    # per transfer: t_c = the sender's 0.05 ms gloo:send; the receiver's last t_c and the sender's call after
    # its gloo:send started are transfer (as for 2 ranks), the rest wait
    assert row[K.TRANSFER_S] == pytest.approx((world - 1) * (0.05e-3 + 0.1e-3) / world, abs=1e-6)
    pairs = pair_rates(aligned)
    assert [(p["src"], p["dst"], p["transfers"], p["bytes"]) for p in pairs] == [
        (i, i + 1, 3, 3 << 20) for i in range(world - 1)
    ]


def _p2p(kind: str, seq: int, peer: int | None, tag: int | None, d: float = 1e-3) -> Collective:
    return Collective(seq, kind, d, 8, peer=peer, tag=tag)


def test_sends_meet_receives_by_peer_tag_and_order():
    # rank 0 sends tag 5 then tag 7 to rank 2, rank 2 receives tag 7 first: each send meets its tag's receive;
    # rank 1 sends twice to rank 2 (the same tag): in order
    a = [SectionRecord(0, "f", 0.0, 1.0, [_p2p("send", 0, 2, 5, 1e-3), _p2p("send", 1, 2, 7, 2e-3)])]
    b = [SectionRecord(0, "f", 0.0, 1.0, [_p2p("send", 0, 2, 0, 3e-3), _p2p("send", 1, 2, 0, 4e-3)])]
    c = [SectionRecord(0, "f", 0.0, 1.0, [_p2p("recv", 0, 0, 7, 20e-3), _p2p("recv", 1, 1, 0, 30e-3),
                                          _p2p("recv", 2, 0, 5, 10e-3), _p2p("recv", 3, 1, 0, 40e-3)])]  # fmt: skip
    out = pair_point_to_point({0: a, 1: b, 2: c})
    key = {r: [(x.group, x.group_seq, x.tag, x.duration_s) for x in out[r][0].collectives] for r in (0, 1, 2)}
    assert key[0] == [("p2p:0->2", 0, 5, 1e-3), ("p2p:0->2", 1, 7, 2e-3)]
    assert key[1] == [("p2p:1->2", 0, 0, 3e-3), ("p2p:1->2", 1, 0, 4e-3)]
    assert key[2] == [("p2p:0->2", 1, 7, 20e-3), ("p2p:1->2", 0, 0, 30e-3), ("p2p:0->2", 0, 5, 10e-3),
                      ("p2p:1->2", 1, 0, 40e-3)]  # fmt: skip
    aligned = align_collectives({0: a, 1: b, 2: c})  # the same seq on both ranks of each transfer
    seqs = {(r, x.group, x.tag, x.duration_s): x.seq for r in (0, 1, 2) for x in aligned[r][0].collectives}
    assert seqs[(0, "p2p:0->2", 7, 2e-3)] == seqs[(2, "p2p:0->2", 7, 20e-3)]
    assert seqs[(1, "p2p:1->2", 0, 4e-3)] == seqs[(2, "p2p:1->2", 0, 40e-3)]
    assert len(set(seqs.values())) == 4


def test_point_to_point_among_more_ranks_refuses_without_peers_or_with_unmatched_halves():
    send = [SectionRecord(2, "f", 0.0, 1.0, [_p2p("send", 0, None, None)])]
    recv = [SectionRecord(2, "f", 0.0, 1.0, [_p2p("recv", 0, 0, 0)])]
    none = [SectionRecord(2, "f", 0.0, 1.0, [])]
    with pytest.raises(SectionError, match=r"rank 0 iteration 2 section 'f': .*peer.*3 ranks.*record_shapes=True"):
        pair_point_to_point({0: send, 1: recv, 2: none})
    bad_peer = [SectionRecord(2, "f", 0.0, 1.0, [_p2p("send", 0, 5, 0)])]
    with pytest.raises(SectionError, match=r"rank 0 iteration 2 section 'f': .*peer is rank 5, not another rank"):
        pair_point_to_point({0: bad_peer, 1: recv, 2: none})
    other_tag = [SectionRecord(2, "f", 0.0, 1.0, [_p2p("send", 0, 1, 3)])]
    with pytest.raises(SectionError, match=r"iteration 2 section 'f': rank 0 sent 1 time\(s\) \(tag 3: 1\) to rank 1, "
                       r"rank 1 received 1 time\(s\) \(tag 0: 1\) from rank 0"):  # fmt: skip
        pair_point_to_point({0: other_tag, 1: recv, 2: none})
    to_two = [SectionRecord(2, "f", 0.0, 1.0, [_p2p("send", 0, 2, 0)])]
    with pytest.raises(SectionError, match=r"rank 0 sent 1 time\(s\) \(tag 0: 1\) to rank 2, rank 2 received 0"):
        pair_point_to_point({0: to_two, 1: none, 2: none})


def test_decompose_refuses_a_transfer_not_on_its_two_ranks():
    coll = pd.DataFrame({"rank": [0, 2], "iteration": 0, "section": "s", "seq": 0, "collective": "send_recv",
                         "duration_s": [0.5, 0.1], "payload_bytes": 8, "process_group": "p2p:0->1"})  # fmt: skip
    ranks = pd.DataFrame({"rank": [0, 1, 2], "iteration": 0, "section": "s", "warmup": False, "section_s": 1.0})
    with pytest.raises(DecompositionError, match=r"p2p:0->1 has rows on ranks \[0, 2\]"):
        decompose(ranks, coll)


def _prefetch_rank(rank: int, it: int, late_ms: float) -> list[Event]:
    """Section 'issue' computes then issues an all_reduce at its very end (gloo's worker starts it after the
    section closed on rank 1); section 'use' computes 20 ms then waits for it. Its gloo range ends ``late_ms``
    after 'use' starts (<= 0: before 'use' started)."""
    t0 = it * 200 * MS
    end_issue = t0 + (30 if rank == 0 else 60) * MS
    use0 = end_issue + MS // 5
    done = use0 + int(late_ms * MS)
    return [
        Event("issue", Kind.CPU, t0, end_issue, tid=1),
        Event("aten::mm", Kind.OP, t0, end_issue - MS // 2, tid=1),
        Event("c10d::allreduce_", Kind.OP, end_issue - 400_000, end_issue - 200_000, tid=1),
        Event("gloo:all_reduce", Kind.CPU, end_issue + (-100_000 if rank == 0 else 20_000), done, tid=9),
        Event("use", Kind.CPU, use0, use0 + 40 * MS, tid=1),
        Event("aten::mm", Kind.OP, use0, use0 + 20 * MS, tid=1),
    ]


def test_a_collective_issued_in_one_section_is_waited_in_the_next():
    per_rank = {0: [e for it in range(3) for e in _prefetch_rank(0, it, 35)],  # waits 15 ms in 'use'
                1: [e for it in range(3) for e in _prefetch_rank(1, it, 5)]}  # done during compute: hidden  # fmt: skip
    aligned, ranks, colls, table = _decompose(per_rank, ["issue", "use"])
    issue = colls[(colls[K.SECTION] == "issue") & (colls[K.ITERATION] == 1)]
    use = colls[(colls[K.SECTION] == "use") & (colls[K.ITERATION] == 1)].set_index(K.RANK)
    assert len(issue) == 2 and len(use) == 2  # placed by its c10d call on both ranks, not by the range start
    assert use.loc[0, K.BLOCKED_S] == pytest.approx(15e-3, abs=1e-6)  # waited from 20 ms to 35 ms into 'use'
    assert use.loc[1, K.BLOCKED_S] == 0.0
    r = ranks[ranks[K.ITERATION] == 1].set_index([K.SECTION, K.RANK])[K.COMM_S]
    assert r[("use", 0)] == pytest.approx(15e-3, abs=1e-6)
    assert r[("issue", 0)] == pytest.approx(0.2e-3, abs=1e-6)  # its call; in flight at the end: not waited there
    # on a rank where it ended before 'use' began, 'use' gets an entry blocked 0 s (the same duration)
    per_rank[1] = [e for it in range(3) for e in _prefetch_rank(1, it, -0.1)]
    aligned, ranks, colls, table = _decompose(per_rank, ["issue", "use"])
    use = colls[(colls[K.SECTION] == "use") & (colls[K.ITERATION] == 1)].set_index(K.RANK)
    assert use.loc[1, K.BLOCKED_S] == 0.0 and use.loc[1, K.DURATION_S] == pytest.approx(use.loc[1, K.DURATION_S])
    assert use.loc[0, K.BLOCKED_S] == pytest.approx(15e-3, abs=1e-6)


def test_placement_and_in_flight():
    a, b = Event("a", Kind.CPU, 0, 100), Event("b", Kind.CPU, 200, 300)
    w1 = Event("gloo:all_reduce", Kind.CPU, 105, 250)  # called in a, started after it: in a, in flight in b
    w2 = Event("gloo:all_reduce", Kind.CPU, 150, 160)  # called between sections: placed at its start
    place = placement([w1, w2], {id(w1): (90, 95), id(w2): (140, 145)}, [a, b])
    assert place == {id(w1): 90, id(w2): 150}
    assert in_flight([a, b], [w1, w2], place) == {id(a): [], id(b): [w1]}


def test_a_carried_entry_whose_issuing_occurrence_was_dropped_is_refused():
    carried = Collective(0, "all_reduce", 1e-3, 8, carried=(0, "issue", 0))
    recs = {r: [SectionRecord(1, "use", 0.0, 1.0, [carried])] for r in (0, 1)}
    with pytest.raises(SectionError, match=r"iteration 0 section 'issue' is waited in a later section"):
        align_collectives(recs)


def _nccl_pipeline_rank(rank: int, it: int) -> list[Event]:
    """The same 2-stage pipeline on CUDA: stage 0's 60 ms compute kernel, then its send; stage 1's receive (its
    SendRecv kernel waits for the sender from 1 ms on), then 20 ms of compute. Descriptors ``nccl:send`` /
    ``nccl:recv`` name the operation, the kernel ``ncclDevKernel_SendRecv``."""
    t0 = it * 100 * MS
    kernel = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    evs = [Event("forward", Kind.CPU, t0, t0 + 85 * MS, tid=1)]
    if rank == 0:
        evs += [Event("nccl:send", Kind.CPU, t0 + MS // 10, t0 + MS // 5, tid=1, collective="send", payload_bytes=4096),
                Event("void gemm_kernel", Kind.GPU, t0 + MS, t0 + 61 * MS, tid=7, launch_ns=t0 + 50_000),
                Event(kernel, Kind.GPU, t0 + 61 * MS, t0 + 61_020_000, tid=8, launch_ns=t0 + MS // 9)]  # fmt: skip
    else:
        evs += [Event("nccl:recv", Kind.CPU, t0 + MS // 10, t0 + MS // 5, tid=1, collective="recv", payload_bytes=4096),
                Event(kernel, Kind.GPU, t0 + MS, t0 + 61 * MS + 20_000, tid=8, launch_ns=t0 + MS // 10),
                Event("void gemm", Kind.GPU, t0 + 62 * MS, t0 + 82 * MS, tid=7, launch_ns=t0 + MS // 5)]  # fmt: skip
    return evs


def test_nccl_sendrecv_kernels_pair_and_the_receiver_waits():
    per_rank = {r: [e for it in range(3) for e in _nccl_pipeline_rank(r, it)] for r in (0, 1)}
    aligned, ranks, colls, table = _decompose(per_rank, ["forward"])
    c = colls[colls[K.ITERATION] == 1].set_index(K.RANK)
    assert (c[K.COLLECTIVE] == SEND_RECV).all()
    assert c.loc[1, K.BLOCKED_S] == pytest.approx(60.02e-3)  # the receiver's kernel, no compute beside it
    row = table[table[K.ITERATION] == 1].iloc[0]
    assert row[K.TRANSFER_S] == pytest.approx(0.02e-3)  # t_c: the sender's 20 us kernel
    assert row[K.WAIT_S] == pytest.approx((60.02e-3 - 0.02e-3) / 2)  # the receiver waited 60 ms, over 2 ranks
    (pair,) = pair_rates(aligned)
    assert pair["bytes"] == 3 * 4096 and pair["rate_gb_s"] == pytest.approx(4096 / 0.02e-3 / 1e9)


def _kineto_event(name: str, cat: str, ts: float, dur: float, args: str) -> str:
    """One event as Kineto writes it (key order, line breaks), ``args`` the text inside its args object."""
    return (f'  {{\n    "ph": "X", "cat": "{cat}",\n    "name": "{name}",\n    "pid": 7,\n    "tid": 7,\n'
            f'    "ts": {ts},\n    "dur": {dur}\n    ,\n    "args": {{\n      {args}\n    }}\n  }}')  # fmt: skip


def test_both_trace_readers_keep_the_peer_and_tag_of_send_and_recv(tmp_path):
    """The args of c10d::send / c10d::recv_ as torch 2.14 writes them with record_shapes (read off a real 3-rank
    gloo trace): the fast path and the exact ijson path keep the same peer and tag, exactly; a call recorded
    without shapes has none."""
    from pnpscale.analysis.trace.read import read_trace
    from pnpscale.analysis.trace.scan import scan_file, stream_events

    shapes = '"Input type": ["TensorList", "", "Scalar", "Scalar"], "Input Dims": [[[1000]], [], [], []]'
    events = [
        _kineto_event("step", "user_annotation", 1000.0, 900.0, '"External id": 1'),
        _kineto_event("c10d::recv_", "cpu_op", 1001.5, 231.304,
                      f'"External id": 2, "Concrete Inputs": ["", "", "0", "7"], {shapes}'),
        _kineto_event("gloo:recv", "cpu_op", 1001.6, 110.6, '"External id": 3, "Input Dims": [[1000]], '
                      '"Input type": ["float"]'),
        _kineto_event("c10d::send", "cpu_op", 1300.25, 68.348,
                      f'"External id": 4, "Concrete Inputs": ["", "", "2", "12"], {shapes}'),
        _kineto_event("gloo:send", "cpu_op", 1300.3, 10.0, '"External id": 5, "Input Dims": [[1000]], '
                      '"Input type": ["float"]'),
        _kineto_event("c10d::send", "cpu_op", 1500.0, 10.0, '"External id": 6'),
    ]  # fmt: skip
    path = tmp_path / "rank1.json"
    path.write_text('{\n  "schemaVersion": 1,\n  "distributedInfo": {"backend": "gloo", "rank": 1, "world_size": 3},\n'
                    '  "traceEvents": [\n' + ",\n".join(events) + "\n  ]\n}\n")  # fmt: skip
    fast = scan_file(path, {"step": "step"}, False)[0]
    exact = stream_events(path, {"step": "step"}, False, repair=False)[0]
    names = list(fast.op_names)
    got = {names[fast.op_name[i]] + f"@{fast.op_start[i]}": v for i, v in fast.op_p2p.items()}
    assert got == {"c10d::recv_@1001500": (0, 7), "c10d::send@1300250": (2, 12)}
    assert fast.op_p2p == exact.op_p2p
    ops = [e for e in read_trace(path, ["step"]).events if e.name.startswith("c10d::")]
    assert [(e.name, e.peer, e.tag) for e in ops] == [("c10d::recv_", 0, 7), ("c10d::send", 2, 12),
                                                      ("c10d::send", None, None)]  # fmt: skip
    # a listed process group that renumbers ranks: a call's peer is its group rank, its group unnamed: not read
    groups = ('"pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3]}, '
              '{"pg_name": "1", "pg_desc": "stage", "ranks": [1, 3]}]')  # fmt: skip
    path.write_text(path.read_text().replace('"world_size": 3}', f'"world_size": 4, {groups}}}'))
    anomalies = Anomalies()
    ops = [e for e in read_trace(path, ["step"], anomalies=anomalies, rank=1).events if e.name.startswith("c10d::")]
    assert [e.peer for e in ops] == [None, None, None] and [e.tag for e in ops] == [7, 12, None]
    (a,) = [a for a in anomalies.records() if a["kind"] == "p2p_peer_ambiguous"]
    assert a["count"] == 2 and "process group '1' holds ranks [1, 3]" in a["example"]


def test_collective_log_names_each_calls_process_group(monkeypatch):
    """pnpscale's own runs: the process group of each torch.distributed call (its ``group`` argument, by keyword or
    position; the default group's name when none), given to the k-th range of its type."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from pnpscale.rank.profiling import CollectiveLog, attach_groups

    class Group:
        def __init__(self, name: str) -> None:
            self.group_name = name

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    def broadcast(tensor, src=0, group=None, async_op=False):
        return None

    for module in (dist, c10d):
        monkeypatch.setattr(module, "all_reduce", all_reduce)
        monkeypatch.setattr(module, "broadcast", broadcast)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # no default group here: its name unknown
    with CollectiveLog() as log:
        dist.all_reduce(torch.zeros(2), group=Group("3"))
        dist.broadcast(torch.zeros(2), 0, Group("5"))  # positional
        dist.all_reduce(torch.zeros(2))  # the default group
    assert log.calls == [("all_reduce", 8), ("broadcast", 8), ("all_reduce", 8)]
    assert log.groups == ["3", "5", None]
    ranges = [Event("gloo:all_reduce", Kind.CPU, 10, 20, collective="all_reduce"),
              Event("gloo:broadcast", Kind.CPU, 30, 40, collective="broadcast"),
              Event("gloo:all_reduce", Kind.CPU, 50, 60, collective="all_reduce")]  # fmt: skip
    assert [e.group for e in attach_groups(ranges, log.calls, log.groups)] == ["3", "5", None]
    assert [e.group for e in attach_groups(ranges[:1], log.calls, log.groups)] == [None]  # 1 range, 2 calls
    rows = rank_rows(0, [SectionRecord(0, "s", 0.0, 1.0, [Collective(0, "all_reduce", 1e-3, 8, group="3")])], 0)
    assert rows["collectives"][0][K.PROCESS_GROUP] == "3"
