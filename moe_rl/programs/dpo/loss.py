"""DPO's pair losses on sequence log-probs, their gradients, and the statistics TRL logs.

For a pair (chosen y_w, rejected y_l) of the same prompt, with sequence log-probs summed over
response tokens, pi_w = log pi(y_w|x), ref_w = log pi_ref(y_w|x) (likewise for y_l), the
log-ratio margin is

    h = (pi_w - ref_w) - (pi_l - ref_l)

and the losses (`dpo.loss`):

    sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
             (DPO, Rafailov et al. 2023, eq. 7; eps = label_smoothing: conservative DPO)
    ipo      (h - 1/(2 beta))^2          (IPO, Azar et al. 2023, eq. 17)

averaged over the pairs: the papers' definitions, which TRL's DPOProgram implements with the same names (TRL's `ipo`
averages log-probs over tokens; here both losses take the summed log-probs). Both losses depend on the policy only through h, so the gradient of a pair's loss is
dL/dh * (grad pi_w - grad pi_l): `margin_grad` is dL/dh in closed form, which is what lets
the learner train on any layout with a per-row linear surrogate (`moe_rl.programs.dpo.surrogate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogps:
    """Sequence log-probs of P preference pairs ([P] each, fp64 or fp32)."""

    chosen: torch.Tensor
    """log pi(y_w | x) under the policy."""
    rejected: torch.Tensor
    """log pi(y_l | x) under the policy."""
    ref_chosen: torch.Tensor
    """log pi_ref(y_w | x) under the frozen reference."""
    ref_rejected: torch.Tensor
    """log pi_ref(y_l | x) under the frozen reference."""

    def margin(self) -> torch.Tensor:
        """[P] h = (pi_w - ref_w) - (pi_l - ref_l)."""
        return (self.chosen - self.ref_chosen) - (self.rejected - self.ref_rejected)


def pair_losses(h_P: torch.Tensor, beta: float, loss: str, label_smoothing: float = 0.0) -> torch.Tensor:
    """[P] per-pair loss of the margins `h_P` (module docstring); differentiable."""
    if loss == "sigmoid":
        z = beta * h_P
        return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    if loss == "ipo":
        return (h_P - 1 / (2 * beta)) ** 2
    raise ValueError(f"dpo.loss={loss!r}; valid: sigmoid, ipo")


def margin_grad(h_P: torch.Tensor, beta: float, loss: str, label_smoothing: float = 0.0) -> torch.Tensor:
    """[P] dL_p/dh_p in closed form: sigmoid: beta (-(1-eps) sigmoid(-beta h) + eps sigmoid(beta h));
    ipo: 2 (h - 1/(2 beta))."""
    if loss == "sigmoid":
        z = beta * h_P
        return beta * (-(1 - label_smoothing) * torch.sigmoid(-z) + label_smoothing * torch.sigmoid(z))
    if loss == "ipo":
        return 2 * (h_P - 1 / (2 * beta))
    raise ValueError(f"dpo.loss={loss!r}; valid: sigmoid, ipo")


def pair_metrics(logps: PairLogps, beta: float, loss: str, label_smoothing: float = 0.0) -> dict[str, float]:
    """The mean loss and TRL's statistics over the pairs: implicit rewards
    beta (pi - ref) of chosen and rejected, their margin, the fraction of pairs whose chosen
    reward is strictly higher (`rewards/accuracies`), and the policy's sequence log-probs."""
    h = logps.margin()
    chosen_reward = beta * (logps.chosen - logps.ref_chosen)
    rejected_reward = beta * (logps.rejected - logps.ref_rejected)
    return {
        "loss": float(pair_losses(h, beta, loss, label_smoothing).mean()),
        "rewards/chosen": float(chosen_reward.mean()),
        "rewards/rejected": float(rejected_reward.mean()),
        "rewards/accuracies": float((chosen_reward > rejected_reward).double().mean()),
        "rewards/margins": float((chosen_reward - rejected_reward).mean()),
        "logps/chosen": float(logps.chosen.mean()),
        "logps/rejected": float(logps.rejected.mean()),
    }
