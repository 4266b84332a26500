"""The pipelined variant projected from the blocking one: exposed transfer with the measured hidden share.

``solver.overlap=pipelined`` hides part of the exchanges' time behind the denoiser. A sweep with
``solver.overlap=none,pipelined`` measures, per GPU count, the pipelined variant's hidden share
``h = ΣH / (ΣH + ΣT + ΣW)`` over the iteration's sections (H hidden, T exposed transfer, W wait: the report's
side-by-side column, :func:`pnpscale.analysis.metrics.run_metrics`). Projected per N from the blocking
variant's model (:mod:`pnpscale.results.projection.model`; C_max its critical-path compute, T its transfer,
section ``all``):

* hidden ``H_p(N) = min(h·T(N), C_max(N))`` — the share of the blocking transfer that the pipelined path
  hides, never more than the compute it hides behind (a rank cannot overlap more than it computes);
* exposed ``T_p(N) = T(N) − H_p(N)`` (= ``T·(1 − h)`` while ``h·T <= C_max``);
* ``h`` held at its value at the largest measured multi-GPU count (within a CPU sweep's cores): the point
  nearest the projected ones. The share depends on how the denoiser's compute per rank compares with the
  exchanges, which changes with N; two or three noisy points do not identify a trend, so none is fitted, and
  a constant share is optimistic where compute shrinks faster than the transfer (the cap bounds it).
  Counting the wait in the denominator is conservative: some of what was hidden was time in flight before
  the last rank arrived.
* the crossover of a variant: the least N > 1 whose (exposed) transfer exceeds the critical-path compute,
  as :func:`pnpscale.results.projection.evaluate.findings` defines it; the compute is the blocking variant's
  for both (the same arithmetic).

Only the transfer is projected for the pipelined variant (its wait and time are not modelled). The check at
the measured points: the blocking model's T(N) with the held share against the pipelined variant's measured
exposed transfer. Units: seconds per iteration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pnpscale import columns as K
from pnpscale.results.projection.base import ALL, Model, ProjectionError
from pnpscale.results.projection.evaluate import evaluate

PIPELINED = "overlap=pipelined"
BLOCKING = "overlap=none"
#: one line when a sweep has no pipelined series (never a silent omission).
NO_PIPELINED = (
    "pipelined overlap: not projected: no solver.overlap=pipelined series in this sweep (a sweep with "
    "solver.overlap=none,pipelined measures the hidden share)"
)


def hidden_shares(rows: pd.DataFrame) -> pd.DataFrame:
    """The measured hidden share of one series per multi-GPU count, its sections summed.

    Args:
        rows: per-section rows of one series (GPUS, SECTION, HIDDEN_S, TRANSFER_S, WAIT_S; seconds per
            iteration); section ``all`` rows are ignored.

    Returns:
        One row per GPU count > 1: GPUS, HIDDEN_S, TRANSFER_S, WAIT_S (sums) and HIDDEN_SHARE
        ``= H / (H + T + W)`` (NaN where H is unknown or nothing was in flight).

    >>> t = pd.DataFrame({"gpus": [2, 2], "section": ["gradient", "denoiser"], "hidden_s": [0.0, 0.5],
    ...                   "transfer_s": [0.0, 0.25], "wait_s": [0.0, 0.25]})
    >>> hidden_shares(t)["hidden_share"].tolist()
    [0.5]
    """
    need = [K.GPUS, K.SECTION, K.HIDDEN_S, K.TRANSFER_S, K.WAIT_S]
    missing = [c for c in need if c not in rows]
    if missing:
        raise ProjectionError(f"pipelined rows lack column(s) {', '.join(missing)}: no hidden share")
    r = rows[(rows[K.SECTION] != ALL) & (rows[K.GPUS] > 1)]
    cols = [K.HIDDEN_S, K.TRANSFER_S, K.WAIT_S]
    out = r.groupby(K.GPUS)[cols].sum(min_count=1).reset_index()
    total = out[cols].sum(axis=1, min_count=3)
    out[K.HIDDEN_SHARE] = np.where(total > 0, out[K.HIDDEN_S] / total.where(total > 0), np.nan)
    return out.astype({K.GPUS: "int64"})


def held_share(shares: pd.DataFrame, cores: int | None = None) -> tuple[float, int]:
    """(share, N): the measured share at the largest multi-GPU count with a finite share (<= ``cores``).

    Raises:
        ProjectionError: no such point (no multi-GPU point, no hidden time recorded, or all past the cores).

    >>> held_share(pd.DataFrame({"gpus": [2, 4, 8], "hidden_share": [0.7, 0.6, float("nan")]}))
    (0.6, 4)
    """
    ok = shares[np.isfinite(shares[K.HIDDEN_SHARE].astype(float))]
    if cores is not None:
        ok = ok[ok[K.GPUS] <= cores]
    if ok.empty:
        raise ProjectionError(
            "no measured multi-GPU point with a hidden share"
            + (f" within the {cores} cores the CPU ranks share" if cores is not None else "")
        )
    top = ok.loc[ok[K.GPUS].idxmax()]
    share = float(top[K.HIDDEN_SHARE])
    if not 0 <= share <= 1:
        raise ProjectionError(f"hidden share {share:.4g} at gpus={int(top[K.GPUS])} is outside [0, 1]")
    return share, int(top[K.GPUS])


def pipelined_transfer(transfer_s: Any, compute_max_s: Any, share: float) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, hidden) seconds of the pipelined variant from the blocking one's transfer and critical-path
    compute (arrays of equal shape): ``hidden = min(share·T, C_max)``, ``exposed = T − hidden``.

    Raises:
        ProjectionError: ``share`` outside [0, 1], or a negative time.

    >>> e, h = pipelined_transfer([0.3, 0.3], [1.0, 0.1], 0.5)
    >>> e.round(6).tolist(), h.round(6).tolist()
    ([0.15, 0.2], [0.15, 0.1])
    """
    t, c = np.asarray(transfer_s, dtype=float), np.asarray(compute_max_s, dtype=float)
    if not 0 <= share <= 1:
        raise ProjectionError(f"hidden share {share!r}: must be in [0, 1]")
    if (t < 0).any() or (c < 0).any():
        raise ProjectionError("negative transfer or compute: no pipelined projection")
    hidden = np.minimum(share * t, c)
    return t - hidden, hidden


