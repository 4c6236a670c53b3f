"""The DPO trainer: pairs -> reference and policy log-probs -> one update, on the loop that
every preference program shares (`moe_rl.programs.preference.program`), in the one run loop
(`moe_rl.loop`: run directory, evaluation, checkpoints, resume, signals).

Per step, on every rank: the step's `dpo.batch_size` pairs (a pure function of run.seed and
the step, `data.pairs_of_step`) become 2P rows; the frozen reference (run.init_checkpoint,
loaded once) scores them once, the policy scores them without gradients, and one optimizer
update runs the surrogate whose gradient is DPO's (`surrogate`). Metrics use TRL's names
(`learner/loss`, `rewards/*`, `logps/*`) and the held-out ones `eval/*`, every
`run.eval_every` steps and at the end, against reference log-probs computed once at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import DPOConfig
from moe_rl.programs.dpo.loss import PairLogps, pair_metrics
from moe_rl.programs.dpo.surrogate import COEF_KEY, surrogate_coefficients, surrogate_loss
from moe_rl.programs.preference.data import encode_pairs, pair_rows
from moe_rl.programs.preference.program import PreferenceProgram

if TYPE_CHECKING:
    from moe_rl.learner.parallel import Layout
    from moe_rl.learner.protocols import PolicyLearner


def sequence_logps(learner: PolicyLearner, tokens: TokenBatch) -> torch.Tensor:
    """[B] fp64 log pi(response | prompt), summed over response tokens (whole batch, every rank)."""
    return (learner.logprobs(tokens).double() * tokens.response_mask()).sum(-1)


class DPOProgram(PreferenceProgram):
    """Owns the policy, the frozen reference and the run directory of one DPO run."""

    name = "dpo"

    section = "dpo"
    module = "moe_rl.dpo"
    init_role = "the starting policy, which is also the frozen reference"
    pairs_cfg: DPOConfig

    @classmethod
    def headline(cls, pairs_cfg: DPOConfig) -> str:
        return f"dpo ({pairs_cfg.loss}, beta {pairs_cfg.beta})"


    def _build(self, layout: Layout, resume_from: Path | None) -> None:
        from moe_rl.learner import Learner, load_start

        run = self.run
        self.model = Learner(self.model_cfg, self.parallel, layout, optimizer=self.optimizer, total_updates=run.steps)
        self.ref = Learner(self.model_cfg, self.parallel, layout)  # (frozen: no optimizer)
        load_start(self.ref, run.init_checkpoint, run.trust_checkpoint)
        if resume_from is None:
            load_start(self.model, run.init_checkpoint, run.trust_checkpoint)
        self.eval_tokens = encode_pairs(self.eval_pairs, self.encoder, layout.tp) if self.eval_pairs else None
        self.eval_ref = sequence_logps(self.ref, self.eval_tokens) if self.eval_pairs else None

    def _train_on(self, tokens: TokenBatch) -> tuple[dict[str, float], dict[str, float]]:
        d = self.pairs_cfg
        ref = sequence_logps(self.ref, tokens)
        logps = PairLogps(*pair_rows(sequence_logps(self.model, tokens)), *pair_rows(ref))
        coef = surrogate_coefficients(logps.margin(), d.beta, d.loss, d.label_smoothing)
        update = self.model.train_step(tokens, surrogate_loss, extras={COEF_KEY: coef})
        return pair_metrics(logps, d.beta, d.loss, d.label_smoothing), update

    def _held_out(self) -> dict[str, float]:
        """Held-out loss, preference accuracy and margins."""
        d = self.pairs_cfg
        assert self.eval_ref is not None  # (scored by _build)
        logps = PairLogps(*pair_rows(sequence_logps(self.model, self.eval_tokens)), *pair_rows(self.eval_ref))
        return pair_metrics(logps, d.beta, d.loss, d.label_smoothing)

    def finish(self, last_step: int, final: Path) -> None:
        """The final checkpoint as a Hugging Face directory `<run>/hf` (the starting
        directory's config.json and tokenizer files when it was one: `moe_rl.convert`)."""
        from moe_rl.convert import megatron_to_hf

        if self.rank != 0 or not self.run.export_hf:
            return
        self.log.info("exported the final model to %s", megatron_to_hf(final, self.run.run_dir / "hf", force=True))

    def _summary_fields(self) -> dict[str, Any]:
        return {"algorithm": "dpo", "loss": self.pairs_cfg.loss, "beta": self.pairs_cfg.beta}
