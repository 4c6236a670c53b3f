"""The policy update of one RL step: how the step's rows split into mini-batches, and the
loss callback the learner calls on every micro-batch.

    loss_fn = PolicyLossFn(rl, max_response_length)   # hyperparameters built and checked once per step
    for rows in minibatch_rows(batch.step_rows, rl.num_minibatches, dp, seed):
        learner.update(batch.take(rows), loss_fn, plan)     # each rank: its rows of `rows`

The learner hands each micro-batch the counts of the whole mini-batch (`MicroBatch.totals`);
they are the objective's global normalisers, so micro-batch losses sum to the mini-batch loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moe_rl.config import RLConfig
from moe_rl.objectives import OBJECTIVES, PolicyBatch, make_common_hparams, policy_loss_from_hparams
from moe_rl.objectives.correction import CorrectionCounts, correction_form, decide_correction, tally
from moe_rl.step_batch import StepBatch

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
    """The objective's loss on one micro-batch, as the learner's `LossFn` (a
    `PassScaledLoss`).

    Reads the micro-batch's `StepBatch`: `adv_B`, `old_logp_BT`, `sampler_logp_BT` (with a
    rollout correction or OPSM) and `ref_logp_BT` (with a KL penalty); from its aux the
    router-shift weights (rspo).
    `on_policy`: the update runs at the weights that sampled (one update per rollout), so
    the old logprobs are this forward's own, detached, and the router has not moved (gamma
    is 1); no old-logprob pass is needed.

    Rejected tokens leave the normalizers (`moe_rl.objectives.correction`). On a scored batch
    the step's correction is decided once before the updates (`prepare`: each mini-batch's
    kept counts and the weights' mean, over every data-parallel rank) and reaches every
    micro-batch's loss as its normalizers. Under the on-policy shortcut the rejection is only
    known from the update's own forward: each micro-batch is normalized by the pass's
    unrejected counts and the learner rescales the gradient once the pass's kept counts are
    summed (`pass_scale`), which gives the same gradient without a second forward."""

    def __init__(self, rl: RLConfig, max_response_length: int, on_policy: bool = False) -> None:
        """`max_response_length`: sampler.max_new_tokens (the length normalizers of the
        objectives that divide by it)."""
        from moe_rl.learner import MicroBatchLoss

        self._result = MicroBatchLoss
        self.on_policy = on_policy
        self.name = rl.objective
        self.spec = OBJECTIVES[rl.objective]
        self.own = rl.hparams
        self.form = correction_form(rl.rollout_correction, rl.rollout_correction_args, self.spec.level == "sequence")
        self.uses_rollout_logp = self.form is not None or rl.opsm_delta is not None
        self.common = make_common_hparams(
            # (with rl.kl_in_reward the KL is in GAE's reward, not in the loss)
            rollout_correction=rl.rollout_correction, opsm_delta=rl.opsm_delta,
            kl_coef=0.0 if rl.kl_in_reward else rl.kl_coef, kl_estimator=rl.kl_estimator,
            max_response_length=max_response_length, **dataclasses.asdict(rl.rollout_correction_args))
        moves = self.form is not None and (self.form.rejects or self.form.batch_normalize)
        self.scales_after_pass = on_policy and moves
        """The normalizers are only known after the pass (`pass_scale` rescales)."""
        self._decided_before = not on_policy and moves
        self._kept_by_minibatch: list[tuple[float, float]] = []
        self._weight_mean: float | None = None
        self.minibatch = 0
        """Which of `prepare`'s mini-batches the next update runs (the update phase sets it)."""

    def prepare(self, batch: StepBatch, minibatches: list[torch.Tensor],
                all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A scored batch: the correction decided on this rank's rows once for the step, and
        each mini-batch's kept tokens and sequences and the weights' mean over the step's kept
        units, summed over the data-parallel ranks by `all_reduce` (one call)."""
        if not self._decided_before or self.form is None:
            return
        if batch.old_logp_BT is None or batch.sampler_logp_BT is None:
            raise ValueError("the rollout correction needs the batch's old and sampler log-probs")
        mask_BT = batch.response_mask()
        decided = decide_correction(self.form, batch.old_logp_BT.float(), batch.sampler_logp_BT.float(), mask_BT)
        kept_len_B = decided.kept_BT.sum(1).double()
        local = []
        for rows in minibatches:
            held_B = torch.isin(batch.row_ids_B, rows)
            local += [kept_len_B[held_B].sum(), (kept_len_B[held_B] > 0).double().sum()]
        step = tally(mask_BT, decided, None)
        totals = all_reduce(torch.stack([*local, step.weight_sum, step.weight_units]).double()).tolist()
        self._kept_by_minibatch = [(totals[2 * k], totals[2 * k + 1]) for k in range(len(minibatches))]
        units = totals[-1]
        self._weight_mean = totals[-2] / units if units > 0 else 1.0

    def __call__(self, logp_BT: torch.Tensor, mb: MicroBatch) -> MicroBatchLoss:
        rows, totals = mb.step, mb.totals
        old_BT = logp_BT.detach() if self.on_policy else rows.old_logp_BT
        if old_BT is None:
            raise ValueError("an off-policy update needs the batch's old logprobs (score it first)")
        if rows.adv_B is None:
            raise ValueError("a policy update needs the batch's advantages")
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
        tokens, sequences, weight_mean = totals.response_tokens, totals.nonempty_sequences, None
        if self._decided_before:  # (the kept counts and mean of `prepare`)
            (tokens, sequences), weight_mean = self._kept_by_minibatch[self.minibatch], self._weight_mean
        elif self.scales_after_pass:  # (the unrejected counts, no normalization: `pass_scale` rescales)
            weight_mean = 1.0
        common = dataclasses.replace(self.common, token_normalizer=tokens, seq_normalizer=sequences,
                                     num_sequences_total=totals.sequences, is_weight_mean=weight_mean)
        out = policy_loss_from_hparams(self.name, pb, common, self.own)
        weight = out.num_sequences if self.spec.level == "sequence" else out.num_tokens
        metrics = {f"policy/{k}": v for k, v in out.metrics.items()}
        metrics["policy/token_ratio_std"] = token_ratio_std(logp_BT.detach(), old_BT, pb.response_mask,
                                                            mb.scored.at_N if mb.scored is not None else None)
        sums = None if out.counts is None else dict(zip(CorrectionCounts.FIELDS, out.counts.values.unbind()))
        return self._result(out.loss, metrics, weight, sums)

    def pass_scale(self, sums: dict[str, float]) -> float:
        """The on-policy shortcut's correction of the pass's normalizers: the micro-batches
        divided by the unrejected token or sequence count and left the weights unnormalized;
        the kept counts and the weights' mean are known now (summed over every rank)."""
        if not self.scales_after_pass or not sums:
            return 1.0
        counts = CorrectionCounts(torch.tensor([sums[k] for k in CorrectionCounts.FIELDS], dtype=torch.float64))
        scale = 1.0
        if self.spec.aggregation == "token-mean":
            scale = max(float(counts.tokens), 1.0) / max(float(counts.kept_tokens), 1.0)
        elif self.spec.aggregation in ("seq-mean", "seq-mean-token-mean"):
            scale = max(float(counts.sequences), 1.0) / max(float(counts.kept_sequences), 1.0)
        if self.form is not None and self.form.batch_normalize:
            mean = float(counts.weight_mean())
            scale = scale / mean if mean > 0 else scale
        return scale

    @staticmethod
    def step_metrics(sums: list[dict[str, float]]) -> dict[str, float]:
        """The step's rejected, vetoed and OPSM-masked fractions from every update's tallies
        (`UpdateResult.sums`); {} without a correction or OPSM."""
        if not sums or not sums[0]:
            return {}
        total = sum((CorrectionCounts(torch.tensor([s[k] for k in CorrectionCounts.FIELDS], dtype=torch.float64))
                     for s in sums), CorrectionCounts.zeros())
        return {f"policy/{k}": v for k, v in total.fractions().items()}


def token_ratio_std(logp_BT: torch.Tensor, old_BT: torch.Tensor, mask_BT: torch.Tensor,
                    at_N: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Std over valid tokens of the token-level ratio exp(logp - old): 0 on-policy, the
    spread the clip and the router shift act on off-policy (0 without a valid token).
    `at_N`: the valid tokens' (rows, positions), found on the host (`ScoredTokens`); without
    it they are found from the mask, which makes a GPU's host wait for its queue."""
    if at_N is None:
        rows_N, cols_N = mask_BT.nonzero(as_tuple=True)
        at_N = (rows_N, cols_N)
    if not at_N[0].numel():
        return logp_BT.new_zeros(())
    r_N = torch.exp((logp_BT - old_BT)[at_N].clamp(-20, 20))
    return r_N.std(unbiased=False)
