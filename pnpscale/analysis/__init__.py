"""Stage 3 (floor 1), analysis: profiler events -> per-section records -> the POP decomposition (pure, no torch).

* :mod:`~pnpscale.analysis.kineto`: the Kineto vocabulary (event categories, NCCL/gloo names, dtypes);
* :mod:`~pnpscale.analysis.events`: plain events and section records (and a rank's rows of them);
* :mod:`~pnpscale.analysis.section`: one rank's events -> its section records (CUDA kernels and spans, gloo
  work ranges, blocked and hidden time), collectives matched across ranks, the iterations kept on every rank;
* :mod:`~pnpscale.analysis.trace`: streaming reader of Kineto JSON traces (offline): a file's bytes, the fast
  and the exact pass, what a pass keeps, the kept events, a lone rank's file cut short;
* :mod:`~pnpscale.analysis.clocks`: whether the ranks' clocks fit together, a causality bound from the
  matched collectives (a clock that stepped during the trace);
* :mod:`~pnpscale.analysis.gpu_checks`: physical checks of device events and the runtime clock;
* :mod:`~pnpscale.analysis.anomalies`: what an analysis dropped, assumed or repaired, per kind;
* :mod:`~pnpscale.analysis.nccl_log`: NCCL debug logs -> topology and algorithm per collective;
* :mod:`~pnpscale.analysis.overlap`: intervals: the time a rank is blocked on communication, unions of
  concurrent collectives, hidden (overlapped) communication;
* :mod:`~pnpscale.analysis.metrics`: compute / transfer / wait, LB, CommE, PE;
* :mod:`~pnpscale.analysis.waits`: wait split by cause (late start, uneven work, jitter);
* :mod:`~pnpscale.analysis.tables`: the three parquet tables of a run (and its ``timeline.json``), built from
  section records;
* :mod:`~pnpscale.analysis.timeline_slices`: each rank's compute / transfer / wait slices at their measured times,
  and the Chrome trace (``timeline.json``);
* :mod:`~pnpscale.analysis.spread`: per-iteration quantiles (p10 / median / p90) per section;
* :mod:`~pnpscale.analysis.offline`: ``python -m pnpscale.analyze`` (any job's traces).

Imports only the ground floor (:mod:`pnpscale.core`, :mod:`pnpscale.columns`).
"""
