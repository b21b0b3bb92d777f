#!/usr/bin/env bash
# Shared parts of the launchers in gpu_scripts/ and tpu_scripts/; sourced, never run:
#   source "$(dirname "${BASH_SOURCE[0]}")/../scripts_lib.sh"
# show: print a command as typed; gpu_overlap_env: the GPU launchers' XLA settings;
# device_check_main: the whole device check (gpu_scripts/ and tpu_scripts/device_check.sh).

# Print a command as it would be typed (quoted only where needed).
show() {
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$a")
    elif [[ "$a" != *"'"* && "$a" =~ ^(--[a-z-]+=|[A-Za-z_][A-Za-z0-9_]*=)(.*)$ ]]; then out+=("${BASH_REMATCH[1]}'${BASH_REMATCH[2]}'")
    elif [[ "$a" != *"'"* ]]; then out+=("'$a'")
    else out+=("$(printf '%q' "$a")"); fi
  done
  echo "${out[*]}"
}

# Export the GPU training settings: collectives overlap compute (the latency-hiding scheduler
# moves them around the matmuls; the train step itself compiles with XLA's collective pipelining,
# which prefetches the next layer: qsdp_jax/_src/collective/overlap.py), 90% of GPU memory for XLA, a dead
# process detected in 10 s.
gpu_overlap_env() {
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_latency_hiding_scheduler=true"
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
  export QSDP_HEARTBEAT_TIMEOUT_S="${QSDP_HEARTBEAT_TIMEOUT_S:-10}"
}

# The device check: `device_check_main PLATFORM SCRIPT [--dry-run] OUT_DIR` with PLATFORM gpu or
# tpu (jax's platform name, also the pytest marker). Each step is echoed ("+ cmd") and, unless
# --dry-run, run; the exit status is the first failing step's. JAX_PLATFORMS is set by the caller.
device_check_main() {
  local platform="$1" script="$2" arg dry=0 dir="" status=0
  shift 2
  for arg in "$@"; do
    case "$arg" in
      --dry-run) dry=1 ;;
      -h|--help) _check_usage "$script" ;;
      -*) echo "unknown option: $arg" >&2; _check_usage "$script" ;;
      *) [[ -z "$dir" ]] || _check_usage "$script"; dir="$arg" ;;
    esac
  done
  [[ -n "$dir" ]] || _check_usage "$script"
  case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac  # absolute: the check runs from the repo root
  cd "$(dirname "${BASH_SOURCE[0]}")" || exit 2  # the repository root (this file's folder)
  local py="${PYTHON:-python}"
  _check_run() {
    echo "+ $*"
    if [[ "$dry" == 0 ]]; then "$@"; fi
  }
  _check_step() {
    _check_run "$@" || { local rc=$?; echo "step failed ($rc): $*" >&2; [[ "$status" != 0 ]] || status=$rc; }
  }
  _check_run mkdir -p "$dir"
  _check_step "$py" -c "import jax; d = jax.devices()[0]; assert d.platform == '$platform', d; print(d.device_kind)"
  _check_step timeout 75 "$py" -m pytest -q -m "$platform" tests/test_kernels.py --junitxml "$dir/${platform}_tests.xml"
  _check_step timeout 240 "$py" -m experiments.bench.device_check kernels --out "$dir"
  _check_step timeout 60 "$py" -m experiments.bench.kernels --elements 33554432 --modes auto reference --repeats 20 --out "$dir"
  _check_step timeout 150 "$py" -m experiments.bench.device_check step --out "$dir"
  _check_run "$py" -m experiments.bench.device_check table "$dir"
  return "$status"
}

_check_usage() { echo "usage: $1 [--dry-run] OUT_DIR" >&2; exit 2; }
