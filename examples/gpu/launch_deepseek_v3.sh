#!/usr/bin/env bash
# Multi-node launch of the DeepSeek-V3 RSPO recipe: 32 nodes x 8 H100 (launch.sh).
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/gpu/launch_deepseek_v3.sh [key=value ...]
# The recipe's layout (TP8 x EP256, distributed optimizer offloaded to the host) fits 256 x 80 GB;
# check overrides before booking: python -m moe_rl.plan --config examples/gpu/deepseek_v3.yaml --gpus 256 [key=value ...]
NNODES=${NNODES:-32} exec bash "$(dirname "$0")/launch.sh" examples/gpu/deepseek_v3.yaml "$@"
