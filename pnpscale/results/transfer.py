"""Transfer explained: bytes each GPU moves, the rate they imply, and a calibrated prediction (pure).

Source: the study "Communication under the hood: transfer vs wait" (section "What sets the transfer
time?"), and nccl-tests' ``doc/PERFORMANCE.md`` for algorithm and bus bandwidth. Units: bytes,
seconds, and GB/s meaning 1e9 bytes per second (not GiB/s).

* Bytes each GPU sends for a collective of payload ``P`` bytes on ``n`` GPUs over ``nodes`` nodes:
  all_reduce ring ``2·P·(n−1)/n``; all_reduce tree ``2·P·(nodes−1)/nodes`` (the bytes that cross
  the network; defined for ``nodes >= 2``); all_gather and reduce_scatter ``P·(n−1)/n`` where ``P``
  is nccl-tests' size (the gathered output, the scattered input); all_to_all ``P·(n−1)/n`` with ``P``
  one rank's input in ``n`` equal blocks (its own block stays local); broadcast and reduce ``P``.
* Bytes of a section: every main collective with its own model, summed (:func:`section_main_bytes`, the rule
  the side-by-side table shares through :func:`main_bytes_per_gpu`): a pipelined transfer's bands, a
  reduce_scatter and its all_gather.
* Rate of a row: ``bytes per GPU / transfer time``; grouped by route (``intra-node, g GPUs``,
  ``inter-node tree``, ``inter-node ring``), one rate per route predicts every row of that route:
  ``predicted = bytes per GPU / rate``, ``rel_error = predicted / measured − 1``. Only rows of exposed
  blocking transfer set or get a rate (an overlapped row's exposed transfer is what the overlap left, not
  bytes / rate); a row missed by more than :data:`MISS_TOLERANCE` is flagged (MISSES).
* nccl-tests: ``algbw = size / time``; ``busbw = algbw × factor`` with factor ``2(n−1)/n``
  (all_reduce), ``(n−1)/n`` (all_gather, reduce_scatter, alltoall), ``1`` (broadcast, reduce).

The algorithm of a row is the one NCCL reported in its log (``algorithm_source = "nccl_log"``);
without a log (gloo, or logs missing) the ring model is assumed and the table says so in
``algorithm_source = "assumed"`` and ``algorithm_note``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.nccl_log import algorithm_for, merge_logs, parse_nccl_log, version_tuple
from pnpscale.analysis.tables import complete_sections
from pnpscale.core import layout
from pnpscale.core.errors import PnpscaleError, UnreadableFile
from pnpscale.core.record import RecordError, read_record

#: the note of a row whose transfer ran partly behind compute (``solver.overlap=pipelined``, hidden time).
OVERLAPPED_NOTE = (
    "overlapped with compute: its exposed transfer is what the overlap left, not bytes / rate; "
    "not used for the route rate, not predicted"
)
#: bytes per second in one GB/s.
GB = 1e9
SOURCE_LOG = "nccl_log"
SOURCE_ASSUMED = "assumed"
ASSUMED_ALGORITHM = "ring"


class ByteModelError(PnpscaleError, ValueError):
    """No byte model for this collective / algorithm / topology."""


def _check(payload_bytes: float, n: int, what: str) -> None:
    if payload_bytes < 0 or not math.isfinite(payload_bytes):
        raise ValueError(f"payload_bytes={payload_bytes}: must be a finite number >= 0")
    if int(n) != n or n < 1:
        raise ValueError(f"{what}={n}: must be an integer >= 1")


def ring_all_reduce_bytes(payload_bytes: float, gpus: int) -> float:
    """Bytes each GPU sends in a ring all_reduce: ``2·P·(n−1)/n`` (the study; nccl-tests busbw).

    Args:
        payload_bytes: ``P``, bytes of the tensor reduced. gpus: ``n`` ranks.

    Raises:
        ValueError: ``P < 0`` or ``n < 1``.

    >>> ring_all_reduce_bytes(805_306_368, 8)  # 8192²×3 float32 on 8 GPUs: 1.4 GB
    1409286144.0
    >>> ring_all_reduce_bytes(100, 1)
    0.0
    """
    _check(payload_bytes, gpus, "gpus")
    return 2.0 * payload_bytes * (gpus - 1) / gpus


def tree_all_reduce_bytes(payload_bytes: float, nodes: int) -> float:
    """Bytes each node's GPUs send across the network in a tree all_reduce: ``2·P·(nodes−1)/nodes``.

    The study's tree model: each node first reduces over its fast intra-node links, then only
    node-level partial sums cross the network (up to the root and back down).

    Raises:
        ValueError: ``P < 0`` or ``nodes < 1``.
        ByteModelError: ``nodes == 1`` (no inter-node traffic: the model does not describe an
            intra-node tree).

    >>> tree_all_reduce_bytes(805_306_368, 2)  # 2 nodes: one payload, 805 MB
    805306368.0
    """
    _check(payload_bytes, nodes, "nodes")
    if nodes == 1:
        raise ByteModelError("the tree byte model counts inter-node bytes: undefined on one node")
    return 2.0 * payload_bytes * (nodes - 1) / nodes


def all_gather_bytes(size_bytes: float, gpus: int) -> float:
    """Bytes each GPU receives in an all_gather: ``S·(n−1)/n`` (nccl-tests PERFORMANCE.md).

    Args:
        size_bytes: ``S``, nccl-tests' size: the gathered output (``n`` × each rank's input).
        gpus: ``n``.

    Raises:
        ValueError: ``S < 0`` or ``n < 1``.

    >>> all_gather_bytes(4000, 4)
    3000.0
    """
    _check(size_bytes, gpus, "gpus")
    return size_bytes * (gpus - 1) / gpus


def reduce_scatter_bytes(size_bytes: float, gpus: int) -> float:
    """Bytes each GPU sends in a reduce_scatter: ``S·(n−1)/n``, ``S`` the full input (nccl-tests).

    Raises:
        ValueError: ``S < 0`` or ``n < 1``.

    >>> reduce_scatter_bytes(4000, 2)
    2000.0
    """
    return all_gather_bytes(size_bytes, gpus)


def nccl_tests_size(collective: str, input_bytes: float, gpus: int) -> float:
    """nccl-tests' size ``S`` of a collective from the bytes of one rank's input tensor.

    all_gather: ``S = n × input`` (the gathered output); every other collective: ``S = input``
    (all_reduce, broadcast, reduce: the payload; reduce_scatter, all_to_all: the full input).

    >>> nccl_tests_size("all_gather", 1000, 4), nccl_tests_size("all_reduce", 1000, 4)
    (4000.0, 1000.0)
    """
    return float(input_bytes) * (gpus if collective == "all_gather" else 1)


#: first NCCL version whose TUNING line prints the per-rank count (``task->count x type size``): for
#: all_gather the send count, for reduce_scatter the receive count. Before it (2.20-2.23) the line
#: printed ``nBytes``, which NCCL scales by the number of ranks for those two collectives.
PER_RANK_TUNING_VERSION = (2, 24)


def nccl_log_size(collective: str, input_bytes: float, gpus: int, nccl_version: tuple[int, ...] | None) -> int:
    """The size NCCL's TUNING line prints for a collective, from the bytes of one rank's input tensor.

    NCCL >= 2.24 (``enqueue.cc``: ``task->count * ncclTypeSize``): all_gather the per-rank input,
    reduce_scatter the per-rank output (``input / n``), others the input. 2.20-2.23: all_gather and
    reduce_scatter the total (``nBytes *= nRanks``: nccl-tests' size, :func:`nccl_tests_size`).
    An unknown version is taken as >= 2.24 (what torch 2.x ships).

    >>> nccl_log_size("all_gather", 1000, 4, (2, 30, 7)), nccl_log_size("reduce_scatter", 4000, 4, (2, 30))
    (1000, 1000)
    >>> nccl_log_size("all_gather", 1000, 4, (2, 21, 5)), nccl_log_size("all_reduce", 1000, 4, None)
    (4000, 1000)
    """
    modern = nccl_version is None or tuple(nccl_version[:2]) >= PER_RANK_TUNING_VERSION
    if collective == "all_gather":
        return int(input_bytes if modern else input_bytes * gpus)
    if collective == "reduce_scatter":
        return int(input_bytes // gpus if modern else input_bytes)
    return int(input_bytes)


def bytes_per_gpu(collective: str, payload_bytes: float, gpus: int, nodes: int, algorithm: str) -> float:
    """Bytes each GPU moves for one collective, by the model of its algorithm (see module doc).

    Args:
        collective: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``reduce``.
        payload_bytes: nccl-tests' size ``S`` (:func:`nccl_tests_size`); the payload for all_reduce.
        gpus, nodes: ranks and nodes of the run (``1 <= nodes <= gpus``).
        algorithm: ``ring`` or ``tree`` (all_reduce); ``ring`` or ``pat`` (all_gather,
            reduce_scatter); any (all_to_all: point to point, ``S·(n−1)/n`` whatever the algorithm named, for
            ``n`` equal blocks); ``ring`` or ``tree`` (broadcast, reduce: ``S``).

    Raises:
        ValueError: negative payload, ``gpus < 1``, or ``nodes`` not in ``1..gpus``.
        ByteModelError: no model for this collective/algorithm (e.g. NVLS, CollNet), or a tree
            all_reduce on one node.

    >>> bytes_per_gpu("all_reduce", 100, 8, 2, "tree"), bytes_per_gpu("all_reduce", 100, 8, 2, "ring")
    (100.0, 175.0)
    >>> bytes_per_gpu("reduce_scatter", 100, 4, 1, "ring"), bytes_per_gpu("all_to_all", 100, 4, 1, "ring")
    (75.0, 75.0)
    """
    _check(payload_bytes, gpus, "gpus")
    if int(nodes) != nodes or not 1 <= nodes <= gpus:
        raise ValueError(f"nodes={nodes}: must be an integer in 1..gpus={gpus}")
    algo = algorithm.lower()
    if collective == "all_reduce":
        if algo == "ring":
            return ring_all_reduce_bytes(payload_bytes, gpus)
        if algo == "tree":
            return tree_all_reduce_bytes(payload_bytes, nodes)
    elif collective in ("all_gather", "reduce_scatter"):
        if algo in ("ring", "pat"):
            return all_gather_bytes(payload_bytes, gpus)
    elif collective == "all_to_all":
        return all_gather_bytes(payload_bytes, gpus)
    elif collective in ("broadcast", "reduce"):
        if algo in ("ring", "tree"):
            return float(payload_bytes) if gpus > 1 else 0.0
    raise ByteModelError(f"no byte model for {collective} with algorithm {algorithm!r}")


def bus_factor(collective: str, gpus: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``2(n−1)/n`` all_reduce, ``(n−1)/n`` all_gather,
    reduce_scatter and all_to_all, ``1`` broadcast and reduce (PERFORMANCE.md; ``alltoall.cu``).

    Raises:
        ValueError: ``gpus < 1``, or a collective nccl-tests gives no factor for.

    >>> bus_factor("all_reduce", 4), bus_factor("all_gather", 4), bus_factor("broadcast", 4)
    (1.5, 0.75, 1.0)
    >>> bus_factor("reduce_scatter", 4), bus_factor("all_to_all", 4)
    (0.75, 0.75)
    """
    _check(0, gpus, "gpus")
    if collective == "all_reduce":
        return 2.0 * (gpus - 1) / gpus
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (gpus - 1) / gpus
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"no nccl-tests bus factor for collective {collective!r}")


