"""A one-rank trace that cannot vouch for its own end: the last iteration of a Kineto file cut short.

Kineto writes a trace in one order: ``schemaVersion`` and the other header keys
(``ChromeTraceLogger::handleTraceStart``), the activities (the CPU ones by start), then its ``PyTorch Profiler
(N)`` span (category ``Trace``: ``GenericActivityProfiler::processCpuTrace`` ends with it, and the in-memory
logger replays it after every activity), and last ``Record Window End`` (``finalizeTrace``). A file that was cut
while being written and then closed as valid JSON by a tool (the profiler killed, a copy stopped) therefore
starts like Kineto's but holds neither the span nor the end marker, and its events end at some start time: a
range that ends after the latest start in the file (:attr:`pnpscale.analysis.events.SectionRecord.open_end`) may
have lost what ran inside its tail (on CPU, the ``gloo:*`` work ranges of its last collectives: a smaller
transfer, silently).

With several ranks, the others vouch for it (:func:`pnpscale.analysis.events.drop_cut_iterations`: fewer
iterations or collectives than another rank). With one rank nothing does, so :func:`drop_unvouched_end` drops the
last iteration whose ranges are open in such a file. A file with the span (HolisticTraceAnalysis' sampled traces
keep it and lose the marker), or without Kineto's header (another tool's trace), is left alone; so is a CUDA
trace (a cut loses the GPU events Kineto writes after the CPU's: found from the launches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import SectionError, SectionRecord
from pnpscale.analysis.kineto import END_MARKER


def drop_unvouched_end(
    records: Mapping[int, Sequence[SectionRecord]], unvouched: Mapping[int, str], anomalies: Anomalies | None = None
) -> dict[int, list[SectionRecord]]:
    """Drop the last iteration of a lone rank's CPU trace that Kineto started but did not finish (see module doc).

    Args:
        records: rank -> its section records (one rank: else returned unchanged, other ranks vouch).
        unvouched: rank -> file name, for files with Kineto's header but neither its ``PyTorch Profiler``
            span nor its end marker.
        anomalies: where ``trace_cut_short`` is recorded, naming the file, rank and iteration.

    Returns:
        The records, without that iteration when its ranges are ``open_end`` and it holds no GPU work. When
        they all close before the cut (it fell between iterations), the records are whole and kept, and
        ``trace_cut_short`` still says the file was cut after that iteration (later ones may be lost).

    Raises:
        SectionError: nothing is left (the message names the file, rank and the cut).

    >>> recs = [SectionRecord(0, "s", 0.0, 1.0), SectionRecord(1, "s", 1.0, 1.0, open_end=True)]
    >>> [s.iteration for s in drop_unvouched_end({0: recs}, {0: "rank0.json"})[0]]
    [0]
    >>> [s.iteration for s in drop_unvouched_end({0: recs}, {})[0]]
    [0, 1]
    """
    out = {r: list(recs) for r, recs in records.items()}
    if len(out) != 1:
        return out
    ((rank, recs),) = out.items()
    if rank not in unvouched or not recs or any(s.gpu_span_s is not None for s in recs):
        return out
    last = max(s.iteration for s in recs)
    final = [s for s in recs if s.iteration == last]
    step = next((s.step for s in final if s.step is not None), None)
    which = f"iteration {last}" + (f" (ProfilerStep#{step})" if step is not None else "")
    if not any(s.open_end for s in final):
        # the cut fell between iterations: what is left is whole, but how many iterations followed is unknown
        if anomalies is not None:
            anomalies.add("trace_cut_short", rank, (
                f"{unvouched[rank]}: rank {rank}: a file Kineto began (schemaVersion) but did not finish (no "
                f"'PyTorch Profiler' span, no {END_MARKER!r}: both are written after every event): cut short after "
                f"{which}, whose ranges all end before the cut; the iterations after it, if the job ran any, are "
                f"lost, and no other rank can say how many"))  # fmt: skip
        return out
    open_ = ", ".join(sorted({repr(s.section) for s in final if s.open_end}))
    message = (
        f"{unvouched[rank]}: rank {rank}, {which}: section {open_} ends after the last event that starts in a "
        f"file Kineto began (schemaVersion) but did not finish (no 'PyTorch Profiler' span, no {END_MARKER!r}: "
        f"both are written after every event): cut short, and no other rank to vouch for what the cut lost; "
        f"that iteration dropped"
    )
    kept = [s for s in recs if s.iteration != last]
    if not kept:
        raise SectionError(f"{message}: no iteration left")
    if anomalies is not None:
        anomalies.add("trace_cut_short", rank, message)
    return {rank: kept}
