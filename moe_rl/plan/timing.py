"""Where a step's time goes: compute from FLOPs at a stated fraction of peak, decoding from
HBM bandwidth, communication from `comms`, all without overlap (an upper bound on what is
exposed; megatron hides part of the DP and TP traffic behind compute).

FLOPs (Kaplan et al. 2020 / Narayanan et al. 2021 counting): a forward pass costs 2 FLOPs
per active GEMM weight per token (the embedding lookup is no GEMM) plus causal attention
2*a*d*s per layer per token (QK^T and AV over s/2 positions on average); backward is twice
the forward, full recompute one more forward. Per rank the work is the step's total / world
(balanced), and the update pays the 1F1B pipeline bubble (pp - 1) / micro-batches.

Rollout: prefill of the prompts is compute-bound (2 * active FLOPs per token); decoding is
one step per generated token for every running sequence, bound by the larger of reading the
rank's weight shard plus the running sequences' KV cache from HBM and its FLOPs, plus the
engine's tensor-parallel all-reduces; a KV cache smaller than the batch needs means more
waves of decoding.

PPO's critic (`rl.advantage: gae`): one forward over the batch for the values and its own
update passes (critic.epochs x critic.num_minibatches), at the actor's FLOPs less the output
layer's GEMM (`critic_seconds`).
"""

from __future__ import annotations

import math

from moe_rl.config import ModelConfig
from moe_rl.plan.hardware import Hardware
from moe_rl.plan.sampler import SamplerMemory
from moe_rl.plan.workload import PlannedLayout, Workload

TERA = 1e12


def attention_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    m = model
    return 2.0 * m.num_attention_heads * m.kv_channels * seq_len * m.num_layers


def _peak(model: ModelConfig, hw: Hardware) -> float:
    return (hw.fp8_tflops if model.fp8 != "none" else hw.bf16_tflops) * TERA * hw.mfu


def _forward_seconds(model: ModelConfig, layout: PlannedLayout, work: Workload, gemm_params: int, hw: Hardware) -> float:
    """One forward pass over the step's batch, per rank, with `gemm_params` GEMM weights."""
    s = work.seq_len
    tokens = work.sequences * s
    gemm_peak, attn_peak = _peak(model, hw), hw.bf16_tflops * TERA * hw.mfu
    return tokens * (2.0 * gemm_params / gemm_peak + attention_flops_per_token(model, s) / attn_peak) / layout.learners


def _update_factor(layout: PlannedLayout, work: Workload, recompute: bool) -> float:
    """The update's cost in forward passes: backward 2x, recompute one more forward, every
    epoch, and the 1F1B bubble."""
    bubble = 1 + (layout.pp - 1) / work.micro_batches
    return (3 + (1 if recompute else 0)) * work.epochs * bubble


def learner_seconds(model: ModelConfig, layout: PlannedLayout, work: Workload, gemm_params: int, recompute: bool,
                    hw: Hardware) -> dict[str, float]:
    """Seconds per step of the scoring passes and the update passes (fwd + bwd), per rank."""
    fwd_seconds = _forward_seconds(model, layout, work, gemm_params, hw)
    return {"scoring": work.scoring_passes * fwd_seconds,
            "update_compute": _update_factor(layout, work, recompute) * fwd_seconds}


def critic_seconds(model: ModelConfig, layout: PlannedLayout, work: Workload, critic_gemm_params: int,
                   recompute: bool, hw: Hardware) -> dict[str, float]:
    """PPO's critic per step, per rank (`work`: its workload, `workload.critic_workload`): one
    forward pass over the batch for the values and its update passes, at the actor's FLOPs
    less the output layer's GEMM (the critic's value head, a [h] dot product per token, is
    left out: 2h FLOPs against ~2 x active parameters; `moe_rl.plan.critic`)."""
    fwd_seconds = _forward_seconds(model, layout, work, critic_gemm_params, hw)
    return {"critic_scoring": fwd_seconds,
            "critic_update_compute": _update_factor(layout, work, recompute) * fwd_seconds}


def rollout_seconds(model: ModelConfig, work: Workload, gemm_params: int, sampler: SamplerMemory,
                    hw: Hardware) -> dict[str, float]:
    """Prefill and decode seconds of one engine (engines run in parallel)."""
    peak = hw.bf16_tflops * TERA * hw.mfu
    per_engine_gpus = work.rollout_tp
    prefill = sampler.sequences_per_engine * work.prompt_tokens * 2.0 * gemm_params / (peak * per_engine_gpus)
    length = work.prompt_tokens + work.response_tokens
    running = sampler.sequences_per_engine
    if sampler.kv_capacity_bytes > 0 and sampler.kv_bytes_per_token:
        running = min(running, max(1, sampler.kv_capacity_bytes // (length * sampler.kv_bytes_per_token)))
    else:
        return {"rollout_prefill": prefill, "rollout_decode": math.inf}
    waves = math.ceil(sampler.sequences_per_engine / running)
    hbm = hw.hbm_tbps * TERA * hw.bandwidth_efficiency
    avg_context = work.prompt_tokens + work.response_tokens / 2
    read = sampler.weights_bytes + running * avg_context * sampler.kv_bytes_per_token
    flops = running * 2.0 * gemm_params / per_engine_gpus
    step = max(read / hbm, flops / peak) + _decode_allreduce_seconds(model, running, per_engine_gpus, hw)
    return {"rollout_prefill": prefill, "rollout_decode": waves * work.response_tokens * step}


def _decode_allreduce_seconds(model: ModelConfig, running: int, rollout_tp: int, hw: Hardware) -> float:
    """vLLM's tensor parallelism all-reduces the hidden states twice per layer per decoding
    step (ring: 2(t-1)/t of running x hidden x 2 bytes); across nodes at InfiniBand speed.
    Latency (tens of microseconds per all-reduce) is not counted."""
    if rollout_tp == 1:
        return 0.0
    gbps = hw.ib_gbps if rollout_tp > hw.gpus_per_node else hw.nvlink_gbps
    nbytes = 2 * model.num_layers * 2 * (rollout_tp - 1) / rollout_tp * running * model.hidden_size * 2
    return nbytes / (gbps * 1e9 * hw.bandwidth_efficiency)


def optimizer_seconds(state_bytes_gpu: int, offloaded_bytes: int, grads_bytes: int, params_bytes: int,
                      offload_fraction: float, updates: int, hw: Hardware) -> float:
    """Adam is memory-bound: read and write the states and main params, read the grads,
    write the params; the offloaded part crosses PCIe (grads down, params up) instead."""
    hbm = hw.hbm_tbps * TERA * hw.bandwidth_efficiency
    gpu = (2 * state_bytes_gpu + grads_bytes + params_bytes) / hbm
    pcie = offload_fraction * (grads_bytes + params_bytes) / (hw.pcie_gbps * 1e9 * hw.bandwidth_efficiency)
    host = offloaded_bytes * 2 / (hw.pcie_gbps * 1e9)  # host Adam at about PCIe speed (stated)
    return updates * (gpu + pcie + host)
