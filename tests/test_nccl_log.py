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


# --- NCCL 2.7 ... 2.30: the printf formats of each version's sources --------------------------------------
# Lines are built from the INFO() formats of NCCL's src/init.cc, src/enqueue.cc, src/graph/rings.cc,
# src/graph/paths.cc, src/transport/{net,p2p,shm}.cc, src/scheduler/symmetric_sched.cc and src/ce_coll.cc
# (tags v2.7.8-1, v2.12.12-1, v2.18.3-1, v2.21.5-1, v2.27.7-1, v2.29.7-1, v2.30.7-1), with the prefixes seen
# in public issue threads (hosts and addresses replaced).


def _mpi(rank: int, host: str, dev: int) -> str:
    """Open MPI's --tag-output prefix before NCCL's own (as pasted in NVIDIA/nccl issue threads)."""
    return f"[1,{rank}]<stdout>:{host}:{4000 + rank}:{4100 + rank} [{dev}] NCCL INFO "


def _log_2_7(rank: int, host: str) -> list[str]:
    """NCCL 2.7.8 (v2.7.8-1): channels and connections printed before the only communicator line."""
    p = _mpi(rank, host, rank % 8)
    lines = [
        p + "NCCL version 2.7.8+cuda11.0",
        p + "Channel 00/02 :    0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15",  # rings.cc
        p + "Channel 01/02 :    0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15",
        p + "Channel 00 : 0[6000] -> 1[7000] via P2P/IPC",  # p2p.cc: "Channel %02d : %d[%lx] -> %d[%lx] via P2P/IPC%s"
        p + "Channel 00 : 1[7000] -> 2[8000] via direct shared memory",  # shm.cc (2.7)
        p + "Channel 00 : 7[b000] -> 8[1000] [send] via NET/IB/0/GDRDMA",  # net.cc: "... [send] via NET/%s/%d%s"
        p + "Channel 00 : 15[b000] -> 0[6000] [receive] via NET/IB/0/GDRDMA",
        p + "2 coll channels, 2 p2p channels, 2 p2p channels per peer",  # paths.cc
        p + f"comm 0x7f3c20001c40 rank {rank} nranks 16 cudaDev {rank % 8} busId 6000 - Init COMPLETE",
        # COLL: a collective call, which names its communicator but creates none
        p + "AllReduce: opCount 0 sendbuff 0x7f3b5c000000 recvbuff 0x7f3b5c000000 count 262144 datatype 7 op 0 "
        "root 0 comm 0x7f3c20001c40 [nranks=16] stream 0x55d0a1e2f3b0",
    ]
    return lines


def test_nccl_2_7_channels_before_the_communicator_mpi_prefix_hosts_and_old_connections():
    logs = [parse_nccl_log(_log_2_7(r, "node-a01" if r < 8 else "node-b07")) for r in range(16)]
    log = logs[0]
    assert log.version == "2.7.8"
    (comm,) = log.communicators  # the opCount line made none
    assert (comm.comm, comm.rank, comm.nranks, comm.nnodes, comm.channels) == ("0x7f3c20001c40", 0, 16, None, 2)
    assert dict(log.transports) == {"P2P": 1, "SHM": 1, "NET/IB GDRDMA": 2}
    assert log.hosts == {"node-a01"}
    merged = merge_logs(logs)
    assert merged.largest().nnodes == 2  # the hosts behind the MPI prefix, counted
    assert merged.transport_label(True) == "NET/IB GDRDMA"
    choice = algorithm_for(merged, "all_reduce", 1 << 20)
    assert choice.algorithm is None and "2.7.8 does not log the per-collective algorithm" in choice.note


def test_nccl_before_2_7_ring_connection_lines():
    log = parse_nccl_log([P + "NCCL version 2.5.6+cuda10.1", P + "Ring 00 : 7 -> 8 [send] via NET/IB/0/GDRDMA",
                          P + "Ring 00 : 0[0] -> 1[1] via P2P/IPC", P + "Ring 00 : 0 -> 1 -> 2"])  # fmt: skip
    assert dict(log.transports) == {"NET/IB GDRDMA": 1, "P2P": 1}  # the GRAPH ring line is no connection


def test_nccl_2_12_and_2_18_connection_index_shm_and_init_start():
    p = P
    lines_2_12 = [
        p + "NCCL version 2.12.12+cuda11.7",
        p + "Channel 00/04 :    0   1   2   3",
        p + "Channel 00/0 : 0[1b000] -> 1[1c000] via P2P/IPC/read",  # p2p.cc 2.12: "Channel %02d/%01d : ..."
        p + "Channel 01/1 : 0[1b000] -> 1[1c000] via P2P/IPC/read",
        p + "Channel 00 : 2[3d000] -> 3[3e000] via SHM/direct/direct",  # shm.cc: no connection index
        p + "4 coll channels, 4 p2p channels, 2 p2p channels per peer",
        p + "comm 0x55d0 rank 0 nranks 4 cudaDev 0 busId 1b000 - Init COMPLETE",
    ]
    log = parse_nccl_log(lines_2_12)
    assert log.communicators[0].channels == 4 and dict(log.transports) == {"P2P": 2, "SHM": 1}
    lines_2_18 = [
        p + "NCCL version 2.18.3+cuda12.2",
        p + "comm 0x61a0 rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 18000 commId 0x9c2f - Init START",
        p + "Channel 00/24 :    0   1   2   3   4   5   6   7",
        p + "24 coll channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer",
        p + "comm 0x61a0 rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 18000 commId 0x9c2f - Init COMPLETE",
        # a second communicator (a process-group split): its channels come before its own line
        p + "Channel 00/02 :    0   1",
        p + "2 coll channels, 0 nvls channels, 2 p2p channels, 2 p2p channels per peer",
        p + "comm 0x7b00 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 commId 0x1d3e - Init COMPLETE",
    ]
    log = parse_nccl_log(lines_2_18)
    assert [(c.comm, c.nranks, c.channels) for c in log.communicators] == [("0x61a0", 8, 24), ("0x7b00", 2, 2)]


