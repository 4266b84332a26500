#!/usr/bin/env bash
# Fill .device-wheels/ (git-ignored) with exactly the Python 3.12 wheels a GPU machine without a package
# index lacks (issue 19): pnpscale's dependencies that its image does not hold, one version each, --no-deps.
#
#   bash scripts/device-wheels.sh            # on a machine with a package index
#   then copy the checkout, .device-wheels/ included, to the GPU machine and run there:
#   bash scripts/device-check.sh             # installs the wheels (pip --no-index) and runs the check
#
# The GPU image these wheels are for (Python 3.12, torch 2.11.0+cu130, no package index) has torch,
# torchvision, numpy, pandas, pyarrow, matplotlib, seaborn, tabulate, filelock, psutil, h5py, einops,
# requests, tqdm, torchmetrics, pyyaml, packaging, cloudpickle, typing-extensions; it lacks the
# packages below. Versions are the ones installed in this checkout's virtual environment (tested
# here); antlr4-python3-runtime has no wheel on the index (sdist only): it is built here.
#
# Knobs: PNPSCALE_PYTHON (the venv's python, default .venv/bin/python), DEVICE_WHEELS_DIR
# (default <repo>/.device-wheels), DEVICE_WHEELS_MAX_MB (64: the most the folder may hold in all).
# Exit status: 0 when the folder holds one wheel per package and fits; 1 otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PNPSCALE_PYTHON:-$ROOT/.venv/bin/python}"
DIR="${DEVICE_WHEELS_DIR:-$ROOT/.device-wheels}"
MAX_MB="${DEVICE_WHEELS_MAX_MB:-64}"
# name (as pip knows it): pure-Python unless listed in BINARY
PACKAGES=(deepinv hydra-core omegaconf antlr4-python3-runtime submitit hydra-submitit-launcher ijson msgspec isal natsort)
SDIST_ONLY=(antlr4-python3-runtime)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

version_of() {  # the version installed in this checkout's venv
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
for name in "${PACKAGES[@]}"; do
  ver="$(version_of "$name")" || { echo "device-wheels: $name is not installed in $PY (pip install -e . first)" >&2; exit 1; }
  if [[ " ${SDIST_ONLY[*]} " == *" $name "* ]]; then
    echo "== $name==$ver: building its wheel from the sdist"
    "$PY" -m pip wheel -q --no-deps --no-binary "$name" -w "$DIR.tmp" "$name==$ver"
  else
    echo "== $name==$ver: py3.12 wheel"
    args=()
    for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${args[@]}" -d "$DIR.tmp" "$name==$ver"
  fi
done
# one wheel per package, nothing else
count="$(find "$DIR.tmp" -maxdepth 1 -name '*.whl' | wc -l)"
if [ "$count" -ne "${#PACKAGES[@]}" ] || [ "$(find "$DIR.tmp" -maxdepth 1 -type f | wc -l)" -ne "$count" ]; then
  echo "device-wheels: expected ${#PACKAGES[@]} wheels, found:" >&2
  ls -l "$DIR.tmp" >&2
  exit 1
fi
bytes="$(du -cb "$DIR.tmp"/*.whl | tail -1 | cut -f1)"
if [ "$bytes" -gt $((MAX_MB * 1024 * 1024)) ]; then
  echo "device-wheels: $bytes bytes of wheels, over the $MAX_MB MiB limit (DEVICE_WHEELS_MAX_MB)" >&2
  exit 1
fi
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
ls -l "$DIR"
echo "device-wheels: $count wheels, $bytes bytes ($(( (bytes + 1048575) / 1048576 )) MiB) in $DIR"
