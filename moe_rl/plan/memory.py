"""Each distinct rank's GPU memory by kind, and its peak in the two phases of a step.

Model state comes from megatron's own buffers (`moe_rl.learner.meta`): parameters as built,
the DDP gradient buffers (fp32: the learner reduces gradients in fp32), and the optimizer:
Adam's two fp32 moments per parameter element plus an fp32 main copy of every non-fp32
(bf16) parameter (megatron's Float16Optimizer / DistributedOptimizer; an fp32 model is
its own main copy). Under the distributed optimizer each rank keeps only its data-parallel
shard of those (dense weights over the DP group, experts over the expert-DP group), and
parameters and gradients sit in megatron's padded buffers. CPU offload moves a fraction of
the optimizer's part to host memory (megatron's HybridDeviceOptimizer; it needs the
distributed optimizer).

fp8 (Transformer Engine): the weights stay bf16; each GEMM weight gets an fp8 copy and its
transpose, cached across micro-batches (2 bytes per GEMM weight element; the scaling state
is a few floats per tensor). This is an estimate, not a measurement.

Host memory per GPU is reported too: offloaded optimizer states, a sleeping engine's
weights, and the routing record of the scoring pass (kept on the host).

Phases: during the rollout the learner's state stays resident beside vLLM's budget; during
the update the activations and logits join, and vLLM's budget is either still resident or,
with `sampler.sleep_between_steps`, freed (KV cache dropped, weights in host memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_rl.config import Config
from moe_rl.plan.activations import logits_bytes, stage_activation_bytes
from moe_rl.plan.hardware import GIB, Hardware
from moe_rl.plan.sampler import SamplerMemory
from moe_rl.plan.workload import PlannedLayout, Workload

if TYPE_CHECKING:  # the meta-device build imports megatron; these modules need only its type
    from moe_rl.learner.meta import MetaRank

ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MAIN_BYTES = 4  # fp32 main copy of a bf16 parameter
GEMM_KINDS = ("attention", "dense_mlp", "shared_experts", "routed_experts")


@dataclass(frozen=True)
class Switches:
    """The memory-relevant settings of a plan (the recipe's, or a what-if)."""

    distributed_optimizer: bool
    offload_fraction: float
    recompute: bool
    sleep: bool

    @classmethod
    def of(cls, cfg: Config) -> Switches:
        return cls(
            distributed_optimizer=cfg.optimizer.distributed,
            offload_fraction=cfg.optimizer.offload_fraction,
            recompute=cfg.model.recompute == "full",
            sleep=cfg.sampler.sleep_between_steps,
        )


@dataclass(frozen=True)
class ModelState:
    params: int
    grads: int
    optimizer: int
    """Optimizer bytes before any offload."""


def model_state(rank: MetaRank, distributed: bool) -> ModelState:
    """Bytes of parameters, gradients and optimizer states on `rank` (exact from megatron's
    buffers; the meta build lays them out for the distributed optimizer, and without it
    megatron's buffers are unpadded, so both variants are exact)."""
    if distributed:
        return ModelState(
            params=sum(b.param_buffer_bytes for b in rank.buffers),
            grads=sum(b.grad_bytes for b in rank.buffers),
            optimizer=sum(MAIN_BYTES * b.shard_low_precision_numel + ADAM_BYTES * b.shard_numel
                          for b in rank.buffers),
        )
    return ModelState(
        params=rank.param_bytes,
        grads=sum(b.params_numel * b.grad_elem_bytes for b in rank.buffers),
        optimizer=sum(MAIN_BYTES * b.low_precision_numel + ADAM_BYTES * b.params_numel for b in rank.buffers),
    )


def routing_record_bytes(cfg: Config, rank: MetaRank, layout: PlannedLayout, work: Workload) -> int:
    """Host bytes of the routing record the scoring pass keeps for this rank's rows and its
    stage's MoE layers (`moe_rl.routing.record`: uint8 / int16 expert ids and fp32 log
    routing probabilities per token, layer and k; the router's own ids too under replay)."""
    rl = cfg.rl
    if not getattr(rl, "records_routing", rl.capture_routing):
        return 0
    ids = 1 if cfg.model.num_experts <= 256 else 2
    per = ids + 4 + (ids if rl.replay != "none" else 0)
    rows = -(-work.sequences // layout.dp)
    return rows * work.seq_len * rank.num_moe_layers * cfg.model.moe_router_topk * per


@dataclass(frozen=True)
class RankMemory:
    """One distinct rank's memory by kind (bytes) and its phase peaks."""

    rank: int
    stage_ranks: tuple[int, ...]
    pp_rank: int
    """-1 for an engine-only rank (separate placement)."""
    params_count: int
    kinds: dict[str, int]
    """GPU bytes by kind, as the plan's switches configure it."""
    host: dict[str, int]
    """Host bytes by kind (optimizer offload, sleeping engine's weights)."""
    variants: dict[str, int]
    """The alternatives the report compares: optimizer with / without distribution and offload,
    activations with / without recompute."""
    rollout: int
    update: int


def _variants(rank: MetaRank, acts: dict[bool, int]) -> dict[str, int]:
    rep, dist = model_state(rank, False), model_state(rank, True)
    return {
        "optimizer_replicated": rep.optimizer,
        "optimizer_distributed": dist.optimizer,
        "optimizer_offloaded_to_host": dist.optimizer,  # full offload: GPU keeps none of it
        "activations_no_recompute": acts[False],
        "activations_full_recompute": acts[True],
    }


def rank_memory(cfg: Config, rank: MetaRank, layout: PlannedLayout, work: Workload, sampler: SamplerMemory,
                hw: Hardware, sw: Switches) -> RankMemory:
    m = cfg.model
    state = model_state(rank, sw.distributed_optimizer)
    acts = {rc: stage_activation_bytes(
        m, tokens=work.micro_batch_tokens, tp=layout.tp, pp=layout.pp, stage=rank.pp_rank,
        layers=rank.num_layers, moe_layers=rank.num_moe_layers, micro_batches=work.micro_batches,
        recompute=rc) for rc in (False, True)}
    last = rank.pp_rank == layout.pp - 1
    colocated = int(layout.learners == layout.world)  # else engines have GPUs of their own
    offloaded = int(state.optimizer * sw.offload_fraction)
    gemm = sum(rank.params_by_kind[k] for k in GEMM_KINDS)
    kinds = {
        "params": state.params,
        "grads": state.grads,
        "optimizer_states": state.optimizer - offloaded,
        "reference_model": rank.param_bytes if cfg.rl.kl_coef > 0 else 0,
        "fp8_extra": 2 * gemm if m.fp8 != "none" else 0,
        "activations": acts[sw.recompute],
        "logits": logits_bytes(m, micro_batch=work.micro_batch, seq_len=work.seq_len,
                               response_tokens=work.response_tokens, tp=layout.tp,
                               chunk_tokens=cfg.parallel.logprob_chunk_tokens) if last else 0,
        **_sampler_kinds(sampler, colocated),
        "reserve": int(hw.reserve_gib * GIB),
    }
    static = kinds["params"] + kinds["grads"] + kinds["optimizer_states"] + kinds["reference_model"] + kinds["reserve"]
    # optimizer.offload_during_rollout: grads and optimizer states wait on the host while the engine samples
    idle = kinds["grads"] + kinds["optimizer_states"] if cfg.optimizer.offload_during_rollout else 0
    rollout = static - idle + kinds["sampler_budget"]
    update = (static + kinds["fp8_extra"] + kinds["activations"] + kinds["logits"]
              + (0 if sw.sleep else kinds["sampler_budget"]))
    host = {"optimizer_offload": offloaded, "offloaded_during_rollout": idle,
            "sleeping_sampler_weights": sampler.weights_bytes * colocated if sw.sleep else 0,
            "routing_record": routing_record_bytes(cfg, rank, layout, work)}
    return RankMemory(
        rank=rank.rank, stage_ranks=rank.stage_ranks, pp_rank=rank.pp_rank, params_count=rank.params,
        kinds=kinds,
        host=host,
        variants=_variants(rank, acts),
        rollout=rollout, update=update,
    )


def _sampler_kinds(sampler: SamplerMemory, on_this_gpu: int) -> dict[str, int]:
    return {
        "sampler_weights": sampler.weights_bytes * on_this_gpu,
        "kv_cache": max(0, min(sampler.kv_need_bytes, sampler.kv_capacity_bytes)) * on_this_gpu,
        "sampler_budget": sampler.budget_bytes * on_this_gpu,
    }


def engine_memory(layout: PlannedLayout, sampler: SamplerMemory, hw: Hardware, sw: Switches) -> RankMemory | None:
    """An engine-only rank under `sampler.placement=separate` (None when colocated): vLLM's
    budget, in the update too unless the engine sleeps."""
    if layout.learners == layout.world:
        return None
    reserve = int(hw.reserve_gib * GIB)
    zeros = dict.fromkeys(("params", "grads", "optimizer_states", "reference_model", "fp8_extra", "activations",
                           "logits"), 0)
    kinds = {**zeros, **_sampler_kinds(sampler, 1), "reserve": reserve}
    return RankMemory(
        rank=layout.learners, stage_ranks=tuple(range(layout.learners, layout.world)), pp_rank=-1, params_count=0,
        kinds=kinds, host={"optimizer_offload": 0, "offloaded_during_rollout": 0, "sleeping_sampler_weights": sampler.weights_bytes if sw.sleep else 0,
                           "routing_record": 0},
        variants={}, rollout=reserve + sampler.budget_bytes,
        update=reserve + (0 if sw.sleep else sampler.budget_bytes),
    )
