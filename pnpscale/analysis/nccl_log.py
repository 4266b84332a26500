"""NCCL debug logs -> topology and the algorithm NCCL chose per collective size (pure).

Run NCCL with ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH,TUNING`` (one file per rank through
``NCCL_DEBUG_FILE``); rank 0 of each communicator prints the choices. Lines look like
``host:pid:tid [dev] NCCL INFO <message>``, possibly behind a launcher's prefix (Open MPI's
``[1,15]<stdout>:``, ``srun --label``'s ``15: ``); the parser reads the message, and the host of the prefix
for the node count. Formats read, NCCL 2.7 to 2.30 (the ``printf`` formats of ``src/enqueue.cc``,
``src/init.cc``, ``src/graph/*.cc``, ``src/transport/*.cc``, ``src/scheduler/symmetric_sched.cc``,
``src/ce_coll.cc`` of each version):

* TUNING, NCCL 2.20-2.22: ``%ld Bytes -> Algo %d proto %d time %f`` (no collective name);
* TUNING, NCCL 2.23: ``%s: %ld Bytes -> Algo %d proto %d time %f``;
* TUNING, NCCL >= 2.24: ``%s: %ld Bytes -> Algo %s proto %s channel{Lo..Hi}={%d..%d}``;
  algorithm ids 0 Tree, 1 Ring, 2 CollNetDirect, 3 CollNetChain, 4 NVLS, 5 NVLSTree, 6 PAT;
  protocol ids 0 LL, 1 LL128, 2 Simple;
* TUNING, NCCL >= 2.27 symmetric kernels: ``%s [Symmetric]: %ld Bytes -> Kernel %s nchannels %d nthreads
  %d[ nWorks %d]`` (algorithm ``symmetric``, the kernel in ``kernel``); NCCL >= 2.29 copy-engine
  collectives: ``%s [Copy Engine]: %ld Bytes -> cudaMemcpy%s`` (``copy_engine``), NCCL 2.30 ``%s
  [Hierarchical CE]: %ld Bytes -> RMA proxy + CE`` (``hierarchical_ce``);
* a line that looks like a TUNING record (``Bytes ->``) but does not parse (cut, interleaved, ``Algo -1``)
  never yields an algorithm: it is counted (``NcclLog.damaged``) and named by :func:`algorithm_for`;
* COLL (``%s: opCount %lx sendbuff %p ... comm %p [nranks=%d] stream %p``): a collective call, never a
  communicator;
* INIT: ``NCCL version X.Y.Z``; ``comm %p rank %d nRanks %d nNodes %d localRanks %d ...`` (2.20+, printed
  before the channels) or only ``comm %p rank %d nranks %d cudaDev %d ... - Init COMPLETE`` (before 2.19:
  printed after them; without ``nNodes`` the node count is the number of distinct hosts of the merged
  logs); ``%d coll channels, ...`` and ring listings ``Channel %02d/%02d : 0 1 2 3`` (the channel count,
  given to the communicator that is open, else kept for the next communicator line); connection lines
  give the transport of each connection: ``Channel %02d/%d : %d[%d] -> %d[%d] via P2P/CUMEM/read``
  (>= 2.12; ``%d`` after ``/`` is a connection index, never a channel count), ``Channel %02d : %d[%lx]
  -> %d[%lx] via P2P/IPC`` (2.7-2.11, and SHM's lines in every version), ``Ring %02d : %d -> %d [send]
  via NET/IB/0/GDRDMA`` (before 2.7): ``P2P`` (``CUMEM``, ``IPC``, ``direct pointer``), ``SHM`` (also
  2.7's ``direct shared memory``), ``NET/IB``, ``NET/Socket``, with ``GDRDMA``;
* GRAPH: ``Pattern p, crossNic c, nChannels n, bw a/b, type NVL/PIX, ...``: ``NVL`` = NVLink.

Two records written on one line (interleaved writes) are both read: a line is split at every
``NCCL INFO``/``NCCL WARN``.

Before NCCL 2.20 the per-collective choice is not logged at INFO level: :func:`algorithm_for` then
says so instead of guessing. Names are normalised to lower case (``ring``, ``tree``, ``simple``),
collectives to pnpscale's names (``all_reduce``...).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from pnpscale.analysis.kineto import collective_type

#: NCCL algorithm ids (``NCCL_ALGO_*``) -> lower-case names.
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
#: NCCL protocol ids (``NCCL_PROTO_*``) -> lower-case names.
PROTOCOLS = ("ll", "ll128", "simple")
#: first NCCL version that logs the algorithm of every collective at INFO level (TUNING).
FIRST_TUNING_VERSION = (2, 20)

_TUNING = re.compile(
    r"(?:\b(?P<coll>[A-Za-z]+):\s+)?(?P<bytes>\d+)\s+Bytes\s+->\s+Algo\s+(?P<algo>\w+)\s+proto\s+(?P<proto>\w+)"
    r"(?:\s+time\s+(?P<time>[-+0-9.eE]+))?"
    r"(?:\s+channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\})?"
)
#: NCCL >= 2.27 symmetric kernels, >= 2.29 copy-engine collectives: ``%s [Kind]: %ld Bytes -> ...``
_TUNING_SPECIAL = re.compile(
    r"\b(?P<coll>[A-Za-z]+)\s+\[(?P<kind>Symmetric|Copy Engine|Hierarchical CE)\]:\s+(?P<bytes>\d+)\s+Bytes\s+->\s+"
    r"(?:Kernel\s+(?P<kernel>\S+))?"
)
_LOOKS_TUNING = re.compile(r"\d\s+Bytes\s+->")
_VERSION = re.compile(r"NCCL version (\d+(?:\.\d+)+)")
_COMM = re.compile(r"\bcomm (0x[0-9a-fA-F]+)")
_COMM_FIELDS = re.compile(r"\b(rank|nranks|nRanks|nNodes|localRanks)\s+(\d+)")
_COLL_CHANNELS = re.compile(r"\b(\d+) coll channels")
_RING_LISTING = re.compile(r"\bChannel \d+/(\d+)\s*:(?:\s+\d+)+\s*$")
_CONNECTION = re.compile(
    r"\b(?:Channel|Ring) \d+(?:/\d+)?\s*:\s*\d+(?:\[[^\]]*\])?\s*->\s*\d+(?:\[[^\]]*\])?.*?\bvia\s+"
    r"(\S+(?: pointer| shared memory)?)"
)
_GRAPH_TYPE = re.compile(r"\bnChannels \d+,.*?\btype (\w+)/(\w+)")
_RECORD_SPLIT = re.compile(r"NCCL (?:INFO|WARN) ")
#: a launcher's prefix before NCCL's own: Open MPI ``[1,15]<stdout>:``, ``srun --label`` ``15: ``
_LAUNCHER = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:|\d+:\s+)")
_HOST = re.compile(r"^\s*([^\s:]+):(\d+):\d+ \[\d+\]")
#: a finite, non-negative number (NCCL's predicted time in us)
_TIME_AFTER = re.compile(r"\s+time\s+([-+]?(?:[0-9.]+(?:[eE][-+]?\d+)?|[A-Za-z]+))")


@dataclass(frozen=True)
class TuningRecord:
    """One TUNING line: the algorithm and protocol NCCL chose for one collective call.

    Attributes:
        collective: pnpscale collective name, ``None`` when the line has none (NCCL 2.20-2.22).
        size_bytes: NCCL's message size in bytes (``count x type size``; for all_reduce the payload).
        algorithm, protocol: lower-case names (``ring``, ``simple``); ``symmetric``, ``copy_engine`` or
            ``hierarchical_ce`` with protocol ``None`` for NCCL's symmetric-kernel and copy-engine records.
        time_us: NCCL's predicted time in microseconds (2.20-2.23), else ``None``.
        channels: ``(lo, hi)`` channel range (>= 2.24), else ``None``.
        line: 1-based line number in the log.
        kernel: the symmetric kernel NCCL ran (``AllReduce_RSxLD_AGxST``), else ``None``.
    """

    collective: str | None
    size_bytes: int
    algorithm: str
    protocol: str | None
    time_us: float | None = None
    channels: tuple[int, int] | None = None
    line: int = 0
    kernel: str | None = None


@dataclass(frozen=True)
class Communicator:
    """One communicator's INIT facts (``None`` where the log does not say).

    Attributes:
        comm: NCCL's communicator address (``0x...``), rank, nranks, nnodes, local_ranks as logged;
        channels: collective channels (``C coll channels`` or the ``Channel cc/CC`` lines).
    """

    comm: str
    rank: int | None = None
    nranks: int | None = None
    nnodes: int | None = None
    local_ranks: int | None = None
    channels: int | None = None


def transport_kind(via: str) -> str:
    """Transport of a connection from the text after ``via``.

    >>> [transport_kind(v) for v in ("P2P/CUMEM/read", "P2P/IPC", "SHM/direct/direct", "NET/IB/1/GDRDMA",
    ...                              "NET/Socket/0", "direct shared memory")]
    ['P2P', 'P2P', 'SHM', 'NET/IB GDRDMA', 'NET/Socket', 'SHM']
    """
    if via.endswith("shared memory"):
        return "SHM"
    parts = via.split("/")
    kind = parts[0].upper()
    if kind == "NET" and len(parts) > 1:
        kind = f"NET/{parts[1]}"
    return f"{kind} GDRDMA" if "GDRDMA" in via.upper() else kind


@dataclass(frozen=True)
class NcclLog:
    """What one (or several merged) NCCL logs say.

    Attributes:
        version: ``"2.21.5"`` or ``None``; communicators: INIT facts per communicator, in order of
        appearance; tuning: every TUNING record, in order. transports: (transport kind, number of
        connections), most frequent first (:func:`transport_kind`). link_types: GRAPH ``type``
        values (``NVL``, ``PIX``, ``SYS``...). hosts: host names of the line prefixes. lines: lines read.
        damaged: lines that look like TUNING records but do not parse (never an algorithm).
        processes: ``(host, pid)`` of the line prefixes: the ranks whose lines the log holds (an ``mpirun``
        log holds every rank's in one file).
    """

    version: str | None
    communicators: tuple[Communicator, ...]
    tuning: tuple[TuningRecord, ...]
    transports: tuple[tuple[str, int], ...] = ()
    link_types: frozenset[str] = frozenset()
    hosts: frozenset[str] = frozenset()
    lines: int = 0
    damaged: int = 0
    processes: frozenset[tuple[str, int]] = frozenset()

    def transport_label(self, inter_node: bool) -> str | None:
        """How collectives travel, for route names: intra-node ``"NVLink P2P"``, ``"P2P"`` or ``"SHM"``;
        inter-node the most used ``NET/...`` transport; ``None`` when the log shows no connection."""
        if inter_node:
            return next((k for k, _ in self.transports if k.startswith("NET/")), None)
        kind = next((k for k, _ in self.transports if not k.startswith("NET/")), None)
        if kind == "P2P" and "NVL" in self.link_types:
            return "NVLink P2P"
        return kind

    def largest(self) -> Communicator | None:
        """The communicator with the most ranks (the world communicator of a job), if any."""
        known = [c for c in self.communicators if c.nranks is not None]
        return max(known, key=lambda c: c.nranks or 0) if known else None


@dataclass(frozen=True)
class AlgorithmChoice:
    """The algorithm NCCL reported for one collective size, or why there is none.

    Attributes:
        algorithm, protocol: lower-case names, ``None`` when the log does not say.
        calls: TUNING lines that matched; note: one line for tables (``""`` when unambiguous).
    """

    algorithm: str | None
    protocol: str | None
    calls: int
    note: str


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"2.21.5+cuda12.4"`` -> ``(2, 21, 5)``; ``None`` when unparseable.

    >>> version_tuple("2.21.5+cuda12.4"), version_tuple(None)
    ((2, 21, 5), None)
    """
    if not version:
        return None
    m = re.match(r"(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _name(token: str, names: Sequence[str]) -> str | None:
    """An algorithm or protocol name from its id (``1``) or name (``RING``); ``None`` for one NCCL never
    prints (an id past the table, an unknown name: a damaged line)."""
    if token.isdigit():
        i = int(token)
        return names[i] if i < len(names) else None
    low = token.lower()
    return low if low in names else None


def parse_tuning_line(line: str, number: int = 0) -> TuningRecord | None:
    """One TUNING record from a log line of any supported NCCL version, else ``None``.

    >>> parse_tuning_line("h:1:2 [0] NCCL INFO 1048576 Bytes -> Algo 1 proto 2 time 36.5")
    TuningRecord(collective=None, size_bytes=1048576, algorithm='ring', protocol='simple', time_us=36.5, \
channels=None, line=0, kernel=None)
    >>> parse_tuning_line("NCCL INFO AllReduce: 64 Bytes -> Algo TREE proto LL channel{Lo..Hi}={0..1}").channels
    (0, 1)
    >>> r = parse_tuning_line("AllReduce [Symmetric]: 4096 Bytes -> Kernel AllReduce_AGxLL_R nchannels 4 nthreads 512")
    >>> (r.collective, r.algorithm, r.protocol, r.kernel)
    ('all_reduce', 'symmetric', None, 'AllReduce_AGxLL_R')

    A damaged line (an algorithm or protocol id or name NCCL never prints, a time that is not a finite
    non-negative number) gives ``None``, never an algorithm:

    >>> parse_tuning_line("NCCL INFO 1048576 Bytes -> Algo 7 proto 3 time nan") is None
    True
    """
    m = _TUNING.search(line)
    if m:
        coll = m.group("coll")
        lo, hi = m.group("lo"), m.group("hi")
        algo, proto = _name(m.group("algo"), ALGORITHMS), _name(m.group("proto"), PROTOCOLS)
        t = _TIME_AFTER.match(line, m.end("proto"))
        time_us = _finite(t.group(1)) if t else None
        if algo is None or proto is None or (t is not None and time_us is None):
            return None
        return TuningRecord(
            collective=(collective_type(coll) or coll.lower()) if coll else None,
            size_bytes=int(m.group("bytes")),
            algorithm=algo,
            protocol=proto,
            time_us=time_us,
            channels=(int(lo), int(hi)) if lo is not None else None,
            line=number,
        )
    m = _TUNING_SPECIAL.search(line)
    if m is None:
        return None
    coll = m.group("coll")
    return TuningRecord(
        collective=collective_type(coll) or coll.lower(),
        size_bytes=int(m.group("bytes")),
        algorithm=m.group("kind").lower().replace(" ", "_"),
        protocol=None,
        line=number,
        kernel=m.group("kernel"),
    )


def _finite(text: str) -> float | None:
    """A finite, non-negative float from ``text``, else ``None`` (``nan``, ``inf``, ``-1``, a cut number)."""
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def parse_nccl_log(lines: Iterable[str]) -> NcclLog:
    """Parse the lines of one NCCL log (INIT, GRAPH and TUNING subsystems; other lines ignored).

    Channel counts (``C coll channels``, ``Channel cc/CC``) carry no communicator address: they go to
    the communicator that is open (named by a line other than ``Init COMPLETE``, which closes it),
    else to the next communicator line (before NCCL 2.19 the only one, printed after the channels).

    Args:
        lines: the log's lines (a file object works).

    Returns:
        :class:`NcclLog`.
    """
    version: str | None = None
    comms: dict[str, dict[str, int | None]] = {}
    from_coll_line: set[str] = set()
    current: str | None = None
    pending: dict[str, int] = {}  # channel counts seen while no communicator is open: "coll", "ring"
    tuning: list[TuningRecord] = []
    transports: Counter[str] = Counter()
    link_types: set[str] = set()
    hosts: set[str] = set()
    processes: set[tuple[str, int]] = set()
    damaged = 0
    number = 0
    for number, line in enumerate(lines, start=1):
        line = _LAUNCHER.sub("", line, count=1)
        if m := _HOST.match(line):
            hosts.add(m.group(1))
            processes.add((m.group(1), int(m.group(2))))
        parts = _RECORD_SPLIT.split(line)
        for msg in parts[1:] if len(parts) > 1 else parts:
            rec = parse_tuning_line(msg, number)
            if rec is not None:
                tuning.append(rec)
                continue
            if _LOOKS_TUNING.search(msg):
                damaged += 1
                continue
            if version is None and (m := _VERSION.search(msg)):
                version = m.group(1)
                continue
            if m := _CONNECTION.search(msg):
                transports[transport_kind(m.group(1))] += 1
                continue
            if m := _GRAPH_TYPE.search(msg):
                link_types.update((m.group(1), m.group(2)))
                continue
            if "opCount" in msg:  # a collective call (COLL), which names its communicator
                continue
            if m := _COMM.search(msg):
                comm = m.group(1)
                fields = comms.setdefault(comm, {})
                for key, value in _COMM_FIELDS.findall(msg):
                    key = {"nRanks": "nranks", "nNodes": "nnodes", "localRanks": "local_ranks"}.get(key, key)
                    fields[key] = int(value)
                if pending and fields.get("channels") is None:
                    fields["channels"] = pending.get("coll", pending.get("ring"))
                    if "coll" in pending:
                        from_coll_line.add(comm)
                pending = {}
                current = None if "COMPLETE" in msg else comm
                continue
            if m := _COLL_CHANNELS.search(msg):
                if current is None:
                    pending["coll"] = int(m.group(1))
                else:
                    comms[current]["channels"] = int(m.group(1))
                    from_coll_line.add(current)
            elif m := _RING_LISTING.search(msg):
                if current is None:
                    pending.setdefault("ring", int(m.group(1)))
                elif current not in from_coll_line:
                    comms[current]["channels"] = int(m.group(1))
    return NcclLog(
        version=version,
        communicators=tuple(Communicator(comm, **fields) for comm, fields in comms.items()),
        tuning=tuple(tuning),
        transports=tuple(transports.most_common()),
        link_types=frozenset(link_types),
        hosts=frozenset(hosts),
        lines=number,
        damaged=damaged,
        processes=frozenset(processes),
    )


def merge_logs(logs: Sequence[NcclLog]) -> NcclLog:
    """One :class:`NcclLog` from the logs of several ranks (first version; all records, in order).

    A communicator without ``nNodes`` (NCCL < 2.20) spanning the most ranks gets the number of
    distinct host names of the logs as its node count, when the logs hold every rank of it, however they are
    split: one log per rank, or lines of as many processes (``host:pid`` prefixes) as it has ranks (an
    ``mpirun`` log of every rank in one file).

    >>> log = parse_nccl_log(["a:1:1 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 - Init COMPLETE",
    ...                       "b:7:7 [0] NCCL INFO comm 0x2 rank 1 nranks 2 cudaDev 0 - Init COMPLETE"])
    >>> [c.nnodes for c in merge_logs([log]).communicators]
    [2, 2]
    """
    version = next((log.version for log in logs if log.version), None)
    comms: dict[str, Communicator] = {}
    for log in logs:
        for c in log.communicators:
            comms.setdefault(c.comm, c)
    hosts = frozenset(h for log in logs for h in log.hosts)
    processes = frozenset(p for log in logs for p in log.processes)
    transports: Counter[str] = Counter()
    for log in logs:
        transports.update(dict(log.transports))
    world = max((c.nranks or 0 for c in comms.values()), default=0)
    if hosts and max(len(logs), len(processes)) >= world > 0:
        comms = {
            k: (replace(c, nnodes=len(hosts)) if c.nnodes is None and c.nranks == world else c)
            for k, c in comms.items()
        }
    return NcclLog(
        version,
        tuple(comms.values()),
        tuple(r for log in logs for r in log.tuning),
        transports=tuple(transports.most_common()),
        link_types=frozenset(t for log in logs for t in log.link_types),
        hosts=hosts,
        lines=sum(log.lines for log in logs),
        damaged=sum(log.damaged for log in logs),
        processes=processes,
    )


def algorithm_for(log: NcclLog, collective: str, size_bytes: int) -> AlgorithmChoice:
    """The algorithm NCCL reported for ``collective`` of ``size_bytes`` bytes.

    Matches TUNING records of exactly that size whose collective is ``collective`` or unknown
    (NCCL 2.20-2.22 lines carry no collective name, so another collective of the same size would be
    counted too; the note says so). When the calls disagree, the most frequent algorithm wins and
    the note gives the counts.

    Args:
        log: a parsed log. collective: pnpscale name (``all_reduce``). size_bytes: NCCL's size
        (for all_reduce, the payload in bytes).

    Returns:
        :class:`AlgorithmChoice` (``algorithm=None`` with the reason when the log does not say).

    >>> log = parse_nccl_log(["NCCL INFO AllReduce: 4096 Bytes -> Algo 0 proto 0 time 9.1"])
    >>> algorithm_for(log, "all_reduce", 4096).algorithm, algorithm_for(log, "all_reduce", 8).note
    ('tree', 'no TUNING line for all_reduce of 8 bytes in the NCCL log')
    """
    hits = [r for r in log.tuning if r.size_bytes == size_bytes and r.collective in (None, collective)]
    if not hits:
        v = version_tuple(log.version)
        if log.lines == 0:
            note = "the NCCL log is empty"
        elif v is not None and v[:2] < FIRST_TUNING_VERSION and not log.tuning:
            note = f"NCCL {log.version} does not log the per-collective algorithm at INFO level (2.20+ does)"
        elif not log.tuning and log.damaged:
            note = f"the NCCL log's {log.damaged} TUNING line(s) are damaged (cut or interleaved): no algorithm read"
        elif not log.tuning:
            note = "no TUNING lines in the NCCL log (NCCL_DEBUG_SUBSYS must include TUNING)"
        else:
            note = f"no TUNING line for {collective} of {size_bytes} bytes in the NCCL log"
            if log.damaged:
                note += f" ({log.damaged} damaged TUNING line(s) not read)"
        return AlgorithmChoice(None, None, 0, note)
    counts = Counter((r.algorithm, r.protocol) for r in hits)
    (algo, proto), _ = counts.most_common(1)[0]
    algos = Counter(r.algorithm for r in hits)
    notes = []
    if len(algos) > 1:
        chose = ", ".join(f"{a} for {n}" for a, n in algos.most_common())
        notes.append(f"NCCL chose {chose} calls; majority used")
    if any(r.collective is None for r in hits):
        notes.append("TUNING lines name no collective (NCCL 2.20-2.22): matched by size only")
    return AlgorithmChoice(algo, proto, len(hits), "; ".join(notes))
