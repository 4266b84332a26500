"""Column names of every table pnpscale writes (one place; never repeat them as literals).

Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_GBps`` 1e9 bytes per second.

``ranks.parquet`` — one row per rank x iteration x section:
    RANK, ITERATION, SECTION, WARMUP, START_S, SECTION_S, COMM_S, N_COLLECTIVES, PEAK_MEM_BYTES, GPU_SPAN_S,
    HIDDEN_S, GPU_START_S
    (SECTION_S on CUDA: CPU range start to last GPU end (pnpscale's runs) or the GPU span (other jobs' traces);
    GPU_SPAN_S: first to last GPU event, NaN on CPU; GPU_START_S: the first GPU event's start on the rank's
    clock, NaN on CPU: SECTION_S ends at GPU_START_S + GPU_SPAN_S;
    COMM_S: the time the rank was blocked on its collectives, their union minus its compute;
    HIDDEN_S: the collectives' time overlapped by compute; see pnpscale.analysis.overlap)

``collectives.parquet`` — one row per rank x iteration x section x collective:
    RANK, ITERATION, SECTION, SEQ, COLLECTIVE, START_S, DURATION_S, PAYLOAD_BYTES, MAIN, BLOCKED_S, HIDDEN_S,
    BLOCKED_SPANS_NS, PROCESS_GROUP
    (PROCESS_GROUP: the collective's process group: in other jobs' traces the trace's "Process Group Name"
    (NCCL's record_param_comms) the matcher keys it by, "p2p:<src>-><dst>" for a point-to-point transfer (its
    rows: those two ranks only), NA where the trace names none (gloo's collectives, matched by order); in
    pnpscale's own runs the group of its torch.distributed call (pnpscale.rank.profiling.attach_groups, "0" the
    default group); absent in older folders.
    DURATION_S: the work range or kernel; BLOCKED_S: the part of it the rank was blocked on, given to this
    collective; HIDDEN_S: the part overlapped by compute; BLOCKED_SPANS_NS: the blocked spans as text,
    "lo-hi,..." ns from START_S; NA in older folders = blocked throughout. START_S: the collective's start
    on the rank's clock, same origin as the rank's section START_S; absent, or NaN, in run folders written
    before it existed)

``sections.parquet`` — one row per iteration x section (the POP decomposition):
    ITERATION, SECTION, WARMUP, WORLD_SIZE, SECTION_S, SECTION_MAX_S, COMPUTE_S, COMPUTE_MAX_S,
    TRANSFER_S, WAIT_S, LB, N_COLLECTIVES, MAIN_COLLECTIVE, MAIN_PAYLOAD_BYTES, N_MAIN,
    MAIN_TRANSFER_S, OTHER_PAYLOAD_BYTES, WAIT_LATE_START_S, WAIT_IMBALANCE_S, WAIT_JITTER_S, HIDDEN_S,
    TIME_SHARED
    (TIME_SHARED: the point's ranks time-shared cores or GPUs, the same on every row; NA when unknown;
    HIDDEN_S: mean over ranks of the collectives' time overlapped by compute, not in C + T + W; the
    three wait parts sum to WAIT_S; see pnpscale.analysis.waits; NA in older run folders)

``timeline.json`` is built from the slices table of :func:`pnpscale.analysis.timeline_slices.slices`, one row per
rank x iteration x section x slice: TIMELINE_COLUMNS (KIND: compute | transfer | wait | hidden).

Spread (pnpscale.analysis.spread): per point and section, per-iteration quantiles ``<metric>_p10_s``,
``_p50_s``, ``_p90_s`` (``lb_p10``... for ratios): SPREAD_COLUMNS, beside ``iterations`` (measured ones).
"""

from typing import NamedTuple

