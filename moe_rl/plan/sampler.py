"""The rollout engines' memory on each GPU: weights at rollout TP and the KV cache.

Placement (the rollout design of `sampler.tensor_parallel_size`): the world (or, with
`sampler.placement=separate`, the last `sampler.engine_ranks` ranks, which train nothing)
is cut into rollout groups of that many consecutive ranks, one vLLM engine per group, each
group generating 1/engines of the step's sequences. vLLM shards attention heads, the vocabulary
and every expert's columns over its TP ranks (or, with `sampler.expert_parallel`, whole
experts), so each rank holds ~1/rollout-TP of the weights; KV heads are sharded too, and
replicated when rollout TP exceeds the KV-head count.

vLLM takes `gpu_memory_utilization` of the GPU at start (weights, a workspace, and the KV
cache filling the rest). If the batch's KV cache needs more, vLLM runs fewer sequences at
once (more decoding waves, not an error); if the weights do not fit in the budget the
engine cannot start. With `sampler.sleep_between_steps` (vLLM sleep mode, level 1) the
engine frees its KV cache and moves its weights to host memory for the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_rl.config import ModelConfig, SamplerConfig
from moe_rl.plan.hardware import GIB, Hardware
from moe_rl.plan.workload import Workload

# bytes per weight element: vLLM serves fp32 / bf16 as is; fp8_emulated rounds bf16 values
# through e4m3 but keeps them in bf16; real fp8 weights (GPU) take one byte.
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp8_emulated": 2, "fp8": 1, "auto": 2}  # (auto: bf16 on a GPU)
KV_BYTES = {"fp32": 4, "bf16": 2, "fp8_emulated": 2, "fp8": 2, "auto": 2}


@dataclass(frozen=True)
class SamplerMemory:
    weights_bytes: int
    """This rank's share of the engine's weights."""
    kv_bytes_per_token: int
    """KV cache per token position on this rank (all layers, K and V)."""
    kv_need_bytes: int
    """This rank's share of the KV cache for its engine's sequences, all at full length."""
    kv_batch_bytes: int
    """The whole step's KV cache (all engines): sequences x (prompt + max_new_tokens)."""
    budget_bytes: int
    """What vLLM takes on this GPU: gpu_memory_utilization x GPU memory."""
    kv_capacity_bytes: int
    """KV cache room in the budget after weights and workspace (<= 0: the engine cannot start)."""
    sequences_per_engine: int

    @property
    def starts(self) -> bool:
        return self.kv_capacity_bytes > 0

    @property
    def concurrency(self) -> float:
        """Fraction of the engine's sequences that fit in the KV cache at once."""
        if self.kv_need_bytes == 0:
            return 1.0
        return max(0.0, min(1.0, self.kv_capacity_bytes / self.kv_need_bytes))


def kv_bytes_per_token(model: ModelConfig, precision: str, rtp: int) -> int:
    """KV cache per token position on one rank of a rollout-TP `rtp` engine, all layers. GQA:
    K and V of the rank's KV heads (replicated past the KV-head count). Multi-latent
    attention: the compressed latent and the shared RoPE key (kv_lora_rank +
    qk_pos_emb_head_dim values), which vLLM caches whole on every TP rank. `precision`:
    sampler.precision."""
    m = model
    if m.multi_latent_attention:
        return m.num_layers * (m.kv_lora_rank + m.qk_pos_emb_head_dim) * KV_BYTES[precision]
    kv_heads = max(m.num_query_groups // rtp, 1)
    return 2 * m.num_layers * kv_heads * m.kv_channels * KV_BYTES[precision]


def sampler_memory(sampler: SamplerConfig, model: ModelConfig, params_by_kind: dict[str, int], work: Workload,
                   hw: Hardware) -> SamplerMemory:
    s = sampler
    rtp = work.rollout_tp
    routed = params_by_kind["routed_experts"]
    dense = sum(params_by_kind.values()) - routed
    if getattr(s, "expert_parallel", False):  # experts split over the group, the rest replicated
        weights = (dense + routed // rtp) * WEIGHT_BYTES[s.precision]
    else:
        weights = (dense + routed) * WEIGHT_BYTES[s.precision] // rtp
    per_token = kv_bytes_per_token(model, s.precision, rtp)
    whole_token = kv_bytes_per_token(model, s.precision, 1)  # the whole batch's cache, unsharded
    per_engine = math.ceil(work.sequences / work.engines)
    length = work.prompt_tokens + work.response_tokens
    budget = int(s.gpu_memory_utilization * hw.gpu_memory_bytes)
    return SamplerMemory(
        weights_bytes=weights,
        kv_bytes_per_token=per_token,
        kv_need_bytes=per_engine * length * per_token,
        kv_batch_bytes=work.sequences * length * whole_token,
        budget_bytes=budget,
        kv_capacity_bytes=budget - weights - int(hw.vllm_workspace_gib * GIB),
        sequences_per_engine=per_engine,
    )