def algbw_GBps(size_bytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth ``S / t`` in GB/s (1e9 B/s); NaN when ``t <= 0``.

    >>> algbw_GBps(2e9, 0.5)
    4.0
    """
    return size_bytes / seconds / GB if seconds > 0 else math.nan


def busbw_GBps(collective: str, size_bytes: float, seconds: float, gpus: int) -> float:
    """nccl-tests' bus bandwidth ``algbw × bus_factor`` in GB/s (1e9 B/s).

    Raises:
        ValueError: see :func:`bus_factor`.

    >>> busbw_GBps("all_reduce", 2e9, 0.5, 2)
    4.0
    """
    return algbw_GBps(size_bytes, seconds) * bus_factor(collective, gpus)


def route_label(gpus: int, nodes: int, algorithm: str, transport: str | None = None) -> str:
    """The physical route of a collective: one node -> its GPU count, else the inter-node algorithm.

    ``transport`` (from the NCCL log's connection lines,
    :meth:`pnpscale.analysis.nccl_log.NcclLog.transport_label`) names the link when known, so that
    routes over different links get different rates.

    >>> route_label(4, 1, "ring"), route_label(8, 2, "tree"), route_label(64, 16, "ring")
    ('intra-node, 4 GPUs', 'inter-node tree', 'inter-node ring')
    >>> route_label(4, 1, "ring", "NVLink P2P"), route_label(2, 1, "ring", "SHM"), route_label(8, 2, "ring", "NET/IB")
    ('intra-node NVLink P2P, 4 GPUs', 'intra-node SHM, 2 GPUs', 'inter-node ring over NET/IB')
    """
    if nodes <= 1:
        return f"intra-node {transport}, {int(gpus)} GPUs" if transport else f"intra-node, {int(gpus)} GPUs"
    return f"inter-node {algorithm.lower()}" + (f" over {transport}" if transport else "")


#: ``|rel_error|`` beyond which one route rate is said to miss a row (a stated tolerance, not a fit statistic).
MISS_TOLERANCE = 0.25


def _model_bytes(coll: str, payload: float, gpus: int, nodes: int, algorithm: str | Mapping[str, str]) -> float:
    """:func:`bytes_per_gpu` of one recorded collective (its payload = one rank's input tensor, bytes); the
    algorithm by collective type when a mapping (types it lacks: ``ring``, the assumed model)."""
    algo = algorithm.get(coll, ASSUMED_ALGORITHM) if isinstance(algorithm, Mapping) else algorithm
    return bytes_per_gpu(coll, nccl_tests_size(coll, payload, gpus), gpus, nodes, algo)


def section_main_bytes(
    collectives: pd.DataFrame, gpus: int, nodes: int = 1, algorithm: str | Mapping[str, str] = "ring"
) -> pd.DataFrame:
    """Per section: its main (image-carrying) collectives and the bytes each GPU moves for them per iteration.

    The one rule the transfer table and the side-by-side comparison share (:func:`main_bytes_per_gpu` sums it
    over sections). The main collectives are the rows flagged MAIN in ``collectives.parquet``
    (:func:`pnpscale.analysis.metrics.mark_main`: the image-sized ones, or the bands / blocks that carry the
    image together, else the section's largest). Every main collective of the first rank in the measured
    (non-warm-up) iterations counts with its own byte model (:func:`bytes_per_gpu`, nccl-tests' size from
    :func:`nccl_tests_size`): a transfer chunked into bands (``solver.overlap=pipelined``) is the sum of its
    chunks, a reduce_scatter / all_gather pair is the sum of ``S·(n−1)/n`` of each; the sum is divided by the
    number of measured iterations.

    Args:
        collectives: rows of ``collectives.parquet`` (RANK, ITERATION, COLLECTIVE, PAYLOAD_BYTES, MAIN; SECTION,
            WARMUP and HIDDEN_S when present: without SECTION every row is one section ``""``, without WARMUP
            every row counts).
        gpus, nodes: ranks and nodes of the run.
        algorithm: the byte model, one name for every collective or ``{collective: algorithm}``.

    Returns:
        One row per section (order of first appearance): SECTION, COLLECTIVE (the main types joined by ``+`` in
        issue order), N_MAIN (main collectives per iteration, a float), BYTES_PER_GPU (bytes per iteration; 0.0 for one
        GPU; NaN when a main collective has no byte model or no payload, ``note`` says which),
        ``overlapped`` (True when a main collective ran partly hidden behind compute, HIDDEN_S > 0) and
        ``note`` ("" when the bytes are known).

    >>> c = pd.DataFrame({"rank": 0, "iteration": 1, "section": "d", "collective": "all_reduce",
    ...                   "payload_bytes": [1000, 1000, 2000], "main": True, "warmup": False})
    >>> section_main_bytes(c, 2)[["section", "n_main", "bytes_per_gpu"]].values.tolist()  # three bands: 4000 B
    [['d', 3.0, 4000.0]]
    """
    cols = [K.SECTION, K.COLLECTIVE, K.N_MAIN, K.BYTES_PER_GPU, "overlapped", "note"]
    rows = collectives[collectives[K.MAIN].astype(bool) & (collectives[K.RANK] == collectives[K.RANK].min())]
    if K.WARMUP in rows:
        rows = rows[~rows[K.WARMUP].astype(bool)]
    if K.SECTION not in rows:
        rows = rows.assign(**{K.SECTION: ""})
    if K.SEQ in rows:
        rows = rows.sort_values([K.ITERATION, K.SEQ], kind="stable")
    iterations = rows[K.ITERATION].nunique()
    out = []
    for section, g in rows.groupby(K.SECTION, sort=False):
        n_it = g[K.ITERATION].nunique()
        total, note = 0.0, ""
        for coll, payload in zip(g[K.COLLECTIVE].astype(str), g[K.PAYLOAD_BYTES], strict=True):
            if gpus <= 1:
                break
            if _na(payload):
                total, note = math.nan, f"a main {coll} has no recorded payload"
                break
            try:
                total += _model_bytes(coll, float(payload), gpus, nodes, algorithm)
            except ByteModelError as exc:
                total, note = math.nan, str(exc)
                break
        hidden = g[K.HIDDEN_S].astype("float64").fillna(0.0) if K.HIDDEN_S in g else pd.Series(0.0, index=g.index)
        out.append(
            {
                K.SECTION: section,
                K.COLLECTIVE: "+".join(dict.fromkeys(g[K.COLLECTIVE].astype(str))),
                K.N_MAIN: len(g) / n_it if n_it else 0.0,
                K.BYTES_PER_GPU: total / iterations if math.isfinite(total) else math.nan,
                "overlapped": bool((hidden > 0).any()),
                "note": note,
            }
        )
    return pd.DataFrame(out, columns=cols)


def main_bytes_per_gpu(
    collectives: pd.DataFrame, gpus: int, nodes: int = 1, algorithm: str | Mapping[str, str] = "ring"
) -> float:
    """Bytes each GPU moves per measured iteration for the main (image-carrying) collectives of a run.

    The sum over sections of :func:`section_main_bytes` (the one rule: every main collective with its own
    byte model, the chunks of a pipelined transfer summed). An all_reduce of ``P`` bytes gives
    ``2·P·(n−1)/n``; the denoiser's all_gather of per-rank buffers of ``L`` bytes gives ``n·L·(n−1)/n``.

    Args:
        collectives: the run's ``collectives.parquet`` (RANK, ITERATION, COLLECTIVE, PAYLOAD_BYTES, MAIN),
            with WARMUP merged in from ``ranks.parquet`` (warm-up rows are skipped; without the column
            every row counts).
        gpus, nodes: ranks and nodes of the run.
        algorithm: byte model (``ring`` by default: the model the report assumes without NCCL logs).

    Returns:
        bytes per GPU per iteration; 0.0 for one GPU; NaN when a main collective has no byte model or its
        payload is unknown, or there is no measured main collective.

    >>> c = pd.DataFrame({"rank": 0, "iteration": [1, 1], "collective": ["all_reduce", "all_gather"],
    ...                   "payload_bytes": [4000, 1000], "main": True, "warmup": False})
    >>> main_bytes_per_gpu(c, 4)  # 2·4000·3/4 + 4·1000·3/4
    9000.0
    """
    if gpus <= 1:
        return 0.0
    per = section_main_bytes(collectives, gpus, nodes, algorithm)
    if per.empty:
        return math.nan
    return float(per[K.BYTES_PER_GPU].sum(skipna=False))


# --- tables ----------------------------------------------------------------------------------


def section_transfers(sections: pd.DataFrame) -> pd.DataFrame:
    """Per section of one run: its main collective, payload and mean transfer per iteration.

    Args:
        sections: the run's ``sections.parquet`` (columns of :data:`pnpscale.columns.SECTIONS_COLUMNS`).

    Returns:
        One row per section (order of first appearance): SECTION, COLLECTIVE (main collective),
        PAYLOAD_BYTES (its payload, bytes, the largest over measured iterations), TRANSFER_S (mean of
        ``main_transfer_s`` over the measured iterations, seconds), ITERATIONS, and N_MAIN (mean main
        collectives per iteration) when ``sections`` has it. Sections without a
        collective (one rank) have NA payload and a transfer of NaN.

    Raises:
        ValueError: no measured (non-warm-up) iteration.
    """
    m = sections[~sections[K.WARMUP].astype(bool)]
    if m.empty:
        raise ValueError("no measured iteration (every row is warm-up)")
    g = m.groupby(K.SECTION, sort=False)
    out = pd.DataFrame(
        {
            K.COLLECTIVE: g[K.MAIN_COLLECTIVE].agg(lambda s: s.dropna().mode().iloc[0] if s.notna().any() else pd.NA),
            K.PAYLOAD_BYTES: g[K.MAIN_PAYLOAD_BYTES].max(),
            K.TRANSFER_S: g[K.MAIN_TRANSFER_S].mean(),
            K.ITERATIONS: g.size(),
        }
    )
    if K.N_MAIN in m:
        out[K.N_MAIN] = g[K.N_MAIN].mean()
    return out.reset_index()


def _column(df: pd.DataFrame, name: str, default: Any) -> pd.Series:
    return df[name] if name in df.columns else pd.Series(default, index=df.index, dtype=object)


def _na(v: Any) -> bool:
    return v is None or (not isinstance(v, str) and bool(pd.isna(v)))


def transfer_rows(runs: pd.DataFrame | Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Measured part of the transfer table: bytes per GPU, rate, bandwidths and route per row.

    Args:
        runs: one row per run x section with GPUS, SECTION, PAYLOAD_BYTES (nccl-tests' size of the
            section's main collective, bytes), TRANSFER_S (its transfer per iteration, seconds), and
            optionally PROBLEM, MODE, NODES, GPUS_PER_NODE, BACKEND, COLLECTIVE (default
            ``all_reduce``), ITERATIONS, ALGORITHM (from the NCCL log; missing = assumed ring),
            PROTOCOL, ALGORITHM_NOTE, TRANSPORT (from the NCCL log, names the route). NODES defaults
            to ``ceil(gpus / gpus_per_node)``, and to 1 for
            gloo.

    Returns:
        Columns :data:`pnpscale.columns.TRANSFER_COLUMNS` without the prediction (CALIBRATED_RATE_GBPS,
        PREDICTED_TRANSFER_S, REL_ERROR are NaN); rows without a collective (one GPU, NA payload or
        transfer) are dropped. RATE_GBPS = bytes per GPU / transfer / 1e9; NaN where the algorithm
        has no byte model (the note says why) or the transfer is 0.

    Raises:
        ValueError: a required column is missing, or a row's node count is unknown (not gloo and
            neither NODES nor GPUS_PER_NODE) or not in ``1..gpus``.
    """
    df = pd.DataFrame(list(runs)) if not isinstance(runs, pd.DataFrame) else runs.reset_index(drop=True)
    missing = [c for c in K.TRANSFER_INPUT_REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"transfer input lacks column(s) {', '.join(missing)}")
    opt = {c: _column(df, c, None).tolist() for c in K.TRANSFER_INPUT_OPTIONAL}
    given_bytes = K.BYTES_PER_GPU in df.columns
    rows = []
    for i in range(len(df)):
        r = {c: (None if _na(v := opt[c][i]) else v) for c in K.TRANSFER_INPUT_OPTIONAL}
        gpus, payload, transfer = df[K.GPUS].iloc[i], df[K.PAYLOAD_BYTES].iloc[i], df[K.TRANSFER_S].iloc[i]
        if _na(gpus) or int(gpus) <= 1 or _na(payload) or _na(transfer):
            continue
        gpus, payload, transfer = int(gpus), float(payload), float(transfer)
        nodes = _nodes(i, gpus, r)
        coll = r[K.COLLECTIVE] or "all_reduce"
        if r[K.ALGORITHM] is not None:
            algo, source, note = str(r[K.ALGORITHM]).lower(), SOURCE_LOG, r[K.ALGORITHM_NOTE] or ""
        else:
            algo, source = ASSUMED_ALGORITHM, SOURCE_ASSUMED
            why = r[K.ALGORITHM_NOTE] or ("gloo: no NCCL log" if r[K.BACKEND] == "gloo" else "no NCCL log")
            note = f"{why}; {ASSUMED_ALGORITHM} assumed"
        if given_bytes:  # the shared rule's bytes (section_main_bytes), from transfer_inputs
            given = r[K.BYTES_PER_GPU]
            nbytes = math.nan if given is None else float(given)
        else:
            try:
                nbytes = bytes_per_gpu(coll, payload, gpus, nodes, algo)
            except ByteModelError as exc:
                nbytes, note = math.nan, "; ".join(p for p in (note, str(exc)) if p)
        overlapped = bool(r[K.OVERLAPPED]) if r[K.OVERLAPPED] is not None else False
        if overlapped:
            note = "; ".join(p for p in (note, OVERLAPPED_NOTE) if p)
        try:
            busbw = busbw_GBps(coll, payload, transfer, gpus)
        except ValueError:
            busbw = math.nan
        rows.append(
            {
                K.PROBLEM: r[K.PROBLEM],
                K.MODE: r[K.MODE],
                K.SECTION: df[K.SECTION].iloc[i],
                K.GPUS: gpus,
                K.NODES: nodes,
                K.GPUS_PER_NODE: -(-gpus // nodes) if (per := r[K.GPUS_PER_NODE]) is None else int(per),
                K.BACKEND: r[K.BACKEND],
                K.COLLECTIVE: coll,
                K.ALGORITHM: algo,
                K.ALGORITHM_SOURCE: source,
                K.PROTOCOL: r[K.PROTOCOL],
                K.ALGORITHM_NOTE: note,
                K.ITERATIONS: r[K.ITERATIONS],
                K.PAYLOAD_BYTES: payload,
                K.BYTES_PER_GPU: nbytes,
                K.TRANSFER_S: transfer,
                K.RATE_GBPS: nbytes / transfer / GB if transfer > 0 else math.nan,
                K.ALGBW_GBPS: algbw_GBps(payload, transfer),
                K.BUSBW_GBPS: busbw,
                K.ROUTE: route_label(gpus, nodes, algo, r[K.TRANSPORT]),
                K.OVERLAPPED: overlapped,
                K.CALIBRATES: not overlapped and transfer > 0 and math.isfinite(nbytes),
            }
        )
    out = pd.DataFrame(rows, columns=list(K.TRANSFER_COLUMNS))
    for c in (K.CALIBRATED_RATE_GBPS, K.PREDICTED_TRANSFER_S, K.REL_ERROR):
        out[c] = np.nan
    out[K.MISSES] = False
    return out.astype({K.OVERLAPPED: "bool", K.CALIBRATES: "bool", K.MISSES: "bool", K.GPUS: "int64",
                       K.NODES: "int64", K.GPUS_PER_NODE: "int64", K.PAYLOAD_BYTES: "float64"})  # fmt: skip


def _nodes(i: int, gpus: int, r: Mapping[str, Any]) -> int:
    if r[K.NODES] is not None:
        nodes = int(r[K.NODES])
    elif r[K.GPUS_PER_NODE] is not None:
        nodes = -(-gpus // int(r[K.GPUS_PER_NODE]))
    elif r[K.BACKEND] == "gloo":
        nodes = 1
    else:
        raise ValueError(f"row {i}: number of nodes unknown (give nodes or gpus_per_node)")
    if not 1 <= nodes <= gpus:
        raise ValueError(f"row {i}: nodes={nodes} must be in 1..gpus={gpus}")
    return nodes


@dataclass(frozen=True)
class Calibration:
    """One rate per (backend, route) and the rows that made it.

    Attributes:
        rates: columns :data:`pnpscale.columns.RATES_COLUMNS`: BACKEND, ROUTE, RATE_GBPS (GB/s),
            N_ROWS, CALIBRATION (``"median"``, ``"reference"``, or ``"median (not in reference)"``),
            ROWS (the rows used, as ``problem/mode/section gpus=N`` labels).
        rows: the transfer-table rows used, with a CALIBRATION column.
    """

    rates: pd.DataFrame
    rows: pd.DataFrame


def _label(row: pd.Series) -> str:
    parts = [str(row[c]) for c in (K.PROBLEM, K.MODE, K.SECTION) if c in row and not _na(row[c])]
    return f"{'/'.join(parts)} gpus={int(row[K.GPUS])}"


def _key(df: pd.DataFrame) -> pd.Series:
    backend = df[K.BACKEND].astype(object).where(df[K.BACKEND].notna(), "")
    return backend.astype(str) + "\x00" + df[K.ROUTE].astype(str)


def _calibrates(table: pd.DataFrame) -> pd.Series:
    """Rows that may set a route rate: a finite rate, and exposed blocking transfer (CALIBRATES, when present)."""
    ok = pd.Series(np.isfinite(table[K.RATE_GBPS].astype("float64")), index=table.index)
    return ok & table[K.CALIBRATES].astype(bool) if K.CALIBRATES in table else ok


def calibrate(table: pd.DataFrame, reference: Mapping[str, Any] | pd.DataFrame | None = None) -> Calibration:
    """One rate per route: the median of RATE_GBPS over the route's calibration rows.

    Routes are keyed by (BACKEND, ROUTE). With an even number of rows the median is the mean of the
    two middle rates (pandas' median).

    Args:
        table: :func:`transfer_rows` output. Rows with a NaN rate, and overlapped rows (CALIBRATES false: their
            exposed transfer is not bytes / rate), are never used.
        reference: ``None``: every row calibrates its route. A mapping ``{column: value}`` selects
            the calibration rows of ``table`` (e.g. ``{"gpus": 8, "problem": "2d"}`` for one run).
            A DataFrame: :func:`transfer_rows` output of separate reference runs (e.g. a forced-ring
            2-node job). Routes the reference does not cover fall back to the median of their own
            rows, marked ``"median (not in reference)"``.

    Returns:
        :class:`Calibration`.

    Raises:
        ValueError: the reference selects no row with a rate, or names a column the table lacks.
    """
    usable = table[_calibrates(table)]
    if reference is None:
        ref, method = usable, "median"
    elif isinstance(reference, pd.DataFrame):
        ref, method = reference[_calibrates(reference)], "reference"
    else:
        bad = [c for c in reference if c not in table.columns]
        if bad:
            raise ValueError(f"reference names unknown column(s) {', '.join(bad)}")
        mask = pd.Series(True, index=usable.index)
        for c, v in reference.items():
            mask &= usable[c] == v
        ref, method = usable[mask], "reference"
    if reference is not None and ref.empty:
        what = dict(reference) if isinstance(reference, Mapping) else "table"
        raise ValueError(f"reference {what} selects no row with a rate")
    used = ref.assign(**{K.CALIBRATION: method})
    if reference is not None:
        rest = usable[~_key(usable).isin(set(_key(ref)))]
        used = pd.concat([used, rest.assign(**{K.CALIBRATION: "median (not in reference)"})], ignore_index=True)
    rates, order = [], []
    for _, g in used.groupby(_key(used), sort=False) if not used.empty else []:
        g = g.sort_values([c for c in (K.GPUS, K.PROBLEM, K.MODE, K.SECTION) if c in g.columns], kind="stable")
        rates.append(
            {
                K.BACKEND: g[K.BACKEND].iloc[0],
                K.ROUTE: g[K.ROUTE].iloc[0],
                K.RATE_GBPS: float(g[K.RATE_GBPS].median()),
                K.N_ROWS: len(g),
                K.CALIBRATION: g[K.CALIBRATION].iloc[0],
                K.ROWS: "; ".join(_label(row) for _, row in g.iterrows()),
            }
        )
        order.append(_route_order(g))
    rates = [r for _, r in sorted(zip(order, rates, strict=True), key=lambda p: p[0])]
    return Calibration(pd.DataFrame(rates, columns=list(K.RATES_COLUMNS)), used.reset_index(drop=True))


def _route_order(rows: pd.DataFrame) -> tuple[str, int, int, str]:
    """Sort key of a route's rates row: backend, then numerically by the fewest nodes and GPUs among its rows
    (``intra-node, 2 GPUs`` before ``intra-node, 16 GPUs``, intra-node before inter-node), then the label."""
    backend = rows[K.BACKEND].iloc[0]
    nodes = rows[K.NODES].astype("float64").min() if K.NODES in rows else np.nan
    gpus = rows[K.GPUS].astype("float64").min()
    return (
        "" if _na(backend) else str(backend),
        int(nodes) if np.isfinite(nodes) else 1,
        int(gpus) if np.isfinite(gpus) else 0,
        str(rows[K.ROUTE].iloc[0]),
    )


def predict(table: pd.DataFrame, calibration: Calibration) -> pd.DataFrame:
    """Predicted transfer per row from its route's rate, and the relative error.

    ``predicted_transfer_s = bytes_per_gpu / (rate_GBps × 1e9)``;
    ``rel_error = predicted_transfer_s / transfer_s − 1`` (positive: the prediction is slower).
    NaN where the route has no rate, the row no byte count, or the row is overlapped (its exposed transfer is
    not bytes / rate). MISSES: ``|rel_error| >`` :data:`MISS_TOLERANCE` (one rate does not explain the row).

    Returns:
        a copy of ``table`` with CALIBRATED_RATE_GBPS, PREDICTED_TRANSFER_S, REL_ERROR, MISSES filled.
    """
    out = table.copy()
    rate_of = dict(zip(_key(calibration.rates), calibration.rates[K.RATE_GBPS], strict=True))
    rate = _key(out).map(rate_of).astype("float64") if not out.empty else pd.Series(dtype="float64")
    out[K.CALIBRATED_RATE_GBPS] = rate
    out[K.PREDICTED_TRANSFER_S] = out[K.BYTES_PER_GPU].astype("float64") / (rate * GB)
    if K.OVERLAPPED in out:  # bytes / rate is no model of what an overlap leaves exposed
        out.loc[out[K.OVERLAPPED].astype(bool), K.PREDICTED_TRANSFER_S] = np.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        out[K.REL_ERROR] = out[K.PREDICTED_TRANSFER_S] / out[K.TRANSFER_S].astype("float64") - 1.0
    out[K.MISSES] = (out[K.REL_ERROR].abs() > MISS_TOLERANCE).fillna(False).astype(bool)
    return out


def transfer_table(
    runs: pd.DataFrame | Sequence[Mapping[str, Any]], reference: Mapping[str, Any] | pd.DataFrame | None = None
) -> pd.DataFrame:
    """The transfer table: :func:`transfer_rows`, calibrated (:func:`calibrate`) and predicted.

    One row per run x section with a collective; columns :data:`pnpscale.columns.TRANSFER_COLUMNS`.
    See :func:`transfer_rows` for the input and :func:`calibrate` for ``reference``.

    >>> t = transfer_table([{"gpus": g, "nodes": 1, "backend": "nccl", "section": "denoiser",
    ...                      "payload_bytes": 1e9, "transfer_s": 2e9 * (g - 1) / g / 40e9} for g in (2, 2)])
    >>> t[["route", "algorithm_source", "rate_GBps", "rel_error"]].round(9).values.tolist()[0]
    ['intra-node, 2 GPUs', 'assumed', 40.0, 0.0]
    """
    rows = transfer_rows(runs)
    return predict(rows, calibrate(rows, reference))


def plot_transfer(table: pd.DataFrame, ax: Any) -> Any:
    """Measured (solid, ``o``) and predicted (dashed, ``x``) transfer per iteration vs GPU count.

    One colour per (problem, mode, section); x axis log-2 with a tick per GPU count; y in seconds.
    Series whose algorithm was assumed say so in the legend. Series whose predictions are equal at every GPU
    count (the same bytes on the same routes: 2D inference's gradient and denoiser each send one image) share
    one dark grey predicted line, its label naming them all, instead of lines drawn over each other. Draws
    on ``ax`` only (no file, no show).

    Args:
        table: :func:`transfer_table` output. ax: a matplotlib Axes.

    Returns:
        ``ax``.
    """
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xlabel("GPUs")
    ax.set_ylabel("transfer per iteration (s)")
    ax.set_title("Transfer: measured vs predicted from one rate per route")
    if table.empty:
        ax.text(0.5, 0.5, "no multi-GPU rows: nothing to predict", ha="center", va="center", transform=ax.transAxes)
        return ax
    keys = [c for c in (K.PROBLEM, K.MODE, K.SECTION) if c in table.columns]
    predicted: dict[tuple[Any, ...], list[tuple[list[str], str, pd.DataFrame]]] = {}
    for i, (key, g) in enumerate(table.groupby(keys, dropna=False, sort=True)):
        g = g.sort_values(K.GPUS)
        parts = [str(k) for k in (key if isinstance(key, tuple) else (key,)) if not _na(k)]
        label = "/".join(parts) + (f" ({ASSUMED_ALGORITHM} assumed)" if _assumed(g) else "")
        color = f"C{i % 10}"
        ax.plot(g[K.GPUS], g[K.TRANSFER_S], marker="o", ls="-", color=color, label=f"{label}: measured")
        curve = tuple(zip(g[K.GPUS].astype(int), np.round(g[K.PREDICTED_TRANSFER_S].astype("float64"), 12),
                          strict=True))  # fmt: skip
        predicted.setdefault(curve, []).append((parts, color, g))
    # series with the same bytes on the same routes get the same prediction: one line for them, named so
    shared = 0  # shared lines are dark grey, told apart by their dashes
    for same in predicted.values():
        parts, color, g = same[0]
        label = "/".join(parts) + (f" ({ASSUMED_ALGORITHM} assumed)" if _assumed(g) else "")
        ls: Any = "--"
        if len(same) > 1:
            note = f"; {ASSUMED_ALGORITHM} assumed" if any(_assumed(s[2]) for s in same) else ""
            color, label = "0.2", f"{_shared_label([s[0] for s in same])} (same bytes, same route rates{note})"
            ls = _SHARED_DASHES[shared % len(_SHARED_DASHES)]
            shared += 1
        ax.plot(g[K.GPUS], g[K.PREDICTED_TRANSFER_S], marker="x", ms=8, ls=ls, color=color,
                label=f"{label}: predicted")  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted(int(x) for x in table[K.GPUS].unique())
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(t) for t in ticks])
    n = len(ax.get_legend_handles_labels()[1])
    # below the axes, where it hides no data
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1 if n <= 6 else 2)
    return ax


_SHARED_DASHES: tuple[Any, ...] = ("--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)))


def _assumed(rows: pd.DataFrame) -> bool:
    return bool((rows[K.ALGORITHM_SOURCE] == SOURCE_ASSUMED).any())


def _shared_label(labels: Sequence[Sequence[str]]) -> str:
    """One label for series drawn as one predicted line: their common leading parts once, then what differs.

    >>> _shared_label([["2d", "inference", "denoiser"], ["2d", "inference", "gradient"]])
    '2d/inference: denoiser = gradient'
    """
    common = 0
    while all(len(p) > common + 1 and p[common] == labels[0][common] for p in labels):
        common += 1
    head = "/".join(labels[0][:common])
    rest = " = ".join("/".join(p[common:]) for p in labels)
    return (f"{head}: " if head else "") + rest


# --- run folders -> transfer table input -------------------------------------------------------


def run_nccl_log(run_dir: Path | str) -> Any:
    """The merged NCCL logs of a run folder (``nccl/rank*.log``, :func:`pnpscale.analysis.nccl_log.merge_logs`),
    or ``None`` when it has none (gloo, or logs not kept).

    Raises:
        ValueError: a log that cannot be read (``str()`` is ``<file>: <reason>``): not a file, no permission,
            an I/O error, or a line the parser rejects.
    """

    parsed = []
    for p in sorted((Path(run_dir) / layout.NCCL_DIR).glob("rank*.log")):
        try:
            with open(p, errors="replace") as f:
                parsed.append(parse_nccl_log(f))
        except Exception as exc:  # noqa: BLE001 - any failure names the file
            reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
            raise UnreadableFile(p, reason) from None
    return merge_logs(parsed) if parsed else None


def transfer_inputs(run_dirs: Sequence[Path | str]) -> pd.DataFrame:
    """The input of :func:`pnpscale.results.transfer.transfer_table` from complete run folders.

    Per run (``run.json``: problem, mode, gpus, nodes, backend) and section (``sections.parquet``
    through :func:`pnpscale.results.transfer.section_transfers`): payload (nccl-tests' size), mean main
    transfer, and the algorithm NCCL logged for that collective in ``nccl/rank*.log`` when there is a log
    (:func:`pnpscale.analysis.nccl_log.algorithm_for`, looked up at the size NCCL prints:
    :func:`pnpscale.results.transfer.nccl_log_size`), else none, with the reason in ``algorithm_note``;
    the transport the log's connection lines show (``NVLink P2P``, ``SHM``, ``NET/IB``...) names the route.
    Folders whose ``run.json`` is not ``complete`` are skipped.

    Raises:
        FileNotFoundError: a complete run folder without ``sections.parquet``.
        ValueError: an NCCL log that cannot be read (:func:`run_nccl_log`).
    """

    rows = []
    for d in map(Path, run_dirs):
        try:
            run = read_record(d).to_dict()
        except RecordError:
            continue
        if run["status"] != layout.STATUS_COMPLETE:
            continue
        gpus, nodes, backend = int(run["gpus"]), int(run.get("nodes") or 1), run.get("backend")
        overlap = (run.get("spec") or {}).get("overlap")
        log = run_nccl_log(d)
        colls = run_main_collectives(d)
        for _, s in section_transfers(complete_sections(pd.read_parquet(d / layout.SECTIONS))).iterrows():
            coll = None if pd.isna(s[K.COLLECTIVE]) else str(s[K.COLLECTIVE])
            payload = None if pd.isna(s[K.PAYLOAD_BYTES]) else nccl_tests_size(coll or "", s[K.PAYLOAD_BYTES], gpus)
            main = colls[colls[K.SECTION].astype(str) == str(s[K.SECTION])] if colls is not None else None
            types = list(dict.fromkeys(main[K.COLLECTIVE].astype(str))) if main is not None and len(main) else []
            algo = proto = None
            notes: list[str] = []
            algos: dict[str, str] = {}
            if log is not None and coll and payload is not None:
                # TUNING lines print NCCL's own size, per rank for all_gather/reduce_scatter (NCCL >= 2.24);
                # each main type looked up at its largest payload
                version = version_tuple(log.version)
                for t in types or [coll]:
                    of_t = main[main[K.COLLECTIVE] == t] if main is not None and types else None
                    largest = of_t[K.PAYLOAD_BYTES].max() if of_t is not None else s[K.PAYLOAD_BYTES]
                    choice = algorithm_for(log, t, nccl_log_size(t, largest, gpus, version))
                    if choice.algorithm is None:
                        notes.append(choice.note)
                        algos = {}
                        break
                    algos[t], proto = choice.algorithm, choice.protocol
                    if choice.note:
                        notes.append(choice.note)
                if algos:
                    algo = "+".join(dict.fromkeys(algos.values()))
            elif backend == "gloo":
                notes.append("gloo: no NCCL log")
            else:
                notes.append(f"no NCCL log in {layout.NCCL_DIR}/")
            nbytes, overlapped = _section_bytes(s, main, coll, payload, gpus, nodes, algos or ASSUMED_ALGORITHM, notes)
            overlapped = overlapped or (overlap is not None and str(overlap) != "none")
            rows.append(
                {
                    K.PROBLEM: run.get("problem"),
                    K.MODE: run.get("mode"),
                    K.GPUS: gpus,
                    K.NODES: nodes,
                    K.GPUS_PER_NODE: math.ceil(gpus / nodes),
                    K.BACKEND: backend,
                    K.SECTION: s[K.SECTION],
                    K.COLLECTIVE: coll,
                    K.ITERATIONS: int(s[K.ITERATIONS]),
                    K.PAYLOAD_BYTES: payload,
                    K.TRANSFER_S: s[K.TRANSFER_S],
                    K.ALGORITHM: algo,
                    K.PROTOCOL: proto,
                    K.ALGORITHM_NOTE: "; ".join(n for n in notes if n),
                    K.TRANSPORT: log.transport_label(nodes > 1) if log is not None else None,
                    K.BYTES_PER_GPU: nbytes,
                    K.OVERLAPPED: overlapped,
                }
            )
    return pd.DataFrame(rows, columns=[*K.TRANSFER_INPUT_REQUIRED, *K.TRANSFER_INPUT_OPTIONAL])


#: share of a section's main collective time hidden behind compute above which its transfer counts as overlapped.
OVERLAPPED_HIDDEN_SHARE = 0.1


def run_main_collectives(run_dir: Path | str) -> pd.DataFrame | None:
    """The main collectives of a run folder's ``collectives.parquet`` with WARMUP from ``ranks.parquet``, or
    ``None`` when the folder has no ``collectives.parquet`` (hand-made or older folders).

    Raises:
        UnreadableFile: a ``collectives.parquet`` or ``ranks.parquet`` there that cannot be read.
    """
    d = Path(run_dir)
    if not (d / layout.COLLECTIVES).exists():
        return None
    try:
        colls = pd.read_parquet(d / layout.COLLECTIVES)
        ranks = pd.read_parquet(d / layout.RANKS, columns=[K.ITERATION, K.WARMUP])
    except Exception as exc:  # noqa: BLE001 - any failure names the file
        raise UnreadableFile(d / layout.COLLECTIVES, str(exc) or type(exc).__name__) from None
    warm = ranks.groupby(K.ITERATION)[K.WARMUP].first()
    colls = colls.assign(**{K.WARMUP: colls[K.ITERATION].map(warm).fillna(False).astype(bool)})
    if K.MAIN not in colls:
        return None
    return colls[colls[K.MAIN].astype(bool)]


def _section_bytes(
    s: pd.Series, main: pd.DataFrame | None, coll: str | None, payload: float | None, gpus: int, nodes: int,
    algorithm: str | Mapping[str, str], notes: list[str],
) -> tuple[float, bool]:
    """(bytes per GPU per iteration, overlapped) of one section: :func:`section_main_bytes` of its main
    collectives; without ``collectives.parquet`` the section's one main collective's model when it issued
    exactly one per iteration, else NaN (the reason appended to ``notes``)."""
    if main is not None and len(main):
        per = section_main_bytes(main, gpus, nodes, algorithm).iloc[0]
        if per["note"]:
            notes.append(str(per["note"]))
        blocked = main[K.BLOCKED_S].astype("float64").fillna(0.0).sum() if K.BLOCKED_S in main else 0.0
        hidden = main[K.HIDDEN_S].astype("float64").fillna(0.0).sum() if K.HIDDEN_S in main else 0.0
        share = hidden / (hidden + blocked) if hidden + blocked > 0 else 0.0
        return float(per[K.BYTES_PER_GPU]), bool(share > OVERLAPPED_HIDDEN_SHARE)
    if coll is None or payload is None:
        return math.nan, False
    n_main = s.get(K.N_MAIN)
    if n_main is not None and not _na(n_main) and float(n_main) > 1:
        notes.append(f"{float(n_main):g} main collectives per iteration and no {layout.COLLECTIVES}: bytes unknown")
        return math.nan, False
    try:
        algo = algorithm.get(coll, ASSUMED_ALGORITHM) if isinstance(algorithm, Mapping) else algorithm
        return bytes_per_gpu(coll, payload, gpus, nodes, algo), False
    except ByteModelError as exc:
        notes.append(str(exc))
        return math.nan, False
