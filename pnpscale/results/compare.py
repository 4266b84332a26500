"""The remedies side by side: when a sweep varies ``problem``, ``solver.denoiser_collective``,
``problem.num_operators``, ``solver.overlap``, ``solver.overlap_chunks`` or ``solver.gradient_collective``, one row
per (mode, value, GPU count) with what each value costs.

Keys that vary (:func:`varied_keys`): ``problem`` when a mode's runs hold several problems; a
variant key (:data:`pnpscale.core.config.VARIANT_KEYS`) when it takes several values among the
runs of one (problem, mode) (:func:`pnpscale.results.runs.variants`). A *series* is one problem and
variant (``2d``, ``2d denoiser_collective=all_gather``, ``ct``); the first series of a mode in
order (``all_reduce`` before ``all_gather``, problems and operator counts sorted) is the baseline.

Per series and GPU count (:func:`comparison`, seconds per measured iteration summed over
sections): section time, transfer (exposed: blocked after the last rank arrived), wait, hidden (collective time
overlapped by compute, outside the section time) and the hidden share ``H / (H + T + W)``, LB, CommE,
scaled cost (GPU-seconds relative to the
series' own smallest GPU count) and bytes per GPU (the main collectives under the ring model,
:func:`pnpscale.results.transfer.main_bytes_per_gpu`), with section time, transfer and bytes
relative to the baseline series at the same GPU count, and whether the difference lies within the
spread from one measured iteration to the next (:func:`noise_verdict`): a difference is called a gain
(or a loss) only when it is beyond that noise, and only where it is also a fair comparison (:func:`verdicts`):
the two points ran the same work (scale preset and sizes, :func:`run_work`), neither is time-shared, and, for the
keys that change nothing on one rank (:data:`SAME_CODE_AT_1`), the difference exceeds the between-run drift that
the 1-GPU pair measures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from pnpscale import columns as K
from pnpscale.analysis.spread import MIN_ITERATIONS, too_few
from pnpscale.core import layout
from pnpscale.core.record import RecordError, read_record
from pnpscale.results.charts import mark_time_shared
from pnpscale.results.plotting import figure, log2_x
from pnpscale.results.runs import work_fields
from pnpscale.results.series import series_label
from pnpscale.results.transfer import main_bytes_per_gpu, run_main_collectives

ALL = "all"
COMPARE_PNG = layout.COMPARE_PNG
COMPARE = layout.COMPARE
#: Report columns -> (label, format) of the comparison's markdown.
_SHOW = {
    K.SECTION_S: ("section s", ".4g"),
    K.TRANSFER_S: ("exposed transfer s", ".4g"),
    K.WAIT_S: ("wait s", ".4g"),
    K.HIDDEN_S: ("hidden s", ".4g"),
    K.HIDDEN_SHARE: ("hidden share", ".2f"),
    K.LB: ("LB", ".3f"),
    K.COMM_E: ("CommE", ".3f"),
    K.SCALED_COST: ("scaled cost", ".3f"),
}


def varied_keys(table: pd.DataFrame) -> list[str]:
    """The compared keys that vary in ``table`` (``problem``, ``denoiser_collective``, ``num_operators``, ``overlap``,
    ``overlap_chunks``, ``gradient_collective``).

    >>> t = pd.DataFrame({"problem": ["2d", "ct"], "mode": "inference", "variant": ""})
    >>> varied_keys(t)
    ['problem']
    """
    keys = []
    if (table.groupby("mode")["problem"].nunique() > 1).any():
        keys.append("problem")
    if K.VARIANT in table:
        for v in table[K.VARIANT].dropna().astype(str):
            for part in v.split():
                key = part.split("=", 1)[0]
                if key not in keys:
                    keys.append(key)
    return keys


def _order(series: pd.Series) -> list[str]:
    """Series in baseline-first order: all_reduce before all_gather or reduce_scatter, overlap=none before
    pipelined, else sorted (numbers numerically)."""

    def key(label: str) -> tuple:
        for default in ("denoiser_collective=all_reduce", "overlap=none", "gradient_collective=all_reduce"):
            label = label.replace(default, default.split("=")[0] + "=0")
        parts = label.split()
        return tuple((0, int(p.split("=")[1])) if p.split("=")[-1].isdigit() else (1, p) for p in parts)

    return sorted(dict.fromkeys(series), key=key)


def run_bytes_per_gpu(run_dir: str | Path, gpus: int, nodes: int) -> float:
    """Bytes per GPU per measured iteration of a run folder's main collectives (ring model), by the rule the
    transfer table uses (:func:`pnpscale.results.transfer.main_bytes_per_gpu`: every main collective with its
    own byte model, a pipelined transfer's bands summed); NaN when unknown (no or a damaged
    ``collectives.parquet``)."""

    if gpus <= 1:
        return 0.0
    try:
        colls = run_main_collectives(Path(run_dir))
    except ValueError:  # damaged (table_of reports a damaged complete run as unreadable)
        return float("nan")
    if colls is None:
        return float("nan")
    return main_bytes_per_gpu(colls, int(gpus), int(nodes or 1))


BASELINE, WITHIN, BEYOND, TOO_FEW = "baseline", "within noise", "beyond noise", "too few iterations"
#: Verdicts that override the noise test (:func:`verdicts`): the 1-GPU pair of a :data:`SAME_CODE_AT_1` key; a
#: difference no larger than that pair's; a time-shared point (either side); runs of different work.
SAME_CODE, DRIFT, SHARED, SIZES = "same code", "within drift", "time-shared", "sizes differ"

#: Variant keys whose values run the same code on one rank: they only choose a collective, which one rank skips
#: (:class:`pnpscale.rank.denoiser` ``GatherTiledProcessing`` returns its local result undistributed, as deepinv's
#: ``DistributedProcessing`` does; :class:`pnpscale.rank.gradient.WindowedGradient` is inactive on one rank).
#: ``solver.overlap`` and ``solver.overlap_chunks`` are not among them: the pipelined step
#: (:mod:`pnpscale.rank.pipeline`) splits the denoiser into row bands and copies its buffers on one rank too.
SAME_CODE_AT_1 = ("denoiser_collective", "gradient_collective")


def variant_parts(variant: object) -> dict[str, str]:
    """``key=value`` parts of a variant label.

    >>> variant_parts("denoiser_collective=all_gather num_operators=4"), variant_parts(None)
    ({'denoiser_collective': 'all_gather', 'num_operators': '4'}, {})
    """
    if not isinstance(variant, str):
        return {}
    return dict(part.split("=", 1) for part in variant.split() if "=" in part)


def run_work(run_dir: str | Path, scale: object) -> dict[str, str]:
    """What a run computed besides its GPU count and variant keys: ``scale`` (the preset) and the spec's work
    fields (:func:`pnpscale.results.runs.work_fields`: ``problem.image_size``, ``channels``, ...), as text; only
    ``scale`` when ``run.json`` cannot be read (the point is then not complete and not compared)."""

    out = {"scale": str(scale)} if isinstance(scale, str) and scale else {}
    try:
        spec = read_record(run_dir).to_dict().get("spec") or {}
    except RecordError:
        return out
    return out | work_fields(spec)


def work_differences(a: dict[str, str], base: dict[str, str], same_problem: bool, skip: set[str]) -> str:
    """How work ``a`` differs from ``base`` (:func:`run_work`), ``""`` when it does not: ``key a vs base`` joined
    by ``, ``. Keys in ``skip`` (the compared variant keys) are left out, and so are the problem's own sizes,
    parameters and channels (``problem.*``, ``channels``) between different problems, which differ by design
    (``conf/problem/*.yaml``); the scale preset and the run settings (``threads_per_rank``, ...) never are.

    >>> work_differences({"scale": "tiny", "problem.image_size": "32"},
    ...                  {"scale": "small", "problem.image_size": "256"}, True, set())
    'scale tiny vs small, problem.image_size 32 vs 256'
    """
    parts = []
    for key in dict.fromkeys([*base, *a]):
        if key in skip or (not same_problem and (key.startswith("problem.") or key == "channels")):
            continue
        if key in a and key in base and a[key] != base[key]:
            parts.append(f"{key} {a[key]} vs {base[key]}")
    return ", ".join(parts)


def noise_verdict(a: pd.Series, base: pd.Series) -> object:
    """Is series ``a``'s section time (summed over sections) different from the baseline's beyond the noise?

    Rule, on the per-iteration spread of both points (:mod:`pnpscale.analysis.spread`): ``too few iterations``
    when either has fewer than :data:`pnpscale.analysis.spread.MIN_ITERATIONS` measured iterations;
    ``within noise`` when their p10–p90 ranges of the per-iteration time overlap (``a.p10 <= b.p90`` and
    ``b.p10 <= a.p90``); else ``beyond noise``. NA when either value is missing (a failed point).

    Args:
        a, base: rows with ITERATIONS, ``section_p10_s`` and ``section_p90_s``.

    >>> row = lambda n, lo, hi: pd.Series({"iterations": n, "section_p10_s": lo, "section_p90_s": hi})
    >>> noise_verdict(row(10, 1.0, 1.2), row(10, 1.1, 1.3)), noise_verdict(row(10, 1.0, 1.2), row(10, 1.3, 1.4))
    ('within noise', 'beyond noise')
    >>> noise_verdict(row(3, 1.0, 1.2), row(10, 2.0, 2.1))
    'too few iterations'
    """

    lo, hi = K.spread_column(K.SECTION_S, 10), K.spread_column(K.SECTION_S, 90)
    values = [a.get(lo), a.get(hi), base.get(lo), base.get(hi)]
    if any(v is None or pd.isna(v) for v in values):
        return pd.NA
    if too_few(a.get(K.ITERATIONS)) or too_few(base.get(K.ITERATIONS)):
        return TOO_FEW
    return WITHIN if a[lo] <= base[hi] and base[lo] <= a[hi] else BEYOND


def comparison(table: pd.DataFrame) -> pd.DataFrame | None:
    """The side-by-side table (columns :data:`pnpscale.columns.COMPARE_COLUMNS`), or ``None`` when no
    compared key varies.

    Args:
        table: :func:`pnpscale.results.summary.scaled_cost` output of
            :func:`pnpscale.results.runs.load` (``variant`` column, section ``all`` rows).

    Returns:
        one row per (mode, series, gpus), baseline series first; failed points kept with NaN
        metrics and their status. ``*_vs_base`` = the value / the baseline series' value at the
        same GPU count (NaN where either is missing or zero); ITERATIONS and the section time's
        per-iteration p10 / p90; NOISE = :func:`noise_verdict` against the baseline at the same GPU count
        (``baseline`` on the baseline's rows).
    """
    varied = varied_keys(table)
    if not varied:
        return None
    rows = table[table[K.SECTION] == ALL].copy()
    variant = rows[K.VARIANT] if K.VARIANT in rows else pd.Series("", index=rows.index)
    rows[K.SERIES] = [series_label(p, v) for p, v in zip(rows["problem"], variant, strict=True)]
    rows[K.BYTES_PER_GPU] = [
        run_bytes_per_gpu(d, g, n) if s == layout.STATUS_COMPLETE else np.nan
        for d, g, n, s in zip(rows["run_dir"], rows["gpus"], rows["nodes"].fillna(1), rows["status"], strict=True)
    ]
    frames = []
    for _, grp in rows.groupby("mode", sort=True):
        order = _order(grp[K.SERIES])
        grp = grp.assign(_o=grp[K.SERIES].map({s: i for i, s in enumerate(order)})).sort_values(["_o", "gpus"])
        base = grp[grp[K.SERIES] == order[0]].set_index("gpus")
        for col, ratio in ((K.SECTION_S, K.SECTION_VS_BASE), (K.TRANSFER_S, K.TRANSFER_VS_BASE),
                           (K.BYTES_PER_GPU, K.BYTES_VS_BASE)):  # fmt: skip
            ref = grp["gpus"].map(base[col]).astype("float64")
            with np.errstate(divide="ignore", invalid="ignore"):
                grp[ratio] = np.where(ref > 0, grp[col].astype("float64") / ref, np.nan)
        grp[K.VARIED] = ", ".join(varied)
        for col in (K.ITERATIONS, K.spread_column(K.SECTION_S, 10), K.spread_column(K.SECTION_S, 90), K.HIDDEN_S,
                    K.HIDDEN_SHARE):  # fmt: skip
            if col not in grp:  # a table built before the spread was kept
                grp[col] = np.nan
                base[col] = np.nan
        if K.TIME_SHARED not in grp:  # folders that predate the flag: unknown
            grp[K.TIME_SHARED] = pd.array([pd.NA] * len(grp), dtype="boolean")
        frames.append(verdicts(grp, order[0]))
    out = pd.concat(frames, ignore_index=True)
    return out[list(K.COMPARE_COLUMNS)].reset_index(drop=True)


def verdicts(grp: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """``grp`` (one mode's rows, SERIES, VARIANT, ``scale``, ``run_dir``, TIME_SHARED and the noise inputs) with
    NOISE, DIFFERS and DRIFT_1GPU, each point against the baseline series' point at the same GPU count.

    Rules, the first that applies: ``baseline`` on the baseline's rows; NA without a baseline point there or
    with a point not complete; ``sizes differ`` when the two runs' work (:func:`run_work`: scale preset, sizes,
    parameters beyond the compared variant keys) differs, DIFFERS naming how; ``time-shared`` when either point's
    ranks time-shared their cores or GPUs (TIME_SHARED): its times measure contention; ``same code`` at 1 GPU when
    the series differ from the baseline only in :data:`SAME_CODE_AT_1` keys, where DRIFT_1GPU = ``|S / S_base -
    1|`` (S: section time) of that pair is the drift between the two runs, written on every row of the series;
    else :func:`noise_verdict`, with ``beyond noise`` lowered to ``within drift`` where ``|S / S_base - 1|`` is no
    larger than the series' DRIFT_1GPU.
    """

    grp = grp.copy()
    base = grp[grp[K.SERIES] == baseline].set_index("gpus")
    complete = grp["status"] == layout.STATUS_COMPLETE
    scales = grp["scale"] if "scale" in grp else pd.Series(None, index=grp.index, dtype=object)
    work = [run_work(d, sc) if ok else {} for d, sc, ok in zip(grp["run_dir"], scales, complete, strict=True)]
    grp["_work"] = work
    base_work = grp.loc[grp[K.SERIES] == baseline].set_index("gpus")["_work"]
    variants = grp[K.VARIANT] if K.VARIANT in grp else pd.Series("", index=grp.index)
    base_parts = variant_parts(variants[grp[K.SERIES] == baseline].iloc[0]) if (grp[K.SERIES] == baseline).any() \
        else {}  # fmt: skip
    base_problem = grp.loc[grp[K.SERIES] == baseline, "problem"].iloc[0] if (grp[K.SERIES] == baseline).any() else None
    shared = grp[K.TIME_SHARED].astype("boolean").fillna(False).to_numpy(dtype=bool)
    shared_at = dict(zip(grp.loc[grp[K.SERIES] == baseline, "gpus"], shared[(grp[K.SERIES] == baseline).to_numpy()],
                         strict=True))  # fmt: skip
    differs, noise = [""] * len(grp), [pd.NA] * len(grp)
    for i, (idx, row) in enumerate(grp.iterrows()):
        g = row["gpus"]
        if row[K.SERIES] == baseline:
            noise[i] = BASELINE
            continue
        if g not in base.index or not complete[idx] or base.loc[g, "status"] != layout.STATUS_COMPLETE:
            continue
        parts = variant_parts(variants[idx])
        changed = {k for k in {*parts, *base_parts} if parts.get(k) != base_parts.get(k)}
        differs[i] = work_differences(row["_work"], base_work[g], row["problem"] == base_problem, changed)
        if differs[i]:
            noise[i] = SIZES
        elif shared[i] or shared_at.get(g, False):
            noise[i] = SHARED
        elif g == 1 and row["problem"] == base_problem and changed and changed <= set(SAME_CODE_AT_1):
            noise[i] = SAME_CODE
        else:
            noise[i] = noise_verdict(row, base.loc[g])
    grp[K.NOISE], grp[K.DIFFERS] = noise, differs
    rel = (grp[K.SECTION_S].astype("float64") / grp["gpus"].map(base[K.SECTION_S]).astype("float64") - 1).abs()
    drift = rel.where(grp[K.NOISE] == SAME_CODE).groupby(grp[K.SERIES]).transform("max")
    grp[K.DRIFT_1GPU] = drift.astype("float64")
    lowered = (grp[K.NOISE] == BEYOND) & (rel <= grp[K.DRIFT_1GPU])
    grp.loc[lowered, K.NOISE] = DRIFT
    return grp.drop(columns="_work")


def savings(cmp: pd.DataFrame) -> list[str]:
    """One sentence per non-baseline series at its largest GPU count shared with the baseline where neither
    point is time-shared (the largest shared one, said to be time-shared, when every shared point is); the
    difference is called a saving or a cost only with the verdict ``beyond noise`` (:func:`verdicts`)."""
    lines = []
    for mode, grp in cmp.groupby(K.MODE, sort=False):
        order = list(dict.fromkeys(grp[K.SERIES]))
        base = grp[(grp[K.SERIES] == order[0]) & (grp["status"] == layout.STATUS_COMPLETE)].set_index(K.GPUS)
        for series in order[1:]:
            s = grp[(grp[K.SERIES] == series) & (grp["status"] == layout.STATUS_COMPLETE)].set_index(K.GPUS)
            shared = sorted(set(s.index) & set(base.index))
            if not shared:
                lines.append(f"{mode}: `{series}` and `{order[0]}` share no complete GPU count: nothing to compare.")
                continue
            fair = [g for g in shared if s.loc[g, K.NOISE] != SHARED]
            n = fair[-1] if fair else shared[-1]
            a, b = s.loc[n], base.loc[n]
            saved = b[K.SECTION_S] - a[K.SECTION_S]
            verdict = a.get(K.NOISE)
            pct = f"{100 * abs(saved) / b[K.SECTION_S]:.0f}%"
            if verdict == BEYOND:
                diff = f"{'saves' if saved >= 0 else 'costs'} {abs(saved):.4g} s, {pct}, beyond the noise"
                if pd.notna(a.get(K.DRIFT_1GPU)):
                    diff += f" and the between-run drift measured at 1 GPU ({100 * a[K.DRIFT_1GPU]:.0f}%)"
            else:
                diff = f"differs by {abs(saved):.4g} s, {pct}: " + _noise_text(verdict, a, b)
            left = [g for g in shared if g > n]
            where = f"{mode}, {n} GPUs"
            if left:
                where += f" (gpus={', '.join(map(str, left))} left out: time-shared)"
            elif not fair:
                where += " (every GPU count both share is time-shared)"
            text = (
                f"{where}: `{series}` takes {a[K.SECTION_S]:.4g} s per iteration vs {b[K.SECTION_S]:.4g} s "
                f"for `{order[0]}` ({diff}); "
                f"exposed transfer {a[K.TRANSFER_S]:.4g} s vs {b[K.TRANSFER_S]:.4g} s"
            )
            if pd.notna(a[K.BYTES_PER_GPU]) and pd.notna(b[K.BYTES_PER_GPU]) and b[K.BYTES_PER_GPU] > 0:
                text += f"; bytes per GPU {a[K.BYTES_PER_GPU] / b[K.BYTES_PER_GPU]:.2f}x"
            text += f"; wait {a[K.WAIT_S]:.4g} s vs {b[K.WAIT_S]:.4g} s"
            if pd.notna(a.get(K.HIDDEN_S)) and pd.notna(b.get(K.HIDDEN_S)) and (a[K.HIDDEN_S] > 0 or b[K.HIDDEN_S] > 0):
                text += f"; hidden {a[K.HIDDEN_S]:.4g} s vs {b[K.HIDDEN_S]:.4g} s"
            text += f"; LB {a[K.LB]:.3f} vs {b[K.LB]:.3f}."
            lines.append(text)
    return lines


def size_cautions(cmp: pd.DataFrame) -> list[str]:
    """One loud line per series whose runs did other work than the baseline's (DIFFERS, :func:`verdicts`),
    naming the GPU counts and how the work differs."""

    lines = []
    for mode, grp in cmp.groupby(K.MODE, sort=False):
        baseline = grp[K.SERIES].iloc[0]
        differ = grp[grp[K.DIFFERS].fillna("") != ""]
        for series, rows in differ.groupby(K.SERIES, sort=False):
            how = "; ".join(dict.fromkeys(rows[K.DIFFERS]))
            gpus = ", ".join(str(int(g)) for g in rows[K.GPUS])
            lines.append(
                f"**Caution** ({mode}): `{series}` and `{baseline}` differ in more than {rows[K.VARIED].iloc[0]} "
                f"at gpus={gpus}: {how}. Their times measure different work, not the effect of the varied key: "
                "rerun both at one scale preset and size."
            )
    return lines


def _noise_text(verdict: object, a: pd.Series, b: pd.Series) -> str:
    """Why a difference is not called a gain (:func:`noise_verdict`)."""

    lo, hi = K.spread_column(K.SECTION_S, 10), K.spread_column(K.SECTION_S, 90)
    if verdict == WITHIN:
        return (
            f"within noise, the p10–p90 ranges of the per-iteration time overlap ({a[lo]:.4g}–{a[hi]:.4g} s vs "
            f"{b[lo]:.4g}–{b[hi]:.4g} s)"
        )
    if verdict == SIZES:
        return f"not called a gain, the runs did different work ({a[K.DIFFERS]})"
    if verdict == SHARED:
        return (
            "not called a gain, time-shared (ranks × threads per rank > usable cores, or a shared GPU): its times "
            "measure contention, not the variant"
        )
    if verdict == SAME_CODE:
        return "both run the same code at 1 GPU, so this is the drift between the two runs, not a gain"
    if verdict == DRIFT:
        return f"within the between-run drift measured at 1 GPU ({100 * a[K.DRIFT_1GPU]:.0f}%), not called a gain"
    if verdict == TOO_FEW:
        n_a, n_b = (int(x[K.ITERATIONS]) if pd.notna(x.get(K.ITERATIONS)) else "?" for x in (a, b))
        return (
            f"not called a gain, {n_a} and {n_b} measured iterations are too few to tell it from noise "
            f"(need ≥ {MIN_ITERATIONS}: `iterations={MIN_ITERATIONS}`)"
        )
    return "the spread is unknown (no per-iteration quantiles): not called a gain"


def markdown(cmp: pd.DataFrame) -> list[str]:
    """The comparison's README section: a table per mode and :func:`savings`."""

    def fmt(v: object, pattern: str) -> str:
        return "—" if v is None or (isinstance(v, float) and not np.isfinite(v)) or pd.isna(v) else format(v, pattern)

    varied = cmp[K.VARIED].iloc[0]
    lines = [
        f"## Side by side: {varied}",
        "",
        f"![{COMPARE_PNG}]({COMPARE_PNG})",
        "",
        "Seconds per measured iteration summed over sections; exposed transfer = blocked after the last rank "
        "arrived, hidden = collective time overlapped by compute (not in the section time), hidden share = "
        "hidden / (hidden + transfer + wait); scaled cost relative to each series' own smallest "
        "GPU count; bytes per GPU = the main (image-carrying) collectives under the ring model "
        "(all_reduce `2·P·(n−1)/n`, all_gather `S·(n−1)/n` with `S` = ranks × per-rank buffer, reduce_scatter "
        "and all_to_all `S·(n−1)/n` with `S` = one rank's input); "
        "`vs base` = ratio to the first series at the same GPU count; the last column says whether the "
        "difference in section time lies within the per-iteration spread (`within noise`: the p10–p90 ranges "
        "overlap; `too few iterations`: fewer than 5 measured), or why it is not tested: `sizes differ` (the "
        "runs did different work: scale preset or sizes), `time-shared` (either point), `same code` (1 GPU, a "
        "key that only changes a collective: the difference is the drift between runs), `within drift` (no "
        "larger than that 1-GPU drift). Table: `compare.parquet`.",
        "",
    ]
    lines += [f"- {c}" for c in size_cautions(cmp)] + ([""] if size_cautions(cmp) else [])
    for mode, grp in cmp.groupby(K.MODE, sort=False):
        status = grp["status"].where(grp["status"] == layout.STATUS_COMPLETE, "missing (" + grp["status"] + ")")
        shared = grp[K.TIME_SHARED].astype("boolean").fillna(False).to_numpy(dtype=bool)
        status = status.where(~shared, status + ", time-shared")
        view = pd.DataFrame(
            {
                "series": grp[K.SERIES],
                "gpus": grp[K.GPUS],
                "status": status,
                **{label: grp[col].map(lambda v, p=p: fmt(v, p)) for col, (label, p) in _SHOW.items()},
                "bytes/GPU": grp[K.BYTES_PER_GPU].map(lambda v: "—" if pd.isna(v) else f"{round(v):,}"),
                "section vs base": grp[K.SECTION_VS_BASE].map(lambda v: fmt(v, ".2f")),
                "bytes vs base": grp[K.BYTES_VS_BASE].map(lambda v: fmt(v, ".2f")),
                "vs base": grp[K.NOISE].map(lambda v: "—" if pd.isna(v) else str(v)),
            }
        )
        lines += [f"### {mode}", "", view.to_markdown(index=False), ""]
    lines += [f"- {s}" for s in savings(cmp)]
    if "problem" in varied:
        lines.append(
            "- Different problems hold different signals and operators: compare how each scales (scaled cost, LB, "
            "CommE, wait), not their seconds."
        )
    return lines + [""]


def plot_comparison(cmp: pd.DataFrame) -> Figure:
    """Each compared metric vs GPU count, one line per (mode, series); bytes per GPU on a log axis; section
    time with its p10–p90 band over the measured iterations (what :func:`noise_verdict` compares)."""

    metrics = [*_SHOW.items(), (K.BYTES_PER_GPU, ("bytes per GPU", ""))]
    fig, axes = figure(2, 5, (22, 8))
    flat = axes.ravel()
    all_gpus = sorted({int(g) for g in cmp[K.GPUS]})
    keys = list(dict.fromkeys(zip(cmp[K.MODE], cmp[K.SERIES], strict=True)))
    styles = ("-", "--", ":", "-.")
    for ax, (col, (label, _)) in zip(flat, metrics, strict=False):
        for i, (mode, series) in enumerate(keys):
            g = cmp[(cmp[K.MODE] == mode) & (cmp[K.SERIES] == series)].set_index(K.GPUS)[col].reindex(all_gpus)
            y = g.to_numpy(dtype=float)
            if col == K.BYTES_PER_GPU:
                y = np.where(y > 0, y, np.nan)
            ax.plot(all_gpus, y, marker="o", color=f"C{i % 10}", ls=styles[i % 4], label=f"{mode}: {series}")
            rows = cmp[(cmp[K.MODE] == mode) & (cmp[K.SERIES] == series)]
            mark_time_shared(ax, rows, pd.Series(y, index=all_gpus), f"C{i % 10}")
            lo, hi = K.spread_column(K.SECTION_S, 10), K.spread_column(K.SECTION_S, 90)
            if col == K.SECTION_S and lo in cmp and hi in cmp:  # the per-iteration spread the verdict uses
                sel = cmp[(cmp[K.MODE] == mode) & (cmp[K.SERIES] == series)].set_index(K.GPUS)
                band = sel[[lo, hi]].reindex(all_gpus).astype(float)
                ax.fill_between(all_gpus, band[lo], band[hi], color=f"C{i % 10}", alpha=0.18, lw=0)
                ax.vlines(all_gpus, band[lo], band[hi], color=f"C{i % 10}", alpha=0.45, lw=3)
        log2_x(ax, all_gpus)
        if col in (K.LB, K.COMM_E, K.HIDDEN_SHARE):
            ax.set_ylim(0, 1.05)
        if col == K.BYTES_PER_GPU and (cmp[col] > 0).any():
            ax.set_yscale("log")
        ax.set_title(label)
    handles, labels = flat[0].get_legend_handles_labels()
    for ax in flat[1:]:  # the time-shared proxy, which only panels with such a point hold
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles, labels = [*handles, h], [*labels, lab]
    flat[-1].axis("off")
    flat[-1].legend(handles, labels, loc="center", fontsize=9)
    fig.suptitle(f"Side by side: {cmp[K.VARIED].iloc[0]} (seconds per iteration; scaled cost, LB, CommE: ratios)")
    fig.tight_layout()
    return fig
