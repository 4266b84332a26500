"""NCCL log parsing (pnpscale.nccl_log) on lines written for these tests in each version's format."""

from __future__ import annotations

import pytest

from pnpscale.analysis.nccl_log import (
    Communicator,
    TuningRecord,
    algorithm_for,
    merge_logs,
    parse_nccl_log,
    parse_tuning_line,
    version_tuple,
)

P = "gpu-a01:4242:4300 [0] NCCL INFO "  # the prefix NCCL puts before every message

# NCCL 2.20-2.22: no collective name, numeric algorithm and protocol, predicted time
LOG_2_21 = [
    P + "NCCL version 2.21.5+cuda12.4",
    P + "comm 0x5617a0 rank 0 nRanks 8 nNodes 2 localRanks 4 localRank 0 MNNVL 0",
    P + "Channel 00/04 :    0   1   2   3   4   5   6   7",
    P + "Channel 01/04 :    0   1   2   3   4   5   6   7",
    P + "Trees [0] 1/4/-1->0->-1 [1] 1/-1/-1->0->4",
    P + "4 coll channels, 4 collnet channels, 0 nvls channels, 4 p2p channels, 1 p2p channels per peer",
    P + "ncclCommInitRank comm 0x5617a0 rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 1b000 commId 0x77 - Init COMPLETE",
    P + "805306368 Bytes -> Algo 0 proto 2 time 47391.250000",
    P + "8 Bytes -> Algo 1 proto 0 time 12.000000",
    P + "805306368 Bytes -> Algo 0 proto 2 time 47388.125000",
]

# NCCL 2.23: collective name added, still numeric
LOG_2_23 = [
    P + "NCCL version 2.23.4+cuda12.6",
    P + "comm 0xabc rank 0 nRanks 16 nNodes 4 localRanks 4 localRank 0 MNNVL 0",
    P + "AllReduce: 805306368 Bytes -> Algo 1 proto 2 time 150123.500000",
    P + "Broadcast: 32 Bytes -> Algo 1 proto 0 time 6.500000",
    P + "AllGather: 65536 Bytes -> Algo 6 proto 2 time 30.000000",
]

# NCCL >= 2.24: names instead of ids, channel range instead of time
LOG_2_26 = [
    P + "NCCL version 2.26.2+cuda12.8",
    P + "comm 0xdef rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0",
    P + "24 coll channels, 24 collnet channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer",
    P + "AllReduce: 805306368 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..23}",
    P + "ReduceScatter: 4096 Bytes -> Algo PAT proto LL channel{Lo..Hi}={0..0}",
    P + "AllReduce: 1024 Bytes -> Algo NVLS_TREE proto LL128 channel{Lo..Hi}={0..3}",
]


def test_tuning_lines_of_2_20_to_2_22():
    log = parse_nccl_log(LOG_2_21)
    assert log.version == "2.21.5"
    assert log.tuning[0] == TuningRecord(None, 805306368, "tree", "simple", 47391.25, None, 8)
    assert [(r.algorithm, r.protocol, r.size_bytes) for r in log.tuning[1:]] == [
        ("ring", "ll", 8),
        ("tree", "simple", 805306368),
    ]


def test_tuning_lines_of_2_23():
    log = parse_nccl_log(LOG_2_23)
    assert [(r.collective, r.size_bytes, r.algorithm, r.protocol, r.time_us) for r in log.tuning] == [
        ("all_reduce", 805306368, "ring", "simple", 150123.5),
        ("broadcast", 32, "ring", "ll", 6.5),
        ("all_gather", 65536, "pat", "simple", 30.0),
    ]


def test_tuning_lines_of_2_24_and_later():
    log = parse_nccl_log(LOG_2_26)
    assert [(r.collective, r.algorithm, r.protocol, r.channels, r.time_us) for r in log.tuning] == [
        ("all_reduce", "ring", "simple", (0, 23), None),
        ("reduce_scatter", "pat", "ll", (0, 0), None),
        ("all_reduce", "nvls_tree", "ll128", (0, 3), None),
    ]


def test_init_topology_ranks_nodes_channels():
    log = parse_nccl_log(LOG_2_21)
    assert log.communicators == (Communicator("0x5617a0", rank=0, nranks=8, nnodes=2, local_ranks=4, channels=4),)
    assert parse_nccl_log(LOG_2_26).largest() == Communicator("0xdef", 0, 4, 1, 4, 24)
    # Channel cc/CC lines alone give the channel count
    only_channels = parse_nccl_log([P + "comm 0x1 rank 1 nRanks 2 nNodes 1 localRanks 2", P + "Channel 01/02 : 0 1"])
    assert only_channels.communicators[0].channels == 2 and only_channels.communicators[0].nnodes == 1


def test_non_tuning_lines_are_ignored():
    assert parse_tuning_line(P + "AllReduce: opCount 3 sendbuff 0x7f recvbuff 0x7f count 1024 datatype 7") is None
    assert parse_tuning_line(P + "Ring 00 : 0 -> 1 -> 2 -> 3") is None
    assert parse_nccl_log([]).tuning == () and parse_nccl_log([]).largest() is None


def test_algorithm_for_the_main_collective_size():
    choice = algorithm_for(parse_nccl_log(LOG_2_23), "all_reduce", 805306368)
    assert (choice.algorithm, choice.protocol, choice.calls, choice.note) == ("ring", "simple", 1, "")
    # 2.20-2.22 lines carry no collective: matched by size, and the note says so
    old = algorithm_for(parse_nccl_log(LOG_2_21), "all_reduce", 805306368)
    assert old.algorithm == "tree" and old.calls == 2 and "matched by size only" in old.note
    # a collective type that the line names differently does not match
    assert algorithm_for(parse_nccl_log(LOG_2_23), "broadcast", 805306368).algorithm is None


def test_disagreeing_calls_use_the_majority_and_say_so():
    lines = [P + f"AllReduce: 4096 Bytes -> Algo {a} proto 2 time 1.0" for a in (1, 1, 0)]
    choice = algorithm_for(parse_nccl_log(lines), "all_reduce", 4096)
    assert choice.algorithm == "ring" and choice.calls == 3
    assert choice.note == "NCCL chose ring for 2, tree for 1 calls; majority used"


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        ([P + "NCCL version 2.17.1+cuda11.8"], "NCCL 2.17.1 does not log the per-collective algorithm"),
        ([P + "NCCL version 2.21.5+cuda12.4"], "no TUNING lines in the NCCL log"),
        (LOG_2_23, "no TUNING line for all_reduce of 12 bytes"),
    ],
)
def test_no_algorithm_says_why(lines, reason):
    choice = algorithm_for(parse_nccl_log(lines), "all_reduce", 12)
    assert choice.algorithm is None and choice.calls == 0 and reason in choice.note


def test_merge_and_version_tuple():
    merged = merge_logs([parse_nccl_log(LOG_2_26[:2]), parse_nccl_log(LOG_2_26)])
    assert merged.version == "2.26.2" and len(merged.communicators) == 1 and len(merged.tuning) == 3
    assert version_tuple("2.26.2+cuda12.8") == (2, 26, 2) and version_tuple("garbage") is None
