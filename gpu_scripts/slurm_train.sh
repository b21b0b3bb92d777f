#!/bin/bash
# Train the qsdp_jax GPT on a multi-node SLURM GPU cluster (one `srun` step, NCCL, jax.distributed).
#
# Usage (from the repository root, with the project installed in .venv on a shared filesystem):
#   sbatch --nodes=4 gpu_scripts/slurm_train.sh --preset small --steps 1000 --inter-grad-bits 4
#   bash gpu_scripts/slurm_train.sh --dry-run [trainer flags ...]   # print what would run, run nothing
# Everything after the options goes to `python -m experiments.gpt.train`.
#
# Settings (environment variables; defaults in brackets):
#   GPUS_PER_NODE  [8]      GPUs on each node
#   PROCS          [gpu]    gpu: one process per GPU (JAX's SLURM detection gives each its GPU);
#                           node: one process per node that drives all its GPUs
#   MESH           [node=<nodes>,local=<GPUS_PER_NODE>]  --mesh for the trainer ("fsdp" for 1-D)
#   OUT            [runs/slurm-<job id>]  output directory (process 0 writes it; logs/ for all)
#   PYTHON         [.venv/bin/python]
#   NCCL_SOCKET_IFNAME, NCCL_IB_HCA   passed on when set (pick the inter-node network)
#   QSDP_HEARTBEAT_TIMEOUT_S [10]  seconds before a dead process brings the others down
# jax.distributed starts from SLURM's variables (qsdp_jax.distributed: JAX's own detection), so
# no coordinator address is needed. XLA_FLAGS below let collectives overlap compute on GPU.
# With PROCS=gpu, JAX gives process <SLURM_LOCALID> GPU <SLURM_LOCALID> of the node's visible
# GPUs: keep --gpus-per-node (do not add --gpus-per-task, which hides the other GPUs).
#
#SBATCH --job-name=qsdp-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --output=qsdp-train-%j.out
set -euo pipefail

# shellcheck source=scripts_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts_lib.sh"  # show, gpu_overlap_env

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi

NODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-2}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
PROCS="${PROCS:-gpu}"
MESH="${MESH:-node=${NODES},local=${GPUS_PER_NODE}}"
OUT="${OUT:-runs/slurm-${SLURM_JOB_ID:-dryrun}}"
PYTHON="${PYTHON:-.venv/bin/python}"

case "$PROCS" in
  gpu) TASKS_PER_NODE="$GPUS_PER_NODE" ;;
  node) TASKS_PER_NODE=1
        # JAX's SLURM detection would give a node's single process only GPU <local id>: all of them
        JAX_LOCAL_DEVICE_IDS="$(seq -s, 0 $((GPUS_PER_NODE - 1)))"
        export JAX_LOCAL_DEVICE_IDS ;;
  *) echo "PROCS=$PROCS: use gpu (one process per GPU) or node (one per node)" >&2; exit 2 ;;
esac

gpu_overlap_env  # XLA_FLAGS: collectives overlap compute (see scripts_lib.sh)
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

CMD=(srun --nodes="$NODES" --ntasks-per-node="$TASKS_PER_NODE" --kill-on-bad-exit=1
     "$PYTHON" -m experiments.gpt.train --mesh "$MESH" --out "$OUT" --process-logs "$OUT/logs"
     "$@")

if [[ "$DRY_RUN" == 1 ]]; then
  for var in XLA_FLAGS XLA_PYTHON_CLIENT_MEM_FRACTION NCCL_DEBUG NCCL_SOCKET_IFNAME NCCL_IB_HCA \
             QSDP_HEARTBEAT_TIMEOUT_S JAX_LOCAL_DEVICE_IDS; do
    if [[ -n "${!var:-}" ]]; then show export "$var=${!var}"; fi
  done
  show "${CMD[@]}"
  exit 0
fi
if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  echo "not inside a SLURM job: submit with sbatch (or try --dry-run)" >&2
  exit 2
fi
exec "${CMD[@]}"
