"""Pieces every objective shares, so that an objective file holds only its own ratio and
surrogate: masked log ratios, the two clipping shapes, aggregation weights with explicit
normalizers and KL estimators (the sampler-learner correction is `correction`).

Conventions. Tensors named `*_BT` are [B,T], `*_B` are [B]. Inputs arrive already masked
(0 at padded positions, selected with `torch.where`, so NaN/inf padding never reaches an
`exp` or a product). Every count used as a divisor is clamped to at least 1: an empty
sequence or an empty batch divides 0 by 1.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LOG_RATIO_BOUND = 20.0
"""Log ratios are clamped to [-20, 20] before exp: a guard against overflow, not a clip;
exp(20) ~ 4.9e8 is far beyond any ratio a sane update produces."""

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean"]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "seq-mean",
)

Count = float | int | Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16/fp16 inputs are computed in fp32 (exp and sums of 1e5 terms need the mantissa);
    fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def masked_log_ratio(num_BT: Tensor, den_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """`num - den` on valid positions, 0 on padding, clamped to +-LOG_RATIO_BOUND."""
    return torch.where(mask_BT, num_BT - den_BT, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def guard_count(count: Count) -> Count:
    """max(count, 1), without a host sync for tensors."""
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    return max(count, 1)


# --------------------------------------------------------------------------- clipping


def clipped_surrogate(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate `min(ratio*A, clip(ratio, 1-lo, 1+hi)*A)` and the mask
    of elements where the clip is active (zero gradient): ratio above the band with A > 0,
    or below it with A < 0. Works per token ([B,T]) or per sequence ([B]).

    Written as `where(clipped, sg[clip(ratio)*A], ratio*A)`: equal to the min in value and
    gradient (where the clipped term is the smaller one, the ratio is outside the band and
    clip() has zero gradient; at a tie both forms give the full gradient), with half the
    backward work of `torch.minimum`."""
    surr = ratio * adv
    with torch.no_grad():
        surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
        clipped = surr_clipped < surr
    return torch.where(clipped, surr_clipped, surr), clipped


def sign_log_clip(
    log_ratio_BT: Tensor, sign_B: Tensor, log_clip_low: float, log_clip_high: float
) -> tuple[Tensor, Tensor]:
    """GMPO's token clip in log space, one bound per advantage sign: `min(lr, hi)` where
    A > 0, `max(lr, -lo)` where A < 0, `lr` where A = 0. Returns the clipped log ratios and
    the mask of clipped tokens."""
    inf = log_ratio_BT.new_full((), float("inf"))  # (filled on the device: torch.tensor would copy, and wait)
    low_B1 = torch.where(sign_B < 0, -log_clip_low, -inf).unsqueeze(1)
    high_B1 = torch.where(sign_B > 0, log_clip_high, inf).unsqueeze(1)
    c_BT = torch.clamp(log_ratio_BT, min=low_B1, max=high_B1)
    with torch.no_grad():
        clipped_BT = c_BT != log_ratio_BT
    return c_BT, clipped_BT


# --------------------------------------------------------------------------- aggregation


def aggregation_weights(
    aggregation: str,
    mask_f_BT: Tensor,
    len_B: Tensor,
    *,
    token_normalizer: Count | None = None,
    seq_normalizer: Count | None = None,
    num_sequences_total: Count | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Weights W with `objective = sum(W * u)` for per-token u ([B,T] weights) or per-sequence
    u ([B] weights, `seq-mean`). Zero on padding and on empty sequences. `mask_f_BT` is the
    response mask as floats, `len_B` its row sums n_i.

    - token-mean:               W = m / N,                N = token_normalizer (valid tokens)
    - seq-mean-token-mean:      W = m / (n_i * B'),       B' = seq_normalizer (non-empty seqs)
    - seq-mean-token-sum-norm:  W = m / (B * L_max),      B = num_sequences_total (all seqs),
                                                           L_max = max_response_length (or T)
    - seq-mean:                 W_i = [n_i > 0] / B'

    A normalizer left as None is counted on this batch. Passing the whole batch's counts
    makes the weights of each micro-batch the whole batch's weights restricted to it, so
    the micro-batch losses sum to the whole-batch loss (and so do their gradients).
    """
    if aggregation == "token-mean":
        n_tok = token_normalizer if token_normalizer is not None else len_B.sum()
        return mask_f_BT / guard_count(n_tok)
    if aggregation == "seq-mean-token-sum-norm":
        n_seq = num_sequences_total if num_sequences_total is not None else mask_f_BT.shape[0]
        l_max = max_response_length if max_response_length is not None else mask_f_BT.shape[1]
        return mask_f_BT / (guard_count(n_seq) * guard_count(l_max))
    # (the non-empty mask only where it is used: each op is a kernel launch on a GPU)
    nonempty_B = len_B > 0 if aggregation == "seq-mean" or seq_normalizer is None else None
    if seq_normalizer is not None:
        n_seq = seq_normalizer
    else:
        assert nonempty_B is not None  # (made above when there is no normalizer)
        n_seq = nonempty_B.sum()
    if aggregation == "seq-mean":
        assert nonempty_B is not None  # (made above for seq-mean)
        return nonempty_B.to(len_B.dtype) / guard_count(n_seq)
    if aggregation == "seq-mean-token-mean":
        return mask_f_BT * (1.0 / (len_B.clamp(min=1) * guard_count(n_seq))).unsqueeze(1)
    raise ValueError(f"unknown aggregation {aggregation!r}; valid: {', '.join(AGGREGATIONS)}")


def weighted_sum(x: Tensor, w: Tensor) -> Tensor:
    """sum(x * w) for same-shape tensors, as one fused dot product (a single pass)."""
    return torch.dot(x.reshape(-1), w.reshape(-1))


# --------------------------------------------------------------------------- KL


KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(estimator: str, logp_BT: Tensor, ref_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples (Schulman's k1/k2/k3), 0 on padding.
    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d_BT = masked_log_ratio(ref_BT, logp_BT, mask_BT)  # log(pi_ref / pi)
    if estimator == "k1":
        return -d_BT
    if estimator == "k2":
        return 0.5 * d_BT.square()
    if estimator == "k3":
        return torch.exp(d_BT) - d_BT - 1.0  # (not expm1: unvectorised on CPU, 5x slower)
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


# --------------------------------------------------------------------------- sampler correction


RolloutCorrection = Literal["none", "tis", "mis", "icepop", "is_rs"]
"""rl.rollout_correction's names (moe_rl.objectives.correction computes them)."""


# --------------------------------------------------------------------------- metrics


def masked_min(x: Tensor, valid: Tensor) -> Tensor:
    """min over the valid elements of x (invalid ones read as +inf, the identity: the result
    with no valid element). No host sync."""
    return torch.where(valid, x, float("inf")).amin() if x.numel() else x.new_full((), float("inf"))


def masked_aminmax(x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) over the valid elements of x ([B] or [B,T]); with no valid element
    (+inf, -inf), the identities. No host sync (locating a valid element by indexing would
    read it back)."""
    if x.numel() == 0:  # (filled on the device: new_tensor would copy from the host, and wait)
        return x.new_full((), float("inf")), x.new_full((), float("-inf"))
    return masked_min(x, valid), torch.where(valid, x, float("-inf")).amax()
