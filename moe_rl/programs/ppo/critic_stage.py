"""PPO with a learned critic (`rl.advantage: gae`): the critic's part of an RL step.

    stage = CriticStage(cfg.critic, cfg.rl, cfg.model, cfg.parallel, layout, run_steps=cfg.run.steps)
    # (the critic learner: moe_rl.learner.critic)
    batch, metrics = stage.advantages(batch)            # values -> token rewards -> GAE -> whitening
    ...                                                 # the actor's update reads batch.adv_B: [b, T]
    metrics |= stage.update(batch, minibatches)         # the clipped value loss, the critic's own Adam

Rewards and advantages (`moe_rl.programs.ppo.gae`, the documents' formulas): the row's verifier score
(after overlong shaping) sits on its last response token; with `rl.kl_in_reward` every
response token also gets -beta * k1, k1 = log pi_old - log pi_ref, where beta is
`rl.kl_coef`, or with `rl.kl_target` > 0 the adaptive controller's weight, updated after
each step's rewards from the step's mean KL per response and kept in the checkpoints
(`state` / `restore`); GAE over the row's
response tokens with `rl.gae_gamma` and `rl.gae_lambda`; returns = advantages + values;
advantages whitened over every valid token of the step (all data-parallel ranks) when
`rl.whiten_advantages`. Values are the critic's at the weights that start the step (the
old values of the clipped value loss).

Which objectives take the token advantages: every token-level one (grpo, which is PPO's
clipped surrogate with token-mean aggregation, dr_grpo, dapo, cispo, sapo, gspo_token); the
sequence-level ones (gspo, gmpo, rspo) need one advantage per sequence and are refused by
the preflight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from moe_rl.config import CriticConfig, ModelConfig, ParallelConfig, RLConfig
from moe_rl.programs.ppo.gae import (
    adaptive_kl_coef,
    clipped_value_loss,
    gae,
    token_rewards,
    unbiased_variance,
    whiten_by_moments,
)
from moe_rl.programs.rl.component import StepComponent
from moe_rl.rollout.types import SCORE
from moe_rl.runtime.metrics import combine
from moe_rl.step_batch import StepBatch

if TYPE_CHECKING:  # (the learner package imports megatron-core: loaded when a learner exists)
    from moe_rl.learner import MicroBatch, MicroBatchLoss
    from moe_rl.learner.engine import Learner
    from moe_rl.learner.parallel import Layout

OLD_VALUES = "old_values_BT"
"""StepBatch.extras key: the critic's values at the start of the step."""
RETURNS = "returns_BT"
"""StepBatch.extras key: GAE's returns, the value loss's targets."""


class ValueLossFn:
    """The critic's clipped value loss on one micro-batch, as the learner's `LossFn`:
    value_loss_coef * 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), token-mean with the
    whole mini-batch's token count (micro-batch contributions sum to it)."""

    def __init__(self, critic: CriticConfig) -> None:
        from moe_rl.learner import MicroBatchLoss

        self._result = MicroBatchLoss
        self.clip = critic.value_clip
        self.coef = critic.value_loss_coef

    def __call__(self, values_BT: torch.Tensor, mb: MicroBatch) -> MicroBatchLoss:
        rows = mb.step
        mask_BT = rows.response_mask()
        total = max(mb.totals.response_tokens, 1.0)
        loss, clipfrac = clipped_value_loss(values_BT, rows.extras[OLD_VALUES], rows.extras[RETURNS], mask_BT,
                                            self.clip, total_tokens=total)
        n_mb = mask_BT.sum().double()
        own = total / float(n_mb) if n_mb > 0 else 0.0  # contribution -> this micro-batch's token mean
        metrics = {"critic/value_loss": loss.detach() * own, "critic/vf_clipfrac": clipfrac * own,
                   "critic/values_pred_mean": (values_BT.detach() * mask_BT).sum() / n_mb.clamp(min=1)}
        return self._result(self.coef * loss, metrics, n_mb)


