"""Finding run folders under any directory and loading them as one tidy table.

A *point* is one (problem, mode, gpus), and its *variant* when the folder's runs differ in a
:data:`~pnpscale.core.config.VARIANT_KEYS` key within one (problem, mode) (a sweep over
``solver.denoiser_collective`` or ``problem.num_operators``: see :func:`variants`). A directory may
hold several sweeps and reruns: for each point the newest complete run wins (by ``finished_at``); a
point with no complete run is kept as a failed/incomplete point so that charts and tables show it as
missing instead of dropping it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pnpscale import columns as K
from pnpscale.analysis.metrics import (
    InvariantError,
    check_collectives_agree,
    check_rank_rows,
    check_section_rows,
    check_tables_agree,
    run_metrics,
    summarize,
)
from pnpscale.analysis.spread import spread
from pnpscale.analysis.tables import complete_sections
from pnpscale.core import layout
from pnpscale.core.config import VARIANT_KEYS
from pnpscale.core.errors import InputError, UnreadableFile
from pnpscale.core.lock import process_gone
from pnpscale.core.record import SCHEMA_VERSION, RecordError, check_digests, read_record
from pnpscale.results.summary import scaled_cost
from pnpscale.results.transfer import run_nccl_log

POINT = ["problem", "mode", "gpus"]
_HIVE = re.compile(
    r"^(problem|mode|gpus|denoiser_collective|num_operators|overlap|overlap_chunks|gradient_collective)=(.+)$"
)
#: Columns of :func:`load`, besides the per-section metrics of :func:`pnpscale.analysis.metrics.summarize`.
RUN_COLUMNS = [
    "run_dir",
    "status",
    "scale",
    "backend",
    "nodes",
    "world_size",
    "linestyle",
    "num_operators",
    "num_tiles",
    "variant",
    "denoiser_collective",
    "overlap",
    "overlap_chunks",
    "gradient_collective",
    K.TIME_SHARED,
    K.CORES,
    K.NODE_GPUS,
]
#: Metric columns of :func:`load` (NaN for failed points; present even when no run completed).
METRIC_COLUMNS = [
    "iterations", K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.SECTION_S, K.LB, K.COMM_E, K.PE,
    K.GPU_SECONDS, K.MAIN_PAYLOAD_BYTES, K.MAIN_TRANSFER_S, K.N_MAIN, K.OTHER_PAYLOAD_BYTES, *K.WAIT_CAUSES,
    *K.SPREAD_COLUMNS,
    K.HIDDEN_S, K.HIDDEN_SHARE,
]  # fmt: skip

#: Text columns of :func:`load`: pandas' ``str`` dtype (NaN where unknown), whatever their source.
TEXT_COLUMNS = [
    "problem", "mode", K.SECTION, "status", "error", "run_dir", "scale", "backend", "linestyle", "variant",
    "denoiser_collective", "overlap", "gradient_collective",
]  # fmt: skip
#: Integer counts of :func:`load`: ``Int64`` (NA for failed points or counts a run did not record).
COUNT_COLUMNS = [
    "iterations", K.N_MAIN, K.MAIN_PAYLOAD_BYTES, K.OTHER_PAYLOAD_BYTES, "nodes", "world_size", "num_operators",
    "num_tiles", "overlap_chunks", K.CORES, K.NODE_GPUS,
]  # fmt: skip


def typed(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with :data:`TEXT_COLUMNS` as ``str``, :data:`COUNT_COLUMNS` as ``Int64``, ``gpus`` as
    ``int64`` and TIME_SHARED as ``boolean``
    (the columns it has): the same dtypes whichever runs (complete, failed, none) it holds.

    >>> t = typed(pd.DataFrame({"problem": ["2d", None], "gpus": [1, 2], "n_main": [2.0, float("nan")]}))
    >>> [str(t[c].dtype) for c in t], t["n_main"].tolist()
    (['str', 'int64', 'Int64'], [2, <NA>])
    """
    out = table.copy()
    for col in TEXT_COLUMNS:
        if col in out:
            out[col] = out[col].astype("str")
    for col in COUNT_COLUMNS:
        if col in out:
            out[col] = pd.to_numeric(out[col]).astype("Int64")
    if "gpus" in out:
        out["gpus"] = out["gpus"].astype("int64")
    if K.TIME_SHARED in out:  # True / False / NA (unknown: older folders)
        out[K.TIME_SHARED] = pd.array([None if v is None or v is pd.NA or (isinstance(v, float) and v != v)
                                       else bool(v) for v in out[K.TIME_SHARED]], dtype="boolean")  # fmt: skip
    return out


