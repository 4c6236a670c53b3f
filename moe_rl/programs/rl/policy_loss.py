"""The policy update of one RL step: how the step's rows split into mini-batches, and the
loss callback the learner calls on every micro-batch.

    loss_fn = PolicyLossFn(cfg)           # hyperparameters built and checked once per step
    for rows in minibatch_rows(batch.step_rows, cfg.rl.num_minibatches, dp, seed):
        learner.update(batch.take(rows), loss_fn, plan)     # each rank: its rows of `rows`

The learner hands each micro-batch the counts of the whole mini-batch (`MicroBatch.totals`);
they are the objective's global normalisers, so micro-batch losses sum to the mini-batch loss.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from moe_rl.config import Config
from moe_rl.objectives import OBJECTIVES, PolicyBatch, make_common_hparams, policy_loss_from_hparams

if TYPE_CHECKING:  # (the learner package imports megatron-core: loaded when a learner exists)
    from moe_rl.learner import MicroBatch, MicroBatchLoss


def minibatch_rows(B: int, num_minibatches: int, dp: int, seed: int) -> list[torch.Tensor]:
    """Split rows 0..B-1 into `num_minibatches` shuffled mini-batches, each balanced over
    data-parallel ranks (the learner gives row r to rank r % dp)."""
    g = torch.Generator().manual_seed(seed)
    chunks: list[list[torch.Tensor]] = [[] for _ in range(num_minibatches)]
    for r in range(dp):
        rows = torch.arange(r, B, dp)
        rows = rows[torch.randperm(rows.numel(), generator=g)]
        for k, part in enumerate(torch.tensor_split(rows, num_minibatches)):
            chunks[k].append(part)
    return [torch.cat(c).sort().values for c in chunks if sum(p.numel() for p in c)]


def shuffle_seed(run_seed: int, step: int, epoch: int, max_epochs: int) -> int:
    """The mini-batch shuffle's seed for pass `epoch` of `step`: distinct for every (step,
    pass) of a run whose models make at most `max_epochs` passes (the step's stride is at
    least that; 31 below it, the stride every recorded run used)."""
    return run_seed * 7919 + step * max(31, max_epochs) + epoch


class PolicyLossFn:
    """The objective's loss on one micro-batch, as the learner's `LossFn`.

    Reads the micro-batch's `StepBatch`: `adv_B`, `old_logp_BT`, `sampler_logp_BT` (with a
    rollout correction) and `ref_logp_BT` (with a KL penalty); from its aux the router-shift
    weights (rspo).
    `on_policy`: the update runs at the weights that sampled (one update per rollout), so
    the old logprobs are this forward's own, detached, and the router has not moved (gamma
    is 1); no old-logprob pass is needed."""

    def __init__(self, cfg: Config, on_policy: bool = False) -> None:
        from moe_rl.learner import MicroBatchLoss

        self._result = MicroBatchLoss
        self.on_policy = on_policy
        rl = cfg.rl
        self.name = rl.objective
        self.spec = OBJECTIVES[rl.objective]
        self.own = rl.hparams
        self.uses_rollout_logp = rl.rollout_correction != "none"
        self.common = make_common_hparams(
            # (with rl.kl_in_reward the KL is in GAE's reward, not in the loss)
            rollout_correction=rl.rollout_correction, kl_coef=0.0 if rl.kl_in_reward else rl.kl_coef,
            kl_estimator=rl.kl_estimator,
            max_response_length=cfg.sampler.max_new_tokens, **dataclasses.asdict(rl.rollout_correction_args))

    def __call__(self, logp_BT: torch.Tensor, mb: MicroBatch) -> MicroBatchLoss:
        rows, totals = mb.step, mb.totals
        old_BT = logp_BT.detach() if self.on_policy else rows.old_logp_BT
        if old_BT is None:
            raise ValueError("an off-policy update needs the batch's old logprobs (score it first)")
        shift_BT = None
        if self.spec.needs_router_shift:
            shift_BT = torch.ones_like(old_BT) if self.on_policy else mb.aux.get("router_shift_BT")
        pb = PolicyBatch(
            logprobs=logp_BT,
            old_logprobs=old_BT,
            advantages=rows.adv_B,
            # (the learner's copy, built on the host: no mask to make on the device)
            response_mask=mb.scored.mask_BT if mb.scored is not None else rows.response_mask(),
            rollout_logprobs=rows.sampler_logp_BT if self.uses_rollout_logp else None,
            ref_logprobs=rows.ref_logp_BT,
            router_shift=shift_BT,
        )
        common = dataclasses.replace(self.common, token_normalizer=totals.response_tokens,
                                     seq_normalizer=totals.nonempty_sequences, num_sequences_total=totals.sequences)
        out = policy_loss_from_hparams(self.name, pb, common, self.own)
        weight = out.num_sequences if self.spec.level == "sequence" else out.num_tokens
        metrics = {f"policy/{k}": v for k, v in out.metrics.items()}
        metrics["policy/token_ratio_std"] = token_ratio_std(logp_BT.detach(), old_BT, pb.response_mask,
                                                            mb.scored.at_N if mb.scored is not None else None)
        return self._result(out.loss, metrics, weight)


def token_ratio_std(logp_BT: torch.Tensor, old_BT: torch.Tensor, mask_BT: torch.Tensor,
                    at_N: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Std over valid tokens of the token-level ratio exp(logp - old): 0 on-policy, the
    spread the clip and the router shift act on off-policy (0 without a valid token).
    `at_N`: the valid tokens' (rows, positions), found on the host (`ScoredTokens`); without
    it they are found from the mask, which makes a GPU's host wait for its queue."""
    if at_N is None:
        at_N = mask_BT.nonzero(as_tuple=True)
    if not at_N[0].numel():
        return logp_BT.new_zeros(())
    r_N = torch.exp((logp_BT - old_BT)[at_N].clamp(-20, 20))
    return r_N.std(unbiased=False)
