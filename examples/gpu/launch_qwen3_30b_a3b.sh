#!/usr/bin/env bash
# Multi-node launch of the Qwen3-30B-A3B-shaped RSPO recipe: 2 nodes x 8 GPUs (launch.sh).
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/gpu/launch_qwen3_30b_a3b.sh [key=value ...]
# The recipe's layout (TP2 x EP8 x PP2: one pipeline stage per node) fits 16 x 80 GB; check
# overrides before booking: python -m moe_rl.plan --config examples/gpu/qwen3_30b_a3b.yaml --gpus 16 [key=value ...]
NNODES=${NNODES:-2} exec bash "$(dirname "$0")/launch.sh" examples/gpu/qwen3_30b_a3b.yaml "$@"
