"""Series labels: a sweep's variants folded into ``problem``, so that every view draws one series per variant.

Pure functions over the tidy table (:mod:`pnpscale.columns`); pandas only, so that the projection's model
and the report's tables share them without importing a plotting library.
"""

from __future__ import annotations

import pandas as pd

from pnpscale import columns as K

__all__ = ["labelled", "series_label"]


def series_label(problem: str, variant: object) -> str:
    """``problem`` plus its variant, if any.

    >>> series_label("2d", ""), series_label("2d", "denoiser_collective=all_gather")
    ('2d', '2d denoiser_collective=all_gather')
    """
    return f"{problem} {variant}" if isinstance(variant, str) and variant else str(problem)


def labelled(table: pd.DataFrame) -> pd.DataFrame:
    """The table with each variant folded into ``problem`` (``2d denoiser_collective=all_gather``),
    so that views keyed by (problem, mode) draw one series per variant.

    Idempotent: a row whose ``problem`` already carries its variant is kept as is, so every view
    (charts, projection) may call it on :func:`pnpscale.load`'s table or on the report's view.

    >>> t = pd.DataFrame({"problem": ["2d", "2d"], "variant": ["", "denoiser_collective=all_gather"]})
    >>> labelled(labelled(t))["problem"].tolist()
    ['2d', '2d denoiser_collective=all_gather']
    """
    if K.VARIANT not in table:
        return table
    variant = table[K.VARIANT].fillna("").astype(str)
    if not (variant != "").any():
        return table
    out = table.copy()
    out["problem"] = [
        str(p) if not v or str(p).endswith(f" {v}") else series_label(str(p), v)
        for p, v in zip(out["problem"], variant, strict=True)
    ]
    return out
