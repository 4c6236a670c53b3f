#!/usr/bin/env bash
# Multi-node launch of the Qwen3-30B-A3B-shaped RSPO recipe: 2 nodes x 8 GPUs.
# Run this on every node with NODE_RANK=0..NNODES-1 and MASTER_ADDR set to node 0's address
# (a SLURM wrapper would take these from SLURM_NODEID / the first host of SLURM_NODELIST).
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/gpu/launch_qwen3_30b_a3b.sh [key=value ...]
# The recipe's layout (TP2 x EP8 x PP2: one pipeline stage per node) fits 16 x 80 GB; check
# overrides before booking: python -m moe_rl.plan --config examples/gpu/qwen3_30b_a3b.yaml --gpus 16 [key=value ...]
set -euo pipefail
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_RANK=${NODE_RANK:?set NODE_RANK}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR}
MASTER_PORT=${MASTER_PORT:-29500}

export CUDA_DEVICE_MAX_CONNECTIONS=1        # megatron: keep TP/SP communication ordered
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=8

exec torchrun \
  --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m moe_rl.train --config examples/gpu/qwen3_30b_a3b.yaml "$@"
