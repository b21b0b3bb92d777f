#!/bin/bash
# Train the qsdp_jax GPT on all GPUs of one machine.
#
# Usage (from the repository root, with the project installed in .venv):
#   bash gpu_scripts/single_node.sh --preset small --steps 1000            # one process, all GPUs
#   PROCS=gpu bash gpu_scripts/single_node.sh --preset small               # one process per GPU
#   bash gpu_scripts/single_node.sh --dry-run [trainer flags ...]        # print, run nothing
# Everything after the options goes to `python -m experiments.gpt.train`.
#
# Settings (environment variables; defaults in brackets):
#   NUM_GPUS  [from nvidia-smi]  GPUs to use
#   PROCS     [1]     1: one process drives every GPU (simplest; no jax.distributed)
#                     gpu: one process per GPU on 127.0.0.1:PORT (QSDP_* variables), the layout
#                     of a multi-node job, useful to test it on one machine
#   PORT      [29511] coordinator port for PROCS=gpu
#   OUT       [runs/single-node]   output directory (written by process 0)
#   PYTHON    [.venv/bin/python]
set -euo pipefail

# shellcheck source=scripts_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts_lib.sh"  # show, gpu_overlap_env

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi

if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
  if [[ "$NUM_GPUS" == 0 ]]; then
    if [[ "$DRY_RUN" == 1 ]]; then NUM_GPUS=8; else
      echo "no GPU found by nvidia-smi; set NUM_GPUS or use experiments.gpt.train directly" >&2
      exit 2
    fi
  fi
fi
PROCS="${PROCS:-1}"
PORT="${PORT:-29511}"
OUT="${OUT:-runs/single-node}"
PYTHON="${PYTHON:-.venv/bin/python}"

gpu_overlap_env  # XLA_FLAGS: collectives overlap compute (see scripts_lib.sh)

if [[ "$DRY_RUN" == 1 ]]; then
  show export XLA_FLAGS="$XLA_FLAGS"
  show export XLA_PYTHON_CLIENT_MEM_FRACTION="$XLA_PYTHON_CLIENT_MEM_FRACTION"
fi

case "$PROCS" in
  1)
    CMD=("$PYTHON" -m experiments.gpt.train --devices "$NUM_GPUS" --out "$OUT" "$@")
    if [[ "$DRY_RUN" == 1 ]]; then show "${CMD[@]}"; exit 0; fi
    exec "${CMD[@]}" ;;
  gpu)
    pids=()
    for ((i = 0; i < NUM_GPUS; i++)); do
      ENV=(QSDP_COORDINATOR="127.0.0.1:$PORT" QSDP_NUM_PROCESSES="$NUM_GPUS" QSDP_PROCESS_ID="$i"
           QSDP_LOCAL_DEVICE_IDS="$i")
      CMD=("$PYTHON" -m experiments.gpt.train --out "$OUT" --process-logs "$OUT/logs" "$@")
      if [[ "$DRY_RUN" == 1 ]]; then show env "${ENV[@]}" "${CMD[@]}"; continue; fi
      env "${ENV[@]}" "${CMD[@]}" &
      pids+=($!)
    done
    if [[ "$DRY_RUN" == 1 ]]; then exit 0; fi
    trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    exit "$status" ;;
  *) echo "PROCS=$PROCS: use 1 (one process) or gpu (one process per GPU)" >&2; exit 2 ;;
esac
