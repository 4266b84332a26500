#!/usr/bin/env bash
# One-call GPU check of pnpscale's CUDA/NCCL path (issue 13), for a machine with one GPU.
#
#   bash scripts/device-check.sh            # GPU mode: under 8 minutes, pass/fail table
#   bash scripts/device-check.sh --cpu      # CPU mode: the steps that make sense without CUDA
#   bash scripts/device-check.sh --only versions,busy_wait
#
# Run from anywhere; the repository is this script's parent folder. Python: $PNPSCALE_PYTHON if set,
# else python3, with torch, deepinv and pnpscale's dependencies (`pip install -e .`; on a machine
# without network, PNPSCALE_WHEELS=<folder of wheels> installs them from there). PYTHONPATH=<repo> is set. Results: the table on stdout and, when $OUT is set,
# $OUT/device-check.md, $OUT/device-check.json, $OUT/runs/<step>/ (run folders) and $OUT/logs/.
# Every step runs in its own process with a time limit; a failed step does not stop the others.
# Exit status: 0 when every step passed (or was skipped), 1 when one failed or timed out, 2 when
# Python or pnpscale cannot be imported.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PNPSCALE_PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 2
echo "== pnpscale device check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), python: $(command -v "$PY" || echo "$PY (not found)")"
if ! "$PY" -c 'import sys; print("python", sys.version.split()[0])'; then
  echo "device-check: $PY does not run (set PNPSCALE_PYTHON)" >&2
  exit 2
fi
IMPORTS='import torch, deepinv, hydra, pandas, pyarrow, ijson, pnpscale.validation.device_check; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "| deepinv", deepinv.__version__)'
if ! "$PY" -c "$IMPORTS" >/dev/null 2>&1 && [ -n "${PNPSCALE_WHEELS:-}" ]; then
  # offline machine: install pnpscale's dependencies from a folder of wheels
  echo "== installing from wheels in $PNPSCALE_WHEELS"
  "$PY" -m pip install --no-index --find-links "$PNPSCALE_WHEELS" -e "$ROOT" || echo "device-check: pip install failed" >&2
fi
if ! "$PY" -c "$IMPORTS"; then
  echo "device-check: $PY cannot import pnpscale's dependencies (pip install -e . or PNPSCALE_WHEELS=<wheel folder>)" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
ARGS=("$@")
if [ -n "${OUT:-}" ]; then
  ARGS+=(--out "$OUT")
fi
"$PY" -m pnpscale.validation.device_check "${ARGS[@]}"
