"""The anomaly report: everything an analysis dropped, assumed or repaired, counted per kind and rank.

Every analysis (live ``run.json``, offline ``analysis.json``) carries an ``anomalies`` list; an empty
list means none was found (and is said so). Each entry: ``kind`` (a key of :data:`KINDS`), ``rank``
(``None`` for the whole job), ``count``, ``example`` (one event or file, as text) and ``action``
(what was done about it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: kind -> what pnpscale did about it (printed in the summary line).
KINDS: dict[str, str] = {
    "gpu_event_outside_window": "dropped: its correlation id has no runtime launch in the trace and it starts "
    "before the first recorded launch (launched before the profiler started)",
    "gpu_event_unknown_correlation": "GPU event whose correlation id matches no runtime launch although it starts "
    "after the first recorded launch (the launch is missing, not before the profiler): not placed; the iteration "
    "holding one dropped on every rank (iteration_incomplete)",
    "collective_on_copy_engines": "a section whose collectives have no kernel and whose GPU work holds device-to-"
    "device copies (NCCL >= 2.28 runs all_gather on the copy engines: cudaMemcpyBatchAsync -> Memcpy DtoD): its "
    "transfer would read as compute, so its iteration is dropped on every rank",
    "copy_without_gpu_event": "a copy or memset launched in a section has no GPU event (none for 0 bytes; a record "
    "the profiler dropped): the section's GPU span ends at its last recorded GPU event, kept and named",
    "iteration_incomplete": "an iteration whose events do not add up (a launch without its GPU event in a file "
    "Kineto closed, or a GPU event without its launch): dropped on every rank, never computed from a partial trace",
    "launch_unknown_paired": "collective kernel with correlation 0 (unknown launch): paired in order with the "
    "CPU-side collective descriptors",
    "launch_unknown_by_start": "GPU event with correlation 0 (unknown launch): placed by its GPU start time; "
    "section assignment may be wrong",
    "non_physical_timing": "event with a negative or missing duration, an unset timestamp (ts <= 0), or a collective "
    "kernel overlapping the work of its own stream: its iteration dropped on every rank",
    "stream_overlap": "compute kernels that start before the previous one on their stream ends (programmatic "
    "dependent launch, or wrong GPU timestamps): read as they are; the GPU span includes the overlap",
    "collective_kernel_unrecognised": "GPU kernels whose names speak of a collective but belong to no known "
    "collective library: read as compute (add the family to pnpscale/analysis/kineto.py if they are collectives)",
    "gpu_before_launch": "device events that start before their launch (the GPU clock runs ahead of the CPU's): "
    "placed by their launch; section time is the GPU span (pnpscale's own traces: from the CPU range start)",
    "unknown_category": "events of categories pnpscale does not read (another device's runtime or kernels?): "
    "not read; counted per category",
    "duplicate_event": "the same event written twice (same name, times, thread or stream): one kept",
    "runtime_clock_offset": "runtime events on another clock than the CPU ranges (collective launches outside "
    "their descriptors): launches shifted by the offset that puts every one inside its descriptor",
    "descriptors_without_any_kernel": "collective descriptors in a trace without any GPU event: the profiler "
    "dropped every GPU record",
    "event_without_ts": "event without a timestamp: dropped",
    "non_finite_number": "bare inf/NaN token in the JSON: read as null",
    "non_trace_file": "JSON file without traceEvents in a trace folder: skipped",
    "collective_without_kernel": "CPU-side collective descriptor without a GPU kernel in its section "
    "(profiler dropped kernels, or coalesced collectives)",
    "kernel_name_disagrees": "kernel name hints another collective than its CPU descriptor: the descriptor wins",
    "range_name_disagrees": "a gloo work range is named after another collective than the c10d call that issued "
    "it (FSDP's reduce_scatter runs as gloo:all_reduce): the c10d call wins",
    "p2p_peer_ambiguous": "the trace lists a process group whose ranks are not 0..n-1 in order: the peer of a "
    "c10d::send / c10d::recv_ is a rank of its process group, which the call does not name: peers not read (a "
    "job of more than 2 ranks with point-to-point is refused)",
    "gpu_work_past_next_section": "a section's GPU work runs past the start of the next section's (asynchronous "
    "GPU pipeline): clipped to its own section, so no GPU time is counted twice",
    "trace_cut_short": "a file Kineto did not close (no 'Record Window End': cut short, then completed by a "
    "tool) lost the end of its events (its last launches without their GPU event, fewer iterations or collectives "
    "than another rank, or, a lone CPU rank, Kineto's header without its span): the iterations it lost, or may "
    "have lost, dropped on every rank",
    "rank_clocks_inconsistent": "no constant offset between two ranks' clocks lets every causal collective "
    "(all_reduce, all_gather, reduce_scatter, all_to_all, barrier) end after the other rank started it: a clock "
    "stepped while the trace was recorded, or collectives matched across ranks are not the same ones; numbers "
    "kept, those of the iterations between the two collectives named may be wrong",
    "empty_iteration": "the ProfilerStep Kineto opens at the last prof.step(): trailing iterations without GPU work "
    "or collective on any rank, in a trace with GPU work, dropped on every rank; or, in any trace, a rank's last "
    "ProfilerStep that is a section range and holds no operator, collective or other section, dropped on that rank; "
    "never counted as a (near) 0 s iteration",
    "nested_sections": "section nested in another: the 'all' row counts the outer section only",
    "step_not_on_every_rank": "ProfilerStep numbers missing on another rank: those steps dropped",
    "rank_overridden": "--rank given for a trace that states another rank: --rank used",
    "no_collectives": "multi-rank job without any collective kernel: transfer and wait unknown, CommE/PE not given",
    "negative_compute": "a rank's collectives last longer than its section (overlapping, asynchronous "
    "collectives): compute and load balance of those rows are not meaningful",
    "transfer_includes_wait": (
        "one rank present: no other rank to take the minimum over, transfer inc"
        "ludes the wait for other ranks (wait_s is only the time blocked before its collectives started)"
    ),
    "payload_unmatched": "the profile's collective ranges of a type and the torch.distributed calls of that type "
    "differ in number: those ranges' payload bytes left unknown (NA)",
}


@dataclass
class Anomaly:
    """One kind of anomaly on one rank (``rank=None``: the whole job)."""

    kind: str
    rank: int | None
    count: int
    example: str
    action: str


class Anomalies:
    """Collects anomalies; one entry per (kind, rank) with a count and the first example."""

    def __init__(self, items: Iterable[Mapping[str, Any]] = ()) -> None:
        self._by: dict[tuple[str, int | None], Anomaly] = {}
        for it in items:
            self.add(str(it["kind"]), it.get("rank"), str(it.get("example", "")), int(it.get("count", 1)))

    def add(self, kind: str, rank: int | None, example: str, count: int = 1) -> None:
        """Count ``count`` more of ``kind`` on ``rank``; the first example is kept.

        Raises:
            KeyError: ``kind`` is not in :data:`KINDS`.
        """
        action = KINDS[kind]
        key = (kind, rank)
        if key in self._by:
            self._by[key].count += count
        else:
            self._by[key] = Anomaly(kind, rank, count, example, action)

    def extend(self, other: Anomalies | Iterable[Mapping[str, Any]]) -> None:
        for a in other.records() if isinstance(other, Anomalies) else other:
            self.add(a["kind"], a["rank"], a["example"], a["count"])

    def kinds(self) -> set[str]:
        return {k for k, _ in self._by}

    def __len__(self) -> int:
        return len(self._by)

    def records(self) -> list[dict[str, Any]]:
        """Plain dicts (for JSON), ordered by kind then rank."""
        items = sorted(self._by.values(), key=lambda a: (a.kind, -1 if a.rank is None else a.rank))
        return [asdict(a) for a in items]


def summary_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per kind: ``kind: N on rank(s) ...: action; e.g. example``; one line saying none when empty.

    >>> summary_lines([])
    ['anomalies: none (nothing dropped, assumed or repaired)']
    >>> summary_lines([{"kind": "event_without_ts", "rank": 1, "count": 2, "example": "x", "action": "dropped"}])
    ['anomaly event_without_ts: 2 on rank 1: dropped; e.g. x']
    """
    if not records:
        return ["anomalies: none (nothing dropped, assumed or repaired)"]
    out = []
    for kind in dict.fromkeys(r["kind"] for r in records):
        rows = [r for r in records if r["kind"] == kind]
        ranks = sorted({r["rank"] for r in rows if r["rank"] is not None})
        where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
        total = sum(int(r["count"]) for r in rows)
        out.append(f"anomaly {kind}: {total}{where}: {rows[0]['action']}; e.g. {rows[0]['example']}")
    return out
