"""PPO's critic on each rank (`rl.advantage: gae`): its memory and its compute, derived from
the actor's.

The critic (`moe_rl.learner.critic`) is the actor's architecture at the actor's parallel
layout, on the actor's ranks: a megatron GPTModel whose output layer is frozen and unused
(its vocab x hidden weight stays allocated on the last stage, with no gradient and no
optimizer state: megatron's DDP leaves a parameter that needs no gradient out of its grad
buffer) plus a scalar value head, a [hidden] vector on the last stage. It has its own
optimizer with the actor's settings (Adam, precision, distribution, offload).

Model state: the actor's, exact from megatron's buffers (`model_state`), less the output
layer's gradient (fp32, in the grad buffer) and optimizer state (Adam's moments and the fp32
main copy of a bf16 weight; under the distributed optimizer a data-parallel rank owns
ceil(1/dp) of it), plus the value head's parameter, gradient and optimizer state (counted
whole on one rank). The buffers' padding is taken as the actor's (it differs by less than
dp elements per bucket).

Activations: the critic's update runs the actor's layers at the actor's micro-batch size over
its own mini-batches (`critic.num_minibatches`, default the actor's: `workload.critic_workload`),
so its saved activations are those of an actor update of that size
(`activations.stage_activation_bytes`); on the last stage the value head's input and fp32
values stand in for the logits. The actor's and the critic's updates run one after the
other, so the update phase holds the larger of the two (`memory.rank_memory`). The critic's
value pass is forward-only, like the reference policy's scoring pass, and is not a peak
either. With fp8, the critic's GEMM weights get their own cached fp8 copies (`memory`'s 2
bytes per GEMM weight element).

Compute: the actor's FLOPs per token less the output layer's GEMM (2 * V * h; the critic's
head is a [h] dot product), for one forward pass over the batch (values) and its update
passes (`critic.epochs` of `critic.num_minibatches`, the actor's recompute and 1F1B bubble),
`timing.critic_seconds`; its traffic (TP, EP, PP, DP) is `comms.traffic` over those passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.config import ModelConfig, RLConfig
from moe_rl.plan.model_state import ModelState, model_state, optimizer_bytes_per_element

if TYPE_CHECKING:  # the meta-device build imports megatron; this module needs only its type
    from moe_rl.learner.meta import MetaRank


def has_critic(rl: RLConfig) -> bool:
    """PPO with a learned value model: the recipe asks for GAE advantages."""
    return rl.uses_critic


def value_head_numel(model: ModelConfig, rank: MetaRank, pp: int) -> int:
    """The value head's elements on `rank`: a [hidden] vector on the last pipeline stage."""
    return model.hidden_size if rank.pp_rank == pp - 1 else 0


def critic_state(rank: MetaRank, distributed: bool, dp: int, head_numel: int) -> ModelState:
    """The critic's parameter, gradient and optimizer bytes on `rank`: the actor's (`rank` is
    the actor's build) without the frozen output layer's gradient and optimizer state, with
    the value head's (`head_numel` elements)."""
    actor = model_state(rank, distributed)
    # the output layer sits in the dense buffer of the model's dtype (the largest one)
    dense = max((b for b in rank.buffers if not b.expert), key=lambda b: b.params_numel)
    frozen = rank.params_by_kind["output"]
    owned = -(-frozen // dp) if distributed else frozen
    per_opt = optimizer_bytes_per_element(dense.param_bytes_per_elem)
    return ModelState(
        params=actor.params + head_numel * dense.param_bytes_per_elem,
        grads=actor.grads + (head_numel - frozen) * dense.grad_elem_bytes,
        optimizer=actor.optimizer + (head_numel - owned) * per_opt,
    )


def value_head_activation_bytes(micro_batch_tokens: int, hidden: int, elem_bytes: int, tp: int) -> int:
    """What the value head keeps for its backward on the last stage, per micro-batch: its
    input (the final hidden states, a sequence-parallel shard: tokens * h / tp) and the fp32
    values (one per token)."""
    return micro_batch_tokens * hidden * elem_bytes // tp + 4 * micro_batch_tokens


def critic_gemm_params(active_params: int, by_kind: dict[str, int]) -> int:
    """The critic's GEMM weights one token's forward uses: the actor's active parameters less
    the embedding (a lookup) and the output layer (frozen and unused; with tied embeddings
    the output GEMM is the embedding's, and `output` counts 0)."""
    return active_params - by_kind["embedding"] - by_kind["output"]