RANK = "rank"
ITERATION = "iteration"
SECTION = "section"
WARMUP = "warmup"
START_S = "start_s"
SECTION_S = "section_s"
SECTION_MAX_S = "section_max_s"
COMM_S = "comm_s"
N_COLLECTIVES = "n_collectives"
PEAK_MEM_BYTES = "peak_mem_bytes"
GPU_SPAN_S = "gpu_span_s"
#: ranks.parquet: first GPU start of a CUDA section's work (rank's clock, seconds; NaN on CPU and in older folders).
GPU_START_S = "gpu_start_s"
#: per point (sections.parquet, summary.parquet, run.json): its ranks time-shared cores or GPUs (ranks x threads per
#: rank > the host's usable cores, or two ranks on one GPU): not a scaling result. NA: unknown (traces of other
#: jobs, older folders). See pnpscale.rank.commit.time_sharing.
TIME_SHARED = "time_shared"
#: run.json / summary.parquet: the usable CPU cores of the point's most loaded host (its ranks' affinity, union).
CORES = "cores"
#: run.json / summary.parquet: the GPUs the point's hosts hold, the fewest of any host (NVML's device count on a rank's
#: host: every GPU of the node outside a device cgroup, the job's GPUs inside one, so at least that many); NA on CPU
#: ranks, without NVML and in older folders. The projection's node size when every run sat on one node.
NODE_GPUS = "node_gpus"

SEQ = "seq"
COLLECTIVE = "collective"
DURATION_S = "duration_s"
PAYLOAD_BYTES = "payload_bytes"
MAIN = "main"

WORLD_SIZE = "world_size"
COMPUTE_S = "compute_s"
COMPUTE_MAX_S = "compute_max_s"
TRANSFER_S = "transfer_s"
WAIT_S = "wait_s"
LB = "lb"
COMM_E = "comm_e"
PE = "pe"
MAIN_COLLECTIVE = "main_collective"
MAIN_PAYLOAD_BYTES = "main_payload_bytes"
MAIN_TRANSFER_S = "main_transfer_s"
N_MAIN = "n_main"
OTHER_PAYLOAD_BYTES = "other_payload_bytes"
WAIT_LATE_START_S = "wait_late_start_s"
WAIT_IMBALANCE_S = "wait_imbalance_s"
WAIT_JITTER_S = "wait_jitter_s"
#: the wait split by cause (pnpscale.analysis.waits): late start + uneven work + jitter = wait.
WAIT_CAUSES = (WAIT_LATE_START_S, WAIT_IMBALANCE_S, WAIT_JITTER_S)
GPU_SECONDS = "gpu_seconds"
#: communication overlapped by computation (pnpscale.analysis.overlap): not part of C + T + W
HIDDEN_S = "hidden_s"
#: hidden / (hidden + transfer + wait): the share of the collectives' time that compute hid
HIDDEN_SHARE = "hidden_share"
BLOCKED_S = "blocked_s"
BLOCKED_SPANS_NS = "blocked_spans_ns"
#: collectives.parquet: the collective's process group (text, NA when unknown; see the module doc)
PROCESS_GROUP = "process_group"
KIND = "kind"

# --- how each measure of the sections table aggregates (one registry: run.json, the summary, load) ---
#: over iterations (and over the sections of the combined row ``all``): a time is summed; a ratio is
#: recomputed from the sums (never averaged); a count or payload is the largest.
SUM, RATIO = "sum", "ratio"


class Measure(NamedTuple):
    """One measure of a section: its column, unit, how it aggregates, and whether older folders lack it.

    Attributes:
        name: the column of ``sections.parquet`` and of the summary (per measured iteration there).
        unit: ``"s"`` seconds, ``"1"`` a ratio.
        over_iterations: :data:`SUM` (summed over the measured iterations; the summary and ``load`` show
            the sum / iterations, ``run.json`` the sum under :func:`total_name`) or :data:`RATIO`
            (recomputed from the sums, e.g. ``LB = ΣC / ΣC_max``).
        over_sections: the same rule for the combined row ``all`` (over the top-level sections).
        optional: absent in run folders written before it existed (NaN there, never 0).
    """

    name: str
    unit: str
    over_iterations: str
    over_sections: str
    optional: bool = False


