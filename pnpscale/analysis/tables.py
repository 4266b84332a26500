"""The table builder: per-rank rows -> the typed ``ranks`` and ``collectives`` tables of a run.

Used by the live run (:mod:`pnpscale.core.record`), the offline analysis
(:mod:`pnpscale.analysis.offline`) and the validation probe alike, so the three write the same
columns (:mod:`pnpscale.columns`) with the same types.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
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
    ranks: pd.DataFrame,
    collectives: pd.DataFrame,
    sections: pd.DataFrame | None = None,
    timeline: TimelineJob | None = None,
) -> dict[str, Any]:
    """File name -> writer of a run's tables, for :func:`pnpscale.core.layout.commit_files` (the one place
    the three tables are written: live runs, offline analysis and the validation probe).

    ``sections`` is omitted by the validation probe, which decomposes later. With ``sections``, the run's
    timeline (``timeline.json``, :func:`pnpscale.analysis.timeline_slices.run_trace`) is written too: from
    ``timeline`` when given (:class:`TimelineJob` of the same ``ranks`` and ``collectives``, started earlier),
    else computed by the writer.
    """

    writers: dict[str, Any] = {
        layout.RANKS: lambda p: ranks.to_parquet(p, index=False),
        layout.COLLECTIVES: lambda p: collectives.to_parquet(p, index=False),
    }
    if sections is not None:
        text = timeline.text if timeline is not None else (lambda: timeline_text(ranks, collectives))
        writers[layout.SECTIONS] = lambda p: sections.to_parquet(p, index=False)
        writers[layout.TIMELINE_JSON] = lambda p: write_timeline(p, text)
    return writers


def timeline_text(ranks: pd.DataFrame, collectives: pd.DataFrame) -> str:
    """The run's Chrome trace (:func:`pnpscale.analysis.timeline_slices.run_trace`) as compact JSON text.

    UTF-8 text, no ``\\u`` escapes but of control characters (older Perfetto importers refuse them: a section
    name outside ASCII is written as it is), and no ``NaN`` / ``Infinity`` (not JSON: Perfetto's importer stops at
    them): :func:`~pnpscale.analysis.timeline_slices.chrome_trace` refuses a non-finite number before it is
    written. Encoded by :func:`msgspec.json.encode` (a seventh of :func:`json.dumps`'s time; the same values,
    floats in their shortest form, ``1e16`` and ``0.00001`` where :mod:`json` writes ``1e+16`` and ``1e-05``).

    Raises:
        ValueError, OverflowError: a non-finite number or time in the tables.
    """
    import msgspec

    return msgspec.json.encode(run_trace(ranks, collectives)).decode()


def write_timeline(path: Any, text: Callable[[], str]) -> None:
    """Write ``text()`` (:func:`timeline_text`) at ``path``, UTF-8; the text is complete before the file is
    opened, so a refusal (``ValueError``: a non-finite number) leaves no file."""
    body = text()
    with open(path, "w", encoding="utf-8") as f:
        f.write(body)


class TimelineJob:
    """:func:`timeline_text` of a run's tables, computed in a forked process while the caller goes on (an
    offline analysis decomposes and writes its tables meanwhile: the two use two cores).

    The tables are pickled to the child as they are at the start; ``ranks`` columns the timeline reads (RANK,
    ITERATION, SECTION, WARMUP, START_S, SECTION_S, GPU_START_S, GPU_SPAN_S) and ``collectives`` must not
    change after it. Where ``fork`` is not available, or the child dies (killed, out of memory), the text is
    computed in this process instead; an error of the computation itself is raised by :meth:`text`, as
    :func:`timeline_text` raises it here.
    """

    def __init__(self, ranks: pd.DataFrame, collectives: pd.DataFrame) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self._tables = (ranks, collectives)
        self._future: Future[str] | None = None
        self._pool: ProcessPoolExecutor | None = None
        if "fork" in mp.get_all_start_methods():
            import gc

            # the child forks with this process's objects out of its collections: a collection there would walk
            # (and copy) every inherited object, 0.2 s more on 8 ranks' records
            gc.freeze()
            try:
                self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("fork"), initializer=gc.disable)
                self._future = self._pool.submit(timeline_text, ranks, collectives)
            finally:
                gc.unfreeze()

    def text(self) -> str:
        """The text; waits for the child.

        Raises:
            ValueError, OverflowError: as :func:`timeline_text` (a non-finite number or time).
        """
        from concurrent.futures.process import BrokenProcessPool

        try:
            if self._future is not None:
                return self._future.result()
        except BrokenProcessPool:
            pass  # the child died: computed here
        finally:
            self.close()
        return timeline_text(*self._tables)

    def close(self) -> None:
        """Stop the child (when the text is not wanted after all) and release it; idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


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
