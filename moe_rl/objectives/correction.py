"""Sampler-learner correction: importance weights, rejection and the veto (pure torch).

From d_t = old_t - rollout_t on response tokens (the learner's behaviour log-prob over the
sampler's, both detached), r_t = exp(d_t), and two per-sequence statistics, the product
exp(sum_t d_t) ("sequence") and the geometric mean exp(mean_t d_t) ("geometric"). Every
log ratio and every per-sequence sum or mean of them is clamped to +-20 before `exp`.

- importance weight (is_level): min(r_t, C) per token, or min(seq statistic, C) per
  sequence, applied to every token of the sequence;
- rejection (rs_level): a token whose r_t, or a sequence whose statistic, is outside
  [rs_low, rs_high] is rejected; for a sequence-level objective a rejected token rejects
  its sequence;
- veto: a sequence with any token r_t < veto_below is rejected whole.
A rejected token leaves the loss *and* its normalizers (the per-sequence length n_i, the
token count, and, when it was the sequence's last kept token, the sequence count B'): the
loss equals the loss of the batch with those tokens taken out of the response mask.

The presets are forms of the general `is_rs`:
  tis     is_level = token (geometric for sequence-level objectives)
  mis     tis's weight + rs_level = token, band [mis_low, mis_high]
  icepop  rs_level = token, band [mis_low, mis_high], weight 1

`CorrectionCounts` are the additive tallies (kept tokens and sequences, rejected and vetoed
sequences, the weights' sum) that a training loop sums over micro-batches and data-parallel
ranks: the step-wide normalizers and the `rollout_*` fractions come from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.config.rl import CorrectionHParams
from moe_rl.objectives.common import LOG_RATIO_BOUND, masked_log_ratio


@dataclass(frozen=True)
class CorrectionForm:
    """A correction resolved for one objective: what `is_rs` computes (presets included)."""

    is_level: str
    """none | token | sequence | geometric."""
    rs_level: str
    """none | token | sequence | geometric."""
    band: tuple[float, float]
    """The rejection band [low, high] (rs_level != none)."""
    cap: float
    """The importance-weight cap C."""
    veto_below: float | None
    """Reject a sequence with any r_t below this; None: off."""
    batch_normalize: bool
    """Divide the weights by their mean over the kept units of the step."""
    per_sequence: bool
    """The objective has one ratio per sequence (gspo, gmpo, rspo)."""

    @property
    def rejects(self) -> bool:
        """Whether any token or sequence can be rejected (the normalizers then move)."""
        return self.rs_level != "none" or self.veto_below is not None

    @property
    def weight_per_sequence(self) -> bool:
        """The importance weight is one number per sequence."""
        return self.is_level in ("sequence", "geometric")


def correction_form(mode: str, hp: CorrectionHParams, per_sequence: bool) -> CorrectionForm | None:
    """The form of `mode` (rl.rollout_correction) with knobs `hp`; None for `none`.
    ValueError for a combination that cannot work (CorrectionHParams.check_mode, or a token
    weight on a sequence-level objective)."""
    hp.check_mode(mode)
    if mode == "none":
        return None
    preset_is = "geometric" if per_sequence else "token"
    if mode == "tis":
        return CorrectionForm(preset_is, "none", (0.0, math.inf), hp.tis_cap, None, False, per_sequence)
    if mode in ("mis", "icepop"):
        is_level = preset_is if mode == "mis" else "none"
        return CorrectionForm(is_level, "token", (hp.mis_low, hp.mis_high), hp.tis_cap, None, False, per_sequence)
    if per_sequence and hp.is_level == "token":
        raise ValueError("is_level=token on a sequence-level objective (one ratio per sequence): use "
                         "is_level=sequence or geometric")
    return CorrectionForm(hp.is_level, hp.rs_level, hp.band, hp.tis_cap, hp.veto_below, hp.is_batch_normalize,
                          per_sequence)


@dataclass
class Correction:
    """What a correction decided on one batch (all detached)."""

    kept_BT: Tensor
    """[B,T] bool: response tokens that stay in the loss and its counts."""
    weight: Tensor | None
    """The importance weight before batch normalization, 0 where rejected: [B] for a
    per-sequence weight, [B,T] for a token weight; None without one (weight 1)."""
    rejected_B: Tensor
    """[B] bool: non-empty sequences with no kept token (rejected whole or token by token)."""
    vetoed_B: Tensor
    """[B] bool: non-empty sequences the veto rejected."""


@dataclass
class CorrectionCounts:
    """Additive tallies of a correction (and OPSM) over a batch: sum them over micro-batches
    and ranks (`+`, or an all-reduce of `.values`), then read the step-wide numbers."""

    values: Tensor
    """float64 [9]: tokens, sequences (non-empty), kept tokens, kept sequences, rejected
    sequences, vetoed sequences, weight sum and weight units (kept tokens or kept sequences),
    OPSM-masked sequences."""

    FIELDS = ("tokens", "sequences", "kept_tokens", "kept_sequences", "rejected_sequences", "vetoed_sequences",
              "weight_sum", "weight_units", "opsm_sequences")

    def __getattr__(self, name: str) -> Tensor:
        if name in CorrectionCounts.FIELDS:
            return self.values[CorrectionCounts.FIELDS.index(name)]
        raise AttributeError(name)

    def __add__(self, other: CorrectionCounts) -> CorrectionCounts:
        return CorrectionCounts(self.values + other.values)

    @staticmethod
    def zeros() -> CorrectionCounts:
        return CorrectionCounts(torch.zeros(len(CorrectionCounts.FIELDS), dtype=torch.float64))

    def weight_mean(self) -> Tensor:
        """The mean importance weight over the kept units (1 with none)."""
        return torch.where(self.weight_units > 0, self.weight_sum / self.weight_units.clamp(min=1), 1.0)

    def fractions(self) -> dict[str, float]:
        """The `rollout_*` and `opsm_*` fractions: rejected tokens over response tokens;
        rejected, vetoed and OPSM-masked sequences over non-empty sequences (0 with none)."""
        v = self.values.tolist()
        tokens, seqs = max(v[0], 1.0), max(v[1], 1.0)
        return {"rollout_masked_frac": (v[0] - v[2]) / tokens, "rollout_rejected_seq_frac": v[4] / seqs,
                "rollout_vetoed_frac": v[5] / seqs, "opsm_masked_frac": v[8] / seqs}


def tally(mask_BT: Tensor, correction: Correction | None, opsm_B: Tensor | None) -> CorrectionCounts:
    """A batch's additive tallies (`mask_BT`: the response mask before rejection)."""
    len_B = mask_BT.sum(1)
    kept_BT = mask_BT if correction is None else correction.kept_BT
    kept_len_B = kept_BT.sum(1)
    kept_seq_B = kept_len_B > 0
    zero = torch.zeros((), dtype=torch.float64, device=mask_BT.device)
    weight = None if correction is None else correction.weight
    if weight is None:
        w_sum, w_units = zero, zero
    elif weight.ndim == 1:
        w_sum, w_units = weight[kept_seq_B].double().sum(), kept_seq_B.double().sum()
    else:
        w_sum, w_units = weight[kept_BT].double().sum(), kept_len_B.double().sum()
    rejected = zero if correction is None else correction.rejected_B.double().sum()
    vetoed = zero if correction is None else correction.vetoed_B.double().sum()
    return CorrectionCounts(torch.stack([
        len_B.sum().double(), (len_B > 0).double().sum(), kept_len_B.sum().double(), kept_seq_B.double().sum(),
        rejected, vetoed, w_sum, w_units, zero if opsm_B is None else opsm_B.double().sum()]))


