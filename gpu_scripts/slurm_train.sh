#!/bin/bash
# Train the qsdp_jax GPT on a multi-node SLURM GPU cluster (one `srun` step, NCCL, jax.distributed).
#
# Usage (from the repository root, with the project installed in .venv on a shared filesystem):
#   sbatch --nodes=4 gpu_scripts/slurm_train.sh --preset small --steps 1000 --inter-grad-bits 4
#   bash gpu_scripts/slurm_train.sh --dry-run [train_gpt flags ...]   # print what would run, run nothing
# Everything after the options goes to `python -m experiments.train_gpt`.
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

# Collectives overlap compute: the latency-hiding scheduler moves them around the matmuls, and
# the pipelined all-gather / reduce-scatter prefetch the next layer inside the scanned layer loop.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_latency_hiding_scheduler=true \
--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true \
--xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export QSDP_HEARTBEAT_TIMEOUT_S="${QSDP_HEARTBEAT_TIMEOUT_S:-10}"

CMD=(srun --nodes="$NODES" --ntasks-per-node="$TASKS_PER_NODE" --kill-on-bad-exit=1
     "$PYTHON" -m experiments.train_gpt --mesh "$MESH" --out "$OUT" --process-logs "$OUT/logs"
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