MEASURES: tuple[Measure, ...] = (
    Measure(COMPUTE_S, "s", SUM, SUM),
    Measure(COMPUTE_MAX_S, "s", SUM, SUM),
    Measure(TRANSFER_S, "s", SUM, SUM),
    Measure(WAIT_S, "s", SUM, SUM),
    Measure(SECTION_S, "s", SUM, SUM),
    *(Measure(c, "s", SUM, SUM, optional=True) for c in WAIT_CAUSES),
    Measure(SECTION_MAX_S, "s", SUM, SUM, optional=True),
    Measure(HIDDEN_S, "s", SUM, SUM, optional=True),
    Measure(LB, "1", RATIO, RATIO),
    Measure(COMM_E, "1", RATIO, RATIO),
    Measure(PE, "1", RATIO, RATIO),
    Measure(HIDDEN_SHARE, "1", RATIO, RATIO, optional=True),
)
#: the measures summed over iterations: required ones, then those older folders may lack.
SUMMED = tuple(m.name for m in MEASURES if m.over_iterations == SUM and not m.optional)
SUMMED_OPTIONAL = tuple(m.name for m in MEASURES if m.over_iterations == SUM and m.optional)


def total_name(name: str) -> str:
    """``run.json``'s name of a summed measure's total over the measured iterations: ``compute_total_s``.

    >>> total_name("compute_s"), total_name("wait_late_start_s")
    ('compute_total_s', 'wait_late_start_total_s')
    """
    return name.removesuffix("_s") + "_total_s"


RANKS_COLUMNS = (
    RANK, ITERATION, SECTION, WARMUP, START_S, SECTION_S, COMM_S, N_COLLECTIVES, PEAK_MEM_BYTES, GPU_SPAN_S,
    HIDDEN_S, GPU_START_S,
)  # fmt: skip
COLLECTIVES_COLUMNS = (
    RANK, ITERATION, SECTION, SEQ, COLLECTIVE, START_S, DURATION_S, PAYLOAD_BYTES, MAIN,
    BLOCKED_S, HIDDEN_S, BLOCKED_SPANS_NS, PROCESS_GROUP,
)  # fmt: skip
SECTIONS_COLUMNS = (
    ITERATION, SECTION, WARMUP, WORLD_SIZE, SECTION_S, SECTION_MAX_S, COMPUTE_S, COMPUTE_MAX_S,
    TRANSFER_S, WAIT_S, LB, N_COLLECTIVES, MAIN_COLLECTIVE, MAIN_PAYLOAD_BYTES, N_MAIN, MAIN_TRANSFER_S,
    OTHER_PAYLOAD_BYTES, WAIT_LATE_START_S, WAIT_IMBALANCE_S, WAIT_JITTER_S,
    HIDDEN_S, TIME_SHARED,
)  # fmt: skip

#: Columns a run folder's table must have: the readers (metrics, wait by cause, the report, ``load``) need
#: them, so a folder lacking one is ``unreadable``; every other column (added by later versions) loads as NA.
RANKS_REQUIRED = (RANK, ITERATION, SECTION, WARMUP, SECTION_S)
COLLECTIVES_REQUIRED = (RANK, ITERATION, SECTION, SEQ, DURATION_S)
SECTIONS_REQUIRED = (ITERATION, SECTION, WARMUP, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S, WAIT_S, SECTION_S)
#: Of those, the numeric ones (a column of text there makes the folder ``unreadable`` too).
NUMERIC_REQUIRED = (RANK, ITERATION, SEQ, SECTION_S, DURATION_S, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S, WAIT_S)

#: the slices table behind timeline.json (pnpscale.analysis.timeline_slices): START_S on the rank's own clock.
TIMELINE_COLUMNS = (RANK, ITERATION, SECTION, WARMUP, KIND, START_S, DURATION_S, SEQ, COLLECTIVE, PAYLOAD_BYTES)

