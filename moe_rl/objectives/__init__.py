"""Policy losses of the GRPO family behind one tensor contract (pure torch).

    from moe_rl.objectives import PolicyBatch, policy_loss, OBJECTIVES
    out = policy_loss("rspo", PolicyBatch(logp, old_logp, adv, mask, router_shift=gamma))
    out.loss.backward()

Names: grpo, dr_grpo, dapo, gspo, gspo_token, gmpo, rspo, cispo, sapo. Exact formulas,
defaults and aggregations: docs/objectives.md; each objective's docstring states where
this code had to choose. Module map: `batch` (PolicyBatch, LossOutput), `base` (registry,
hyperparameters, Context/Surrogate), `common` (masking, clipping, aggregation, KL, sampler
correction), `loss` (policy_loss), then one file per objective family.

Micro-batches and data-parallel ranks: pass the whole batch's counts, and the pieces'
losses (and gradients) sum to the whole-batch ones:

    policy_loss(name, micro_batch, token_normalizer=N_tokens, seq_normalizer=N_nonempty,
                num_sequences_total=B, max_response_length=L_max)
"""

# Importing the objective modules registers them, in the order OBJECTIVES lists them.
# isort: off
from moe_rl.objectives import ppo_clip, gspo, gmpo, rspo, cispo, sapo  # noqa: F401
# isort: on
from moe_rl.objectives.base import (
    OBJECTIVES,
    CommonHParams,
    Context,
    CorrectionHParams,
    ObjectiveSpec,
    Surrogate,
    make_common_hparams,
    make_hparams,
    register_objective,
)
from moe_rl.objectives.batch import LossOutput, PolicyBatch, combine_metrics
from moe_rl.objectives.loss import policy_loss, policy_loss_from_hparams

__all__ = [
    "OBJECTIVES",
    "CommonHParams",
    "Context",
    "CorrectionHParams",
    "LossOutput",
    "ObjectiveSpec",
    "PolicyBatch",
    "Surrogate",
    "combine_metrics",
    "make_common_hparams",
    "make_hparams",
    "policy_loss",
    "policy_loss_from_hparams",
    "register_objective",
]
