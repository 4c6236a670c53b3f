"""One RL step's shapes as the trainer runs it, from the recipe and the world size.

A step: every engine samples its share of `prompts_per_step * group_size` sequences; the
learner scores the batch once (old log-probs, unless the on-policy shortcut lets the first
update's forward score; one more forward for the reference policy when `rl.kl_coef > 0`),
then takes `num_minibatches * epochs` optimizer updates, each over
1/num_minibatches of the batch; the weights go to the engines. Every sequence is taken at
its longest (prompt + `sampler.max_new_tokens`), which is the bound memory must meet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moe_rl.config import ConfigError, ModelConfig, ParallelConfig, RLConfig, SamplerConfig


def separate_engine_ranks(sampler: SamplerConfig) -> int:
    """GPUs that host engines only (`sampler.placement=separate`), else 0."""
    if sampler.placement != "separate":
        return 0
    return sampler.engine_ranks


@dataclass(frozen=True)
class PlannedLayout:
    """The process layout the recipe would run at on a hypothetical world size (the
    planner's; nothing runs: `moe_rl.learner.parallel.Layout` is a running rank's place)."""

    world: int
    learners: int
    """Ranks that train: the world, less the engine-only ranks under separate placement."""
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    """Dense data-parallel size: world / (tp * pp)."""
    expert_dp: int
    """Expert data-parallel size: world / (etp * ep * pp)."""

    @classmethod
    def of(cls, parallel: ParallelConfig, sampler: SamplerConfig, world: int) -> PlannedLayout:
        p = parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
        n = world - separate_engine_ranks(sampler)
        return cls(world, n, tp, pp, ep, etp, n // (tp * pp), n // (etp * ep * pp))

    def describe(self) -> str:
        engines = f" + {self.world - self.learners} engine-only" if self.world > self.learners else ""
        return (f"TP{self.tp} x EP{self.ep} x ETP{self.etp} x PP{self.pp}, DP{self.dp} "
                f"(expert DP{self.expert_dp}), {self.learners}{engines} GPUs")


@dataclass(frozen=True)
class Workload:
    sequences: int
    """Sequences per step: prompts_per_step * group_size."""
    prompt_tokens: int
    response_tokens: int
    """sampler.max_new_tokens."""
    seq_len: int
    """Learner sequence length: prompt + response, padded to a multiple of TP (sequence parallel)."""
    micro_batch: int
    """Sequences per micro-batch (parallel.micro_batch_size, or as many longest sequences as
    parallel.max_tokens_per_microbatch holds; fewer when a rank has fewer)."""
    micro_batches: int
    """Micro-batches per data-parallel rank per optimizer update."""
    updates: int
    """Optimizer updates per step: num_minibatches * epochs."""
    epochs: int
    """Passes over the step's batch (rl.epochs; in the critic's workload critic.epochs)."""
    scoring_passes: int
    """Forward-only passes over the whole batch per step (old log-probs, reference policy)."""
    rollout_tp: int
    engines: int
    """vLLM engines: one per rollout group of `rollout_tp` ranks (all ranks, or the engine-only
    ones under separate placement)."""

    @property
    def micro_batch_tokens(self) -> int:
        return self.micro_batch * self.seq_len


def workload(rl: RLConfig, sampler: SamplerConfig, parallel: ParallelConfig, layout: PlannedLayout,
             prompt_tokens: int) -> Workload:
    """The step's shapes for the recipe's `rl`, `sampler` and `parallel` sections at `layout`
    with prompts of `prompt_tokens` tokens."""
    sequences = rl.prompts_per_step * rl.group_size
    response = sampler.max_new_tokens
    seq_len = math.ceil((prompt_tokens + response) / layout.tp) * layout.tp
    micro_batch, micro_batches = _micro_batching(parallel, layout, sequences, seq_len, rl.num_minibatches)
    rollout_tp = sampler.tensor_parallel_size
    return Workload(
        sequences=sequences,
        prompt_tokens=prompt_tokens,
        response_tokens=response,
        seq_len=seq_len,
        micro_batch=micro_batch,
        micro_batches=micro_batches,
        updates=rl.num_minibatches * rl.epochs,
        epochs=rl.epochs,
        # the old-logprob pass is skipped when the first update's forward scores (on-policy)
        scoring_passes=(0 if getattr(rl, "scores_in_update", False) else 1) + (rl.kl_coef > 0),
        rollout_tp=rollout_tp,
        engines=(layout.world - layout.learners or layout.world) // rollout_tp,
    )


def critic_workload(parallel: ParallelConfig, layout: PlannedLayout, work: Workload, minibatches: int,
                    epochs: int) -> Workload:
    """PPO's critic's update shapes: the step's batch in `minibatches` mini-batches
    (critic.num_minibatches, default the actor's), `epochs` passes (critic.epochs), at the
    actor's micro-batch size; one value pass over the batch (its scoring pass)."""
    micro_batch, micro_batches = _micro_batching(parallel, layout, work.sequences, work.seq_len, minibatches)
    return dataclasses.replace(work, micro_batch=micro_batch, micro_batches=micro_batches,
                               updates=minibatches * epochs, epochs=epochs, scoring_passes=1)


def _micro_batching(parallel: ParallelConfig, layout: PlannedLayout, sequences: int, seq_len: int,
                    minibatches: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per rank per update) for `sequences` split
    into `minibatches` updates over `layout.dp` ranks."""
    per_rank = math.ceil(math.ceil(sequences / minibatches) / layout.dp)
    budget = parallel.max_tokens_per_microbatch
    # the plan's worst case: every sequence at its longest, so a token budget holds
    # budget // seq_len of them (at least one: a longer sequence takes a micro-batch alone)
    per_micro = max(1, budget // seq_len) if budget and parallel.packing else parallel.micro_batch_size
    micro_batch = min(per_micro, per_rank)
    return micro_batch, math.ceil(per_rank / micro_batch)


def check_rollout_tp(sampler: SamplerConfig, model: ModelConfig, world: int) -> None:
    """vLLM's tensor parallelism needs whole query heads per rank and KV heads either split
    evenly or replicated evenly."""
    rtp = sampler.tensor_parallel_size
    m = model
    hosts = separate_engine_ranks(sampler) or world
    if hosts % rtp or m.num_attention_heads % rtp or (m.num_query_groups % rtp and rtp % m.num_query_groups):
        raise ConfigError(
            f"sampler.tensor_parallel_size={rtp} must divide the engines' ranks ({hosts}) and "
            f"model.num_attention_heads={m.num_attention_heads}, and divide or be a multiple of "
            f"model.num_query_groups={m.num_query_groups}"
        )


def prompt_tokens_for(model: ModelConfig, sampler: SamplerConfig, requested: int) -> int:
    """The prompt length to plan: `requested`, capped so that prompt + max_new_tokens fits
    model.max_position_embeddings."""
    room = model.max_position_embeddings - sampler.max_new_tokens
    if room < 1:
        raise ConfigError(f"sampler.max_new_tokens={sampler.max_new_tokens} leaves no room for a prompt in "
                          f"model.max_position_embeddings={model.max_position_embeddings}")
    return max(1, min(requested, room))
