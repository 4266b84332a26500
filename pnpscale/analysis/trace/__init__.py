"""Reading one Kineto JSON trace (offline): bytes, passes, kept events, cut detection.

* :mod:`~pnpscale.analysis.trace.read`: the streaming reader (:func:`read_trace`, :func:`read_header`);
* :mod:`~pnpscale.analysis.trace.files`: a file's bytes (gzip, head, tail keys, non-finite tokens, exact
  numbers) and the error family (:class:`TraceError`);
* :mod:`~pnpscale.analysis.trace.scan`: the fast and the exact pass over a file;
* :mod:`~pnpscale.analysis.trace.collect`: what a pass keeps;
* :mod:`~pnpscale.analysis.trace.select`: duplicates, runtime clock, device checks, the kept events;
* :mod:`~pnpscale.analysis.trace.cut`: a lone rank's file Kineto began but did not finish (its last iteration).
"""

from pnpscale.analysis.trace.read import (
    NotATraceError,
    Trace,
    TraceError,
    TraceInfo,
    iter_trace_files,
    parse_sections,
    read_header,
    read_trace,
)

__all__ = [
    "NotATraceError",
    "Trace",
    "TraceError",
    "TraceInfo",
    "iter_trace_files",
    "parse_sections",
    "read_header",
    "read_trace",
]
