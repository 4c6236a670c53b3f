"""`policy_loss`: one entry point that wraps any registered objective with the shared
machinery (input checks, aggregation weights, sampler correction, KL penalty, metrics).

    loss = -sum(W * c * o * u) + kl_coef * sum(W_tok * c_tok * k)

u is the objective's per-unit term, W its aggregation weights over the kept tokens
(explicit normalizers make micro-batch losses add up to the whole-batch loss), c the
sampler-correction weight (1 without correction; `moe_rl.objectives.correction`), o the
OPSM keep flag of the unit's sequence (1 without OPSM), k the per-token KL estimate (token
weights W_tok: W itself for token-level objectives, W_i m / n_i for sequence-level ones).
A token the correction rejects leaves the response mask before anything is computed, so it
counts in neither the loss nor n_i nor the token and sequence counts; the correction weight
multiplies the KL term too (the penalty is part of each token's term), OPSM does not (it
masks the policy-gradient term, as DeepSeek-V3.2 writes it). docs/objectives.md has the
formulas.

Metrics (see LossOutput for how they combine), means over the objective's units:
- `clip_frac`: token-level objectives, the fraction of valid tokens whose clip is active
  (sapo: whose soft gate 4p(1-p) < 1/2); gspo, the fraction of sequences; gmpo/rspo (token
  clip, sequence unit), the mean over sequences of each sequence's clipped-token fraction.
- `ratio_mean/_max/_min`: token ratios; for gspo/gmpo/rspo the unclipped sequence ratio
  exp(mean_t lr) (for rspo without gamma, which `router_shift_*` reports on its own).
- `approx_kl`: k3 of old vs current per token; sequence-level objectives average it
  within each sequence first. Likewise `kl_ref` (the configured estimator vs ref_logprobs)
  and `router_shift_mean` (the input gamma, before the g_min floor).
- `rollout_weight_mean`: the correction's importance weight (after batch normalization)
  per kept unit.
Additive tallies (LossOutput.counts, with a correction or OPSM): kept and rejected tokens
and sequences, vetoed and OPSM-masked sequences, the weights' sum; summed over micro-batches
and ranks they give the step's normalizers and `CorrectionCounts.fractions()`
(`rollout_masked_frac`, `rollout_rejected_seq_frac`, `rollout_vetoed_frac`, `opsm_masked_frac`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from moe_rl.objectives.base import (
    OBJECTIVES,
    CommonHParams,
    Context,
    ObjectiveSpec,
    Surrogate,
    split_hparams,
)
from moe_rl.objectives.batch import LossOutput, PolicyBatch
from moe_rl.objectives.common import (
    aggregation_weights,
    compute_dtype,
    kl_estimate,
    masked_aminmax,
    masked_min,
    weighted_sum,
)
from moe_rl.objectives.correction import (
    CorrectionCounts,
    correction_form,
    decide_correction,
    opsm_masked,
    tally,
)


def policy_loss(name: str, batch: PolicyBatch, **hparams: Any) -> LossOutput:
    """The loss of objective `name` on `batch`.

    `hparams` are the objective's own (OBJECTIVES[name].hparams fields) and the shared ones
    (CommonHParams fields: rollout_correction and its knobs, opsm_delta, kl_coef,
    kl_estimator, token_normalizer, seq_normalizer, num_sequences_total,
    max_response_length, is_weight_mean). An unknown name or key, or inputs the objective
    cannot use (rspo without router_shift, kl_coef > 0 without ref_logprobs, a correction
    or OPSM without rollout_logprobs, [B,T] advantages for a sequence-level objective or
    OPSM), raise ValueError. With a correction that rejects, the normalizers count kept
    tokens and sequences only (a single call without them counts its own).
    """
    common, own = split_hparams(name, hparams)
    return policy_loss_from_hparams(name, batch, common, own)


def policy_loss_from_hparams(name: str, batch: PolicyBatch, common: CommonHParams, own: Any) -> LossOutput:
    """`policy_loss` with the hyperparameters already built (CommonHParams and the
    objective's own dataclass): what a training loop calls per micro-batch, so that the
    hyperparameters are built and checked once, not once per call."""
    spec = OBJECTIVES[name]
    if not isinstance(own, spec.hparams):
        raise ValueError(f"objective {name!r} takes {spec.hparams.__name__}, got {type(own).__name__}")
    _check_inputs(spec, batch, common)
    per_sequence = spec.level == "sequence"
    form = correction_form(common.rollout_correction, common, per_sequence)
    mask_BT, correction = batch.response_mask, None
    if form is not None:
        dtype = compute_dtype(batch.logprobs.dtype)
        assert batch.rollout_logprobs is not None
        correction = decide_correction(form, batch.old_logprobs.detach().to(dtype),
                                       batch.rollout_logprobs.detach().to(dtype), mask_BT)
        if form.rejects:  # rejected tokens leave the loss and every count: the batch without them
            batch = copy.copy(batch)
            batch.response_mask = correction.kept_BT
    ctx = Context(batch)
    surrogate = spec.fn(ctx, own)

    with torch.no_grad():
        weight = aggregation_weights(
            spec.aggregation,
            ctx.mask_f_BT,
            ctx.len_B,
            token_normalizer=common.token_normalizer,
            seq_normalizer=common.seq_normalizer,
            num_sequences_total=common.num_sequences_total,
            max_response_length=common.max_response_length,
        )
        counts = None if form is None and common.opsm_delta is None else tally(mask_BT, correction, None)
        is_weight = None
        if correction is not None and correction.weight is not None:
            is_weight = correction.weight
            if form is not None and form.batch_normalize:
                mean = common.is_weight_mean
                if mean is None:
                    assert counts is not None  # (a correction form: tallied above)
                    mean = counts.weight_mean()
                mean = torch.as_tensor(mean, dtype=is_weight.dtype, device=is_weight.device)
                is_weight = is_weight / torch.where(mean > 0, mean, 1.0)  # (no kept unit: weights are 0 anyway)
            weight = weight * (is_weight.unsqueeze(1) if is_weight.ndim < weight.ndim else is_weight)
        opsm_B = None
        if common.opsm_delta is not None:
            assert batch.rollout_logprobs is not None and ctx.adv_B is not None
            opsm_B = opsm_masked(common.opsm_delta, batch.rollout_logprobs.to(ctx.dtype), ctx.logprobs_BT,
                                 ctx.mask_BT, ctx.adv_B)
        # OPSM masks the objective only; its tokens stay in the normalizers (and in the KL term).
        objective_weight = weight if opsm_B is None else weight * _per_unit(~opsm_B, weight)

    objective = weighted_sum(surrogate.objective, objective_weight)

    kl_BT = None
    if batch.ref_logprobs is not None:
        ref_BT = batch.ref_logprobs.detach().to(ctx.dtype)
        logp_BT = ctx.logprobs_BT if common.kl_coef > 0 else ctx.logprobs_BT.detach()
        kl_BT = kl_estimate(common.kl_estimator, logp_BT, ref_BT, ctx.mask_BT)
        if common.kl_coef > 0:
            # A sequence's weight is spread over its tokens as a token mean.
            w_tok = (weight * ctx.inv_len_B).unsqueeze(1) * ctx.mask_f_BT if per_sequence else weight
            objective = objective - common.kl_coef * weighted_sum(kl_BT, w_tok)

    with torch.no_grad():
        metrics = _metrics(ctx, surrogate, per_sequence, kl_BT, is_weight)
        if counts is not None and opsm_B is not None:
            counts.values[CorrectionCounts.FIELDS.index("opsm_sequences")] = opsm_B.double().sum()  # (decided last)
    num_tokens, num_sequences = ctx.mask_BT.sum(), ctx.num_nonempty
    return LossOutput(-objective, metrics, num_tokens, num_sequences, counts)


def _per_unit(x_B: Tensor, like: Tensor) -> Tensor:
    """A per-sequence [B] factor shaped to multiply `like` ([B] or [B,T])."""
    x = x_B.to(like.dtype)
    return x if like.ndim == 1 else x.unsqueeze(1)


def _check_inputs(spec: ObjectiveSpec, batch: PolicyBatch, common: CommonHParams) -> None:
    if not isinstance(batch, PolicyBatch):
        raise ValueError(f"batch must be a PolicyBatch, got {type(batch).__name__}")
    if spec.needs_router_shift and batch.router_shift is None:
        raise ValueError(
            f"objective {spec.name!r} needs PolicyBatch.router_shift (gamma from "
            "moe_rl.routing.router_shift); it is None"
        )
    if common.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(
            f"kl_coef={common.kl_coef} needs PolicyBatch.ref_logprobs (the KL penalty's "
            "reference); it is None"
        )
    if common.rollout_correction != "none" and batch.rollout_logprobs is None:
        raise ValueError(
            f"rollout_correction={common.rollout_correction!r} needs "
            "PolicyBatch.rollout_logprobs (the sampler's logprobs); it is None"
        )
    if common.opsm_delta is not None and batch.rollout_logprobs is None:
        raise ValueError("opsm_delta needs PolicyBatch.rollout_logprobs (the sampler's logprobs); it is None")
    if common.opsm_delta is not None and batch.advantages.ndim != 1:
        raise ValueError(
            "opsm_delta masks whole sequences by their advantage's sign and needs PolicyBatch.advantages "
            f"of shape [B], got {list(batch.advantages.shape)} (per-token advantages, e.g. PPO's GAE)"
        )
    if spec.level == "sequence" and batch.advantages.ndim != 1:
        raise ValueError(
            f"objective {spec.name!r} is sequence-level and needs PolicyBatch.advantages of "
            f"shape [B], got {list(batch.advantages.shape)} (gspo_token takes [B,T])"
        )


def _metrics(
    ctx: Context,
    surrogate: Surrogate,
    per_sequence: bool,
    kl_BT: Tensor | None,
    is_weight: Tensor | None,
) -> dict[str, Tensor]:
    """Local metrics: means over this batch's units (valid tokens; or non-empty sequences,
    per-token quantities first averaged within each sequence)."""
    nonempty_B, n_seq = ctx.nonempty_B, ctx.num_nonempty
    seq_w_B = nonempty_B.to(ctx.dtype) / n_seq.clamp(min=1)
    if per_sequence:
        tok_w_BT = (seq_w_B * ctx.inv_len_B).unsqueeze(1) * ctx.mask_f_BT
        inv_n: float | Tensor = 1.0
    else:  # token means: dot with the float mask, then one scalar division
        tok_w_BT, inv_n = ctx.mask_f_BT, 1.0 / ctx.len_B.sum().clamp(min=1)

    def mean(x: Tensor) -> Tensor:
        return weighted_sum(x, seq_w_B) if x.ndim == 1 else weighted_sum(x, tok_w_BT) * inv_n

    ratio, lr_BT = surrogate.ratio, ctx.log_ratio_BT.detach()
    unit_valid = nonempty_B if ratio.ndim == 1 else ctx.mask_BT
    ratio_min, ratio_max = masked_aminmax(ratio, unit_valid)
    metrics = {
        "clip_frac": mean(surrogate.clipped.to(ctx.dtype)),
        "ratio_mean": mean(ratio),
        "ratio_max": ratio_max,
        "ratio_min": ratio_min,
        # k3 of old vs current, mean of exp(-lr) + lr - 1 (>= 0; padding has lr = 0), taken
        # as mean(exp(-lr)) + mean(lr) - [any unit]: two dot products, no k3 tensor.
        "approx_kl": mean(torch.exp(-lr_BT)) + mean(lr_BT) - (n_seq > 0).to(ctx.dtype),
    }
    if kl_BT is not None:
        metrics["kl_ref"] = mean(kl_BT.detach())
    if ctx.router_shift_BT is not None:
        shift_BT = torch.where(ctx.mask_BT, ctx.router_shift_BT, 0.0)
        metrics["router_shift_mean"] = mean(shift_BT)
        metrics["router_shift_min"] = masked_min(shift_BT, ctx.mask_BT)
    if is_weight is not None:  # (a sequence weight of a token-level objective: per token, like the loss)
        shaped = is_weight if per_sequence or is_weight.ndim == 2 else is_weight.unsqueeze(1) * ctx.mask_f_BT
        metrics["rollout_weight_mean"] = mean(shaped)
    return metrics