#: Columns of ``sections.parquet`` the metrics are computed from (:data:`pnpscale.columns.SECTIONS_REQUIRED`):
#: a run folder lacking one is unreadable. Other columns (added by later versions) load as NA.
SECTIONS_REQUIRED = K.SECTIONS_REQUIRED
#: Every table of a run folder and the columns it must have (from :mod:`pnpscale.columns`).
REQUIRED_COLUMNS = {layout.RANKS: K.RANKS_REQUIRED, layout.COLLECTIVES: K.COLLECTIVES_REQUIRED,
                    layout.SECTIONS: K.SECTIONS_REQUIRED}  # fmt: skip
#: ``status`` of a run folder whose ``run.json`` or ``sections.parquet`` cannot be read (``error`` says why).
STATUS_UNREADABLE = "unreadable"


class NoRunsError(InputError, FileNotFoundError):
    """A directory without any run folder (``run.json`` or hive-style point folder)."""


@dataclass(frozen=True)
class Selection:
    """Chosen run per point.

    Attributes:
        runs: one row per point: POINT columns, ``run_dir``, ``status`` (``complete``,
            ``failed`` (also a ``running`` record whose process is gone: ``error`` says
            ``failed (process gone)``), ``running``/``incomplete`` for a folder whose run never
            finished, ``not_run`` for a point its sweep never started (a stop came first), ``unreadable``
            with ``error`` ``unreadable: <file>: <reason>``),
            ``finished_at``, ``error``, and run metadata.
        notes: one line per point that had more than one candidate, saying which run was used.
    """

    runs: pd.DataFrame
    notes: list[str]


