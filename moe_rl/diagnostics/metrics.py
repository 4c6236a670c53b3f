"""Sampler-learner probability mismatch: per-token metrics, sequence and bucket aggregates.

One implementation for both consumers: the trainer logs `compute_mismatch(...).summary()`
every step, and `tools/measure_mismatch.py` writes the full result with `write_report`.

Conventions. The response tokens were sampled from the sampler q; the learner p rescored
them. Per valid token, with `s = sampler_logp`, `l = learner_logp`:

    d       = l - s = log p/q            the log ratio; exp(d) is the TIS/IcePop ratio
    k1      = -d = log q - log p         unbiased estimate of KL(q || p) (can be < 0 per token)
    k3      = exp(d) - 1 - d             also estimates KL(q || p); >= 0 per token
    |dp|    = |exp(l) - exp(s)|          absolute probability difference

Aggregates (B' = sequences with at least one valid token):
    dp_mean       (1/B') sum_i mean_t |dp|       per-sequence mean, then mean over sequences
    dp_max_mean   (1/B') sum_i max_t |dp|        per-sequence max, then mean over sequences
    dp_max        max over all valid tokens of |dp|
    k1, k3        token-mean over all valid tokens
    log_ppl_diff  (1/B') sum_i mean_t (s - l) = log ppl_learner - log ppl_sampler
                  (log ppl = -mean_t logp). Positive: the learner finds the sampled text
                  less likely than the sampler did (the usual sign, like k1); it is the
                  sequence-mean counterpart of the token-mean k1.
    frac_tis_capped      fraction of valid tokens with exp(d) > tis_cap (C = 2)
    frac_outside_icepop  fraction with exp(d) < lo or exp(d) > hi, band [lo, hi] = [0.5, 2]
    frac_dlogp_gt_ln2    fraction with |d| > ln 2: the "extreme" tokens, ratio beyond 2 either way
    ratio_mean    token-mean of r = exp(d) (1 when the sampler matches)
    chi2_token    token-mean of r^2, minus 1: the chi-square divergence the token ratios' variance
                  grows with (0 when the sampler matches)
    chi2_seq      (1/B') sum_i exp(2 sum_t d) - 1: the same for whole-sequence ratios, which
                  compound over the response (the sum clamped to +-20 before exp)
    ess_token     (sum r)^2 / (N sum r^2) = ratio_mean^2 / (chi2_token + 1): the token ratios'
                  effective sample size over their count N (1: every token counts fully)
All threshold tests are done in log space (d > ln C), so a ratio exactly on a boundary
counts as inside. With the default band [0.5, 2], frac_outside_icepop equals
frac_dlogp_gt_ln2 by construction; they differ once the band is set otherwise.

Buckets: by response position (index among the sequence's valid tokens, so right-padding is
not required) and by sampler probability exp(s). Each bucket is [e_i, e_{i+1}), the last
one closed [e_{n-2}, e_{n-1}] so that probability 1 is counted. Per bucket: num_tokens;
token-means of |dp|, k1, k3 and the three fractions; dp_max_mean (max |dp| over a
sequence's tokens in that bucket, averaged over the sequences that have any). Empty bucket:
NaN (undefined), except num_tokens = 0. Tokens outside every bucket (user edges that do not
cover them) are counted in `num_outside`.

Empty input (no valid token): every summary value is 0 and num_tokens is 0; never NaN.
Cost: a few elementwise passes and a handful of bincounts, no Python loop over tokens and
no host sync except `check_values` (one) and `summary()` (one). Per-token math
is float64 and uses expm1, so k3 (~ d^2/2) keeps its digits when d ~ 1e-4 (in float32,
exp(d) - 1 - d would be mostly rounding error there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.diagnostics.buckets import (
    DEFAULT_PROB_EDGES,
    BucketTable,
    bucket_index,
    bucket_table,
    check_edges,
    default_position_edges,
)
from moe_rl.objectives.common import LOG_RATIO_BOUND
from moe_rl.routing.stats import topk_disagreement

PREFIX = "mismatch/"
TIS_CAP = 2.0
ICEPOP_BAND = (0.5, 2.0)
LN2 = math.log(2.0)
LOGP_TOL = 1e-3  # a valid log-prob above this is not a log-prob (rounding may give +1e-7)

@dataclass(frozen=True)
class TokenArrays:
    """Per-token and per-sequence arrays kept for plots (float64, zero at masked slots)."""

    log_ratio: Tensor  # [B, T] d = learner - sampler
    abs_dp: Tensor  # [B, T] |exp(learner) - exp(sampler)|
    sampler_p: Tensor  # [B, T]
    learner_p: Tensor  # [B, T]
    mask: Tensor  # [B, T] bool
    length: Tensor  # [B] valid tokens per sequence
    dp_max: Tensor  # [B] max |dp| per sequence (0 for empty sequences)

    def valid(self, name: str) -> Tensor:
        """1-D tensor of `name`'s values at valid tokens (for histograms and scatters)."""
        return getattr(self, name)[self.mask]


