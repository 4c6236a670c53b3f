"""An independent computation of the policy loss under a rollout correction and OPSM, written
from the formulas (docs/rollout_correction.md) one sequence and one token at a time, with
none of `moe_rl.objectives`' code: loops over Python floats for the decisions, autograd
through scalar torch expressions for the gradient. Slow and plain on purpose.

Objectives covered: grpo, dapo, dr_grpo (token ratios) and gspo (a sequence ratio).
"""

from __future__ import annotations

import math

import torch

CLIP = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


def _clamp(x: float) -> float:
    return min(max(x, -20.0), 20.0)


def _outside(value: float, low: float, high: float) -> bool:
    """A ratio outside [low, high], compared in log space (a ratio on a bound is inside)."""
    lv = math.log(value) if value > 0 else -math.inf
    return lv < (math.log(low) if low > 0 else -math.inf) or lv > math.log(high)


def decide(name: str, old, rollout, mask, *, is_level="none", rs_level="none", rs_low=None, rs_high=None,
           veto_below=None, cap=2.0):
    """Per sequence: (kept token flags, the importance weight per token, vetoed?)."""
    per_sequence = name == "gspo"
    B, T = mask.shape
    low = rs_low if rs_low is not None else (1.0 / rs_high if rs_high else 0.0)
    kept, weights, vetoed = [], [], []
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t]]
        d = {t: _clamp(float(old[i, t]) - float(rollout[i, t])) for t in valid}
        seq_sum, seq_mean = _clamp(sum(d.values())), _clamp(sum(d.values()) / max(len(valid), 1))
        stat = {"sequence": math.exp(seq_sum), "geometric": math.exp(seq_mean)}
        token_out = {t: rs_level == "token" and _outside(math.exp(d[t]), low, rs_high) for t in valid}
        seq_out = rs_level in stat and bool(valid) and _outside(stat[rs_level], low, rs_high)
        if per_sequence and any(token_out.values()):
            seq_out = True
        veto = veto_below is not None and any(math.exp(d[t]) < veto_below for t in valid)
        keep = {t: not (seq_out or veto or (token_out[t] and not per_sequence)) for t in valid}
        w = {t: (min(math.exp(d[t]), cap) if is_level == "token" else
                 min(stat[is_level], cap) if is_level in stat else 1.0) for t in valid}
        kept.append([t for t in valid if keep[t]])
        weights.append(w)
        vetoed.append(veto)
    return kept, weights, vetoed


def reference_loss(name: str, logp: torch.Tensor, old, rollout, adv, mask, *, opsm_delta=None,
                   batch_normalize=False, max_response_length=None, **form) -> torch.Tensor:
    """The loss (negative objective) of `name` on the batch under the correction `form`
    (decide's keywords) and OPSM; differentiable in `logp` (a [B,T] float64 leaf)."""
    kept, weights, _ = decide(name, old, rollout, mask, **form)
    B, T = mask.shape
    if batch_normalize and form.get("is_level", "none") != "none":
        if form["is_level"] == "token":
            units = [weights[i][t] for i in range(B) for t in kept[i]]
        else:
            units = [weights[i][kept[i][0]] for i in range(B) if kept[i]]
        mean = sum(units) / len(units) if units else 1.0
        weights = [{t: w / mean for t, w in row.items()} for row in weights]
    lo, hi = CLIP[name]
    terms, n_tokens = [], sum(len(k) for k in kept)
    n_seqs = sum(1 for k in kept if k)
    for i in range(B):
        if not kept[i]:
            continue
        a = float(adv[i])
        lr = {t: (logp[i, t] - float(old[i, t])).clamp(-20, 20) for t in kept[i]}
        if opsm_delta is not None:
            gap = sum(float(rollout[i, t]) - float(logp[i, t]) for t in kept[i]) / len(kept[i])
            if a < 0 and gap > opsm_delta:
                continue  # masked out of the objective; its tokens stay in the counts above
        if name == "gspo":
            s = torch.exp(sum(lr.values()) / len(kept[i]))
            u = torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a)
            terms.append(weights[i][kept[i][0]] * u / n_seqs)
            continue
        for t in kept[i]:
            rho = torch.exp(lr[t])
            u = torch.minimum(rho * a, rho.clamp(1 - lo, 1 + hi) * a) * weights[i][t]
            if name == "grpo":
                terms.append(u / (len(kept[i]) * n_seqs))
            elif name == "dapo":
                terms.append(u / n_tokens)
            else:  # dr_grpo: every sequence, empty ones included, and the constant L_max
                terms.append(u / (B * (max_response_length or T)))
    return -sum(terms) if terms else logp.sum() * 0.0