def _point_from_path(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in path.parts:
        m = _HIVE.match(part)
        if m:
            out[m.group(1)] = int(m.group(2)) if m.group(1) == "gpus" and m.group(2).isdigit() else m.group(2)
    return out


def discover(root: str | Path) -> pd.DataFrame:
    """Every run folder under ``root``: folders with a ``run.json``, or hive-style point folders.

    Returns:
        one row per folder with POINT columns, run_dir, status, finished_at, error, scale,
        backend, nodes, world_size.

    Raises:
        NoRunsError: ``root`` does not exist or holds no run folder.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise NoRunsError(f"{root}: is a file, not a folder of run folders (give the sweep folder)")
    if not root.is_dir():
        raise NoRunsError(f"{root}: no such directory")
    rows, configured, works = [], [], []  # the variant keys as the run's spec set them; its work fields
    folders = {p.parent for p in root.glob(f"**/{layout.RUN_JSON}")}
    folders |= {p for p in root.glob("**/gpus=*") if p.is_dir() and "mode=" in str(p)}
    for d in sorted(folders):
        point = _point_from_path(d.relative_to(root) if d != root else Path(d.name))
        status, error = "incomplete", None
        try:
            run = read_record(d).to_dict()
            status = run["status"]
            error = (run.get("error") or "").splitlines()[0] if run.get("error") else None
            fields = _record_fields(run)
            moved = folder_disagreement(point, run)
            if moved:  # label the point as its folder does (the point asked for there), refuse the record
                status, error = STATUS_UNREADABLE, f"unreadable: {d / layout.RUN_JSON}: {moved}"
                run, fields = {k: point.get(k, run.get(k)) for k in POINT}, {}
        except RecordError as exc:
            run, fields = {}, {}
            if (d / layout.RUN_JSON).exists():
                status, error = STATUS_UNREADABLE, f"unreadable: {exc}"
        if status == layout.STATUS_RUNNING and process_gone(run.get("pid"), run.get("host"), run.get("started_at")):
            status, error = layout.STATUS_FAILED, gone_text(run)
        # an unreadable run.json: the point and its variant from the folder names
        variant = fields.get("variant") or {
            "denoiser_collective": point.get("denoiser_collective", "all_reduce"),
            "num_operators": int(point["num_operators"]) if str(point.get("num_operators", "")).isdigit() else pd.NA,
            "overlap": point.get("overlap", "none"),
            "overlap_chunks": int(point["overlap_chunks"]) if str(point.get("overlap_chunks", "")).isdigit() else pd.NA,
            "gradient_collective": point.get("gradient_collective", "all_reduce"),
        }
        row = {
            "problem": run.get("problem", point.get("problem")),
            "mode": run.get("mode", point.get("mode")),
            "gpus": run.get("gpus", point.get("gpus")),
            "run_dir": str(d),
            "status": status,
            "finished_at": run.get("finished_at") or _mtime(d),
            "error": error,
            "scale": run.get("scale"),
            "backend": run.get("backend"),
            "nodes": run.get("nodes"),
            "world_size": run.get("world_size"),
            "linestyle": fields.get("linestyle"),  # the problem's chart style
            **variant,
            "num_operators": fields.get("num_operators", variant["num_operators"]),
            "num_tiles": fields.get("num_tiles"),
            K.TIME_SHARED: run.get(K.TIME_SHARED),
            K.CORES: run.get(K.CORES),
            K.NODE_GPUS: run.get(K.NODE_GPUS),
        }
        if None not in (row["problem"], row["mode"], row["gpus"]):
            rows.append(row)
            configured.append(variant)
            works.append(work_fields(run.get("spec") or {}) if fields else {})
    if not rows:
        raise NoRunsError(f"{root}: no run folders found (no run.json under it)")
    df = pd.DataFrame(rows)
    df["gpus"] = df["gpus"].astype("int64")
    df["variant"] = variants(pd.DataFrame(configured, index=df.index).assign(problem=df["problem"], mode=df["mode"]))
    df["variant"] = work_variants(pd.DataFrame(works, index=df.index), df)
    return df


#: The fields of a run's spec that set the work of a point beside its GPU count and variant keys: runs of one
#: (problem, mode, variant) whose values differ are different series (:func:`work_variants`), never one curve;
#: ``inject``: a perturbation put in on purpose (``inject.*``, the validation suite's cases), see :func:`inject_text`.
WORK_FIELDS = ("sizes", "params", "channels", "threads_per_rank", "record_shapes", "mode_params", "inject")


def inject_text(inject: Any) -> str:
    """A run's ``inject.*`` as one token (no spaces: it goes in a variant label): ``none`` when nothing is
    injected, else e.g. ``rank1:denoiser:+0.2s`` (a delay of 0.2 s) or ``rank0:gradient:fail``, so that a run with
    a perturbation put in on purpose is never the measurement of a clean point.

    >>> inject_text({"rank": None, "section": None, "delay_s": 0.0, "fail": False})
    'none'
    >>> inject_text({"rank": 1, "section": "denoiser", "delay_s": 0.2, "fail": False})
    'rank1:denoiser:+0.2s'
    """
    if not isinstance(inject, dict) or not (inject.get("delay_s") or inject.get("fail")):
        return "none"
    what = [f"+{inject['delay_s']:g}s"] if inject.get("delay_s") else []
    what += ["fail"] if inject.get("fail") else []
    return ":".join([f"rank{inject.get('rank')}", str(inject.get("section") or "any"), *what])


def work_fields(spec: dict[str, Any]) -> dict[str, str]:
    """A run's :data:`WORK_FIELDS` (``sizes`` and ``params`` flattened: ``problem.overlap``, ...), as text;
    ``num_operators`` is a variant key already.

    >>> work_fields({"sizes": {"overlap": 8, "nc": [4, 8], "num_operators": 4}, "channels": 3})
    {'problem.overlap': '8', 'problem.nc': '[4, 8]', 'channels': '3'}
    """
    out: dict[str, str] = {}
    for key in WORK_FIELDS:
        value = spec.get(key)
        if isinstance(value, dict) and key in ("sizes", "params"):
            out |= {f"problem.{k}": str(v) for k, v in value.items() if k != "num_operators" and v is not None}
        elif key == "inject" and key in spec:
            out[key] = inject_text(value)
        elif value is not None:
            out[key] = str(value)
    return out


def work_variants(works: pd.DataFrame, runs: pd.DataFrame) -> pd.Series:
    """``runs``' variant labels, each with ``field=value`` added for every work field (:func:`work_fields`, one
    column each in ``works``) that takes several values among the runs of its (problem, mode, variant): a run
    made with ``problem.overlap=100`` beside a sweep made with 8 is its own series, so that no scaled cost
    divides one spec's GPU-seconds by another's (the choice of runs is per point: :func:`select`).

    >>> runs = pd.DataFrame({"problem": "2d", "mode": "inference", "variant": ["", "", ""]})
    >>> works = pd.DataFrame({"problem.overlap": ["8", "8", "100"], "channels": ["3", "3", "3"]})
    >>> work_variants(works, runs).tolist()
    ['problem.overlap=8', 'problem.overlap=8', 'problem.overlap=100']
    """
    label = runs["variant"].astype(str).copy()
    if works.empty:
        return label
    keys = [runs["problem"], runs["mode"], runs["variant"]]
    for col in works.columns:
        varied = works[col].groupby(keys).transform(lambda s: s.dropna().nunique()) > 1
        varied = varied & works[col].notna()
        label = label.where(~varied, (label + " " + col + "=" + works[col].astype(str)).str.strip())
    return label


def folder_disagreement(point: dict[str, Any], run: dict[str, Any]) -> str | None:
    """Where a run folder's hive parts (``problem=2d/mode=inference/gpus=4``, variant parts such as
    ``denoiser_collective=all_gather``) disagree with its ``run.json`` (or the record's ``problem``, ``mode``,
    ``gpus`` with its ``spec``'s), the reason; ``None`` when they agree.

    The record says what was measured, the folder names are what the report and :func:`load` label it
    with (the hive partition columns): a run folder moved or renamed into another point's place would
    otherwise be reported as that point, silently. Only the parts the folder has are compared.

    Args:
        point: the folder's parts, ``{key: value}`` (:func:`_point_from_path`; ``gpus`` an int).
        run: the record (:meth:`pnpscale.core.record.RunRecord.to_dict`).

    >>> folder_disagreement({"problem": "3d", "gpus": 2}, {"problem": "2d", "gpus": 2, "spec": {}})
    "problem is '2d', but its folder says problem=3d (moved or renamed?)"
    >>> folder_disagreement({"gpus": 4, "denoiser_collective": "all_gather"},
    ...                     {"gpus": 4, "spec": {"denoiser_collective": "all_gather"}}) is None
    True
    """
    spec = run.get("spec") or {}
    recorded = {k: run.get(k) for k in POINT} | _variant_fields(spec)
    for key, value in point.items():
        mine = recorded.get(key)
        if mine is None or mine is pd.NA or str(mine) != str(value):
            where = key if key in POINT else f"spec.{'sizes.' if key == 'num_operators' else ''}{key}"
            return f"{where} is {mine!r}, but its folder says {key}={value} (moved or renamed?)"
    for key in POINT:  # the record itself: its point and its spec's
        if key in spec and spec[key] != run.get(key):
            return f"spec.{key} is {spec[key]!r}, but {key} is {run.get(key)!r}"
    return None


def _record_fields(run: dict[str, Any]) -> dict[str, Any]:
    """The fields :func:`discover` takes from a record's ``spec`` and ``assignment`` (their shapes are
    checked by the record's schema, :func:`pnpscale.core.record.check_nested`)."""
    spec = run.get("spec") or {}
    variant = _variant_fields(spec)
    assignment = run.get("assignment") or {}
    ops = sum(assignment.get("operators_per_rank") or []) or variant["num_operators"]
    return {"variant": variant, "linestyle": spec.get("linestyle"), "num_operators": ops,
            "num_tiles": assignment.get("num_tiles")}  # fmt: skip


def _variant_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A run's values of the variant keys, from its ``run.json`` spec (defaults for older records)."""
    ops = (spec.get("sizes") or {}).get("num_operators")
    collective = spec.get("denoiser_collective") or "all_reduce"
    chunks = spec.get("overlap_chunks")
    return {
        "denoiser_collective": collective,
        "num_operators": ops if ops is not None else pd.NA,
        "overlap": spec.get("overlap") or "none",
        "overlap_chunks": chunks if chunks is not None else pd.NA,
        "gradient_collective": spec.get("gradient_collective") or "all_reduce",
    }


def variants(runs: pd.DataFrame) -> pd.Series:
    """Each run's variant label: ``key=value`` for every variant key that takes several values
    among the runs of its (problem, mode); ``""`` when none does (the plain point).

    >>> df = pd.DataFrame({"problem": ["2d", "2d", "ct"], "mode": "inference",
    ...                    "denoiser_collective": ["all_reduce", "all_gather", "all_reduce"],
    ...                    "num_operators": [8, 8, 16]})
    >>> variants(df).tolist()
    ['denoiser_collective=all_reduce', 'denoiser_collective=all_gather', '']
    >>> variants(pd.DataFrame({"problem": "2d", "mode": "inference", "overlap": ["none", "pipelined", "pipelined"],
    ...                        "overlap_chunks": [pd.NA, 2, 4]})).tolist()
    ['overlap=none', 'overlap=pipelined overlap_chunks=2', 'overlap=pipelined overlap_chunks=4']
    """

    label = pd.Series("", index=runs.index, dtype=object)
    for key in VARIANT_KEYS:
        if key not in runs:
            continue
        counts = runs.groupby(["problem", "mode"])[key].transform(lambda s: s.dropna().nunique())
        varied = counts > 1
        part = key + "=" + runs[key].astype(str)
        varied = varied & runs[key].notna()  # a key the run does not set (overlap_chunks without pipelined)
        label = label.where(~varied, (label + " " + part).str.strip())
    return label


def gone_text(run: dict[str, Any]) -> str:
    """The error shown for a ``running`` record whose process is gone."""
    return (
        f"failed (process gone): pid {run.get('pid')} on host {run.get('host')}, started {run.get('started_at')}, "
        "ended without recording its end (killed, or the machine went down)"
    )


def _mtime(d: Path) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(d.stat().st_mtime, dt.UTC).isoformat(timespec="seconds")


def select(runs: pd.DataFrame) -> Selection:
    """Newest complete run per point, else the newest failed/incomplete one (shown as missing)."""
    chosen, notes = [], []
    keys = POINT + (["variant"] if "variant" in runs else [])
    for point, grp in runs.groupby(keys, sort=True):
        complete = grp[grp["status"] == layout.STATUS_COMPLETE].sort_values("finished_at")
        pick = complete.iloc[-1] if not complete.empty else grp.sort_values("finished_at").iloc[-1]
        if len(grp) > 1:
            label = " ".join(f"{k}={v}" for k, v in zip(keys, point, strict=True) if v != "")
            kind = f"newest complete of {len(complete)}" if not complete.empty else "no complete run"
            notes.append(f"{label}: using {pick['run_dir']} ({kind}; {len(grp)} folders)")
        chosen.append(pick)
    return Selection(pd.DataFrame(chosen).reset_index(drop=True), notes)


def load(path: str | Path, include_failed: bool = True) -> pd.DataFrame:
    """One tidy table of every point under ``path``: one row per (run, section).

    Sections are the run's sections plus ``"all"`` (sums over sections). Metrics come from
    :func:`pnpscale.analysis.metrics.summarize` (the same code as ``run.json``), with time columns as
    **seconds per measured iteration**: ``compute_s``, ``compute_max_s``, ``transfer_s``,
    ``wait_s``, ``section_s``, ``main_transfer_s``, the wait parts ``wait_late_start_s``,
    ``wait_imbalance_s``, ``wait_jitter_s`` (NaN for runs older than the split); ratios ``lb``, ``comm_e``, ``pe``;
    ``gpu_seconds`` = gpus x section_s; ``main_payload_bytes``, ``n_main`` and ``other_payload_bytes``
    (per iteration, the largest over iterations); from ``run.json``: ``num_operators``, ``num_tiles``; the
    spread from one measured iteration to the next, p10 / p50 / p90 of the per-iteration values
    (:data:`pnpscale.columns.SPREAD_COLUMNS`: ``section_p10_s`` ... ``lb_p90``, :mod:`pnpscale.analysis.spread`)
    beside ``iterations``, the number of measured iterations they come from.
    Typed partition columns
    ``problem`` (str), ``mode`` (str), ``gpus`` (int) come from each run's ``run.json``, checked against its
    folder's own hive parts (:func:`folder_disagreement`: a run folder that disagrees is ``unreadable``).
    Failed or incomplete points appear once, with section ``"all"``, their ``status`` and NaN metrics
    (``include_failed=False`` drops them). Where several folders hold one point (sweeps run again, or
    into one output root), the newest complete run is used and said: one :class:`RunChoiceWarning` naming each
    choice, the same lines in ``table.attrs["choices"]`` (what the report prints).

    Raises:
        NoRunsError: no run folder under ``path``.
    """
    import warnings

    sel = select(discover(path))
    table = table_of(sel, path, include_failed)
    table.attrs["choices"] = list(sel.notes)
    if sel.notes:
        warnings.warn(
            f"{len(sel.notes)} point(s) under {path} have several run folders; the newest complete run is used: "
            + "; ".join(sel.notes), RunChoiceWarning, stacklevel=2)  # fmt: skip
    return table


class RunChoiceWarning(UserWarning):
    """:func:`load` chose one of several run folders of a point (the newest complete one)."""


def table_of(sel: Selection, path: str | Path, include_failed: bool = True) -> pd.DataFrame:
    """The tidy table of :func:`load` for an existing :class:`Selection` of runs under ``path``.

    A complete run whose ``sections.parquet`` cannot be read (truncated, or lacking one of
    :data:`SECTIONS_REQUIRED`), or whose ``ranks.parquet``, ``collectives.parquet`` or NCCL logs cannot
    be read (:func:`check_run_files`), becomes an ``unreadable`` point (``error``: ``unreadable: <file>:
    <reason>``) and the other points are loaded; columns a run folder lacks otherwise load as NA. (A
    ``run.json`` of the wrong shape is found by :func:`discover`: an ``unreadable`` point too.)
    Every later reader of a complete point's files (the report's wait and transfer tables, the
    comparison's bytes, the projection's algorithms) thus reads files already read whole here.
    """
    runs = sel.runs.copy()
    complete = runs[runs["status"] == layout.STATUS_COMPLETE]
    frames = []
    if not complete.empty:
        table, unreadable = _complete_table(complete, Path(path))
        if table is not None:
            frames.append(table)
        for run_dir, error in unreadable.items():
            hit = runs["run_dir"] == run_dir
            runs.loc[hit, "status"], runs.loc[hit, "error"] = STATUS_UNREADABLE, error
    if include_failed:
        bad = runs[runs["status"] != layout.STATUS_COMPLETE]
        if not bad.empty:
            frames.append(bad[POINT + RUN_COLUMNS + ["error"]].assign(section="all"))
    if not frames:
        return typed(pd.DataFrame(columns=POINT + [K.SECTION] + METRIC_COLUMNS + RUN_COLUMNS))
    out = pd.concat(frames, ignore_index=True)
    for col in METRIC_COLUMNS:
        if col not in out:
            out[col] = float("nan")
    first = POINT + [K.SECTION]
    out = typed(out[first + [c for c in out.columns if c not in first]])
    return out.sort_values(POINT + [K.SECTION], kind="stable").reset_index(drop=True)


def read_sections(path: Path, base: Path) -> pd.DataFrame:
    """One run's ``sections.parquet`` with its hive partition columns (``problem``, ``mode``, ``gpus``,
    typed by a pyarrow dataset); columns of :data:`pnpscale.columns.SECTIONS_COLUMNS` it lacks are NA.

    Raises:
        UnreadableFile: unreadable (a ``ValueError``; ``str()`` is ``<file>: <reason>``): not a parquet file, truncated,
            or lacking one of :data:`SECTIONS_REQUIRED`.
    """
    import pyarrow as pa
    import pyarrow.dataset as ds

    try:
        resolved = str(path.resolve())
        dataset = ds.dataset([resolved], format="parquet", partitioning=ds.partitioning(flavor="hive"),
                             partition_base_dir=str(base.resolve()))  # fmt: skip
        (frag,) = list(dataset.get_fragments())
        sections = frag.to_table().to_pandas()
        keys = ds.get_partition_keys(frag.partition_expression)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise UnreadableFile(path, _reason(exc, path)) from None
    check_columns(sections, path, SECTIONS_REQUIRED)

    for key, value in keys.items():
        sections[key] = value
    return complete_sections(sections)


def read_table(
    path: Path, columns: list[str] | None = None, required: tuple[str, ...] | list[str] = ()
) -> pd.DataFrame:
    """A run folder's parquet table (``ranks.parquet``, ``collectives.parquet``...), read whole.

    Args:
        path: the table.
        columns: read only these (each must exist); default every column.
        required: columns it must have (:func:`check_columns`).

    Raises:
        UnreadableFile: unreadable (a ``ValueError``; ``str()`` is ``<file>: <reason>``): missing, not a parquet file,
            truncated, or lacking one of ``columns``.
    """
    import pyarrow as pa

    try:
        table = pd.read_parquet(path, columns=columns)
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        raise UnreadableFile(path, _reason(exc, path)) from None
    check_columns(table, path, required)
    return table


def _reason(exc: BaseException, path: Path) -> str:
    """Why ``path`` could not be read, in one line: ``missing`` for a file that is not there (pyarrow's
    ``FileNotFoundError`` says only the path), else the first line of the error (its class if empty)."""
    if isinstance(exc, FileNotFoundError) or not path.exists():
        return "missing (no such file)"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_columns(table: pd.DataFrame, path: Path, columns: tuple[str, ...] | list[str]) -> None:
    """``table`` (read from ``path``) has every one of ``columns``, numeric where
    :data:`pnpscale.columns.NUMERIC_REQUIRED` says so.

    Raises:
        UnreadableFile: ``<file>: missing column(s) ...`` or ``<file>: column <c> is <dtype>, not numeric``.
    """
    missing = [c for c in columns if c not in table]
    if missing:
        raise UnreadableFile(path, f"missing column(s) {', '.join(missing)}")
    for c in columns:
        if c in K.NUMERIC_REQUIRED and not pd.api.types.is_numeric_dtype(table[c]):
            raise UnreadableFile(path, f"column {c} is {table[c].dtype}, not numeric")


def check_run_files(run_dir: Path, gpus: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read every file of a complete run folder that the report reads besides ``sections.parquet``:
    ``ranks.parquet``, ``collectives.parquet`` (whole, with their :data:`REQUIRED_COLUMNS`; every rank
    ``0..gpus-1`` present in ``ranks.parquet``, none other) and the NCCL logs ``nccl/rank*.log``
    (:func:`pnpscale.results.transfer.run_nccl_log`), so that a damaged one makes its point
    ``unreadable`` here, for the report and :func:`load` alike, instead of stopping the report later.

    Returns:
        the ``ranks.parquet`` and ``collectives.parquet`` tables (for :func:`check_consistent`).

    Raises:
        UnreadableFile: ``<file>: <reason>`` of the first unreadable file.
    """

    ranks = read_table(run_dir / layout.RANKS, required=REQUIRED_COLUMNS[layout.RANKS])
    if gpus is not None:
        seen = sorted(int(r) for r in ranks[K.RANK].dropna().unique())
        if seen != list(range(gpus)):
            raise UnreadableFile(run_dir / layout.RANKS, f"ranks {seen[:8]}{' ...' if len(seen) > 8 else ''}, "
                                 f"expected 0..{gpus - 1} (gpus={gpus})")  # fmt: skip
    collectives = read_table(run_dir / layout.COLLECTIVES, required=REQUIRED_COLUMNS[layout.COLLECTIVES])
    run_nccl_log(run_dir)
    return ranks, collectives


#: Relative tolerance of run.json's metrics against the same metrics computed from the tables (plus 1e-9
#: absolute): the record is written from those tables, so only a damaged or hand-edited file differs.
METRICS_REL = 1e-6


def check_consistent(
    run_dir: Path, ranks: pd.DataFrame, sections: pd.DataFrame, gpus: int, collectives: pd.DataFrame | None = None
) -> None:
    """A complete run folder's tables and ``run.json`` hold together: the invariants checked before the
    run was written, by the writer's own functions (:func:`pnpscale.analysis.metrics.check_rank_rows`,
    :func:`~pnpscale.analysis.metrics.check_section_rows`), the sections table as the decomposition of the
    ranks table (:func:`~pnpscale.analysis.metrics.check_tables_agree`), its main-collective columns as the
    collectives table's (:func:`~pnpscale.analysis.metrics.check_collectives_agree`), and ``run.json``'s ``metrics``
    (``lb``, ``comm_e``, ``pe``, ``gpu_seconds_per_iteration``, ``iterations`` and every per-section total it
    has; records of the current schema version only: older ones used older definitions) equal to
    :func:`~pnpscale.analysis.metrics.run_metrics` of the tables within :data:`METRICS_REL`.

    Raises:
        UnreadableFile: (a ``ValueError``) ``<file>: iteration <i> section <s> [rank <r>]: <the invariant>``, or
            ``<run.json>: metrics.<key> = <recorded>, the tables give <computed>``.
    """

    if collectives is None:
        collectives = pd.DataFrame()
    checks = ((layout.RANKS, lambda: check_rank_rows(ranks)), (layout.SECTIONS, lambda: check_section_rows(sections)),
              (layout.SECTIONS, lambda: check_tables_agree(ranks, sections)),
              (layout.SECTIONS, lambda: check_collectives_agree(collectives, sections)))  # fmt: skip
    for name, check in checks:
        try:
            check()
        except InvariantError as exc:
            raise UnreadableFile(run_dir / name, str(exc)) from None

    try:
        if layout.read_json(run_dir / layout.RUN_JSON).get("schema_version") != SCHEMA_VERSION:
            return  # an older record's metrics follow the definitions of its version (CommE over mean S)
        recorded = read_record(run_dir).metrics or {}
    except (RecordError, OSError, ValueError):
        return  # discover() already made it unreadable
    computed = run_metrics(sections, gpus)
    headline = ("lb", "comm_e", "pe", "gpu_seconds_per_iteration", "iterations")
    pairs: list[tuple[str, Any, Any]] = [(k, recorded.get(k), computed.get(k)) for k in headline if k in recorded]
    for sec, totals in (recorded.get("sections") or {}).items():
        mine = computed["sections"].get(sec)
        if mine is None:
            pairs.append((f"sections.{sec}", "recorded", None))
            continue
        pairs += [(f"sections.{sec}.{k}", v, mine.get(k)) for k, v in (totals or {}).items() if k in mine]
    for key, rec, comp in pairs:
        if not _agrees(rec, comp):
            raise UnreadableFile(run_dir / layout.RUN_JSON, f"metrics.{key} = {_num(rec)}, the tables give "
                                 f"{_num(comp)} (run.json's metrics are computed from them)")  # fmt: skip


def _num(value: Any) -> str:
    return f"{value:.9g}" if isinstance(value, float) else str(value)


def _agrees(recorded: Any, computed: Any) -> bool:
    if recorded is None or computed is None:
        return recorded is None and computed is None
    try:
        a, b = float(recorded), float(computed)
    except (TypeError, ValueError):
        return recorded == computed
    if a != a or b != b:  # NaN
        return a != a and b != b
    return abs(a - b) <= 1e-9 + METRICS_REL * abs(b)


def read_complete(run_dir: Path, base: Path, point: dict[str, Any]) -> tuple[pd.DataFrame, int, pd.DataFrame]:
    """A complete run folder read and validated as the report and :func:`load` read it (the one check of
    a run folder's tables: the digests run.json holds of its tables and assignment
    (:func:`pnpscale.core.record.check_digests`), :func:`read_sections`, :func:`check_run_files`,
    :func:`check_consistent`, then :func:`pnpscale.analysis.metrics.summarize`).

    Args:
        run_dir: the run folder. base: the folder its hive parts are relative to.
        point: its ``problem``, ``mode``, ``gpus`` (the record's, which :func:`discover` checked against the
            folder's own parts): the partition columns take these values, since pyarrow's hive partitioning
            takes the first ``key=`` part of the path, also one of a folder above the sweep
            (``results/problem=3d/<sweep>/problem=2d/...`` would label a 2d run ``3d``).

    Returns:
        (its sections table with the partition columns, its GPU count, the per-section summary:
        sums over the measured iterations).

    Raises:
        UnreadableFile: ``<file>: <reason>`` (an unexpected error is named with its class, against
            ``sections.parquet``).
    """

    try:
        edited = check_digests(run_dir, read_record(run_dir))
    except RecordError as exc:
        reason = str(exc).removeprefix(f"{run_dir / layout.RUN_JSON}: ")
        raise UnreadableFile(run_dir / layout.RUN_JSON, reason) from None
    if edited is not None:  # before any table is read: an edited table never reaches a number
        raise UnreadableFile(*edited)
    try:
        sections = read_sections(run_dir / layout.SECTIONS, base)
        gpus = int(point["gpus"])
        for key in POINT:
            sections[key] = gpus if key == "gpus" else point[key]
        ranks, collectives = check_run_files(run_dir, gpus)
        check_consistent(run_dir, ranks, sections, gpus, collectives)
        return sections, gpus, summarize(sections, gpus)
    except UnreadableFile:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a damaged folder makes the readers raise
        raise UnreadableFile(run_dir / layout.SECTIONS, f"{type(exc).__name__}: {exc}") from None


def unreadable_reason(run_dir: Path) -> str | None:
    """Why a run folder whose ``run.json`` says ``complete`` cannot be read as the report and :func:`load`
    read it (``<file>: <reason>``, from the same checks: the record, its folder's names,
    :func:`read_complete`); ``None`` when it can. The resume rule skips only a readable complete run."""
    run_dir = Path(run_dir)
    try:
        run = read_record(run_dir).to_dict()
    except RecordError as exc:
        return str(exc)
    moved = folder_disagreement(_point_from_path(Path(run_dir.name)), run)
    if moved:
        return f"{run_dir / layout.RUN_JSON}: {moved}"
    try:
        read_complete(run_dir, run_dir.parent, run)
    except UnreadableFile as exc:
        return str(exc)
    return None


def _complete_table(complete: pd.DataFrame, base: Path) -> tuple[pd.DataFrame | None, dict[str, str]]:
    """The metric rows of the complete runs, and ``run_dir -> "unreadable: <file>: <reason>"`` for the others."""

    rows, unreadable = [], {}
    for run_dir, info in complete.set_index("run_dir").iterrows():
        try:
            sections, gpus, summ = read_complete(Path(run_dir), base, {k: info[k] for k in POINT})
        except UnreadableFile as exc:  # one damaged folder never hides the others
            unreadable[str(run_dir)] = f"unreadable: {exc}"
            continue
        n_it = summ["iterations"].iloc[0]
        for c in (*K.SUMMED, *K.SUMMED_OPTIONAL):  # sums over iterations -> per measured iteration
            if c not in summ:  # a run folder written before the wait split (or hidden time): NaN, never 0
                summ[c] = float("nan")
            summ[c] = summ[c] / n_it
        measured = sections[~sections[K.WARMUP].astype(bool)]
        per = measured.groupby(K.SECTION).agg(
            main_payload_bytes=(K.MAIN_PAYLOAD_BYTES, "max"),
            main_transfer_s=(K.MAIN_TRANSFER_S, "mean"),
            n_main=(K.N_MAIN, "max"),
            other_payload_bytes=(K.OTHER_PAYLOAD_BYTES, "max"),
        )
        summ = summ.merge(per, left_on=K.SECTION, right_index=True, how="left")
        quantiles = spread(sections).drop(columns=[K.ITERATIONS])
        summ = summ.merge(quantiles.astype({K.SECTION: summ[K.SECTION].dtype}), on=K.SECTION, how="left")
        for k in ("problem", "mode"):
            summ[k] = info[k]
        summ["gpus"] = gpus
        summ["run_dir"] = run_dir
        for k in RUN_COLUMNS[1:]:
            summ[k] = info[k]
        rows.append(summ)
    return (pd.concat(rows, ignore_index=True) if rows else None), unreadable


def build_table(path: str | Path, echo: Callable[[str], None] = print) -> pd.DataFrame:
    """Discover, select (printing the choices), load and add scaled cost; prints one line per
    unreadable point (``... unreadable: <file>: <reason>``).

    Raises:
        NoRunsError: no run folder under ``path``.
    """
    sel = select(discover(path))
    for note in sel.notes:
        echo(note)
    table = table_of(sel, path)
    for line in unreadable_points(table):
        echo(line)
    return scaled_cost(table)


def unreadable_points(table: pd.DataFrame) -> list[str]:
    """One line per point of ``table`` whose run folder could not be read: ``<point>: unreadable: <file>: <reason>``."""
    bad = table[(table["status"] == STATUS_UNREADABLE) & (table[K.SECTION] == "all")]
    lines = []
    for _, r in bad.iterrows():
        variant = r.get(K.VARIANT) if isinstance(r.get(K.VARIANT), str) and r.get(K.VARIANT) else ""
        lines.append(f"{layout.point_label(r['problem'], r['mode'], int(r['gpus']), variant)}: {r['error']}")
    return lines
