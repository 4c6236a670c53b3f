"""The reward model's Bradley-Terry loss over a pair's compared slots, its closed-form
gradient with respect to the scores, and the statistics a run logs.

A batch holds P pairs as 2P rows (`moe_rl.programs.preference.data.encode_pairs`: chosen rows 0..P-1,
rejected rows P..2P-1). The value model scores every response token's slot t: r_t is the
score of the prefix before response token t, so the last slot (t = L-1, before EOS) scores
the whole answer. Pair p compares n_p slot pairs (c_k, r_k) (`compared_slots`), and

    L = (1/P) sum_p (1/n_p) sum_k -log sigmoid(z_pk),   z_pk = r^chosen_{c_k} - r^rejected_{r_k}
    dL/dr^chosen_{c_k} = -sigmoid(-z_pk) / (P n_p),      dL/dr^rejected_{r_k} = +sigmoid(-z_pk) / (P n_p)

The learner trains on the row-local surrogate sum_rows sum_t coef_t r_t with those
derivatives held fixed (`score_coefficients`): its gradient is the pair loss's, whichever
micro-batch, pipeline pass or data-parallel rank a pair's two rows land on (the argument of
`moe_rl.programs.dpo.surrogate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.batch import TokenBatch

if TYPE_CHECKING:  # (the learner package imports megatron-core)
    from moe_rl.learner import MicroBatch, MicroBatchLoss

COEF_KEY = "rm_coef_BT"
"""`StepBatch.extras` key of the [B, T] surrogate coefficients."""


def compared_slots(tokens: TokenBatch, compare: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([P, T] chosen, [P, T] rejected) bool masks of the slots each pair compares, the same
    count per pair, in matching order. `last`: each response's last slot. `divergence`: the
    slots t = d+1 .. min(L_c, L_r) - 1 of both (d: the first response token where they
    differ), whose prefixes hold the difference; `last` where that range is empty."""
    if compare not in ("divergence", "last"):
        raise ValueError(f"compare={compare!r}; valid: divergence, last")
    P, T = tokens.batch_size // 2, tokens.response_width
    chosen, rejected = torch.zeros(P, T, dtype=torch.bool), torch.zeros(P, T, dtype=torch.bool)
    lens = tokens.response_lens_B.tolist()
    for p in range(P):
        lc, lr = lens[p], lens[P + p]
        if compare == "divergence":
            a, b = _response(tokens, p), _response(tokens, P + p)
            n = min(lc, lr)
            d = next((k for k in range(n) if a[k] != b[k]), n)
            if d + 1 <= n - 1:
                chosen[p, d + 1:n] = rejected[p, d + 1:n] = True
                continue
        chosen[p, lc - 1] = rejected[p, lr - 1] = True
    return chosen, rejected


def _response(tokens: TokenBatch, row: int) -> list[int]:
    """The response token ids of `row`."""
    start = int(tokens.prompt_lens_B[row])
    return tokens.tokens_BS[row, start:start + int(tokens.response_lens_B[row])].tolist()


def pair_differences(scores_BT: torch.Tensor, chosen_PT: torch.Tensor, rejected_PT: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """([K] z = chosen score - rejected score at every compared slot pair, [K] its pair's index)."""
    P = chosen_PT.shape[0]
    s = scores_BT.double()
    z = s[:P][chosen_PT] - s[P:][rejected_PT]
    pair_K = chosen_PT.nonzero()[:, 0]
    return z, pair_K


def pair_loss(scores_BT: torch.Tensor, chosen_PT: torch.Tensor, rejected_PT: torch.Tensor) -> torch.Tensor:
    """The module docstring's L (fp64; differentiable in `scores_BT`)."""
    z, pair_K = pair_differences(scores_BT, chosen_PT, rejected_PT)
    P = chosen_PT.shape[0]
    n_K = chosen_PT.sum(-1).double()[pair_K]
    return (torch.nn.functional.softplus(-z) / n_K).sum() / max(P, 1)


def score_coefficients(scores_BT: torch.Tensor, chosen_PT: torch.Tensor, rejected_PT: torch.Tensor) -> torch.Tensor:
    """[2P, T] fp64 dL/dr at every slot (0 where a slot is not compared): the surrogate's
    coefficients."""
    z, pair_K = pair_differences(scores_BT, chosen_PT, rejected_PT)
    P = chosen_PT.shape[0]
    g_K = -torch.sigmoid(-z) / (chosen_PT.sum(-1).double()[pair_K] * max(P, 1))
    coef = torch.zeros(scores_BT.shape, dtype=torch.float64)
    coef[:P][chosen_PT] = g_K
    coef[P:][rejected_PT] = -g_K
    return coef


def score_surrogate_loss(scores_BT: torch.Tensor, mb: MicroBatch) -> MicroBatchLoss:
    """Loss callback: this micro-batch's sum over rows and slots of coef * score."""
    from moe_rl.learner import MicroBatchLoss

    coef_BT = mb.extras[COEF_KEY].to(device=scores_BT.device, dtype=scores_BT.dtype)
    mask_BT = mb.batch.response_mask().to(scores_BT.device)
    return MicroBatchLoss((coef_BT * scores_BT * mask_BT).sum(), {}, weight=float(mb.batch.response_lens_B.sum()))


def score_pair_metrics(scores_BT: torch.Tensor, tokens: TokenBatch, chosen_PT: torch.Tensor,
                 rejected_PT: torch.Tensor) -> dict[str, float]:
    """The loss; each response's score at its last slot (`rewards/chosen`, `rewards/rejected`,
    their mean difference `rewards/margins`, the fraction of pairs whose chosen one is
    strictly higher `rewards/accuracies`); the fraction of compared slot pairs ordered right
    (`rewards/slot_accuracies`)."""
    P = tokens.batch_size // 2
    last_B = (tokens.response_lens_B - 1).clamp(min=0)
    final_B = scores_BT.double().gather(1, last_B.unsqueeze(1)).squeeze(1)
    chosen, rejected = final_B[:P], final_B[P:]
    z, _ = pair_differences(scores_BT, chosen_PT, rejected_PT)
    return {"loss": float(pair_loss(scores_BT, chosen_PT, rejected_PT)),
            "rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean()),
            "rewards/margins": float((chosen - rejected).mean()),
            "rewards/accuracies": float((chosen > rejected).double().mean()),
            "rewards/slot_accuracies": float((z > 0).double().mean()) if z.numel() else float("nan")}
