"""Projection error on real runs: fit on small GPU counts, project larger ones, then measure them.

Runs ``python -m pnpscale -m gpus=<fit + check> scale=small`` (2D inference, CPU ranks on gloo) into
one sweep folder, projects the check GPU counts from the fit ones with :mod:`pnpscale.results.projection.output`
(the same code as ``python -m pnpscale.project SWEEP --fit-gpus ... --gpus ...``), and prints the
projected and the measured time per iteration, compute, transfer, wait and PE side by side.

    python benchmarks/projection_error.py [--fit 1,2,3,4] [--check 6,8] [--devices CORES] [--sweep DIR]

``--sweep DIR`` reuses a sweep folder that already holds those points (nothing is run). ``--devices``
tells the model how many CPU cores the ranks share (default: this machine's CPU count). The command
(``python -m pnpscale.project``) does not fit points with more ranks than cores nor project past them
(time-sharing is not modelled); this script evaluates the model there anyway, labelled, to show how far
off an unmodelled time-sharing is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from pnpscale import columns as K
from pnpscale.results.projection.output import Options, evaluate, fit, leave_one_out, rank_samples, with_algorithms
from pnpscale.results.runs import build_table

METRICS = (K.SECTION_S, K.COMPUTE_S, K.COMPUTE_MAX_S, K.TRANSFER_S, K.WAIT_S, K.PE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", default="1,2,3,4")
    p.add_argument("--check", default="6,8")
    p.add_argument("--devices", type=int, default=os.cpu_count())
    p.add_argument("--sweep", default=None)
    a = p.parse_args()
    fit_gpus, check = [int(x) for x in a.fit.split(",")], [int(x) for x in a.check.split(",")]
    sweep = Path(a.sweep) if a.sweep else Path(tempfile.mkdtemp(prefix="pnpscale-projection-"))
    if not a.sweep:
        cmd = [sys.executable, "-m", "pnpscale", "-m", f"gpus={','.join(map(str, fit_gpus + check))}", "scale=small",
               "report=false", f"hydra.sweep.dir={sweep}", f"output.root={sweep}"]  # fmt: skip
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, capture_output=True)
    table = build_table(sweep, echo=lambda s: None)
    table = with_algorithms(table[(table["status"] == "complete") & (table["mode"] == "inference")])
    options = Options(devices=a.devices or None, bootstrap=0)
    samples = rank_samples(table)  # each run's ranks.parquet: the per-rank compute the command fits too
    model = fit(table[table[K.GPUS].isin(fit_gpus)], options, samples)
    past = [n for n in check if model.cores is not None and n > model.cores]
    if past:
        print(f"the command refuses {past} (past the {model.cores} cores); evaluated here anyway")
    projected = evaluate(model, check, past_cores=True).set_index([K.GPUS, K.SECTION])
    measured = table[table[K.GPUS].isin(check)].set_index([K.GPUS, K.SECTION])
    print(f"sweep: {sweep}; fitted on gpus={a.fit}; devices={options.devices}")
    rows = []
    for n in check:
        for metric in METRICS:
            mv, pv = float(measured.loc[(n, "all"), metric]), float(projected.loc[(n, "all"), metric])
            rows.append({"gpus": n, "metric": metric, "projected": pv, "measured": mv, "error %": 100 * (pv / mv - 1)})
    print(pd.DataFrame(rows).to_markdown(index=False, floatfmt=".4g"))
    loo = leave_one_out(table[table[K.GPUS].isin(fit_gpus)], options, samples=samples)
    loo = loo[(loo[K.SECTION] == "all") & (loo["metric"] == K.SECTION_S)]
    print("\nleave-one-out on the fit points, time per iteration (error %):")
    print(loo[[K.GPUS, "fitted_on", "projected_value", "measured_value", K.REL_ERROR]]
          .assign(**{K.REL_ERROR: 100 * loo[K.REL_ERROR]}).to_markdown(index=False, floatfmt=".4g"))  # fmt: skip


if __name__ == "__main__":
    main()
