"""One rank's events -> its section records, and the records of all ranks made comparable.

* :mod:`~pnpscale.analysis.section.records`: :func:`section_records` (the entry point);
* :mod:`~pnpscale.analysis.section.gpu`: CUDA: collective kernels, launches, descriptors, section spans;
* :mod:`~pnpscale.analysis.section.gloo`: gloo work ranges typed by their ``c10d::`` calls;
* :mod:`~pnpscale.analysis.section.busy`: where a rank computes: each collective's blocked and hidden time;
* :mod:`~pnpscale.analysis.section.align`: collectives matched across ranks, nested sections;
* :mod:`~pnpscale.analysis.section.iterations`: the iterations kept on every rank (by ``ProfilerStep``,
  without non-physical events, without what a file cut short lost).
"""

from pnpscale.analysis.section.align import align_collectives, nested_sections
from pnpscale.analysis.section.iterations import (
    drop_bad_iterations,
    drop_cut_iterations,
    drop_empty_iterations,
    match_steps,
)
from pnpscale.analysis.section.records import section_records

__all__ = [
    "align_collectives",
    "drop_bad_iterations",
    "drop_cut_iterations",
    "drop_empty_iterations",
    "match_steps",
    "nested_sections",
    "section_records",
]