def crossover(gpus: Sequence[int], transfer_s: Any, compute_max_s: Any) -> int | None:
    """The least N > 1 whose transfer exceeds the critical-path compute; None if there is none.

    >>> crossover([1, 2, 4, 8], [0.0, 0.1, 0.3, 0.4], [1.0, 0.5, 0.3, 0.2])
    8
    """
    over = [int(n) for n, t, c in zip(gpus, transfer_s, compute_max_s, strict=True) if n > 1 and t > c]
    return min(over) if over else None


def grid(model: Model, gpus: Sequence[int], share: float) -> pd.DataFrame:
    """The blocking model at each N (section ``all``) beside the pipelined variant's projected transfer.

    Returns:
        Columns :data:`pnpscale.columns.OVERLAP_PROJECTION_COLUMNS` (seconds per iteration; HIDDEN_SHARE the
        share used).
    """
    a = evaluate(model, gpus)
    a = a[a[K.SECTION] == ALL].reset_index(drop=True)
    exposed, hidden = pipelined_transfer(a[K.TRANSFER_S], a[K.COMPUTE_MAX_S], share)
    out = a[[K.GPUS, K.NODES, K.COMPUTE_MAX_S, K.TRANSFER_S]].copy()
    out[K.PIPELINED_TRANSFER_S], out[K.PIPELINED_HIDDEN_S], out[K.HIDDEN_SHARE] = exposed, hidden, share
    return out[list(K.OVERLAP_PROJECTION_COLUMNS)]


@dataclass
class OverlapProjection:
    """The pipelined series projected from its blocking one.

    Attributes:
        blocking, pipelined, mode: the two series' labels and their mode.
        share, share_gpus: the hidden share held and the GPU count it was measured at.
        shares: :func:`hidden_shares` of the pipelined series.
        table: :func:`grid` at the measured and projected N and at both crossovers.
        checks: per measured multi-GPU count of the pipelined series: GPUS, the measured and the predicted
            exposed transfer (MEASURED_VALUE, PROJECTED_VALUE) and REL_ERROR.
        crossover_blocking, crossover_pipelined: :func:`crossover` of each over 1..``searched_up_to``.
        assumptions: stated in the report.
    """

    blocking: str
    pipelined: str
    mode: str
    share: float
    share_gpus: int
    shares: pd.DataFrame
    table: pd.DataFrame
    checks: pd.DataFrame
    crossover_blocking: int | None
    crossover_pipelined: int | None
    searched_up_to: int
    assumptions: list[str] = field(default_factory=list)


