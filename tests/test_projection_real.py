"""The projection on real measured data: a CPU-rank sweep of this project (tests/data/projection_cpu).

The synthetic study mechanism (tests/test_projection.py, benchmarks/projection_study.py) checks that the
model gives a known mechanism back; these tests check what it does with measured rows: their real
columns, noise and failures of the model's assumptions (each refused with its reason, no impossible number).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pnpscale import columns as K
from pnpscale.results.projection.output import Options, ProjectionError, evaluate, fit, misses, project

DATA = Path(__file__).parent / "data" / "projection_cpu" / "summary.csv"


@pytest.fixture(scope="module")
def measured() -> pd.DataFrame:
    t = pd.read_csv(DATA)
    t["variant"] = ["" if pd.isna(v) else str(v) for v in t["variant"]]  # no variant: "" (as the report has it)
    return t


def test_real_inference_compute_falling_faster_than_1_over_n_is_refused_naming_the_points(measured):
    """Measured: the gradient's compute 0.0311 s on 1 rank, 0.0121 s on 2 (x 0.39, faster than 1/N): no
    non-negative fixed + per-operator compute fits it, so 2D inference is not projected, and says why."""
    p = project(measured, [2], Options(devices=2))
    why = p.skipped[("2d", "inference")]
    assert why.startswith("2d inference gradient: no non-negative fixed + per-unit compute fits the measured points")
    assert "N=1 compute 0.0311 s (fit -14 %)" in why and "N=2 compute 0.01208 s (fit +11 %)" in why


def test_real_training_fits_its_points_and_refuses_what_they_cannot_tell(measured):
    """2D training on 1 and 2 ranks: the fit holds its own points within 10 % (time, transfer, wait, PE);
    no leave-one-out (2 GPU counts); on 4 ranks (every rank 1 operator, 4 tiles) it projects; on 8 (half the
    ranks hold no operator) the operator / tile split the points never told apart is refused, as is N past
    the cores."""
    key = ("2d", "training")
    p = project(measured, [2], Options(devices=2))
    assert key in p.findings and misses(p.validation, 0.10).empty
    v = p.validation[(p.validation[K.MODE] == "training") & (p.validation[K.SECTION] == "all")]
    res = v[v["kind"] == "residual"].set_index([K.GPUS, "metric"])[K.REL_ERROR]
    assert res.loc[(2, K.WAIT_S)] == pytest.approx(0.0, abs=0.10) and res.loc[(2, K.PE)] == pytest.approx(0, abs=0.1)
    assert not (v["kind"] == "leave-one-out").any()
    with pytest.raises(ProjectionError, match="more ranks than the 2 cores"):
        evaluate(fit(measured[measured[K.MODE] == "training"], Options(devices=2)), [4])
    model = fit(measured[measured[K.MODE] == "training"], Options(devices=8))  # as if the runs had 8 cores
    at4 = evaluate(model, [4])
    assert (at4[K.PE] <= 1).all() and (at4[K.WAIT_S] >= 0).all()
    split = "backward: compute_max and wait at gpus=8 not projected: on the fitted points 1, 2 every rank holds"
    with pytest.raises(ProjectionError, match=f"{split} the same share of the 4 operators and 16 tiles"):
        evaluate(model, [8])
    assert "compute_max and wait at gpus=8 not projected" in project(measured, [8], Options(devices=8)).skipped[key]
