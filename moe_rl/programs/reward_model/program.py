"""The reward-model trainer: pairs -> the value model's scores -> one Bradley-Terry update, on
what every preference program shares (`moe_rl.programs.preference.program`), in the one run loop.

Per step, on every rank: the step's `rm.batch_size` pairs (`moe_rl.programs.preference.data.pairs_of_step`)
become 2P rows; the value model (`moe_rl.learner.critic.ValueModel`: the policy's
architecture and layout with a scalar head, started from run.init_checkpoint with a small
random head, `rm.head_init_scale`) scores them without gradients, which gives dL/dr in
closed form (`loss.score_coefficients`); then one optimizer update runs the row-local
surrogate with that gradient. Metrics: `learner/loss`, `rewards/chosen`, `rewards/rejected`,
`rewards/margins`, `rewards/accuracies` (scores at each response's last slot),
`rewards/slot_accuracies` (every compared slot), and `eval/*` on the held-out pairs.

The checkpoints are the run's product: `critic.init_checkpoint=<run>/checkpoints/step_N`
starts PPO's critic from this transformer (its value head restarts at zero: the scores here
are Bradley-Terry logits, not returns), after InstructGPT's value function initialised from
the reward model. Nothing is exported to Hugging Face: a value head has no place in a
causal-LM directory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.batch import TokenBatch
from moe_rl.config import RewardModelConfig
from moe_rl.programs.preference.data import encode_pairs
from moe_rl.programs.preference.program import PreferenceProgram
from moe_rl.programs.reward_model.loss import (
    COEF_KEY,
    compared_slots,
    score_coefficients,
    score_pair_metrics,
    score_surrogate_loss,
)

if TYPE_CHECKING:
    from moe_rl.learner.parallel import Layout


class RewardModelProgram(PreferenceProgram):
    """Owns the value model and the run directory of one reward-model run."""

    name = "reward model"

    section = "rm"
    module = "moe_rl.reward_model"
    init_role = "the starting transformer (its value head starts small and random)"
    pairs_cfg: RewardModelConfig

    @classmethod
    def headline(cls, pairs_cfg: RewardModelConfig) -> str:
        return f"reward model (compare {pairs_cfg.compare})"


    def _build(self, layout: Layout, resume_from: Path | None) -> None:
        from moe_rl.learner import load_start
        from moe_rl.learner.critic import VALUE_HEAD_KEYS, ValueModel

        run, rm = self.run, self.pairs_cfg
        self.model = ValueModel(self.model_cfg, self.parallel, layout, optimizer=self.optimizer, total_updates=run.steps)
        if resume_from is None:  # (the policy's weights hold no value head: rm.head_init_scale starts it)
            load_start(self.model, run.init_checkpoint, run.trust_checkpoint, optional=(VALUE_HEAD_KEYS,))
            if rm.head_init_scale > 0:
                self.model.init_value_head(rm.head_init_scale / math.sqrt(self.model_cfg.hidden_size), run.seed)
        self.eval_tokens = encode_pairs(self.eval_pairs, self.encoder, layout.tp) if self.eval_pairs else None
        # (the held-out pairs never change: their compared slots are found once, not per evaluation)
        self.eval_slots = compared_slots(self.eval_tokens, rm.compare) if self.eval_tokens is not None else None

    def _train_on(self, tokens: TokenBatch) -> tuple[dict[str, float], dict[str, float]]:
        chosen_PT, rejected_PT = compared_slots(tokens, self.pairs_cfg.compare)
        scores_BT = self.model.logprobs(tokens)  # (a value model's per-token output: scores)
        coef_BT = score_coefficients(scores_BT, chosen_PT, rejected_PT)
        update = self.model.train_step(tokens, score_surrogate_loss, extras={COEF_KEY: coef_BT})
        return score_pair_metrics(scores_BT, tokens, chosen_PT, rejected_PT), update

    def _held_out(self) -> dict[str, float]:
        """Held-out loss, accuracies and margins."""
        assert self.eval_slots is not None  # (set by _build)
        chosen_PT, rejected_PT = self.eval_slots
        scores_BT = self.model.logprobs(self.eval_tokens)
        return score_pair_metrics(scores_BT, self.eval_tokens, chosen_PT, rejected_PT)

    def finish(self, last_step: int, final: Path) -> None:
        if self.rank == 0:
            self.log.info("reward model in %s; start PPO's critic from it with critic.init_checkpoint=%s", final, final)

    def _summary_fields(self) -> dict[str, Any]:
        return {"algorithm": "reward_model", "compare": self.pairs_cfg.compare}