def project_pipelined(model: Model, pipelined: pd.DataFrame, gpus: Sequence[int], up_to: int,
                      labels: tuple[str, str]) -> OverlapProjection:  # fmt: skip
    """The pipelined series (its per-section rows ``pipelined``) projected from the blocking ``model``
    at ``gpus`` and searched for both crossovers over 1..``up_to`` (see the module doc).

    Raises:
        ProjectionError: no hidden share to hold (:func:`held_share`), or the blocking model cannot be
            evaluated there.
    """
    gpus = [n for n in gpus if model.cores is None or n <= model.cores]
    shares = hidden_shares(pipelined)
    share, at = held_share(shares, model.cores)
    measured = sorted(int(n) for n in shares[K.GPUS] if model.cores is None or n <= model.cores)
    search = grid(model, range(1, up_to + 1), share)
    cross = (crossover(search[K.GPUS], search[K.TRANSFER_S], search[K.COMPUTE_MAX_S]),
             crossover(search[K.GPUS], search[K.PIPELINED_TRANSFER_S], search[K.COMPUTE_MAX_S]))  # fmt: skip
    table = grid(model, sorted(set(gpus) | set(measured) | {1} | {n for n in cross if n}), share)
    checks = []
    for n in measured:
        got = float(shares.loc[shares[K.GPUS] == n, K.TRANSFER_S].iloc[0])
        pred = float(table.loc[table[K.GPUS] == n, K.PIPELINED_TRANSFER_S].iloc[0])
        checks.append({K.GPUS: n, "measured_value": got, "projected_value": pred,
                       K.REL_ERROR: pred / got - 1 if got > 0 else math.nan})  # fmt: skip
    listed = ", ".join(f"{int(r[K.GPUS])}: {r[K.HIDDEN_SHARE]:.2f}" for _, r in shares.iterrows())
    assumptions = [
        f"hidden share h = ΣH/(ΣH + ΣT + ΣW), sections summed, measured on {labels[1]} ({listed}); held at "
        f"N={at}'s {share:.3g} for every N (the largest measured multi-GPU count: no trend fitted)",
        f"pipelined exposed transfer = {labels[0]}'s projected transfer − min(h x transfer, critical-path "
        "compute) (= transfer x (1 − h) while the hidden part fits in the compute); compute: the blocking "
        "model's for both; the pipelined wait and time are not projected",
    ]
    return OverlapProjection(labels[0], labels[1], model.mode, share, at, shares, table, pd.DataFrame(checks),
                             cross[0], cross[1], up_to, assumptions)  # fmt: skip


def blocking_label(label: str, variant: str) -> str | None:
    """The blocking series' label of a pipelined series (``overlap=pipelined`` -> ``overlap=none``, its
    ``overlap_chunks`` dropped); None when ``variant`` is not pipelined.

    >>> blocking_label("2d overlap=pipelined overlap_chunks=2", "overlap=pipelined overlap_chunks=2")
    '2d overlap=none'
    >>> blocking_label("2d", "") is None
    True
    """
    parts = variant.split()
    if PIPELINED not in parts or not label.endswith(variant):
        return None
    base = label[: len(label) - len(variant)].strip()
    kept = [BLOCKING if p == PIPELINED else p for p in parts if not p.startswith("overlap_chunks=")]
    return " ".join([base, *kept]).strip()