WAIT_PCT_OF_COMPUTE = "wait_pct_of_compute"
#: per-iteration quantiles (percent) kept for every point and section.
SPREAD_QUANTILES = (10, 50, 90)
#: metrics whose per-iteration spread is kept (pnpscale.analysis.spread).
SPREAD_METRICS = (SECTION_S, COMPUTE_S, TRANSFER_S, WAIT_S, LB, COMM_E, WAIT_PCT_OF_COMPUTE)


def spread_column(metric: str, q: int) -> str:
    """Name of the per-iteration ``q``-th percentile of ``metric`` (the unit suffix stays last).

    >>> spread_column("section_s", 10), spread_column("lb", 90), spread_column("wait_pct_of_compute", 50)
    ('section_p10_s', 'lb_p90', 'wait_pct_of_compute_p50')
    """
    stem, unit = (metric[:-2], "_s") if metric.endswith("_s") else (metric, "")
    return f"{stem}_p{q}{unit}"


SPREAD_COLUMNS = tuple(spread_column(m, q) for m in SPREAD_METRICS for q in SPREAD_QUANTILES)

# --- transfer explained (pnpscale.transfer): one row per run x section, and rates per route ---
PROBLEM = "problem"
MODE = "mode"
GPUS = "gpus"
NODES = "nodes"
GPUS_PER_NODE = "gpus_per_node"
BACKEND = "backend"
ITERATIONS = "iterations"
ALGORITHM = "algorithm"
ALGORITHM_SOURCE = "algorithm_source"  # "nccl_log" | "assumed"
ALGORITHM_NOTE = "algorithm_note"
PROTOCOL = "protocol"
BYTES_PER_GPU = "bytes_per_gpu"
RATE_GBPS = "rate_GBps"
ALGBW_GBPS = "algbw_GBps"
BUSBW_GBPS = "busbw_GBps"
ROUTE = "route"
TRANSPORT = "transport"  # from the NCCL log: "NVLink P2P", "SHM", "NET/IB GDRDMA"...
CALIBRATED_RATE_GBPS = "calibrated_rate_GBps"
PREDICTED_TRANSFER_S = "predicted_transfer_s"
REL_ERROR = "rel_error"
CALIBRATION = "calibration"
N_ROWS = "n_rows"
ROWS = "rows"

#: input of pnpscale.results.transfer.transfer_rows: one row per run x section (optional ones may be absent).
TRANSFER_INPUT_REQUIRED = (GPUS, SECTION, PAYLOAD_BYTES, TRANSFER_S)
#: transfer table: the row's transfer ran partly behind compute; it may set its route's rate; one rate misses it.
OVERLAPPED = "overlapped"
CALIBRATES = "calibrates"
MISSES = "misses"
TRANSFER_INPUT_OPTIONAL = (
    PROBLEM, MODE, NODES, GPUS_PER_NODE, BACKEND, COLLECTIVE, ITERATIONS, ALGORITHM, PROTOCOL, ALGORITHM_NOTE,
    TRANSPORT, BYTES_PER_GPU, OVERLAPPED,
)  # fmt: skip
TRANSFER_COLUMNS = (
    PROBLEM, MODE, SECTION, GPUS, NODES, GPUS_PER_NODE, BACKEND, COLLECTIVE, ALGORITHM, ALGORITHM_SOURCE, PROTOCOL,
    ALGORITHM_NOTE, ITERATIONS, PAYLOAD_BYTES, BYTES_PER_GPU, TRANSFER_S, RATE_GBPS, ALGBW_GBPS, BUSBW_GBPS, ROUTE,
    OVERLAPPED, CALIBRATES, CALIBRATED_RATE_GBPS, PREDICTED_TRANSFER_S, REL_ERROR, MISSES,
)  # fmt: skip
RATES_COLUMNS = (BACKEND, ROUTE, RATE_GBPS, N_ROWS, CALIBRATION, ROWS)

# --- projection (pnpscale.results.projection.output): one row per (problem, mode) x N x section ---
SCALED_COST = "scaled_cost"
MEASURED = "measured"
#: a projected row resting on a term its leave-one-out could not predict says which ("" otherwise).
CAVEAT = "caveat"


