"""Token-level advantages from a learned critic (GAE) and the critic's clipped value loss:
the math of PPO with a critic, on [B, T] response grids.

docs/objectives.md defines the GRPO family's advantages; these are the standard
definitions (GAE: Schulman et al. 2016, eqs. 11-16; the clipped value loss:
PPO as OpenAI baselines and verl implement it), which verl's PPO trainer uses with the same
conventions:

- rewards (`token_rewards`): the sequence's scalar score sits on its last response token;
  with `kl_coef > 0`, every response token also gets -kl_coef * k1, k1 = log pi_old - log
  pi_ref (the KL-in-reward penalty).
- the adaptive KL controller (`adaptive_kl_coef`, Ziegler et al. 2019, "Fine-Tuning
  Language Models from Human Preferences", section 2.2; PPO's "adaptive KL scheduler" in
  the design documents): beta <- beta (1 + clip(KL / KL_target - 1, -0.2, 0.2) B / horizon)
  after a step of B responses whose mean KL (summed k1 per response) was KL.
- GAE (`gae`): over the response tokens of a row in order (masked positions are skipped:
  the value and advantage of the next valid token pass through them),
      delta_t = r_t + gamma V_{t+1} - V_t     (V after the last token is 0)
      A_t = sum_{l >= 0} (gamma lambda)^l delta_{t+l} = delta_t + gamma lambda A_{t+1}
      returns_t = A_t + V_t
- whitening (`masked_whiten`): (A - mean) / sqrt(var + 1e-8) over the valid tokens of the
  batch (unbiased variance), optional.
- value loss (`clipped_value_loss`): 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) -
  R)^2), token-mean over the valid tokens; `vf_clipfrac` is the fraction of tokens where
  the clipped term is the larger.

The critic that supplies the values is `moe_rl.learner.critic`; `moe_rl.programs.ppo.critic_stage` puts these
together within an RL step (`rl.advantage: gae`, docs/ppo_dpo.md).
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


KL_ERROR_CLIP = 0.2
"""The adaptive controller's proportional error is clipped to [-0.2, 0.2] (Ziegler et al.)."""


def adaptive_kl_coef(coef: float, kl: float, target: float, responses: int, horizon: int) -> float:
    """The KL weight after a step of `responses` responses whose mean KL to the reference
    was `kl` (nats per response): coef * (1 + clip(kl / target - 1, -0.2, 0.2) * responses /
    horizon). Above the target the weight grows, below it shrinks, at most 0.2 B / horizon
    of itself a step."""
    error = min(max(kl / target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
    return coef * (1.0 + error * responses / horizon)


def token_rewards(score_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """[B, T] rewards: `score_B` on each row's last valid token, minus kl_coef * kl_BT on
    every valid token (`kl_BT`: k1 = log pi_old - log pi_ref). Rows without a valid token
    get nothing."""
    mask = mask_BT.to(torch.bool)
    T = mask.shape[1]
    last_B = torch.where(mask, torch.arange(T).expand_as(mask), -1).max(dim=1).values
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    rows = (last_B >= 0).nonzero().squeeze(1)
    rewards[rows, last_B[rows]] = score_B.to(torch.float64)[rows]
    if kl_coef:
        if kl_BT is None:
            raise ValueError("kl_coef > 0 needs the per-token KL (k1 = log pi_old - log pi_ref)")
        rewards = rewards - kl_coef * kl_BT.to(torch.float64) * mask
    return rewards


def gae(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] advantages, [B, T] returns) by the recursion in the module docstring, 0 at
    masked positions (fp64)."""
    mask = mask_BT.to(torch.bool)
    rewards, values = rewards_BT.to(torch.float64), values_BT.to(torch.float64)
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    next_value = torch.zeros(B, dtype=torch.float64)
    next_adv = torch.zeros(B, dtype=torch.float64)
    for t in reversed(range(T)):
        m = mask[:, t]
        a_t = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a_t, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a_t, next_adv)
    returns = torch.where(mask, adv + values, 0.0)
    return adv, returns


def unbiased_variance(n: float, s: torch.Tensor | float, ss: torch.Tensor | float) -> float:
    """Unbiased variance from a count, a sum and a sum of squares (0 below two samples)."""
    return max(float(ss - s * s / n) / (n - 1), 0.0) if n > 1 else 0.0


def whiten_by_moments(x_BT: torch.Tensor, mask_BT: torch.Tensor, n: torch.Tensor | float, s: torch.Tensor,
                      ss: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the mean and unbiased variance of a token count, sum
    and sum of squares (this batch's, or summed over every data-parallel rank's valid tokens
    for whitening over the whole step); 0 at masked positions, and everywhere below two tokens."""
    count = float(n)
    if count < 2:
        return torch.zeros_like(x_BT, dtype=torch.float64)
    mean = float(s) / count
    std = (unbiased_variance(count, float(s), float(ss)) + WHITEN_EPS) ** 0.5
    return torch.where(mask_BT.to(torch.bool), (x_BT.to(torch.float64) - mean) / std, 0.0)


def masked_whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the valid tokens (unbiased var); 0 elsewhere."""
    valid = x_BT[mask_BT.to(torch.bool)].to(torch.float64)
    return whiten_by_moments(x_BT, mask_BT, valid.numel(), valid.sum(), (valid * valid).sum())


def clipped_value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       mask_BT: torch.Tensor, clip: float, total_tokens: float | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, vf_clipfrac): the module docstring's value loss, summed over valid tokens and
    divided by `total_tokens` (the whole batch's count, so micro-batch contributions add up;
    default: this batch's). Differentiable in `values_BT`."""
    mask = mask_BT.to(values_BT.dtype)
    n = float(total_tokens) if total_tokens is not None else float(mask.sum().clamp(min=1))
    clipped = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    plain_sq, clipped_sq = (values_BT - returns_BT) ** 2, (clipped - returns_BT) ** 2
    loss = 0.5 * (torch.maximum(plain_sq, clipped_sq) * mask).sum() / n
    clipfrac = ((clipped_sq > plain_sq).to(mask.dtype) * mask).sum().detach() / n
    return loss, clipfrac


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the valid tokens (nan when Var(returns) = 0)."""
    mask = mask_BT.to(torch.bool)
    ret, val = returns_BT[mask].to(torch.float64), values_BT[mask].to(torch.float64)
    var = ret.var() if ret.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    return float("nan") if var == 0 else float(1 - (ret - val).var() / var)
