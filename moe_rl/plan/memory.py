"""Each distinct rank's GPU memory by kind, and its peak in the two phases of a step.

Model state comes from megatron's own buffers (`model_state`). CPU offload moves a fraction
of the optimizer's part to host memory (megatron's HybridDeviceOptimizer; it needs the
distributed optimizer).

PPO's critic (`rl.advantage: gae`, `critic`): its parameters, gradients and optimizer
states sit beside the actor's in both phases (offloaded as the actor's are), its fp8 weight
caches join the update, and since the two updates run one after the other the update phase
holds the larger of the actor's activations + logits and the critic's activations.

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

from moe_rl.config import ModelConfig, OptimizerConfig, ParallelConfig, RLConfig, SamplerConfig
from moe_rl.plan.activations import (
    DTYPE_BYTES,
    expert_id_bytes,
    logits_bytes,
    stage_activation_bytes,
)
from moe_rl.plan.critic import (
    critic_state,
    value_head_activation_bytes,
    value_head_numel,
)
from moe_rl.plan.hardware import GIB, Hardware
from moe_rl.plan.model_state import model_state
from moe_rl.plan.sampler import SamplerMemory
from moe_rl.plan.workload import PlannedLayout, Workload

if TYPE_CHECKING:  # the meta-device build imports megatron; these modules need only its type
    from moe_rl.learner.meta import MetaRank

GEMM_KINDS = ("attention", "dense_mlp", "shared_experts", "routed_experts")


@dataclass(frozen=True)
class Switches:
    """The memory-relevant settings of a plan (the recipe's, or a what-if)."""

    distributed_optimizer: bool
    offload_fraction: float
    recompute: bool
    sleep: bool

    @classmethod
    def of(cls, optimizer: OptimizerConfig, model: ModelConfig, sampler: SamplerConfig) -> Switches:
        """The recipe's: its optimizer, model and sampler sections say."""
        return cls(
            distributed_optimizer=optimizer.distributed,
            offload_fraction=optimizer.offload_fraction,
            recompute=model.recompute == "full",
            sleep=sampler.sleep_between_steps,
        )


def routing_record_bytes(rl: RLConfig, model: ModelConfig, rank: MetaRank, layout: PlannedLayout,
                         work: Workload) -> int:
    """Host bytes of the routing record the scoring pass keeps for this rank's rows and its
    stage's MoE layers (`moe_rl.routing.record`: uint8 / int16 expert ids and fp32 log
    routing probabilities per token, layer and k; the router's own ids too under replay)."""
    if not getattr(rl, "records_routing", rl.capture_routing):
        return 0
    ids = expert_id_bytes(model.num_experts)
    per = ids + 4 + (ids if rl.replay != "none" else 0)
    rows = -(-work.sequences // layout.dp)
    return rows * work.seq_len * rank.num_moe_layers * model.moe_router_topk * per


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


def _stage_activations(model: ModelConfig, rank: MetaRank, layout: PlannedLayout, work: Workload,
                       recompute: bool) -> int:
    """The activations `rank`'s pipeline stage holds during an update of `work`'s shapes."""
    return stage_activation_bytes(model, tokens=work.micro_batch_tokens, tp=layout.tp, pp=layout.pp,
                                  stage=rank.pp_rank, layers=rank.num_layers, moe_layers=rank.num_moe_layers,
                                  micro_batches=work.micro_batches, recompute=recompute)


def _critic_kinds(model: ModelConfig, rank: MetaRank, layout: PlannedLayout, work: Workload, sw: Switches,
                  actor_fp8: int) -> tuple[dict[str, int], int]:
    """The critic's GPU bytes by kind on `rank` (`moe_rl.plan.critic`) and its optimizer
    bytes offloaded to the host (the actor's offload fraction); `work`: its own workload
    (`workload.critic_workload`), whose micro-batching sets its activations."""
    activations = _stage_activations(model, rank, layout, work, sw.recompute)
    head = value_head_numel(model, rank, layout.pp)
    state = critic_state(rank, sw.distributed_optimizer, layout.dp, head)
    offloaded = int(state.optimizer * sw.offload_fraction)
    e = DTYPE_BYTES[model.dtype_on(True)]
    value_head = value_head_activation_bytes(work.micro_batch_tokens, model.hidden_size, e, layout.tp)
    return {
        "critic_params": state.params,
        "critic_grads": state.grads,
        "critic_optimizer_states": state.optimizer - offloaded,
        "critic_fp8_extra": actor_fp8,  # the same GEMM weights (the output layer is none of them)
        "critic_activations": activations + (value_head if head else 0),
    }, offloaded


def rank_memory(model: ModelConfig, rl: RLConfig, parallel: ParallelConfig, optimizer: OptimizerConfig,
                rank: MetaRank, layout: PlannedLayout, work: Workload, critic_work: Workload | None,
                sampler: SamplerMemory, hw: Hardware, sw: Switches) -> RankMemory:
    """`rank`'s memory by kind and phase, from the recipe's `model`, `rl` (reference policy,
    routing record), `parallel` (the log-prob chunk) and `optimizer` (offload during the
    rollout) sections."""
    m = model
    state = model_state(rank, sw.distributed_optimizer)
    acts = {rc: _stage_activations(m, rank, layout, work, rc) for rc in (False, True)}
    last = rank.pp_rank == layout.pp - 1
    colocated = int(layout.learners == layout.world)  # else engines have GPUs of their own
    offloaded = int(state.optimizer * sw.offload_fraction)
    gemm = sum(rank.params_by_kind[k] for k in GEMM_KINDS)
    fp8 = 2 * gemm if m.fp8 != "none" else 0
    critic, critic_offloaded = (_critic_kinds(m, rank, layout, critic_work, sw, fp8)
                                if critic_work is not None else ({}, 0))
    kinds = {
        "params": state.params,
        "grads": state.grads,
        "optimizer_states": state.optimizer - offloaded,
        "reference_model": rank.param_bytes if rl.kl_coef > 0 else 0,
        "fp8_extra": fp8,
        "activations": acts[sw.recompute],
        "logits": logits_bytes(m, micro_batch=work.micro_batch, seq_len=work.seq_len,
                               response_tokens=work.response_tokens, tp=layout.tp,
                               chunk_tokens=parallel.logprob_chunk_tokens) if last else 0,
        **critic,
        **_sampler_kinds(sampler, colocated),
        "reserve": int(hw.reserve_gib * GIB),
    }
    k = lambda kind: kinds.get(kind, 0)  # noqa: E731  (the critic's kinds exist only with a critic)
    trained = ("grads", "optimizer_states", "critic_grads", "critic_optimizer_states")
    static = sum(k(kind) for kind in ("params", "critic_params", "reference_model", "reserve", *trained))
    # optimizer.offload_during_rollout: grads and optimizer states wait on the host while the engine samples
    idle = sum(k(kind) for kind in trained) if optimizer.offload_during_rollout else 0
    rollout = static - idle + kinds["sampler_budget"]
    # the actor's and the critic's updates run one after the other: the larger pass is the peak
    passes = max(k("activations") + k("logits"), k("critic_activations"))
    update = static + k("fp8_extra") + k("critic_fp8_extra") + passes + (0 if sw.sleep else kinds["sampler_budget"])
    host = {"optimizer_offload": offloaded + critic_offloaded, "offloaded_during_rollout": idle,
            "sleeping_sampler_weights": sampler.weights_bytes * colocated if sw.sleep else 0,
            "routing_record": routing_record_bytes(rl, m, rank, layout, work)}
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
