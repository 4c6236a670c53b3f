"""Direct Preference Optimisation on the megatron-core MoE learner (`python -m moe_rl.dpo`).

Modules: `loss` (the sigmoid / IPO pair losses, their closed-form gradients, TRL's
statistics), `surrogate` (the per-row loss whose gradient is DPO's, at any layout),
`trainer` (the policy and its frozen reference on the preference loop, the export),
`__main__` (the command line). The pairs, their checks and the loop are
`moe_rl.preference`'s, shared with the reward model.
"""

from moe_rl.dpo.loss import PairLogps, margin_grad, pair_losses, pair_metrics

__all__ = ["PairLogps", "margin_grad", "pair_losses", "pair_metrics"]
