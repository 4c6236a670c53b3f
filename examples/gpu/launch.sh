#!/usr/bin/env bash
# Multi-node torchrun launch of one recipe; the per-model scripts (launch_<model>.sh) call it
# with their recipe and node count:
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/gpu/launch.sh RECIPE.yaml [key=value ...]
# Run it on every node with NODE_RANK=0..NNODES-1 and MASTER_ADDR set to node 0's address (a
# SLURM wrapper would take these from SLURM_NODEID / the first host of SLURM_NODELIST).
set -euo pipefail
RECIPE=${1:?usage: launch.sh RECIPE.yaml [key=value ...]}
shift
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_RANK=${NODE_RANK:?set NODE_RANK}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR}
MASTER_PORT=${MASTER_PORT:-29500}
# torchrun kills its workers this long after forwarding a SIGTERM: the step in progress plus
# the recipe's run.stop_grace_s (a save in flight and the stopped step's save), or the
# preempted step is lost; python -m moe_rl.plan --config RECIPE says what a recipe needs.
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-1800}

export CUDA_DEVICE_MAX_CONNECTIONS=1        # megatron: keep TP/SP communication ordered
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=8

# Check the recipe, the overrides and the inputs once, for the whole world: a mistake is one
# line here (exit 2) instead of one error per rank under torchrun's own traceback.
python -m moe_rl.train --check --nproc "$((NNODES * GPUS_PER_NODE))" --config "$RECIPE" "$@"
exec torchrun \
  --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  -m moe_rl.train --config "$RECIPE" "$@"
