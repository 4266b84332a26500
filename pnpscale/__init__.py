"""pnpscale: does adding GPUs to deepinv's distributed PnP solver keep paying off, and why.

Run ``python -m pnpscale -m gpus=1,2,4 problem=2d``; see README.md. In a notebook,
``pnpscale.load("outputs/")`` returns the tidy table of every run (one row per run x section).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "load"]


def load(path: str, **kwargs: Any) -> Any:
    """One tidy DataFrame (one row per run x section) of every complete run under ``path``.

    See :func:`pnpscale.runs.load` (imported lazily: pandas/pyarrow are not loaded before use).
    """
    from pnpscale.runs import load as _load

    return _load(path, **kwargs)
