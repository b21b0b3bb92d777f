#!/usr/bin/env bash
# Device check on one machine with one NVIDIA GPU (A100 or newer) and the project installed
# (pip install -e '.[dev,cuda]'). From the repository root:
#
#   bash gpu_scripts/device_check.sh OUT_DIR            # run it (about 3-6 minutes)
#   bash gpu_scripts/device_check.sh --dry-run OUT_DIR  # print the commands, run nothing
#
# It runs the tests marked @pytest.mark.gpu, checks every Pallas kernel (Triton lowering)
# against the jnp reference on the GPU with random data (bits 1..8, three roundings, buckets
# 64..4096), runs experiments/bench_kernels.py (each pass vs a plain copy; target >= 0.8 of the
# copy bandwidth), times one step of the `small` GPT with fp32 FSDP and QSDP W8G8, writes JSON
# to OUT_DIR and prints one summary table last. Exit status: the first failing step's.
# PYTHON=/path/to/python picks the interpreter (default: python on PATH).
set -euo pipefail

usage() { echo "usage: $0 [--dry-run] OUT_DIR" >&2; exit 2; }
DRY=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) usage ;;
    -*) echo "unknown option: $arg" >&2; usage ;;
    *) [[ -z "$OUT" ]] || usage; OUT="$arg" ;;
  esac
done
[[ -n "$OUT" ]] || usage
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # absolute: the script runs from the repo root
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the repository root
PY="${PYTHON:-python}"
# the GPU first, the host CPU for the CPU reference; the tests' conftest keeps this value
export JAX_PLATFORMS="cuda,cpu"
export XLA_PYTHON_CLIENT_PREALLOCATE=false

run() {
  echo "+ $*"
  if [[ "$DRY" == 0 ]]; then "$@"; fi
}

STATUS=0
step() { run "$@" || { rc=$?; echo "step failed ($rc): $*" >&2; [[ "$STATUS" != 0 ]] || STATUS=$rc; }; }

run mkdir -p "$OUT"
step "$PY" -c "import jax; d = jax.devices()[0]; assert d.platform == 'gpu', d; print(d.device_kind)"
step timeout 75 "$PY" -m pytest -q -m gpu tests/test_kernels.py --junitxml "$OUT/gpu_tests.xml"
step timeout 150 "$PY" -m experiments.device_check kernels --out "$OUT"
step timeout 60 "$PY" -m experiments.bench_kernels --elements 33554432 --modes auto reference --repeats 20 --out "$OUT"
step timeout 60 "$PY" -m experiments.device_check step --out "$OUT"
run "$PY" -m experiments.device_check table "$OUT"
exit "$STATUS"