@dataclass(frozen=True)
class MismatchResult:
    """What `compute_mismatch` measured; `summary()` is the flat dict the trainer logs."""

    scalars: dict[str, Tensor]  # unprefixed names -> 0-dim tensors
    by_position: BucketTable
    by_sampler_prob: BucketTable
    tokens: TokenArrays
    routing_disagree_per_layer: Tensor | None = None  # [L] sampler vs learner top-k set
    routing_disagree_any: Tensor | None = None  # tokens differing in >= 1 layer
    params: dict[str, float | list[float]] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """Flat `mismatch/...` floats (one host sync): TensorBoard / JSONL ready."""
        named = {f"{PREFIX}{k}": v for k, v in self.scalars.items()}
        if self.routing_disagree_per_layer is not None and self.routing_disagree_any is not None:
            for i in range(self.routing_disagree_per_layer.shape[0]):
                named[f"{PREFIX}routing_disagree_layer{i}"] = self.routing_disagree_per_layer[i]
            named[f"{PREFIX}routing_disagree_any"] = self.routing_disagree_any
        values = torch.stack([v.detach().double().reshape(()) for v in named.values()])
        return dict(zip(named.keys(), values.cpu().tolist()))

    def to_dict(self) -> dict:
        """JSON-ready (NaN left as float NaN; the report writer maps it to null)."""
        out = {
            "summary": self.summary(),
            "params": dict(self.params),
            "by_position": {
                "edges": list(self.by_position.edges),
                "num_outside": int(self.by_position.num_outside),
                "rows": self.by_position.rows(),
            },
            "by_sampler_prob": {
                "edges": list(self.by_sampler_prob.edges),
                "num_outside": int(self.by_sampler_prob.num_outside),
                "rows": self.by_sampler_prob.rows(),
            },
        }
        if self.routing_disagree_per_layer is not None and self.routing_disagree_any is not None:
            out["routing"] = {
                "disagree_per_layer": self.routing_disagree_per_layer.double().cpu().tolist(),
                "disagree_any": float(self.routing_disagree_any),
            }
        return out


# --------------------------------------------------------------------------- validation


