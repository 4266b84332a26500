"""The named steps of :func:`pnpscale.analysis.section.records.section_records`, each called alone (issue 29)."""

from __future__ import annotations

import pytest

from pnpscale.analysis.anomalies import Anomalies
from pnpscale.analysis.events import Event, Kind, SectionError, Window
from pnpscale.analysis.section.busy import Busy
from pnpscale.analysis.section.records import gloo_part, section_ranges, step_of

MS = 1_000_000  # ns


def _sorted(evs):
    return sorted(evs, key=lambda e: (e.start_ns, -e.end_ns))


def test_section_ranges_counts_and_refuses_uneven_counts():
    evs = _sorted([Event("a", Kind.CPU, 0, 10), Event("b", Kind.CPU, 20, 30), Event("a", Kind.CPU, 40, 50)])
    with pytest.raises(SectionError, match=r"a=2, b=1") as err:
        section_ranges(evs, ["a", "b"], Anomalies(), 0, None)
    assert err.value.counts == {"a": 2, "b": 1}
    # a file that may be cut short: the first occurrence of each name kept, recorded as an anomaly
    anomalies = Anomalies()
    ranges, counts = section_ranges(evs, ["a", "b"], anomalies, 0, 50)
    assert [r.start_ns for r in ranges] == [0, 20] and counts == {"a": 1, "b": 1}
    assert [a["kind"] for a in anomalies.records()] == ["trace_cut_short"]


def test_step_of_takes_the_enclosing_profiler_step():
    evs = _sorted([Event("ProfilerStep#7", Kind.OP, 0, 100), Event("a", Kind.CPU, 10, 20),
                   Event("a", Kind.CPU, 90, 120)])  # fmt: skip
    ranges = [e for e in evs if e.name == "a"]
    assert step_of(evs, ranges, ["a"]) == [7, None]  # the second outlives the step


def test_gloo_part_blocked_from_the_call_to_the_end_of_the_work():
    r = Event("s", Kind.CPU, 0, 100 * MS, tid=1)
    call = Event("c10d::allreduce_", Kind.OP, 10 * MS, 11 * MS, tid=1)
    work = Event("gloo:all_reduce", Kind.CPU, 10 * MS + 500_000, 60 * MS, tid=9, collective="all_reduce")
    mm = Event("aten::mm", Kind.OP, 60 * MS, 100 * MS, tid=1)
    busy = Busy(_sorted([r, call, work, mm]), ["s"], [])
    part = gloo_part(r, Window([work]), {id(work): (call.start_ns, call.end_ns)}, busy, 0)
    (c,) = part.collectives
    assert part.section_ns == 100 * MS and c.name == "all_reduce"
    assert c.blocked_s == pytest.approx(0.050) and part.hidden_ns == 0  # 10 ms .. 60 ms: the call, then idle