def overlap_projections(
    pts: pd.DataFrame,
    models: Mapping[tuple[str, str], Model],
    searched: Mapping[tuple[str, str], int],
    skipped: Mapping[tuple[str, str], str],
    gpus: Sequence[int],
) -> tuple[dict[tuple[str, str], OverlapProjection], list[str]]:
    """Every pipelined series of ``pts`` (labelled per-section rows with VARIANT) projected from its blocking
    series' model.

    Args:
        pts: the projection's rows (PROBLEM the series label, VARIANT). models: (series, mode) -> fitted
            model. searched: (series, mode) -> the N searched for the findings. skipped: (series, mode) ->
            why it was not projected. gpus: the GPU counts projected.

    Returns:
        ``({(pipelined series, mode): OverlapProjection}, lines)``: one line per pipelined series not
        projected and why, or :data:`NO_PIPELINED` when the sweep has none.
    """
    out: dict[tuple[str, str], OverlapProjection] = {}
    lines: list[str] = []
    if K.VARIANT not in pts:
        pts = pts.assign(**{K.VARIANT: ""})
    keys = pts[[K.PROBLEM, K.MODE, K.VARIANT]].drop_duplicates([K.PROBLEM, K.MODE])
    found = False
    for _, k in keys.iterrows():
        label, mode = str(k[K.PROBLEM]), str(k[K.MODE])
        variant = "" if pd.isna(k[K.VARIANT]) else str(k[K.VARIANT])
        base = blocking_label(label, variant)
        if base is None:
            continue
        found = True
        why = None
        if (base, mode) not in models:
            why = skipped.get((base, mode), f"no blocking series `{base}` in this sweep")
        else:
            rows = pts[(pts[K.PROBLEM] == label) & (pts[K.MODE] == mode)]
            try:
                out[(label, mode)] = project_pipelined(models[(base, mode)], rows, gpus, searched[(base, mode)],
                                                       (base, label))  # fmt: skip
            except ProjectionError as exc:
                why = str(exc)
        if why is not None:
            lines.append(f"pipelined overlap: {label} {mode} not projected from {base}: {why}")
    if not found and "overlap" in pts and (pts["overlap"].astype(str) == "pipelined").any():
        return out, ["pipelined overlap: not projected: every run of the sweep is pipelined; no blocking "
                     "(solver.overlap=none) series to project from"]  # fmt: skip
    return out, (lines if found else [NO_PIPELINED])


def frame(overlap: Mapping[tuple[str, str], OverlapProjection]) -> pd.DataFrame:
    """Every :class:`OverlapProjection`'s table in one frame (:data:`pnpscale.columns.PROJECTION_OVERLAP_COLUMNS`;
    no row without a pipelined series)."""
    cols = list(K.PROJECTION_OVERLAP_COLUMNS)
    parts = [o.table.assign(**{K.PROBLEM: o.pipelined, K.MODE: o.mode, K.BLOCKING_SERIES: o.blocking})[cols]
             for _, o in sorted(overlap.items())]  # fmt: skip
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)


def markdown(o: OverlapProjection, tolerance: float) -> list[str]:
    """README lines of one :class:`OverlapProjection`: the crossovers, the check at the measured points
    (a miss beyond ``tolerance`` said in bold), the table, the assumptions."""

    def n(v: int | None) -> str:
        return f"N = {v}" if v else f"none up to {o.searched_up_to}"

    lines = [
        f"### Pipelined overlap: {o.pipelined} {o.mode} (projected from {o.blocking})",
        "",
        f"- crossover (exposed transfer > critical-path compute): blocking {n(o.crossover_blocking)}, "
        f"pipelined {n(o.crossover_pipelined)} (hidden share {o.share:.3g}, measured at N={o.share_gpus}, held)",
    ]
    if not o.checks.empty:
        parts = [f"N={int(r[K.GPUS])} {r['projected_value']:.4g} s vs {r['measured_value']:.4g} s "
                 f"({100 * r[K.REL_ERROR]:+.1f} %)" for _, r in o.checks.iterrows()]  # fmt: skip
        bad = o.checks[o.checks[K.REL_ERROR].abs() > tolerance]
        lead = (f"**the pipelined exposed transfer is missed by more than {100 * tolerance:g} % at its measured "
                "points**" if not bad.empty else "pipelined exposed transfer at its measured points")  # fmt: skip
        lines.append(f"- {lead} (projected vs measured): " + "; ".join(parts))
    lines.append("")
    view = o.table.rename(columns={K.TRANSFER_S: "blocking transfer_s", K.PIPELINED_TRANSFER_S: "pipelined transfer_s",
                                   K.PIPELINED_HIDDEN_S: "pipelined hidden_s"})  # fmt: skip
    lines += [view.drop(columns=[K.HIDDEN_SHARE]).to_markdown(index=False, floatfmt=".4g"), ""]
    lines += [f"- {a}" for a in o.assumptions] + [""]
    return lines
