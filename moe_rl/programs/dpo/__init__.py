"""Direct Preference Optimisation on the megatron-core MoE learner (`python -m moe_rl.dpo`).

Modules: `loss` (the sigmoid / IPO pair losses, their closed-form gradients, TRL's
statistics), `surrogate` (the per-row loss whose gradient is DPO's, at any layout),
`program` (the policy and its frozen reference as a program of the one run loop, the
export). The pairs and their checks are `moe_rl.programs.preference`'s, shared with the
reward model.
"""

from moe_rl.programs.dpo.loss import PairLogps, margin_grad, pair_losses, pair_metrics

__all__ = ["PairLogps", "margin_grad", "pair_losses", "pair_metrics"]
