"""``python -m pnpscale.validate [...]``: is the compute / transfer / wait split right on this machine?

The command only; the validation suite lives in :mod:`pnpscale.validation.suite` (functions pickled
for ranks and SLURM jobs resolve there, never in ``__main__``).
"""

from pnpscale.validation.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
