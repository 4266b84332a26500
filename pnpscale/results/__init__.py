"""Stage 4 (floor 4), results: run folders -> the tidy table, transfer explained, charts and the sweep report.

* :mod:`~pnpscale.results.runs`: discover, validate and load run folders (``pnpscale.load``);
* :mod:`~pnpscale.results.summary`: scaled GPU-seconds, headline checks;
* :mod:`~pnpscale.results.transfer`: byte models, route rates, calibration and prediction, and the
  run-folder readers behind them (NCCL logs, transfer inputs);
* :mod:`~pnpscale.results.plotting`: pyplot-free figures, the GPU axis and series labels every chart shares;
* :mod:`~pnpscale.results.charts`: the study's charts (matplotlib Figures, no pyplot);
* :mod:`~pnpscale.results.compare`: the varied keys (remedies) side by side, within or beyond the noise;
* :mod:`~pnpscale.results.timeline`: ``timeline.png``, one median iteration per rank;
* :mod:`~pnpscale.results.projection_model`: the projection's model (stated in its docstring) and its
  assembly over a table (``project``), made of :mod:`~pnpscale.results.projection_base` (options, the model's
  types, work per rank, the measured points), :mod:`~pnpscale.results.projection_fit` (compute, jitter, wait),
  :mod:`~pnpscale.results.projection_routes` (algorithm per node count, routes, rates),
  :mod:`~pnpscale.results.projection_eval` (the numbers at any N, no impossible number, findings),
  :mod:`~pnpscale.results.projection_checks` (residuals, leave-one-out) and
  :mod:`~pnpscale.results.projection_overlap` (the pipelined series from the blocking one and its hidden share);
* :mod:`~pnpscale.results.jitter`: the expected maximum of N ranks' compute, non-negative least squares;
* :mod:`~pnpscale.results.projection`: the projection's files and chart;
* :mod:`~pnpscale.results.projection_command`: its command (``python -m pnpscale.project``): options, the
  projection they ask for, a report's recorded projection made again;
* :mod:`~pnpscale.results.report`: ``<sweep>/report/`` (``python -m pnpscale.report``).
"""
