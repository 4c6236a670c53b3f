#!/usr/bin/env bash
# The body of every examples/gpu/slurm/<model>.sbatch: torchrun's rendezvous from the SLURM
# allocation, the recipe's --check once for the whole world, then one torchrun per node.
#   bash examples/gpu/slurm/sbatch_common.sh RECIPE.yaml [key=value ...]   (inside an sbatch job)
# From the allocation: nodes (SLURM_JOB_NUM_NODES, or SLURM_NNODES), GPUs per node
# (SLURM_GPUS_ON_NODE, else the count in SLURM_GPUS_PER_NODE, e.g. "h100:8", else 8), the
# rendezvous endpoint (the first host of SLURM_JOB_NODELIST, `scontrol show hostnames`) and
# its id (SLURM_JOB_ID). Each node's torchrun writes $LOG_DIR/<job name>-<job id>-<node>.log.
# Optional: GPUS_PER_NODE, RDZV_PORT (29500), LOG_DIR (logs/slurm), PYTHON (python),
# SHUTDOWN_TIMEOUT (seconds torchrun waits after forwarding SIGTERM before SIGKILL: the
# sbatch script sets it to its --signal=TERM@N), RESUME (true: a requeued or resubmitted job
# continues from the run's newest checkpoint; the first start begins fresh).
set -euo pipefail
RECIPE=${1:?usage: sbatch_common.sh RECIPE.yaml [key=value ...] (from an examples/gpu/slurm/*.sbatch job)}
shift
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}
if [[ -z $NNODES || -z ${SLURM_JOB_NODELIST:-} || -z ${SLURM_JOB_ID:-} ]]; then
  echo "error: SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST or SLURM_JOB_ID unset: not inside a SLURM job; submit with sbatch examples/gpu/slurm/<model>.sbatch" >&2
  exit 2
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-8}}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}  # ("h100:8" -> 8)
WORLD=$((NNODES * GPUS_PER_NODE))
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
RDZV_HOST=${HOSTS[0]:?scontrol show hostnames $SLURM_JOB_NODELIST printed no host}
RDZV_PORT=${RDZV_PORT:-29500}
LOG_DIR=${LOG_DIR:-logs/slurm}
PYTHON=${PYTHON:-python}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-1800}
RESUME=${RESUME:-true}
CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}  # (all the node's: a step's one task gets one CPU unless told)

export CUDA_DEVICE_MAX_CONNECTIONS=1        # megatron: keep TP/SP communication ordered
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

echo "moe_rl: $RECIPE on $NNODES node(s) x $GPUS_PER_NODE GPUs (world $WORLD), rendezvous $RDZV_HOST:$RDZV_PORT id $SLURM_JOB_ID, logs $LOG_DIR"
# Check the recipe, the overrides and the inputs once, for the whole world, here on the
# batch host: a mistake is one line in the job's output (exit 2) before any node starts.
"$PYTHON" -m moe_rl.train --check --nproc "$WORLD" --config "$RECIPE" "run.resume=$RESUME" "$@"
mkdir -p "$LOG_DIR"
# One torchrun per node (c10d rendezvous: no node rank to hand out); a node that fails ends
# the step on every node. `#SBATCH --signal=TERM@N` reaches each torchrun, which forwards it
# to its workers: they finish the step, save and exit within SHUTDOWN_TIMEOUT.
exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_NODE" \
  --kill-on-bad-exit=1 --output="$LOG_DIR/%x-%j-%N.log" \
  torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \
  --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  -m moe_rl.train --config "$RECIPE" "run.resume=$RESUME" "$@"