def band_column(metric: str, end: str) -> str:
    """The projection band's column of ``metric`` (``end`` ``lo``: 5 %, ``hi``: 95 %).

    >>> band_column("section_s", "lo"), band_column("pe", "hi")
    ('section_s_lo', 'pe_hi')
    """
    return f"{metric}_{end}"


#: the 5–95 % band of the projection (bootstrap over iterations and ranks; NaN without per-rank samples).
PROJECTION_BAND_COLUMNS = tuple(band_column(m, e) for m in (SECTION_S, SCALED_COST, COMM_E, PE) for e in ("lo", "hi"))
PROJECTION_COLUMNS = (
    PROBLEM, MODE, GPUS, NODES, SECTION, COMPUTE_S, COMPUTE_MAX_S, TRANSFER_S, WAIT_S, SECTION_S, LB, COMM_E, PE,
    GPU_SECONDS, SCALED_COST, ROUTE, RATE_GBPS, ALGORITHM, ALGORITHM_SOURCE, MEASURED, *PROJECTION_BAND_COLUMNS,
    CAVEAT,
)  # fmt: skip
#: the pipelined variant projected from the blocking one (pnpscale.results.projection.overlap), section ``all``
#: per N: the blocking model's COMPUTE_MAX_S and TRANSFER_S, the pipelined exposed transfer and hidden time (s)
#: under the held HIDDEN_SHARE.
PIPELINED_TRANSFER_S = "pipelined_transfer_s"
PIPELINED_HIDDEN_S = "pipelined_hidden_s"
OVERLAP_PROJECTION_COLUMNS = (
    GPUS, NODES, COMPUTE_MAX_S, TRANSFER_S, PIPELINED_TRANSFER_S, PIPELINED_HIDDEN_S, HIDDEN_SHARE,
)  # fmt: skip
#: report/projection_overlap.parquet: the rows above per pipelined series (PROBLEM, the series label) and the
#: blocking series it was projected from.
BLOCKING_SERIES = "blocking_series"
PROJECTION_OVERLAP_COLUMNS = (PROBLEM, MODE, BLOCKING_SERIES, *OVERLAP_PROJECTION_COLUMNS)
#: checks of the projection: one row per kind ("residual": the fit at its own points; "leave-one-out":
#: each measured N predicted without it) x N x section x metric; ``note`` says why a row has no numbers.
VALIDATION_COLUMNS = (
    PROBLEM, MODE, "kind", GPUS, "fitted_on", SECTION, "metric", "measured_value", "projected_value", REL_ERROR,
    "headline", "note",
)  # fmt: skip
# report/compare.parquet (pnpscale.results.compare): the varied keys side by side per GPU count
VARIANT = "variant"
SERIES = "series"
VARIED = "varied"
SECTION_VS_BASE = "section_vs_base"
TRANSFER_VS_BASE = "transfer_vs_base"
BYTES_VS_BASE = "bytes_vs_base"
#: the comparison's verdict vs the baseline (pnpscale.results.compare.noise_verdict)
NOISE = "noise"
#: how a point's run settings differ from the baseline's at its GPU count beyond the varied keys ("" when they agree)
DIFFERS = "differs"
#: |section time / baseline's - 1| at 1 GPU, where both series run the same code there (NaN elsewhere)
DRIFT_1GPU = "drift_1gpu"
COMPARE_COLUMNS = (
    MODE, VARIED, SERIES, GPUS, "status", TIME_SHARED, SECTION_S, TRANSFER_S, WAIT_S, HIDDEN_S, HIDDEN_SHARE, LB,
    COMM_E, SCALED_COST, BYTES_PER_GPU,
    SECTION_VS_BASE, TRANSFER_VS_BASE, BYTES_VS_BASE, ITERATIONS, spread_column(SECTION_S, 10),
    spread_column(SECTION_S, 90), NOISE, DIFFERS, DRIFT_1GPU,
)  # fmt: skip
