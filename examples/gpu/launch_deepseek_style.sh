#!/usr/bin/env bash
# Single-node launch of the DeepSeek-style GSPO recipe on 8 GPUs.
#   bash examples/gpu/launch_deepseek_style.sh [key=value ...]
# Check overrides before booking: python -m moe_rl.plan --config examples/gpu/deepseek_style.yaml --gpus 8 [key=value ...]
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=8
exec torchrun --standalone --nproc-per-node "${GPUS_PER_NODE:-8}" \
  -m moe_rl.train --config examples/gpu/deepseek_style.yaml "$@"
