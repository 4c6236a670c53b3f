"""Direct Preference Optimisation on the megatron-core MoE learner (`python -m moe_rl.dpo`).

Modules: `loss` (the sigmoid / IPO pair losses, their closed-form gradients, TRL's
statistics), `data` (preference rows -> pairs -> token batches), `surrogate` (the per-row
loss whose gradient is DPO's, at any layout), `preflight` (input checks, `--check`),
`trainer` (the loop, run directory, checkpoints, export), `__main__` (the command line).
"""

from moe_rl.dpo.loss import PairLogps, margin_grad, pair_losses, pair_metrics

__all__ = ["PairLogps", "margin_grad", "pair_losses", "pair_metrics"]
