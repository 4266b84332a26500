"""Is the split right on this machine? Known perturbations through the real pipeline (the top floor).

* :mod:`~pnpscale.validation.suite`: ``python -m pnpscale.validate`` (injected imbalance, payload sweep,
  noise floor);
* :mod:`~pnpscale.validation.device_check`: the GPU check behind ``scripts/device-check.sh``.
"""
