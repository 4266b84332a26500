"""The run record: ``run.json``, typed and versioned, with its one writer and one reader.

:class:`RunRecord` is the schema of ``run.json`` (``schema_version`` :data:`SCHEMA_VERSION`);
:func:`read_record` is the only reader (it upgrades older records), :func:`write_record` /
:func:`update_record` the only writers (:func:`pnpscale.rank.commit.write_run`, rank 0, decomposes the
gathered rank tables and writes the run folder through them: tables staged and renamed together,
``run.json`` last). This module is part of the ground floor (:mod:`pnpscale.core`): it imports
nothing of pnpscale above it.

Schema history:

* 1 (no ``schema_version`` key; pnpscale 0.1 before the record was typed): ``metrics.sections.<s>``
  held totals over the measured iterations under the per-iteration names ``compute_s``, ``wait_s``...
* 2: those totals are ``compute_total_s``, ``compute_max_total_s``, ``transfer_total_s``,
  ``wait_total_s``, ``section_total_s`` (seconds summed over ``iterations`` measured iterations);
  ``started_at`` added; later, ``pid`` and ``host`` (optional: the process that supervises the
  point, so that a ``running`` record whose process is gone is reported as failed).
* 3: every summed measure of :data:`pnpscale.columns.MEASURES` is a total under its
  :func:`pnpscale.columns.total_name` (schema 2 kept the wait parts' totals under the per-iteration names
  ``wait_late_start_s``...); older records are upgraded on reading.
* 4: each plugin owns its keys: ``spec.blur_sigma`` is ``spec.params.blur_sigma`` (the problem's own
  parameters), ``spec.lr`` and ``spec.train_stepsize`` are in ``spec.mode_params`` (the mode's own); older
  records are upgraded on reading, the values kept as recorded (a record of schema 3 or before held them
  for every run, whether its problem or mode read them or not). ``fingerprint`` is unchanged: the digest
  is taken in the old layout (:meth:`pnpscale.core.config.RunSpec.fingerprint`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pnpscale.core import layout

if TYPE_CHECKING:
    from pnpscale.core.config import RunSpec
from pnpscale import columns as K
from pnpscale.core import __version__
from pnpscale.core.errors import PnpscaleError
from pnpscale.core.signals import deferred

SCHEMA_VERSION = 4


class RecordError(PnpscaleError, ValueError):
    """An unreadable ``run.json``: ``str()`` is ``<path>: <reason>``."""


@dataclass
class RunRecord:
    """The content of ``run.json`` (JSON object; units in the key names, times in seconds).

    Attributes:
        status: ``running``, ``complete`` or ``failed`` (a folder is complete exactly when this
            says ``complete``), or ``not_run``: a point its sweep asked for and never started (a stop
            came first; ``error`` says so).
        problem, mode, gpus: the point.
        scale, scale_requested: the size preset used, and the one asked for (``auto``).
        fingerprint: digest of ``spec`` (same point + same sizes = same digest; the resume rule).
        spec: the resolved :class:`~pnpscale.core.config.RunSpec` as a dict.
        config: the resolved Hydra config.
        error: the failure (first line: what happened; then the traceback tail), or ``None``.
        started_at, finished_at: ISO 8601 UTC.
        pid, host: the process supervising the point (the Hydra task) and its host: a ``running``
            record whose process is gone was killed before it could record its end.
        versions: python, torch, deepinv, nccl, pnpscale, platform, backend.
        backend, world_size, nodes, hosts, device_names, threads_per_rank: where it ran.
        time_shared, cores: whether the ranks time-shared CPU cores (ranks x threads > usable cores of a host) or
            GPUs, and the usable cores of the most loaded host (:func:`pnpscale.rank.commit.time_sharing`);
            ``None`` in records written before they were recorded.
        node_gpus: the GPUs each host holds, the fewest of any host (:func:`pnpscale.rank.commit.node_gpus`);
            ``None`` on CPU ranks, without NVML, and in records written before it was recorded.
        assignment: ``operators_per_rank``, ``tiles_per_rank``, ``num_tiles``.
        solver: mode-specific (training: ``losses``, ``grad_norms``), ``weights_sha256_per_rank``.
        timings: ``launch_s``, ``init_s``, ``setup_s``, ``measure_s``... (seconds).
        metrics: ``lb``, ``comm_e``, ``pe``, ``gpu_seconds_per_iteration``, ``iterations`` and
            ``sections.<name>`` totals over the measured iterations (``*_total_s``) with ``lb``,
            ``comm_e``, ``pe``.
        peak_memory: ``bytes_per_rank`` (the highest peak of any section of any iteration, warm-up
            included, per rank, bytes) and ``source`` (``cuda max_memory_allocated`` or ``cpu VmHWM``:
            the resident-set high-water mark, reset per section); see :func:`peak_memory`.
        files: the tables written.
        slurm: the SLURM job (id, state, nodes, logs...), SLURM runs only.
        processes: per rank (index = rank), how its process started: ``pid``, ``cuda_bad_fork``
            (forked from a process that had touched CUDA: always ``false`` in a complete run, the rank
            refuses to run otherwise), ``cuda_visible_devices`` and ``gpu_binding`` (the one GPU the
            launcher bound it to, ``null`` when not bound); see :func:`pnpscale.rank.process.process_info`.
        digests: ``{"algorithm": "sha256", "files": {name: hex digest}, "assignment": hex digest}``: each
            file of ``files`` and the canonical JSON of ``assignment`` as written, added by
            :func:`write_record` to a complete record (the last write of a run); checked on read
            (:func:`check_digests`): an edited table or assignment makes the point unreadable.
        extra: keys this version does not know (kept on rewrite).
    """

    status: str
    problem: str | None = None
    mode: str | None = None
    gpus: int | None = None
    scale: str | None = None
    scale_requested: str | None = None
    fingerprint: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    error: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    pid: int | None = None
    host: str | None = None
    versions: dict[str, Any] | None = None
    backend: str | None = None
    world_size: int | None = None
    nodes: int | None = None
    hosts: list[str] | None = None
    device_names: list[str] | None = None
    threads_per_rank: int | None = None
    time_shared: bool | None = None
    cores: int | None = None
    node_gpus: int | None = None
    assignment: dict[str, Any] | None = None
    solver: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    peak_memory: dict[str, Any] | None = None
    files: list[str] | None = None
    slurm: dict[str, Any] | None = None
    processes: list[dict[str, Any]] | None = None
    digests: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (``extra`` keys merged in, ``None``-valued optional blocks kept)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out

    def set(self, **fields: Any) -> RunRecord:
        """Set fields (unknown names go to :attr:`extra`); returns ``self``."""
        names = {f.name for f in dataclasses.fields(self)} - {"extra"}
        for k, v in fields.items():
            if k in names:
                setattr(self, k, v)
            else:
                self.extra[k] = v
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """Build from a ``run.json`` object of any schema version (upgraded to the current one).

        Raises:
            RecordError: not an object, no ``status``, a schema newer than this version reads, or a
                field of the wrong JSON type (``"gpus": "abc"``, ``gpus`` < 1, a nested field of
                :data:`NESTED_TYPES` of the wrong shape, e.g. an ``assignment`` that is not arrays of
                integers, or a per-rank array of a complete record without one entry per rank:
                :func:`check_nested`): ``str()`` names the field, its value and the shape it must have.
        """
        if not isinstance(data, dict):
            raise RecordError(f"not a JSON object ({type(data).__name__})")
        data = dict(data)
        version = data.pop("schema_version", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise RecordError(f"schema_version {version!r}: this pnpscale reads 1..{SCHEMA_VERSION}")
        if version < 3:
            data = _upgrade_totals(data)
        if version < 4:
            data = _upgrade_plugin_keys(data)
        if not isinstance(data.get("status"), str):
            raise RecordError("no status")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "schema_version"}
        known = {k: v for k, v in data.items() if k in names}
        for key, value in known.items():
            _check_type(key, value)
        if known.get("spec") is None:
            known.pop("spec", None)
        if known.get("gpus") is not None and known["gpus"] < 1:
            raise RecordError(f"gpus is {known['gpus']!r}: must be >= 1")
        check_nested(data)
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})


#: JSON type of each typed field of :class:`RunRecord` (``None`` is allowed for every field but ``status``).
_FIELD_TYPES: dict[str, type] = {
    "status": str, "problem": str, "mode": str, "gpus": int, "scale": str, "scale_requested": str,
    "fingerprint": str, "spec": dict, "config": dict, "error": str, "started_at": str, "finished_at": str,
    "pid": int, "host": str, "versions": dict, "backend": str, "world_size": int, "nodes": int, "hosts": list,
    "device_names": list, "threads_per_rank": int, "time_shared": bool, "cores": int, "node_gpus": int,
    "assignment": dict, "solver": dict, "timings": dict,
    "metrics": dict, "files": list, "slurm": dict, "processes": list,
}  # fmt: skip


_FIELD_TYPES["digests"] = dict


def _check_type(key: str, value: Any) -> None:
    """Raise :class:`RecordError` when ``value`` is not the JSON type of field ``key`` (an int is never a bool)."""
    want = _FIELD_TYPES.get(key)
    if want is None or (value is None and key != "status"):
        return
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise RecordError(f"{key} is {value!r} ({type(value).__name__}): must be {_JSON_NAMES[want]}")


_JSON_NAMES = {str: "a string", int: "an integer", dict: "an object", list: "an array", bool: "true or false"}


#: Nested fields readers use (the report, :func:`pnpscale.load`, resume), dotted path -> JSON shape:
#: ``int``, ``str``, ``object``, ``int[]`` (array of integers), ``int?[]`` (integers or null),
#: ``str[]``, ``object[]``. ``None`` is allowed for each (an older record without it).
NESTED_TYPES: dict[str, str] = {
    "spec.sizes": "object", "spec.sizes.num_operators": "int", "spec.linestyle": "str",
    "spec.denoiser_collective": "str", "spec.overlap": "str", "spec.overlap_chunks": "int",
    "spec.gradient_collective": "str",
    "assignment.operators_per_rank": "int[]", "assignment.tiles_per_rank": "int[]", "assignment.num_tiles": "int",
    "metrics.sections": "object", "metrics.iterations": "int",
    "peak_memory.bytes_per_rank": "int?[]", "slurm.nodes": "int",
    "hosts": "str[]", "device_names": "str[]", "anomalies": "object[]",
}  # fmt: skip
#: Per-rank arrays: one entry per rank (``gpus``) in a complete record.
PER_RANK_FIELDS = ("assignment.operators_per_rank", "assignment.tiles_per_rank", "device_names")
#: Keys every entry of ``anomalies`` has (:meth:`pnpscale.analysis.anomalies.Anomalies.records`).
ANOMALY_KEYS = {"kind": "str", "count": "int"}

_SHAPE_NAMES = {
    "int": "an integer", "str": "a string", "object": "an object", "int[]": "an array of integers",
    "int?[]": "an array of integers or nulls", "str[]": "an array of strings", "object[]": "an array of objects",
}  # fmt: skip


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fits(value: Any, shape: str) -> bool:
    one = {"int": _is_int, "str": lambda v: isinstance(v, str), "object": lambda v: isinstance(v, dict)}
    if not shape.endswith("[]"):
        return one[shape](value)
    item = shape[:-2]
    if not isinstance(value, list):
        return False
    if item.endswith("?"):
        return all(v is None or one[item[:-1]](v) for v in value)
    return all(one[item](v) for v in value)


def _nested(data: dict[str, Any], path: str) -> Any:
    value: Any = data
    for part in path.split("."):
        if not isinstance(value, dict):
            return None  # the parent's own shape is checked under its own path
        value = value.get(part)
    return value


def check_nested(data: dict[str, Any]) -> None:
    """The nested fields of a record (:data:`NESTED_TYPES`), the entries of ``anomalies``
    (:data:`ANOMALY_KEYS`), and in a complete record one entry per rank in :data:`PER_RANK_FIELDS`.

    Raises:
        RecordError: ``<field> is <value>: must be <shape>`` (or ``... N entries for gpus=G ...``).

    >>> try:
    ...     check_nested({"status": "complete", "gpus": 2, "assignment": {"operators_per_rank": [1]}})
    ... except RecordError as exc:
    ...     print(exc)
    assignment.operators_per_rank is [1]: 1 entry for gpus=2, must have one per rank
    """
    for path, shape in NESTED_TYPES.items():
        value = _nested(data, path)
        if value is not None and not _fits(value, shape):
            raise RecordError(f"{path} is {value!r}: must be {_SHAPE_NAMES[shape]}")
    for i, entry in enumerate(data.get("anomalies") or []):
        for key, shape in ANOMALY_KEYS.items():
            if not _fits(entry.get(key), shape):
                raise RecordError(f"anomalies[{i}].{key} is {entry.get(key)!r}: must be {_SHAPE_NAMES[shape]}")
    gpus = data.get("gpus")
    if data.get("status") == "complete" and _is_int(gpus):
        for path in PER_RANK_FIELDS:
            value = _nested(data, path)
            if value is not None and len(value) != gpus:
                n = len(value)
                entries = f"{n} entr{'y' if n == 1 else 'ies'}"
                raise RecordError(f"{path} is {value!r}: {entries} for gpus={gpus}, must have one per rank")
        check_world(data, data["gpus"])


def check_world(data: dict[str, Any], gpus: int) -> None:
    """A complete record's ``world_size`` and ``nodes`` agree with its ``gpus`` (the transfer model takes the
    route and the ring/tree bytes from ``nodes``): ``world_size = gpus``, ``1 <= nodes <= gpus``, and without
    SLURM (``slurm`` null: a local run) ``nodes`` = the number of ``hosts`` (SLURM's emulated nodes can share a
    host name, so there ``nodes`` is SLURM's count).

    Raises:
        RecordError: ``world_size is 7: must equal gpus=2``, ``nodes is 5: must be in 1..gpus=2``,
            ``nodes is 2, but hosts lists 1 host(s): ['vm']``.

    >>> check_world({"world_size": 2, "nodes": 1, "hosts": ["a"], "slurm": None}, 2)
    >>> try:
    ...     check_world({"nodes": 2, "hosts": ["vm"], "slurm": None}, 2)
    ... except RecordError as exc:
    ...     print(exc)
    nodes is 2, but hosts lists 1 host(s): ['vm']
    """
    world, nodes, hosts = data.get("world_size"), data.get("nodes"), data.get("hosts")
    if _is_int(world) and world != gpus:
        raise RecordError(f"world_size is {world!r}: must equal gpus={gpus}")
    if not isinstance(nodes, int) or isinstance(nodes, bool):
        return
    if not 1 <= nodes <= gpus:
        raise RecordError(f"nodes is {nodes!r}: must be in 1..gpus={gpus}")
    if not data.get("slurm") and isinstance(hosts, list) and hosts and nodes != len(hosts):
        raise RecordError(f"nodes is {nodes!r}, but hosts lists {len(hosts)} host(s): {hosts!r}")


def _upgrade_totals(data: dict[str, Any]) -> dict[str, Any]:
    """Schemas 1 and 2 kept some sums over iterations under the tables' per-iteration names: rename every
    summed measure's key (:data:`pnpscale.columns.MEASURES`) to its :func:`pnpscale.columns.total_name`."""

    summed = {*K.SUMMED, *K.SUMMED_OPTIONAL}
    metrics = data.get("metrics")
    if isinstance(metrics, dict) and isinstance(metrics.get("sections"), dict):
        metrics = dict(metrics)
        metrics["sections"] = {
            name: {(K.total_name(k) if k in summed else k): v for k, v in sec.items()} if isinstance(sec, dict) else sec
            for name, sec in metrics["sections"].items()
        }
        data["metrics"] = metrics
    return data


#: Schema 4 moved these ``spec`` keys into a plugin's own parameters: old key -> (node, key there).
MOVED_SPEC_KEYS = {"blur_sigma": ("params", "blur_sigma"), "lr": ("mode_params", "lr"),
                   "train_stepsize": ("mode_params", "train_stepsize")}  # fmt: skip


def _upgrade_plugin_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Schemas 1 to 3 kept the plugins' keys at the top of ``spec``: move each of :data:`MOVED_SPEC_KEYS` into
    its plugin's node (a value the node already holds wins)."""
    spec = data.get("spec")
    if not isinstance(spec, dict) or not any(k in spec for k in MOVED_SPEC_KEYS):
        return data
    spec = dict(spec)
    for old, (node, key) in MOVED_SPEC_KEYS.items():
        if old in spec:
            value = spec.pop(old)
            held = spec.get(node)
            spec[node] = {key: value, **(held if isinstance(held, dict) else {})}
    data["spec"] = spec
    return data


def read_record(run_dir: Path | str) -> RunRecord:
    """The record in ``run_dir/run.json`` (the one reader).

    Raises:
        RecordError: missing or unreadable file, invalid JSON, or not a run record
            (``str()`` names the file and the reason).
    """
    path = Path(run_dir) / layout.RUN_JSON
    try:
        data = layout.read_json(path)
    except OSError as exc:
        raise RecordError(f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RecordError(f"{path}: invalid JSON ({exc})") from None
    try:
        return RunRecord.from_dict(data)
    except RecordError as exc:
        raise RecordError(f"{path}: {exc}") from None
    except TypeError as exc:  # pragma: no cover - a key of the wrong shape
        raise RecordError(f"{path}: {exc}") from None


def write_record(run_dir: Path | str, record: RunRecord) -> None:
    """Write ``run_dir/run.json`` atomically (temporary file, then rename); the one writer.

    A ``complete`` record with ``files`` and no ``digests`` yet gets them here (:func:`digests_of`): the
    record is the last file a run writes, so the digests are of the tables as published; a later rewrite
    (the ``slurm`` block) keeps them.

    Raises:
        OSError: ``run.json`` (or a table being digested) could not be written or read.
    """
    if record.status == layout.STATUS_COMPLETE and record.files and record.digests is None:
        record.digests = digests_of(Path(run_dir), record.files, record.assignment)
    layout.write_json(Path(run_dir) / layout.RUN_JSON, record.to_dict())


#: The digest of the files and the assignment of a complete run (:func:`digests_of`).
DIGEST_ALGORITHM = "sha256"
#: Bytes read at a time while a file is digested.
_DIGEST_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """The hex :data:`DIGEST_ALGORITHM` digest of the bytes of ``path``.

    Raises:
        OSError: ``path`` cannot be read.
    """
    h = hashlib.new(DIGEST_ALGORITHM)
    with open(path, "rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def assignment_digest(assignment: dict[str, Any] | None) -> str:
    """The hex digest of ``assignment`` as canonical JSON (sorted keys, no spaces).

    >>> assignment_digest({"operators_per_rank": [2, 2]}) == assignment_digest({"operators_per_rank": [2, 2]})
    True
    >>> assignment_digest({"operators_per_rank": [2, 2]}) == assignment_digest({"operators_per_rank": [3, 1]})
    False
    """
    text = json.dumps(assignment, sort_keys=True, separators=(",", ":"))
    return hashlib.new(DIGEST_ALGORITHM, text.encode()).hexdigest()


def digests_of(run_dir: Path, files: list[str], assignment: dict[str, Any] | None) -> dict[str, Any]:
    """``{"algorithm", "files": {name: digest}, "assignment": digest}`` of a run folder's ``files`` (the ones
    present: a file named but absent is left out, and :func:`check_digests` then names it missing)."""
    out = {name: file_digest(run_dir / name) for name in files if (run_dir / name).is_file()}
    return {"algorithm": DIGEST_ALGORITHM, "files": out, "assignment": assignment_digest(assignment)}


def check_digests(run_dir: Path, record: RunRecord) -> tuple[Path, str] | None:
    """Whether a complete run's files and assignment are as written: ``None`` when they are (or the record
    has no digests: written before pnpscale recorded them), else ``(file, reason)`` for the first that is
    not: a table edited, cut or removed since (``<table>``), an assignment edited (``run.json``), or
    digests of the wrong shape (``run.json``).
    """
    got = record.digests
    if got is None:
        return None
    run_json = run_dir / layout.RUN_JSON
    files = got.get("files")
    if got.get("algorithm") != DIGEST_ALGORITHM or not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        return run_json, f"digests: not {DIGEST_ALGORITHM} digests of files ({str(got)[:80]})"
    for name in sorted(set(files) | set(record.files or [])):
        path = run_dir / name
        if name not in files:
            return path, "written after the run (not among the digests in run.json)"
        try:
            now = file_digest(path)
        except FileNotFoundError:
            return path, "missing (no such file)"
        except OSError as exc:
            return path, f"unreadable ({exc.strerror or exc})"
        if now != files[name]:
            return path, (f"edited since the run wrote it: its {DIGEST_ALGORITHM} differs from the digest in "
                          "run.json (a table is never rewritten in place)")  # fmt: skip
    if got.get("assignment") != assignment_digest(record.assignment):
        return run_json, (f"assignment {record.assignment} edited since the run wrote it (its "
                          f"{DIGEST_ALGORITHM} differs from the one in run.json's digests)")  # fmt: skip
    return None


def update_record(run_dir: Path | str, **fields: Any) -> RunRecord | None:
    """Set ``fields`` in an existing record (e.g. the ``slurm`` block); ``None`` when there is none."""
    try:
        record = read_record(run_dir)
    except RecordError:
        return None
    write_record(run_dir, record.set(**fields))
    return record


def provenance(backend: str) -> dict[str, Any]:
    """Versions of Python, torch, deepinv, NCCL (when CUDA) and pnpscale."""
    import deepinv
    import torch


    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - NCCL absent from this build
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepinv": deepinv.__version__,
        "nccl": nccl,
        "pnpscale": __version__,
        "platform": platform.platform(),
        "backend": backend,
    }


def peak_memory(ranks: Any, devices: list[str], reserved: list[int | None] | None = None) -> dict[str, Any]:
    """``run.json``'s ``peak_memory`` block from the ranks table (one row per rank, iteration, section).

    Args:
        ranks: the ranks table (columns ``rank`` and ``peak_mem_bytes``, bytes).
        devices: each rank's device name (``cpu: ...`` on CPU).
        reserved: CUDA runs: each rank's highest ``max_memory_reserved`` over its sections (bytes: what
            the caching allocator held, allocated or not; what the GPU must have), ``None`` on CPU.

    Returns:
        ``{"bytes_per_rank": [max bytes of rank 0, 1, ...], "max_bytes": ..., "source": ...}``
        (``None`` entries where a rank recorded no peak), plus ``reserved_bytes_per_rank`` and
        ``max_reserved_bytes`` when some rank gave ``reserved``.

    >>> import pandas as pd
    >>> peak_memory(pd.DataFrame({"rank": [0, 0, 1], "peak_mem_bytes": [5, 7, 6]}), ["cpu: x", "cpu: x"])
    {'bytes_per_rank': [7, 6], 'max_bytes': 7, 'source': 'cpu VmHWM (resident set high-water mark)'}
    """

    per = ranks.groupby(K.RANK)[K.PEAK_MEM_BYTES].max()
    values = [None if r not in per.index or per[r] != per[r] else int(per[r]) for r in range(len(devices))]
    known = [v for v in values if v is not None]
    cpu = all(str(d).startswith("cpu") for d in devices)
    out: dict[str, Any] = {
        "bytes_per_rank": values,
        "max_bytes": max(known) if known else None,
        "source": "cpu VmHWM (resident set high-water mark)" if cpu else "cuda max_memory_allocated",
    }
    held = [None if v is None else int(v) for v in (reserved or [])]
    if any(v is not None for v in held):
        out["reserved_bytes_per_rank"] = held
        out["max_reserved_bytes"] = max(v for v in held if v is not None)
    return out


def start_record(spec: RunSpec, config: dict[str, Any] | None) -> RunRecord:
    """The record of a point about to start (status ``running``): what is known before any rank runs."""
    return RunRecord(
        status=layout.STATUS_RUNNING,
        problem=spec.problem,
        mode=spec.mode,
        gpus=spec.gpus,
        scale=spec.scale,
        scale_requested=spec.scale_requested,
        fingerprint=spec.fingerprint(),
        spec=spec.to_dict(),
        config=config,
        started_at=now_iso(),
    )


#: Most bytes set aside in a running point's folder (:func:`reserve_space`): room for a failure record.
RESERVE_BYTES = 256 * 1024
#: The reserve is at most this fraction of the free space (a small disk keeps room for the point itself).
RESERVE_FRACTION = 1 / 16
#: Longest error text stored in a failure record (the first line is always kept whole).
MAX_ERROR_CHARS = 8000


def reserve_size(free_bytes: int) -> int:
    """Bytes :func:`reserve_space` sets aside on a disk with ``free_bytes`` free: :data:`RESERVE_BYTES`,
    at most :data:`RESERVE_FRACTION` of the free space, whole 4 KiB blocks.

    >>> reserve_size(10**9), reserve_size(320 * 1024), reserve_size(60 * 1024)
    (262144, 20480, 0)
    """
    return int(min(RESERVE_BYTES, free_bytes * RESERVE_FRACTION)) // 4096 * 4096


def reserve_space(run_dir: Path | str, nbytes: int | None = None) -> None:
    """Set space aside in ``run_dir`` (:data:`pnpscale.core.layout.RESERVE`), freed by :func:`write_failure`
    on a full disk so that the failure can be recorded in full; ``nbytes`` default :func:`reserve_size`
    of the disk's free space. Best effort: nothing is reserved when the disk has no room for it (the
    failure is still recorded: :func:`write_record_or_reserve`)."""
    path = Path(run_dir) / layout.RESERVE
    if nbytes is None:
        try:
            st = os.statvfs(run_dir)
            nbytes = reserve_size(st.f_bavail * st.f_frsize)
        except OSError:
            nbytes = 0
    if nbytes <= 0:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.ftruncate(fd, 0)  # no partial reserve: it would only take room from the point
    finally:
        os.close(fd)


def release_space(run_dir: Path | str) -> None:
    """Give back the space of :func:`reserve_space` (the point ended)."""
    (Path(run_dir) / layout.RESERVE).unlink(missing_ok=True)


def write_record_or_reserve(run_dir: Path | str, record: RunRecord) -> None:
    """:func:`write_record`; on a full disk, free the reserve and try again, then with the error cut short
    (no config), then by overwriting the existing ``run.json`` in place (:func:`overwrite_record`: its
    blocks are already allocated), so that a ``running`` record never stays behind.

    Raises:
        OSError: still no room (the disk is full and there is no earlier ``run.json`` to overwrite).
    """
    try:
        write_record(run_dir, record)
        return
    except OSError:
        release_space(run_dir)
    try:
        write_record(run_dir, record)
        return
    except OSError:
        pass
    small = RunRecord(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)})
    small.config, small.extra = None, {}
    small.error = (record.error or "").splitlines()[0][:MAX_ERROR_CHARS] if record.error else None
    try:
        write_record(run_dir, small)
    except OSError as exc:
        overwrite_record(Path(run_dir), small, exc)