class CriticStage(StepComponent):
    """PPO's critic within an RL step: its values, the step's token advantages, its update
    (a `StepComponent`: the RL program runs it without knowing it by name)."""

    missing_hint = "it was saved by a run without rl.advantage=gae; resume a PPO run from its own checkpoints"

    def __init__(self, critic: CriticConfig, rl: RLConfig, model: ModelConfig, parallel: ParallelConfig,
                 layout: Layout, *, run_steps: int, updates: int | None = None) -> None:
        """`run_steps`: run.steps; `updates`: the critic's optimizer updates over the run, for
        its schedule (None: every step's passes, warm-up included)."""
        from moe_rl.learner.critic import Critic

        self.critic_cfg, self.rl = critic, rl
        self.passes = (critic.epochs, critic.num_minibatches or rl.num_minibatches)
        self.actor_warmup_steps = critic.warmup_steps
        if updates is None:  # (the whole run's: every step trains the critic, warm-up included)
            updates = run_steps * self.passes[0] * self.passes[1]
        self.critic = Critic(model, parallel, layout, optimizer=critic.optimizer, total_updates=updates)
        self.loss_fn = ValueLossFn(critic)
        self.kl_coef = rl.kl_coef
        """beta, the KL weight in the reward of the next step (rl.kl_in_reward)."""

    def models(self) -> dict[str, Learner]:
        return {"critic": self.critic}

    def start(self, init: str, trust: bool) -> None:
        """critic.init_checkpoint, else the actor's starting weights: a PPO checkpoint's saved
        critic, value head included; other weights: their transformer, head at zero."""
        from moe_rl.learner.start import load_critic_start

        own = self.critic_cfg.init_checkpoint
        if own or init:
            load_critic_start(self.critic, own or init, trust,
                              key="critic.init_checkpoint" if own else "run.init_checkpoint")

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps of the stage besides the critic: the adaptive KL weight."""
        return {"kl_coef": self.kl_coef} if self.rl.kl_target > 0 else {}

    def restore(self, meta: dict[str, Any]) -> None:
        """Resume `state` from a checkpoint's metadata (a checkpoint saved without the
        adaptive controller leaves it at rl.kl_coef)."""
        if self.rl.kl_target > 0 and "kl_coef" in meta:
            self.kl_coef = float(meta["kl_coef"])

    def advantages(self, batch: StepBatch, gather: Callable[[Any], list[Any]]) -> tuple[StepBatch, dict[str, float]]:
        """`batch` with [b, T] token advantages in `adv_B` and the critic's old values and
        returns in its extras; `gather`: every data-parallel rank's object (for the step-wide
        whitening and statistics)."""
        rl = self.rl
        mask_BT = batch.response_mask()
        values_BT = self.critic.values(batch).double() * mask_BT
        kl_BT = None
        if rl.kl_in_reward:
            assert batch.old_logp_BT is not None and batch.ref_logp_BT is not None  # (kl_in_reward: both scored)
            kl_BT = (batch.old_logp_BT.double() - batch.ref_logp_BT.double()) * mask_BT
        rewards_BT = token_rewards(batch.extras[SCORE], mask_BT, kl_BT, self.kl_coef if rl.kl_in_reward else 0.0)
        adv_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, rl.gae_gamma, rl.gae_lambda)
        sums = gather(_moments(mask_BT, adv_BT, returns_BT, values_BT, kl_BT))
        moments = torch.stack(sums).sum(dim=0)
        metrics = _step_metrics(moments)
        if rl.kl_in_reward:
            metrics |= self._control_kl(float(moments[9]), int(moments[10]))
        if rl.whiten_advantages:
            adv_BT = whiten_by_moments(adv_BT, mask_BT, moments[0], moments[1], moments[2])
        extras = {**batch.extras, OLD_VALUES: values_BT.float(), RETURNS: returns_BT.float()}
        return dataclasses.replace(batch, adv_B=adv_BT.float(), extras=extras), metrics

    def _control_kl(self, kl_sum: float, responses: int) -> dict[str, float]:
        """The step's KL weight and mean KL per response; with rl.kl_target, the next step's
        weight (every data-parallel rank computes the same one from the gathered sums)."""
        rl = self.rl
        kl = kl_sum / responses if responses else 0.0
        used = self.kl_coef
        if rl.kl_target > 0 and responses:
            self.kl_coef = adaptive_kl_coef(used, kl, rl.kl_target, responses, rl.kl_horizon)
        return {"critic/kl_coef": used, "critic/kl_per_response": kl}

    def update(self, batch: StepBatch, minibatches: list[torch.Tensor]) -> dict[str, float]:
        """One critic update per mini-batch (this rank's rows of each); its metrics, with
        `critic/updates` their count."""
        from moe_rl.learner.microbatch import OPTIMIZER_METRICS

        out: list[dict[str, float]] = []
        for rows in minibatches:
            result = self.critic.update(batch.take(rows), self.loss_fn)
            m = {k: v for k, v in result.metrics.items() if k.startswith("critic/")}
            m.update({f"critic/{k}": result.metrics[k] for k in OPTIMIZER_METRICS})
            out.append(m)
        return combine(out) | {"critic/updates": float(len(out))}


def _moments(mask_BT: torch.Tensor, adv_BT: torch.Tensor, returns_BT: torch.Tensor, values_BT: torch.Tensor,
             kl_BT: torch.Tensor | None) -> torch.Tensor:
    """[11] fp64 sums over this rank's valid tokens: n, sum and sum of squares of the
    advantages, the returns and the returns minus values, the sum of |adv| and of k1; and
    the number of responses (rows with a valid token)."""
    m = mask_BT.to(torch.bool)
    a, r, d = adv_BT[m], returns_BT[m], (returns_BT - values_BT)[m]
    kl = kl_BT[m].sum() if kl_BT is not None else torch.zeros((), dtype=torch.float64)
    return torch.stack([torch.tensor(float(m.sum()), dtype=torch.float64), a.sum(), (a * a).sum(),
                        r.sum(), (r * r).sum(), d.sum(), (d * d).sum(), a.abs().sum(), values_BT[m].sum(), kl,
                        m.any(dim=1).sum().double()])


def _step_metrics(moments: torch.Tensor) -> dict[str, float]:
    n = float(moments[0])
    if n == 0:
        return {}
    var_r, var_d = unbiased_variance(n, moments[3], moments[4]), unbiased_variance(n, moments[5], moments[6])
    return {"critic/values_mean": float(moments[8]) / n, "critic/returns_mean": float(moments[3]) / n,
            "critic/explained_variance": 1.0 - var_d / var_r if var_r > 0 else float("nan"),
            "advantage/abs_mean": float(moments[7]) / n, "critic/kl_in_reward_mean": float(moments[9]) / n}
