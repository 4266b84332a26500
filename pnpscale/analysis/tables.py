"""The table builder: per-rank rows -> the typed ``ranks`` and ``collectives`` tables of a run.

Used by the live run (:mod:`pnpscale.core.record`), the offline analysis
(:mod:`pnpscale.analysis.offline`) and the validation probe alike, so the three write the same
columns (:mod:`pnpscale.columns`) with the same types.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.metrics import mark_main
from pnpscale.analysis.timeline_slices import run_trace
from pnpscale.core import layout


def frames(
    gathered: list[tuple[dict[str, list[Any]], dict[str, Any]]], image_bytes: int | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Concatenate per-rank tables into ``ranks`` and ``collectives`` DataFrames.

    Args:
        gathered: one ``(table, info)`` per rank, ``table = {"ranks": [row...], "collectives":
            [row...]}`` with the columns of :mod:`pnpscale.columns`.
        image_bytes: the signal's size in bytes, to flag the image-sized collectives as main
            (see :func:`pnpscale.analysis.metrics.mark_main`).

    Returns:
        ``(ranks, collectives)`` with typed columns; ``collectives`` gains the MAIN flag.
    """
    ranks = pd.DataFrame([r for table, _ in gathered for r in table["ranks"]], columns=list(K.RANKS_COLUMNS))
    colls = pd.DataFrame(
        [c for table, _ in gathered for c in table["collectives"]],
        columns=[c for c in K.COLLECTIVES_COLUMNS if c != K.MAIN],
    )
    ranks = ranks.astype({K.RANK: "int64", K.ITERATION: "int64", K.SECTION: "string", K.WARMUP: "bool",
                          K.START_S: "float64", K.SECTION_S: "float64", K.COMM_S: "float64",
                          K.N_COLLECTIVES: "int64", K.PEAK_MEM_BYTES: "Int64", K.GPU_SPAN_S: "float64",
                          K.HIDDEN_S: "float64", K.GPU_START_S: "float64"})  # fmt: skip
    colls = colls.astype({K.RANK: "int64", K.ITERATION: "int64", K.SECTION: "string", K.SEQ: "int64",
                          K.COLLECTIVE: "string", K.START_S: "float64", K.DURATION_S: "float64",
                          K.PAYLOAD_BYTES: "Int64", K.BLOCKED_S: "float64", K.HIDDEN_S: "float64",
                          K.BLOCKED_SPANS_NS: "string", K.PROCESS_GROUP: "string"})  # fmt: skip
    colls[K.MAIN] = mark_main(colls, image_bytes, world_size=len(gathered))
    colls = colls[list(K.COLLECTIVES_COLUMNS)]
    return ranks, colls


def table_writers(
    ranks: pd.DataFrame, collectives: pd.DataFrame, sections: pd.DataFrame | None = None
) -> dict[str, Any]:
    """File name -> writer of a run's tables, for :func:`pnpscale.core.layout.commit_files` (the one place
    the three tables are written: live runs, offline analysis and the validation probe).

    ``sections`` is omitted by the validation probe, which decomposes later. With ``sections``, the run's
    ``timeline.json`` (:func:`pnpscale.analysis.timeline_slices.run_trace`) is staged with the tables.
    """

    writers: dict[str, Any] = {
        layout.RANKS: lambda p: ranks.to_parquet(p, index=False),
        layout.COLLECTIVES: lambda p: collectives.to_parquet(p, index=False),
    }
    if sections is not None:
        writers[layout.SECTIONS] = lambda p: sections.to_parquet(p, index=False)
        writers[layout.TIMELINE_JSON] = lambda p: write_timeline(p, ranks, collectives)
    return writers


def write_timeline(path: Any, ranks: pd.DataFrame, collectives: pd.DataFrame) -> None:
    """Write the run's Chrome trace (:func:`pnpscale.analysis.timeline_slices.run_trace`) as compact JSON at ``path``.

    UTF-8 text, no ``\\u`` escapes (older Perfetto importers refuse them: a section name outside ASCII is
    written as it is), and no ``NaN`` / ``Infinity`` (not JSON: Perfetto's importer stops at them).

    Raises:
        ValueError: a non-finite number in the trace (never written).
    """
    import json

    # one json.dumps: its C encoder (json.dump streams through the pure-Python one, 5-10x slower), and a
    # non-finite number refused before the file is opened
    text = json.dumps(run_trace(ranks, collectives), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def complete_sections(sections: pd.DataFrame) -> pd.DataFrame:
    """``sections`` with every column of :data:`pnpscale.columns.SECTIONS_COLUMNS`: columns a folder written
    by an older version lacks (e.g. ``main_transfer_s``, ``other_payload_bytes``) added as NA (NaN; ``pd.NA``
    for the collective's name and ``time_shared``), so that they read as missing values, never as zeros."""
    out = sections.copy()
    for col in K.SECTIONS_COLUMNS:
        if col not in out:
            if col == K.TIME_SHARED:
                out[col] = pd.array([pd.NA] * len(out), dtype="boolean")
            else:
                out[col] = pd.Series(pd.NA, index=out.index, dtype=object) if col == K.MAIN_COLLECTIVE else float("nan")
    return out
