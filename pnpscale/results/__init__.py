"""Stage 4 (floor 4), results: run folders -> the tidy table, transfer explained, charts and the sweep report.

* :mod:`~pnpscale.results.runs`: discover, validate and load run folders (``pnpscale.load``);
* :mod:`~pnpscale.results.summary`: scaled GPU-seconds, headline checks;
* :mod:`~pnpscale.results.transfer`: byte models, route rates, calibration and prediction, and the
  run-folder readers behind them (NCCL logs, transfer inputs);
* :mod:`~pnpscale.results.plotting`: pyplot-free figures, the GPU axis and series labels every chart shares;
* :mod:`~pnpscale.results.charts`: the study's charts (matplotlib Figures, no pyplot);
* :mod:`~pnpscale.results.compare`: the varied keys (remedies) side by side, within or beyond the noise;
* :mod:`~pnpscale.results.timeline_chart`: ``timeline.png``, one median iteration per rank;
* :mod:`~pnpscale.results.projection`: the projection past the measured GPU counts (model, fit, routes,
  evaluation, checks, the pipelined series, files and chart, ``python -m pnpscale.project``);
* :mod:`~pnpscale.results.jitter`: the expected maximum of N ranks' compute, non-negative least squares;
* :mod:`~pnpscale.results.report`: ``<sweep>/report/`` (``python -m pnpscale.report``).
"""
