"""Is the split right on this machine? Known perturbations through the real pipeline.

``python -m pnpscale.validate``; see :mod:`pnpscale.validation.suite`.
"""
