"""Stage 4, results: run folders -> the tidy table, transfer explained, charts and the sweep report.

* :mod:`~pnpscale.results.runs`: discover and load run folders (``pnpscale.load``);
* :mod:`~pnpscale.results.summary`: scaled GPU-seconds, headline checks;
* :mod:`~pnpscale.results.transfer`: byte models, route rates, calibration and prediction;
* :mod:`~pnpscale.results.charts`: the study's charts (matplotlib Figures, no pyplot);
* :mod:`~pnpscale.results.report`: ``<sweep>/report/`` (``python -m pnpscale.report``).
"""