def _outside(x: Tensor, band: tuple[float, float]) -> Tensor:
    """x (a log ratio) outside [log low, log high], tested in log space: a ratio exactly on
    a bound is inside."""
    low, high = band
    below = x < math.log(low) if low > 0 else torch.zeros_like(x, dtype=torch.bool)
    above = x > math.log(high) if math.isfinite(high) else torch.zeros_like(x, dtype=torch.bool)
    return below | above


def _level_log_ratio(level: str, d_BT: Tensor, len_B: Tensor) -> Tensor:
    """[B] the sequence statistic's log: sum_t d_t (sequence) or mean_t d_t (geometric), clamped."""
    total_B = d_BT.sum(1)
    log_B = total_B if level == "sequence" else total_B / len_B.clamp(min=1)
    return log_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@torch.no_grad()
def decide_correction(form: CorrectionForm, old_BT: Tensor, rollout_BT: Tensor, mask_BT: Tensor) -> Correction:
    """Weights, kept tokens, rejected and vetoed sequences of one batch (module docstring)."""
    d_BT = masked_log_ratio(old_BT, rollout_BT, mask_BT)
    len_B = mask_BT.sum(1)
    nonempty_B = len_B > 0
    no_B = torch.zeros_like(nonempty_B)
    out_BT = torch.zeros_like(mask_BT)
    seq_out_B = no_B
    if form.rs_level == "token":
        out_BT = _outside(d_BT, form.band) & mask_BT
        if form.per_sequence:  # (one ratio per sequence: a rejected token takes its sequence with it)
            seq_out_B, out_BT = out_BT.any(1), torch.zeros_like(mask_BT)
    elif form.rs_level != "none":
        seq_out_B = _outside(_level_log_ratio(form.rs_level, d_BT, len_B), form.band) & nonempty_B
    vetoed_B = no_B
    if form.veto_below is not None:
        vetoed_B = ((d_BT < math.log(form.veto_below)) & mask_BT).any(1)
    kept_BT = mask_BT & ~out_BT & ~(seq_out_B | vetoed_B).unsqueeze(1)
    rejected_B = nonempty_B & ~kept_BT.any(1)
    weight = None
    if form.is_level == "token":
        weight = torch.where(kept_BT, torch.exp(d_BT).clamp(max=form.cap), 0.0)
    elif form.weight_per_sequence:
        w_B = torch.exp(_level_log_ratio(form.is_level, d_BT, len_B)).clamp(max=form.cap)
        weight = torch.where(rejected_B, 0.0, w_B)
    return Correction(kept_BT, weight, rejected_B, vetoed_B & nonempty_B)


@torch.no_grad()
def opsm_masked(delta: float, rollout_BT: Tensor, logp_BT: Tensor, mask_BT: Tensor, adv_B: Tensor) -> Tensor:
    """[B] bool: DeepSeek-V3.2's off-policy sequence masking. A sequence is masked when its
    advantage is negative and mean_t (rollout_t - logp_t) over its (kept) tokens, the current
    policy's `logp` detached, exceeds `delta`; decided per sequence, never per token."""
    gap_BT = masked_log_ratio(rollout_BT, logp_BT.detach(), mask_BT)
    len_B = mask_BT.sum(1)
    gap_B = gap_BT.sum(1) / len_B.clamp(min=1)
    return (adv_B < 0) & (gap_B > delta) & (len_B > 0)
