#!/usr/bin/env bash
# One-call GPU check of pnpscale's CUDA/NCCL path, for a machine with one GPU (or two).
#
#   bash scripts/device-check.sh            # GPU mode: the whole check under 6 minutes, pass/fail table
#   bash scripts/device-check.sh --plan --gpus 1 --nccl 2.28.9 --torch 2.11   # what would run; runs nothing
#   bash scripts/device-check.sh --cpu      # CPU mode: the same steps on gloo CPU ranks at tiny sizes
#   bash scripts/device-check.sh --only versions,nccl_probe
#
# On a GPU machine without a package index: run `bash scripts/device-wheels.sh` on a machine with one,
# copy the checkout with its .device-wheels/ folder to the GPU machine, and run this script there.
#
# Run from anywhere; the repository is this script's parent folder. Python: $PNPSCALE_PYTHON if set,
# else python3, with torch (whatever version it finds: it is reported) and pnpscale's dependencies.
# Where they are missing and a folder of wheels is there ($PNPSCALE_WHEELS, default <repo>/.device-wheels),
# they are installed from it with pip --no-index --no-deps --target $PNPSCALE_SITE (default
# ${TMPDIR:-/tmp}/pnpscale-site), nothing from a registry. PYTHONPATH=<repo>[:<site>] is set.
# Results: the table and a summary line on stdout. Run folders, traces and step logs go to the work folder
# ($PNPSCALE_WORK, default ${TMPDIR:-/tmp}/pnpscale-device-check), never to $OUT; when $OUT is set it receives
# at most 8 files, 16 MiB in all: device-check.md and .json (the table), nccl-probe.json (how two NCCL ranks
# shared the GPU), nccl-rank0.log (rank 0's NCCL log, head and tail) and device-check-logs.tar.gz (step logs,
# run.json files, stderr logs, each cut to 256 KiB). Every step runs in a process group with a time limit (the
# group is killed at the limit, its pnpscale runs with it); a failed step does not stop the others. Exit
# status: 0 when every step passed (or was skipped, saying why), 1 when one failed or timed out, 3 when the
# budget cut a step (not run: it proved nothing), 2 when Python or pnpscale cannot be imported.
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
IMPORTS='import torch, deepinv, hydra, pandas, pyarrow, ijson, msgspec, isal, pnpscale.validation.device_check; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "| deepinv", deepinv.__version__)'
WHEELS="${PNPSCALE_WHEELS:-$ROOT/.device-wheels}"
# one import of everything (torch, deepinv, pnpscale: seconds each time), again only after installing wheels
if ! IMPORTED="$("$PY" -c "$IMPORTS" 2>&1)" && [ -d "$WHEELS" ]; then
  # a machine without a package index: the wheels it lacks, copied into the checkout's .device-wheels/
  SITE="${PNPSCALE_SITE:-${TMPDIR:-/tmp}/pnpscale-site}"
  echo "== installing $(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l) wheel(s) from $WHEELS into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || echo "device-check: pip install from $WHEELS failed" >&2
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
  IMPORTED="$("$PY" -c "$IMPORTS" 2>&1)"
fi
if ! grep -q '^torch ' <<<"$IMPORTED"; then
  echo "$IMPORTED" | tail -3 >&2
  echo "device-check: $PY cannot import pnpscale's dependencies (pip install -e ., or bash scripts/device-wheels.sh on a machine with an index and copy .device-wheels/ here)" >&2
  exit 2
fi
echo "$IMPORTED" | grep '^torch '
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
ARGS=("$@")
if [ -n "${OUT:-}" ]; then
  ARGS+=(--out "$OUT")
fi
if [ -n "${PNPSCALE_WORK:-}" ]; then
  ARGS+=(--work "$PNPSCALE_WORK")
fi
"$PY" -m pnpscale.validation.device_check "${ARGS[@]}"
