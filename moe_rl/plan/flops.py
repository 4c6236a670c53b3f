"""Model FLOPs of a training pass and the GPUs' dense bf16 peaks: the one count behind every
MFU this project reports (`bench/device/bench_gpu.py`, `bench/device/gpu_learner_levers.py` and the RL
metrics' `perf/mfu_learner`), so a run's MFU compares with the benchmarks'.

    train_flops(cfg.model, [2048, 1024])              # one forward + backward over two sequences
    train_flops_from_sums(cfg.model, tokens, squares)  # the same from sum(s) and sum(s^2)
    peak_bf16_flops("NVIDIA H100 80GB HBM3")           # 989e12; None for a GPU not in the table

Megatron's throughput formula (Narayanan et al. 2021) with the router's GEMM, 2 FLOPs a
multiply-add, forward, per token and layer: GQA attention's projections QKV 2h(a+2g)d and
output 2adh, or multi-latent attention's (`_attention_projections`); the MoE layer's router
2hE and top-k SwiGLU experts 2*3hfk (+ a shared expert's 2*3hf_s); a dense layer's MLP
2*3h*ffn instead; once per token the output head 2hV. Causal attention, scores and context,
costs a * (d_qk + d_v) * s per token of an s-token sequence (megatron's half of the square),
so a pass over sequences s_i costs per_token * sum(s_i) + core * sum(s_i^2). Training is
3x the forward (backward = 2x); activation recompute's extra forward is not model work and
is not counted. Embedding lookups and multi-token-prediction layers (never built) are not
counted either. The fp8 rows of the benchmarks use the same count against the bf16 peak.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0,
    "A100": 312.0,
}
"""Dense (not 2:4 sparse) bf16 TFLOP/s per GPU from NVIDIA's datasheets (SXM unless named),
matched in this order against `torch.cuda.get_device_name()` (so "H100 PCIe" before
"H100", "H200" before "H20")."""


def _attention_projections(m: Any) -> float:
    """Forward FLOPs per token and layer of the attention's projections."""
    h, a = m.hidden_size, m.num_attention_heads
    if not m.multi_latent_attention:
        d, g = m.kv_channels, m.num_query_groups
        return 2 * h * (a + 2 * g) * d + 2 * a * d * h
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    q = 2 * h * m.q_lora_rank + 2 * m.q_lora_rank * a * qk if m.q_lora_rank else 2 * h * a * qk
    kv = 2 * h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + 2 * m.kv_lora_rank * a * (m.qk_head_dim + m.v_head_dim)
    return q + kv + 2 * a * m.v_head_dim * h


def forward_flops_per_token(m: Any) -> float:
    """Forward FLOPs per token of every GEMM (`m`: a ModelConfig), attention's core aside."""
    h = m.hidden_size
    moe = 2 * h * m.num_experts + 2 * 3 * h * m.moe_ffn_hidden_size * m.moe_router_topk
    moe += 2 * 3 * h * m.moe_shared_expert_intermediate_size
    dense = 2 * 3 * h * m.ffn_hidden_size
    moe_layers = m.num_layers - m.num_dense_layers
    return (m.num_layers * _attention_projections(m) + moe_layers * moe + m.num_dense_layers * dense
            + 2 * h * m.vocab_size)


def attention_core_flops(m: Any) -> float:
    """Forward FLOPs of causal attention's scores and context per squared sequence length:
    a sequence of s tokens costs this x s^2, over every layer."""
    a = m.num_attention_heads
    qk, v = ((m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim) if m.multi_latent_attention
             else (m.kv_channels, m.kv_channels))
    return m.num_layers * a * (qk + v)


def train_flops_from_sums(m: Any, tokens: float, squares: float) -> float:
    """Model FLOPs of one training pass (forward + backward) over sequences whose lengths sum
    to `tokens` and whose squared lengths sum to `squares`."""
    return 3 * (forward_flops_per_token(m) * tokens + attention_core_flops(m) * squares)


def train_flops(m: Any, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one training pass over sequences of `seq_lens` real tokens."""
    return train_flops_from_sums(m, sum(seq_lens), sum(s * s for s in seq_lens))


def gpu_model(device_name: str) -> str | None:
    """The table's name for a CUDA device ("NVIDIA H100 80GB HBM3" -> "H100"), None if absent."""
    return next((k for k in PEAK_BF16_TFLOPS if k in device_name), None)


def peak_bf16_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak, FLOP/s; None for a device the table lacks (no MFU then)."""
    model = gpu_model(device_name)
    return PEAK_BF16_TFLOPS[model] * 1e12 if model else None


def device_short_name(device_name: str) -> str:
    """A file-name-safe name of the device: the table's ("h100", "h100_pcie"), else the
    device name's own ("nvidia_a10g")."""
    return re.sub(r"[^a-z0-9]+", "_", (gpu_model(device_name) or device_name).lower()).strip("_")


def mfu(flops: float, seconds: float, gpus: int, peak: float) -> float:
    """Model FLOPs utilisation: `flops` done by `gpus` GPUs in `seconds`, over their peak."""
    return flops / (seconds * gpus * peak) if seconds > 0 and gpus > 0 and peak > 0 else 0.0