def test_nccl_2_27_to_2_30_symmetric_and_copy_engine_records():
    lines = [
        P + "NCCL version 2.30.7+cuda13.0",
        P + "comm 0xa1 rank 0 nRanks 8 nNodes 1 localRanks 8 localRank 0 MNNVL 0",
        P + "AllReduce: 8388608 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..31}",
        # scheduler/symmetric_sched.cc (2.28+; 2.27 without nWorks)
        P + "AllReduce [Symmetric]: 4096 Bytes -> Kernel AllReduce_AGxLLMC_R nchannels 4 nthreads 512 nWorks 1",
        P + "AllGather [Symmetric]: 65536 Bytes -> Kernel AllGather_LLMC nchannels 8 nthreads 512",
        # ce_coll.cc (2.29+, 2.30)
        P + "AllGather [Copy Engine]: 1048576 Bytes -> cudaMemcpyBatchAsync",
        P + "AllReduce [Hierarchical CE]: 2097152 Bytes -> RMA proxy + CE",
    ]
    log = parse_nccl_log(lines)
    got = [(r.collective, r.size_bytes, r.algorithm, r.protocol, r.kernel) for r in log.tuning]
    assert got == [
        ("all_reduce", 8388608, "ring", "simple", None),
        ("all_reduce", 4096, "symmetric", None, "AllReduce_AGxLLMC_R"),
        ("all_gather", 65536, "symmetric", None, "AllGather_LLMC"),
        ("all_gather", 1048576, "copy_engine", None, None),
        ("all_reduce", 2097152, "hierarchical_ce", None, None),
    ]
    choice = algorithm_for(log, "all_reduce", 4096)
    assert (choice.algorithm, choice.protocol) == ("symmetric", None)


def test_damaged_tuning_lines_never_yield_an_algorithm_and_are_named():
    lines = [
        P + "NCCL version 2.21.5+cuda12.4",
        P + "805306368 Bytes -> Algo -1 proto -1 time -1.000000",  # no algorithm chosen
        P + "805306368 Bytes -> Algo 1 pro",  # cut
        P
        + "AllReduce: 805306368 Bytes -> Al"
        + P
        + "comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0",
    ]
    log = parse_nccl_log(lines)
    assert log.tuning == () and log.damaged == 3
    assert log.communicators[0].nranks == 2  # the record behind the damaged one on its line is read
    choice = algorithm_for(log, "all_reduce", 805306368)
    assert choice.algorithm is None and "3 TUNING line(s) are damaged" in choice.note


def test_srun_label_prefix_counts_hosts():
    lines = [f"{r}: node-c{r // 4:02d}:{100 + r}:{200 + r} [{r % 4}] NCCL INFO comm 0xf rank {r} nranks 8 cudaDev "
             f"{r % 4} busId 1000 - Init COMPLETE" for r in range(8)]  # fmt: skip
    merged = merge_logs([parse_nccl_log([line]) for line in lines])
    assert merged.hosts == {"node-c00", "node-c01"} and merged.largest().nnodes == 2


def test_mpirun_log_of_every_rank_in_one_file_counts_its_hosts():
    # Open MPI's --tag-output: every rank's lines in one file; NCCL < 2.20 prints no nNodes
    lines = [
        f"[1,{r}]<stdout>:node-{'a' if r < 4 else 'b'}:{300 + r}:{400 + r} [{r % 4}] NCCL INFO comm 0xe rank {r} "
        f"nranks 8 cudaDev {r % 4} busId 1000 - Init COMPLETE"
        for r in range(8)
    ]
    merged = merge_logs([parse_nccl_log(lines)])
    assert merged.hosts == {"node-a", "node-b"} and len(merged.processes) == 8
    assert merged.largest().nnodes == 2
    # rank 0's lines alone: the other ranks' hosts cannot be vouched for
    assert merge_logs([parse_nccl_log(lines[:1])]).largest().nnodes is None


@pytest.mark.parametrize(
    "damaged",
    [
        "805306368 Bytes -> Algo 7 proto 3 time nan",  # ids NCCL never prints, a time that is not one
        "805306368 Bytes -> Algo 1 proto 2 time nan",
        "805306368 Bytes -> Algo 1 proto 9 time 3.5",
        "AllReduce: 805306368 Bytes -> Algo BOGUS proto SIMPLE channel{Lo..Hi}={0..1}",
    ],
)
def test_tuning_line_with_impossible_values_is_damaged(damaged):
    log = parse_nccl_log([P + "NCCL version 2.21.5+cuda12.4", P + damaged])
    assert log.tuning == () and log.damaged == 1
    choice = algorithm_for(log, "all_reduce", 805306368)
    assert choice.algorithm is None and "damaged" in choice.note
