"""`policy_loss`: one entry point that wraps any registered objective with the shared
machinery (input checks, aggregation weights, sampler correction, KL penalty, metrics).

    loss = -sum(W * c * u) + kl_coef * sum(W_tok * c_tok * k)

u is the objective's per-unit term, W its aggregation weights (explicit normalizers make
micro-batch losses add up to the whole-batch loss), c the sampler-correction weight
(1 without correction), k the per-token KL estimate (token weights W_tok: W itself for
token-level objectives, W_i m / n_i for sequence-level ones). The correction multiplies
the KL term too: OBJECTIVES.md puts `-beta*k3` inside u and lets the weight multiply "each
token's term" (a dropped token or sequence leaves the loss entirely).

Metrics (see LossOutput for how they combine), means over the objective's units:
- `clip_frac`: token-level objectives, the fraction of valid tokens whose clip is active
  (sapo: whose soft gate 4p(1-p) < 1/2); gspo, the fraction of sequences; gmpo/rspo (token
  clip, sequence unit), the mean over sequences of each sequence's clipped-token fraction.
- `ratio_mean/_max/_min`: token ratios; for gspo/gmpo/rspo the unclipped sequence ratio
  exp(mean_t lr) (for rspo without gamma, which `router_shift_*` reports on its own).
- `approx_kl`: k3 of old vs current per token; sequence-level objectives average it
  within each sequence first. Likewise `kl_ref` (the configured estimator vs ref_logprobs)
  and `router_shift_mean` (the input gamma, before the g_min floor).
- `rollout_weight_mean`, `rollout_masked_frac`: the correction weight and dropped fraction
  per unit (tokens, or sequences for sequence-level objectives).
"""

from __future__ import annotations

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
    kl_estimate,
    masked_aminmax,
    masked_min,
    rollout_correction_weights,
    weighted_sum,
)


def policy_loss(name: str, batch: PolicyBatch, **hparams: Any) -> LossOutput:
    """The loss of objective `name` on `batch`.

    `hparams` are the objective's own (OBJECTIVES[name].hparams fields) and the shared ones
    (CommonHParams fields: rollout_correction, tis_cap, mis_low, mis_high, kl_coef,
    kl_estimator, token_normalizer, seq_normalizer, num_sequences_total,
    max_response_length). An unknown name or key, or inputs the objective cannot use (rspo
    without router_shift, kl_coef > 0 without ref_logprobs, a correction without
    rollout_logprobs, [B,T] advantages for a sequence-level objective), raise ValueError.
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
    ctx = Context(batch)
    surrogate = spec.fn(ctx, own)

    per_sequence = spec.level == "sequence"
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
        correction = None
        if common.rollout_correction != "none":
            assert batch.rollout_logprobs is not None
            correction = rollout_correction_weights(
                common.rollout_correction,
                ctx.old_BT,
                batch.rollout_logprobs.detach().to(ctx.dtype),
                ctx.mask_BT,
                ctx.inv_len_B,
                per_sequence=per_sequence,
                tis_cap=common.tis_cap,
                mis_low=common.mis_low,
                mis_high=common.mis_high,
            )
            weight = weight * correction[0]

    objective = weighted_sum(surrogate.objective, weight)

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
        metrics = _metrics(ctx, surrogate, per_sequence, kl_BT, correction)
    num_tokens, num_sequences = ctx.mask_BT.sum(), ctx.num_nonempty
    return LossOutput(-objective, metrics, num_tokens, num_sequences)


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
    correction: tuple[Tensor, Tensor] | None,
) -> dict[str, Tensor]:
    """Local metrics: means over this batch's units (valid tokens; or non-empty sequences,
    per-token quantities first averaged within each sequence)."""
    nonempty_B, n_seq = ctx.nonempty_B, ctx.num_nonempty
    seq_w_B = nonempty_B.to(ctx.dtype) / n_seq.clamp(min=1)
    if per_sequence:
        tok_w_BT = (seq_w_B * ctx.inv_len_B).unsqueeze(1) * ctx.mask_f_BT
        inv_n = 1.0
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
    if correction is not None:
        weight, kept = correction
        metrics["rollout_weight_mean"] = mean(weight)
        metrics["rollout_masked_frac"] = mean((~kept).to(ctx.dtype))
    return metrics
