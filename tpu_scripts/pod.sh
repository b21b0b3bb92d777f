#!/bin/bash
# Train the qsdp_jax GPT on a Cloud TPU VM pod slice: create (or reuse) the slice, install the
# project on every worker, start training on all workers at once, collect the logs, tear down.
#
# Usage (on your workstation, with gcloud authenticated and a project/zone with TPU quota):
#   TPU_NAME=qsdp-pod ZONE=us-central2-b ACCELERATOR_TYPE=v4-32 bash tpu_scripts/pod.sh all --preset small
#   bash tpu_scripts/pod.sh create|install|train|logs|delete [trainer flags ...]
#   bash tpu_scripts/pod.sh --dry-run [step] [trainer flags ...]   # print the gcloud commands only
# `all` runs create, install, train, logs and then delete (set KEEP=1 to keep the slice).
# Flags after the step go to `python -m experiments.gpt.train` (on the train step).
#
# Settings (environment variables; defaults in brackets):
#   TPU_NAME [qsdp-pod]  ZONE [us-central2-b]  ACCELERATOR_TYPE [v4-32]
#   RUNTIME_VERSION [tpu-ubuntu2204-base] (v4/v5p; v5e: v2-alpha-tpuv5-lite)
#   PROJECT [gcloud's default]  SPOT [0] (1: --spot)  REMOTE_PYTHON [python3.11] (apt-installed)
#   MESH [node,local]  --mesh for the trainer: node = one per worker (host, over DCN/ICI),
#                      local = its chips; "fsdp" for a 1-D mesh over every chip
#   NUM_WORKERS [asked from gcloud; 4 in a dry run]   hosts in the slice, for collecting logs
#   LOGS [tpu-logs/<TPU_NAME>]  local folder for the collected logs and process 0's run files
# On the workers jax.distributed starts by itself (JAX detects the TPU pod); every worker must
# run the same command at the same time, which `--worker=all` does.
set -euo pipefail

# shellcheck source=scripts_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts_lib.sh"  # show

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
STEP="${1:-}"
case "$STEP" in
  create|install|train|logs|delete|all) shift ;;
  "") if [[ "$DRY_RUN" == 1 ]]; then STEP=all; else
        echo "usage: bash tpu_scripts/pod.sh [--dry-run] create|install|train|logs|delete|all [train flags]" >&2
        exit 2
      fi ;;
  *) echo "unknown step '$STEP': use create, install, train, logs, delete or all" >&2; exit 2 ;;
esac

TPU_NAME="${TPU_NAME:-qsdp-pod}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-32}"
RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
MESH="${MESH:-node,local}"
LOGS="${LOGS:-tpu-logs/$TPU_NAME}"
REMOTE_DIR="qsdp_jax"
REMOTE_PYTHON="${REMOTE_PYTHON:-python3.11}"  # the project needs Python >= 3.11
RUN_DIR="runs/pod"
GC=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
if [[ -n "${PROJECT:-}" ]]; then WHERE+=(--project="$PROJECT"); fi

run() {  # run a command, or print it in a dry run
  if [[ "$DRY_RUN" == 1 ]]; then show "$@"; else "$@"; fi
}

on_all() {  # run a shell command on every worker of the slice, in parallel
  run "${GC[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command="$1"
}

create() {
  if [[ "$DRY_RUN" == 0 ]] && "${GC[@]}" describe "$TPU_NAME" "${WHERE[@]}" >/dev/null 2>&1; then
    echo "reusing the existing TPU VM $TPU_NAME"
    return
  fi
  local extra=()
  if [[ "${SPOT:-0}" == 1 ]]; then extra+=(--spot); fi
  [[ "$DRY_RUN" == 1 ]] && echo "# (only if '$(show "${GC[@]}" describe "$TPU_NAME" "${WHERE[@]}")' fails)"
  run "${GC[@]}" create "$TPU_NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR_TYPE" \
    --version="$RUNTIME_VERSION" "${extra[@]}"
}

install() {
  local tarball="/tmp/qsdp_jax-$TPU_NAME.tar.gz"
  run git archive --format=tar.gz -o "$tarball" HEAD
  run "${GC[@]}" scp "$tarball" "$TPU_NAME:qsdp_jax.tar.gz" "${WHERE[@]}" --worker=all
  on_all "sudo apt-get update -q && sudo apt-get install -y -q $REMOTE_PYTHON $REMOTE_PYTHON-venv \
&& mkdir -p $REMOTE_DIR && tar -xzf qsdp_jax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR \
&& $REMOTE_PYTHON -m venv .venv && .venv/bin/pip install -q -U pip \
&& .venv/bin/pip install -q -e \".[experiments,tpu]\""
}

train() {
  local args
  args="$(show "$@")"
  on_all "cd $REMOTE_DIR && QSDP_HEARTBEAT_TIMEOUT_S=\${QSDP_HEARTBEAT_TIMEOUT_S:-30} \
.venv/bin/python -m experiments.gpt.train --mesh $MESH --out $RUN_DIR --overwrite \
--process-logs $RUN_DIR/logs $args 2>&1 | tee train.log"
}

logs() {
  local n="${NUM_WORKERS:-}"
  if [[ -z "$n" ]]; then
    if [[ "$DRY_RUN" == 1 ]]; then n=4; else
      n="$("${GC[@]}" describe "$TPU_NAME" "${WHERE[@]}" \
           --format='value(networkEndpoints[].ipAddress)' | tr ';' '\n' | grep -c .)"
    fi
  fi
  run mkdir -p "$LOGS"
  for ((w = 0; w < n; w++)); do
    run "${GC[@]}" scp "$TPU_NAME:$REMOTE_DIR/train.log" "$LOGS/worker_$w.log" "${WHERE[@]}" --worker="$w"
  done
  run "${GC[@]}" scp --recurse "$TPU_NAME:$REMOTE_DIR/$RUN_DIR" "$LOGS/" "${WHERE[@]}" --worker=0
}

delete() {
  run "${GC[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
}

case "$STEP" in
  create) create ;;
  install) install ;;
  train) train "$@" ;;
  logs) logs ;;
  delete) delete ;;
  all)
    create
    install
    status=0
    train "$@" || status=$?
    logs || true
    if [[ "${KEEP:-0}" == 1 ]]; then echo "# KEEP=1: the slice $TPU_NAME stays up"; else delete; fi
    exit "$status" ;;
esac
