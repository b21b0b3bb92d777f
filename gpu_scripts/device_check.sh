#!/usr/bin/env bash
# Device check on one machine with one NVIDIA GPU (A100 or newer) and the project installed
# (pip install -e '.[dev,cuda]'). From the repository root:
#
#   bash gpu_scripts/device_check.sh OUT_DIR            # run it (about 3-6 minutes)
#   bash gpu_scripts/device_check.sh --dry-run OUT_DIR  # print the commands, run nothing
#
# It runs the tests marked @pytest.mark.gpu, checks every Pallas kernel (Triton lowering)
# against the jnp reference on the GPU with random data (bits 1..8, three roundings, buckets
# 64..4096), runs experiments/bench/kernels.py (each pass vs a plain copy; target >= 0.8 of the
# copy bandwidth), times one step of the `small` GPT with fp32 FSDP and QSDP W8G8 (Pallas kernels
# and the jnp reference), writes JSON
# to OUT_DIR and prints one summary table last. Exit status: the first failing step's.
# PYTHON=/path/to/python picks the interpreter (default: python on PATH).
set -euo pipefail
# shellcheck source=scripts_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts_lib.sh"  # device_check_main

# the GPU first, the host CPU for the CPU reference; the tests' conftest keeps this value
export JAX_PLATFORMS="cuda,cpu"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
device_check_main gpu "$0" "$@"
