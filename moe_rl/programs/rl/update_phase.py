"""The update phase of an RL step: the actor's `epochs x num_minibatches` optimizer steps on
the step's rows, then each step component's (PPO's critic) on the same mini-batches.

    phase = UpdatePhase(cfg.rl, cfg.sampler, cfg.run.seed, learner, components, dp, rank)
    metrics, batch = phase.run(step, batch)

Each rank updates on its own rows of every mini-batch (`moe_rl.programs.rl.policy_loss.minibatch_rows`). An
unscored batch (the on-policy shortcut: one update, no replay) takes its old logprobs and
routing record from the update's own forward.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from moe_rl.config import RLConfig, SamplerConfig
from moe_rl.programs.rl.policy_loss import PolicyLossFn, minibatch_rows, shuffle_seed
from moe_rl.programs.rl.throughput import device_peak, learner_perf
from moe_rl.routing.record import row_positions
from moe_rl.runtime.metrics import combine
from moe_rl.step_batch import StepBatch

if TYPE_CHECKING:
    from moe_rl.learner.protocols import PolicyLearner
    from moe_rl.programs.rl.component import StepComponent

log = logging.getLogger(__name__)


class UpdatePhase:
    """The optimizer steps of one RL step, for the actor and the step components."""

    def __init__(self, rl: RLConfig, sampler: SamplerConfig, seed: int, learner: PolicyLearner,
                 components: list[StepComponent], dp: int, rank: int) -> None:
        """`sampler`: the sampling settings the update's log-probs and length normalizers
        follow (temperature, max_new_tokens); `seed`: run.seed, of the mini-batch shuffles."""
        self.rl, self.sampler, self.seed = rl, sampler, seed
        self.learner, self.components, self.dp, self.rank = learner, components, dp, rank
        self._said_fewer_updates = False
        self._peak = device_peak()

    def actor_trains(self, step: int) -> bool:
        """False during a component's warm-up (PPO's critic: the first `critic.warmup_steps`)."""
        return step > max((c.actor_warmup_steps for c in self.components), default=0)

    def run(self, step: int, batch: StepBatch) -> tuple[dict[str, float], StepBatch]:
        """The actor's updates (none during a component's warm-up), then each component's
        (its own passes: epochs after the actor's reuse their shuffles)."""
        rl = self.rl
        metrics: dict[str, float] = {"policy/updates": 0.0}
        if self.actor_trains(step):
            metrics, batch = self._update_actor(batch, self.minibatches(step, batch, rl.epochs, rl.num_minibatches))
        for component in self.components:
            epochs, count = component.passes
            metrics.update(component.update(batch, self.minibatches(step, batch, epochs, count)))
        return metrics, batch

    def minibatches(self, step: int, batch: StepBatch, epochs: int, count: int) -> list[torch.Tensor]:
        """`epochs` passes of `count` shuffled mini-batches (global row ids), a shuffle per
        (step, pass); a component's passes reuse the actor's shuffles."""
        most = max([self.rl.epochs, *(c.passes[0] for c in self.components)])
        out = [rows for epoch in range(epochs)
               for rows in minibatch_rows(batch.step_rows, count, self.dp,
                                          seed=shuffle_seed(self.seed, step, epoch, most))]
        if len(out) < epochs * count and not self._said_fewer_updates and self.rank == 0:
            self._said_fewer_updates = True  # (said once: policy/updates and critic/updates count every step's)
            log.warning("step %d: %d rows make %d of the %d mini-batches a pass asks for (dynamic sampling kept "
                        "fewer groups than rl.prompts_per_step): fewer optimizer updates this step, and the "
                        "learning-rate schedule runs behind", step, batch.step_rows, len(out) // epochs, count)
        return out

    def _update_actor(self, batch: StepBatch, minibatches: list[torch.Tensor]) -> tuple[dict[str, float], StepBatch]:
        """The actor's updates. An unscored batch (the on-policy shortcut) takes its old
        logprobs and routing from the update's forward; under bypass (rl.old_logprobs=sampler)
        the sampler's are the old ones, and the returned batch carries each row's first
        update log-probs for the mismatch metrics."""
        rl = self.rl
        loss_fn = PolicyLossFn(rl, self.sampler.max_new_tokens, on_policy=batch.old_logp_BT is None)
        loss_fn.prepare(batch, minibatches, self._dp_sum)
        plan = self.learner.routing_plan(rl.replay if batch.old_logp_BT is not None else "none", batch,
                                         capture=rl.records_routing)
        bypass = rl.old_logprobs == "sampler"
        first_BT = torch.zeros_like(batch.old_logp_BT) if bypass and batch.old_logp_BT is not None else None
        seen_B = torch.zeros(batch.batch_size, dtype=torch.bool)
        updates, works, sums, record = [], [], [], None
        for index, rows in enumerate(minibatches):
            loss_fn.minibatch = index
            part = batch.take(rows)
            result = self.learner.update(part, loss_fn, plan, self.sampler.temperature)
            if batch.old_logp_BT is None:
                batch = batch.scored(result.logp_BT, result.record)
            elif first_BT is not None:  # (each row's first update: the weights before any of this step's)
                pos = row_positions(batch.row_ids_B, part.row_ids_B)
                new = ~seen_B[pos]
                first_BT[pos[new]] = result.logp_BT[new].to(first_BT.dtype)
                seen_B[pos] = True
                record = result.record if len(minibatches) == 1 else None
            updates.append({k if "/" in k else f"learner/{k}": v for k, v in result.metrics.items()})
            works.append(result.work)
            sums.append(result.sums)
        metrics = combine(updates)
        metrics.update(PolicyLossFn.step_metrics(sums))
        metrics["policy/updates"] = float(len(updates))
        layout = self.learner.layout
        metrics.update(learner_perf(self.learner.model_cfg, works, layout.tp * layout.pp * layout.dp, self._peak))
        if first_BT is not None:
            batch = batch.scored(first_BT, record)
        return metrics, batch

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the data-parallel ranks (every rank gets the sum)."""
        return torch.stack(self.learner.dp_gather_object(t)).sum(0)