def overwrite_record(run_dir: Path, record: RunRecord, full: OSError) -> None:
    """Write ``record`` over the existing ``run.json`` in place, padded with spaces to its old length (the
    last resort on a full disk: no new block is needed). Not atomic: used only when nothing else fits.

    Raises:
        OSError: ``full`` when there is no ``run.json`` or the record does not fit in it even without its
            spec and with a one-line error.
    """
    import json

    path = run_dir / layout.RUN_JSON
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        raise full from None
    try:
        size = os.fstat(fd).st_size
        doc = record.to_dict()
        data = json.dumps(doc, separators=(",", ":")).encode()
        if len(data) > size:  # the shortest record that still says what happened
            doc = {k: v for k, v in doc.items() if k not in ("spec", "config", "versions")}
            doc["error"] = str(doc.get("error") or "")[:200]
            data = json.dumps(doc, separators=(",", ":")).encode()
        if len(data) > size:
            raise full
        os.pwrite(fd, data + b" " * (size - len(data)), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_failure(
    run_dir: Path, spec: RunSpec, config: dict[str, Any] | None, exc: BaseException | str, **extra: Any
) -> None:
    """Record a failed run: ``run.json`` with status ``failed`` and the error; no tables.

    Keeps the fields of an existing ``run.json`` (e.g. written by rank 0 before it failed). Stop
    signals are held back while it writes; on a full disk the space of :func:`reserve_space` is
    used (:func:`write_record_or_reserve`).

    Raises:
        OSError: not even a short record fits on the disk.
    """

    with deferred():
        try:
            base = read_record(run_dir)
        except RecordError:
            base = start_record(spec, config)
        base.status, base.finished_at = layout.STATUS_FAILED, now_iso()
        text = exc if isinstance(exc, str) else error_text(exc)
        base.error = text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "\n[...]"
        write_record_or_reserve(run_dir, base.set(**extra))


def now_iso() -> str:
    """Now, ISO 8601 UTC to the second."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def error_text(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {exc}\n" + "\n".join(tb[-15:])


class RankFailureRecord:
    """A rank's failure record (:func:`pnpscale.core.layout.failure_file`): the launcher decides on its ``kind``
    (:func:`pnpscale.core.errors.failure_kind`), never on the error's text.

    Created when the rank starts, as :data:`SIZE` bytes holding ``{"kind": null}`` (no failure), so that
    writing the failure later rewrites those bytes in place and needs no new block of a full disk (the
    failure may be the full disk, and torch's own error file is written after it). A rank that could not
    create it records nothing: the launcher then knows no kind for it.
    """

    #: bytes of the record (a failure's fields beyond it are dropped, ``kind`` kept).
    SIZE = 512

    def __init__(self, run_dir: Path | str, rank: int) -> None:
        self.rank = rank
        self.fd: int | None = None
        path = layout.failure_file(run_dir, rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(self.fd, b'{"kind": null}'.ljust(self.SIZE), 0)
        except OSError:
            self.close()

    def write(self, kind: str, error_type: str, **where: Any) -> None:
        """Record the failure.

        Args:
            kind: :data:`pnpscale.core.errors.TIMEOUT` or the error's class name.
            error_type: the error's class name.
            where: ``own`` (a :class:`pnpscale.core.errors.PnpscaleError`: pnpscale's own error, a cause, never
                the echo of another rank's), ``iteration``, ``section``, ``waited_s`` (seconds in its last step),
                ``failed_at`` (Unix time of the failure, seconds: which of two timed-out ranks gave up first).
        """
        import json

        if self.fd is None:
            return
        data = json.dumps({"rank": self.rank, "kind": kind, "error_type": error_type, **where}).encode()
        if len(data) > self.SIZE:
            data = json.dumps({"rank": self.rank, "kind": kind, "own": bool(where.get("own"))}).encode()
        try:
            os.pwrite(self.fd, data.ljust(self.SIZE), 0)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write_rank_failure(run_dir: Path | str, rank: int, kind: str, error_type: str, **where: Any) -> None:
    """Create rank ``rank``'s :class:`RankFailureRecord` and record a failure in it (tests, tools)."""
    record = RankFailureRecord(run_dir, rank)
    record.write(kind, error_type, **where)
    record.close()


def clear_rank_failures(run_dir: Path | str, ranks: int) -> None:
    """Remove the failure records of ranks ``0..ranks-1`` (a launcher, before it starts them: an earlier attempt's
    records in the folder never speak for this one)."""
    for r in range(ranks):
        try:
            layout.failure_file(run_dir, r).unlink(missing_ok=True)
        except OSError:
            pass


def read_rank_failures(run_dir: Path | str, ranks: int) -> dict[int, dict[str, Any]]:
    """rank -> its failure record (:func:`write_rank_failure`), for the ranks ``0..ranks-1`` that wrote one."""
    import json

    out: dict[int, dict[str, Any]] = {}
    for r in range(ranks):
        try:
            data = json.loads(layout.failure_file(run_dir, r).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("kind"), str):
            out[r] = data
    return out
