#!/usr/bin/env bash
# Device check on a TPU host (one or more chips) and the project installed
# (pip install -e '.[dev,tpu]'). From the repository root:
#
#   bash tpu_scripts/device_check.sh OUT_DIR            # run it (about 3-6 minutes)
#   bash tpu_scripts/device_check.sh --dry-run OUT_DIR  # print the commands, run nothing
#
# It runs the tests marked @pytest.mark.tpu, checks every Pallas kernel (Mosaic TPU lowering)
# against the jnp reference on the TPU with random data (bits 1..8, three roundings, buckets
# 64..4096), runs experiments/bench/kernels.py (each pass vs a plain copy; Mosaic TPU has no
# stated target), times one step of the `small` GPT with fp32 FSDP and QSDP W8G8, writes JSON
# to OUT_DIR and prints one summary table last. Exit status: the first failing step's.
# PYTHON=/path/to/python picks the interpreter (default: python on PATH).
set -euo pipefail
# shellcheck source=scripts_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts_lib.sh"  # device_check_main

# the TPU first, the host CPU for the CPU reference; the tests' conftest keeps this value
export JAX_PLATFORMS="tpu,cpu"
device_check_main tpu "$0" "$@"