def _check_inputs(
    sampler_logp_BT: Tensor,
    learner_logp_BT: Tensor,
    mask_BT: Tensor,
    sampler_ids_BTLK: Tensor | None,
    learner_ids_BTLK: Tensor | None,
) -> None:
    if sampler_logp_BT.dim() != 2:
        raise ValueError(
            f"sampler_logp_BT must be 2-D [B, T], got shape {tuple(sampler_logp_BT.shape)}"
        )
    shape = tuple(sampler_logp_BT.shape)
    if tuple(learner_logp_BT.shape) != shape:
        raise ValueError(
            f"learner_logp_BT must have sampler_logp_BT's shape {shape}, "
            f"got {tuple(learner_logp_BT.shape)}"
        )
    for name, x in (("sampler_logp_BT", sampler_logp_BT), ("learner_logp_BT", learner_logp_BT)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point log-probs, got {x.dtype}")
    if tuple(mask_BT.shape) != shape or mask_BT.dtype != torch.bool:
        raise ValueError(
            f"mask_BT must be a bool tensor of shape {shape}, "
            f"got {mask_BT.dtype} {tuple(mask_BT.shape)}"
        )
    if (sampler_ids_BTLK is None) != (learner_ids_BTLK is None):
        raise ValueError("sampler_ids_BTLK and learner_ids_BTLK must be given together")
    if sampler_ids_BTLK is not None and learner_ids_BTLK is not None:
        if sampler_ids_BTLK.dim() != 4 or tuple(sampler_ids_BTLK.shape[:2]) != shape:
            raise ValueError(
                f"sampler_ids_BTLK must be 4-D [B, T, L, K] with [B, T] = {shape}, "
                f"got {tuple(sampler_ids_BTLK.shape)}"
            )
        if learner_ids_BTLK.shape != sampler_ids_BTLK.shape:
            raise ValueError(
                f"learner_ids_BTLK must have sampler_ids_BTLK's shape "
                f"{tuple(sampler_ids_BTLK.shape)}, got {tuple(learner_ids_BTLK.shape)}"
            )


def _check_values(name: str, logp_BT: Tensor, mask_BT: Tensor) -> None:
    """Valid positions must hold finite log-probs <= LOGP_TOL; padding may hold anything."""
    bad_BT = mask_BT & ~(torch.isfinite(logp_BT) & (logp_BT <= LOGP_TOL))
    if bad_BT.any():
        b, t = (int(i) for i in bad_BT.nonzero()[0])
        raise ValueError(
            f"{name} has {int(bad_BT.sum())} invalid value(s) at valid (mask) positions "
            f"(not finite or > {LOGP_TOL}: not a log-prob), first at [{b}, {t}] = "
            f"{float(logp_BT[b, t])}"
        )


# --------------------------------------------------------------------------- per token


@dataclass(frozen=True)
class _PerToken:
    """float64 per-token terms, zero at padding (d is zeroed there, and every term below is 0
    where d = 0: |dp| = q |expm1(d)|, k3 = expm1(d) - d), so no further masking is needed."""

    mask_BT: Tensor  # bool
    d_BT: Tensor  # learner - sampler log-prob
    em1_BT: Tensor  # exp(d) - 1, accurate when d is tiny
    q_BT: Tensor  # sampler probability (1 at padding)
    abs_dp_BT: Tensor  # |p - q| = q |exp(d) - 1|
    k3_BT: Tensor
    capped_BT: Tensor  # bool: exp(d) > tis_cap
    outside_BT: Tensor  # bool: exp(d) outside the IcePop band
    gt_ln2_BT: Tensor  # bool: |d| > ln 2
    ratio_BT: Tensor  # exp(d), d clamped to +-20 (0 at padding)


def _per_token(
    sampler_logp_BT: Tensor,
    learner_logp_BT: Tensor,
    mask_BT: Tensor,
    tis_cap: float,
    band: tuple[float, float],
) -> _PerToken:
    m_BT = mask_BT
    lo, hi = band
    # padding may hold NaN / -inf: it is replaced before any arithmetic
    s_BT = torch.where(m_BT, sampler_logp_BT.detach().to(torch.float64), 0.0)
    d_BT = torch.where(m_BT, learner_logp_BT.detach().to(torch.float64) - s_BT, 0.0)
    em1_BT = torch.expm1(d_BT)
    q_BT = s_BT.exp()
    return _PerToken(
        mask_BT=m_BT,
        d_BT=d_BT,
        em1_BT=em1_BT,
        q_BT=q_BT,
        abs_dp_BT=q_BT * em1_BT.abs(),
        k3_BT=(em1_BT - d_BT).clamp_min(0.0),
        capped_BT=(d_BT > math.log(tis_cap)) & m_BT,
        outside_BT=((d_BT < math.log(lo)) | (d_BT > math.log(hi))) & m_BT,
        gt_ln2_BT=(d_BT.abs() > LN2) & m_BT,
        ratio_BT=torch.where(m_BT, torch.exp(d_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), 0.0),
    )


# --------------------------------------------------------------------------- per sequence


@dataclass(frozen=True)
class _PerSequence:
    """Per-sequence reductions shared by the scalars and the token arrays."""

    len_B: Tensor  # float64 valid tokens per sequence
    dp_max_B: Tensor  # max |dp| per sequence (0 for empty sequences)
    negd_sum_B: Tensor  # sum_t (s - l)
    seq_ratio_sq_B: Tensor  # exp(2 sum_t d) (clamped), 0 for empty sequences
    num_sequences: Tensor  # sequences with at least one valid token (B')
    num_tokens: Tensor


def _per_sequence(tok: _PerToken) -> _PerSequence:
    len_B = tok.mask_BT.sum(1).to(torch.float64)
    T = tok.mask_BT.shape[1]
    return _PerSequence(
        len_B=len_B,
        dp_max_B=tok.abs_dp_BT.amax(1) if T > 0 else len_B * 0,
        negd_sum_B=-tok.d_BT.sum(1),
        seq_ratio_sq_B=torch.where(len_B > 0, torch.exp(2 * tok.d_BT.sum(1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), 0.0),
        num_sequences=(len_B > 0).to(torch.float64).sum(),
        num_tokens=len_B.sum(),
    )


def _scalars(tok: _PerToken, seq: _PerSequence) -> dict[str, Tensor]:
    """The summary numbers (module docstring); a zero count divides by 1, so never NaN."""
    n_tok = seq.num_tokens
    seq_den, tok_den = seq.num_sequences.clamp_min(1), n_tok.clamp_min(1)
    len_B = seq.len_B.clamp_min(1)
    abs_dp_BT = tok.abs_dp_BT
    return {
        "num_tokens": n_tok,
        "num_sequences": seq.num_sequences,
        "dp_mean": (abs_dp_BT.sum(1) / len_B).sum() / seq_den,
        "dp_max_mean": seq.dp_max_B.sum() / seq_den,  # empty sequences have max 0
        "dp_max": abs_dp_BT.amax() if abs_dp_BT.numel() else n_tok * 0,
        "k1": seq.negd_sum_B.sum() / tok_den,
        "k3": tok.k3_BT.sum() / tok_den,
        # per sequence mean_t (s - l) = log ppl_learner - log ppl_sampler, then over sequences
        "log_ppl_diff": (seq.negd_sum_B / len_B).sum() / seq_den,
        "frac_tis_capped": tok.capped_BT.sum() / tok_den,
        "frac_outside_icepop": tok.outside_BT.sum() / tok_den,
        "frac_dlogp_gt_ln2": tok.gt_ln2_BT.sum() / tok_den,
        **ratio_moments(tok.ratio_BT.sum() / tok_den, tok.ratio_BT.square().sum() / tok_den, n_tok > 0),
        "chi2_seq": torch.where(seq.num_sequences > 0, seq.seq_ratio_sq_B.sum() / seq_den - 1.0, 0.0),
    }


def ratio_moments(mean_r: Tensor | float, mean_r2: Tensor | float, any_token: Tensor | bool) -> dict[str, Tensor]:
    """ratio_mean, chi2_token and ess_token from the token means of r and r^2 (all 0 with no
    token, like every summary value); `combine_mismatch_summaries` rebuilds the whole batch's from the parts' means."""
    any_t = torch.as_tensor(any_token)
    mean_r, mean_r2 = torch.as_tensor(mean_r, dtype=torch.float64), torch.as_tensor(mean_r2, dtype=torch.float64)
    ess = torch.where(mean_r2 > 0, mean_r.square() / mean_r2.clamp(min=1e-300), 1.0)
    return {"ratio_mean": torch.where(any_t, mean_r, 0.0), "chi2_token": torch.where(any_t, mean_r2 - 1.0, 0.0),
            "ess_token": torch.where(any_t, ess, 0.0)}


def _bucket_tables(
    tok: _PerToken, num_tokens: Tensor, pos_edges: tuple[float, ...], prob_edges: tuple[float, ...]
) -> tuple[BucketTable, BucketTable]:
    """(by response position, by sampler probability)."""
    m_BT = tok.mask_BT
    T = m_BT.shape[1]
    flags_BT = tok.capped_BT.long() + 2 * tok.outside_BT.long() + 4 * tok.gt_ln2_BT.long()
    bucket_args = (tok.abs_dp_BT, tok.d_BT, tok.k3_BT, flags_BT, num_tokens)
    # position = index among the sequence's valid tokens; bucket it once per position 0..T-1
    pos_BT = (m_BT.cumsum(1) - 1).clamp_min(0)
    pos_bucket_T = bucket_index(
        torch.arange(T, device=m_BT.device, dtype=torch.float64),
        pos_edges,
        torch.ones(T, dtype=torch.bool, device=m_BT.device),
    )
    pos_idx_BT = torch.where(m_BT, pos_bucket_T[pos_BT], len(pos_edges) - 1)
    by_position = bucket_table("position", pos_edges, pos_idx_BT, *bucket_args)
    prob_idx_BT = bucket_index(tok.q_BT.clamp(0.0, 1.0), prob_edges, m_BT)
    by_prob = bucket_table("sampler_prob", prob_edges, prob_idx_BT, *bucket_args)
    return by_position, by_prob


def _routing_disagreement(
    sampler_ids_BTLK: Tensor | None, learner_ids_BTLK: Tensor | None, mask_BT: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """(per layer [L], any layer []) from the one implementation in moe_rl.routing."""
    if sampler_ids_BTLK is None or learner_ids_BTLK is None:
        return None, None
    B, T, L, K = sampler_ids_BTLK.shape
    return topk_disagreement(
        sampler_ids_BTLK.reshape(B * T, L, K),
        learner_ids_BTLK.reshape(B * T, L, K),
        mask_BT.reshape(-1),
    )


def _token_arrays(tok: _PerToken, seq: _PerSequence) -> TokenArrays:
    w_BT = tok.mask_BT.to(torch.float64)
    return TokenArrays(
        log_ratio=tok.d_BT,
        abs_dp=tok.abs_dp_BT,
        sampler_p=tok.q_BT * w_BT,
        learner_p=tok.q_BT * (1.0 + tok.em1_BT) * w_BT,  # exp(l) without a second exp
        mask=tok.mask_BT,
        length=seq.len_B,
        dp_max=seq.dp_max_B,
    )


# --------------------------------------------------------------------------- entry point


def _check_params(
    T: int,
    tis_cap: float,
    icepop_band: tuple[float, float],
    position_edges: Sequence[float] | None,
    prob_edges: Sequence[float],
) -> tuple[tuple[float, float], tuple[float, ...], tuple[float, ...]]:
    """(band, position edges, probability edges), checked; position edges default to
    `default_position_edges(T)`."""
    if not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    lo, hi = (float(x) for x in icepop_band)
    if not 0 < lo < hi:
        raise ValueError(f"icepop_band must be (lo, hi) with 0 < lo < hi, got {icepop_band}")
    pos_edges = check_edges(
        "position_edges",
        default_position_edges(T) if position_edges is None else position_edges,
        0.0,
        None,
    )
    return (lo, hi), pos_edges, check_edges("prob_edges", prob_edges, 0.0, 1.0)


def compute_mismatch(
    sampler_logp_BT: Tensor,
    learner_logp_BT: Tensor,
    mask_BT: Tensor,
    *,
    sampler_ids_BTLK: Tensor | None = None,
    learner_ids_BTLK: Tensor | None = None,
    tis_cap: float = TIS_CAP,
    icepop_band: tuple[float, float] = ICEPOP_BAND,
    position_edges: Sequence[float] | None = None,
    prob_edges: Sequence[float] = DEFAULT_PROB_EDGES,
    check_values: bool = True,
) -> MismatchResult:
    """Sampler-vs-learner mismatch of B right-padded responses of up to T tokens.

    sampler_logp_BT / learner_logp_BT: log-prob of each sampled token under the sampler and
    the learner (same weights); mask_BT: bool, True at response tokens. Optional routing,
    aligned with the tokens: sampler_ids_BTLK / learner_ids_BTLK `[B, T, L, K]` top-k ids
    (any integer dtype); the per-layer and any-layer disagreement come from
    `moe_rl.routing.stats.topk_disagreement`. position_edges defaults to
    `default_position_edges(T)`. check_values (one host sync) rejects non-finite or positive
    log-probs at valid positions. Definitions: the module docstring.
    """
    _check_inputs(sampler_logp_BT, learner_logp_BT, mask_BT, sampler_ids_BTLK, learner_ids_BTLK)
    T = sampler_logp_BT.shape[1]
    band, pos_edges, p_edges = _check_params(T, tis_cap, icepop_band, position_edges, prob_edges)
    if check_values:
        _check_values("sampler_logp_BT", sampler_logp_BT, mask_BT)
        _check_values("learner_logp_BT", learner_logp_BT, mask_BT)

    tok = _per_token(sampler_logp_BT, learner_logp_BT, mask_BT, tis_cap, band)
    seq = _per_sequence(tok)
    by_position, by_prob = _bucket_tables(tok, seq.num_tokens, pos_edges, p_edges)
    dis_L, dis_any = _routing_disagreement(sampler_ids_BTLK, learner_ids_BTLK, mask_BT)
    return MismatchResult(
        scalars=_scalars(tok, seq),
        by_position=by_position,
        by_sampler_prob=by_prob,
        tokens=_token_arrays(tok, seq),
        routing_disagree_per_layer=dis_L,
        routing_disagree_any=dis_any,
        params={
            "tis_cap": float(tis_cap),
            "icepop_band": list(band),
            "dlogp_threshold": LN2,
            "position_edges": list(pos_edges),
            "prob_edges": list(p_edges),
        },
    )
