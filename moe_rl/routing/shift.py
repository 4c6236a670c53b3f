"""Router shift gamma (RSPO): how far the router moved for the experts a token used.

For token n, MoE layer l and the K experts e_lk chosen by the OLD router (in the
old-logprob pass), with r the router's score distribution before top-k:

    gamma_n = max(exp(-(1/L) sum_l (1/K) sum_k |log r_new(e_lk) - log r_old(e_lk)|), gamma_min)

detached: gamma is a sample weight, never a path for gradient into the router (RSPO, docs/objectives.md).

Gamma is a product over layers of per-layer factors, so the exponent is a plain sum of
|delta log r|. Under pipeline parallelism each stage owns some MoE layers: it computes
`router_shift_partial` over its own layers, the stages all-reduce (sum) that [N] vector, and
`router_shift_from_partial` with the GLOBAL layer count turns it into gamma. `router_shift`
is the single-stage case of exactly that composition, so there is one formula.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_gamma_min(gamma_min: float) -> None:
    if not 0.0 <= gamma_min <= 1.0:
        raise ValueError(f"gamma_min must lie in [0, 1] (gamma is in (0, 1]), got {gamma_min}")


def _check_lnk_pair(old_logp_LNK: Tensor, new_logp_LNK: Tensor) -> None:
    if old_logp_LNK.dim() != 3:
        raise ValueError(
            f"old_logp_LNK must be 3-D [L, N, K], got shape {tuple(old_logp_LNK.shape)}"
        )
    if new_logp_LNK.shape != old_logp_LNK.shape:
        raise ValueError(
            f"new_logp_LNK must have old_logp_LNK's shape {tuple(old_logp_LNK.shape)} "
            f"([L, N, K]), got {tuple(new_logp_LNK.shape)}"
        )
    if not (old_logp_LNK.is_floating_point() and new_logp_LNK.is_floating_point()):
        raise ValueError(
            "old_logp_LNK and new_logp_LNK must be floating point log routing probabilities, "
            f"got {old_logp_LNK.dtype} and {new_logp_LNK.dtype}"
        )


def abs_dlogr(old_logp: Tensor, new_logp: Tensor) -> Tensor:
    """|log r_new - log r_old| elementwise, detached, in at least float32 (any layout).

    Router log-probs often arrive in bf16; the sums over L*K terms want float32.
    """
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    return (new_logp.detach().to(dtype) - old_logp.detach().to(dtype)).abs()


def router_shift_partial(old_logp_LNK: Tensor, new_logp_LNK: Tensor) -> Tensor:
    """Per-token sum over this stage's layers and the K old experts of |delta log r|: [N].

    Sum these vectors over pipeline stages, then call `router_shift_from_partial`.
    """
    _check_lnk_pair(old_logp_LNK, new_logp_LNK)
    return abs_dlogr(old_logp_LNK, new_logp_LNK).sum(dim=(0, 2))


def router_shift_from_partial(
    sum_abs_N: Tensor, num_layers: int, k: int, gamma_min: float
) -> Tensor:
    """gamma [N] from the summed |delta log r| over ALL `num_layers` MoE layers and `k` experts.

    `num_layers` is the global MoE layer count (not one pipeline stage's share).
    """
    if sum_abs_N.dim() != 1:
        raise ValueError(f"sum_abs_N must be 1-D [N], got shape {tuple(sum_abs_N.shape)}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    _check_gamma_min(gamma_min)
    mean_abs_N = sum_abs_N.detach() / (num_layers * k)
    return torch.exp(-mean_abs_N).clamp_min(gamma_min)


def router_shift(old_logp_LNK: Tensor, new_logp_LNK: Tensor, gamma_min: float) -> Tensor:
    """RSPO's gamma [N] = max(exp(-mean_l mean_k |new - old|), gamma_min), detached.

    old_logp_LNK, new_logp_LNK: [L, N, K] log routing probability of the K experts chosen
    by the OLD router, under the old and the current router (L MoE layers, N tokens).
    Inputs are expected finite (router log-softmax is); a NaN input gives a NaN gamma.
    """
    _check_gamma_min(gamma_min)
    _check_lnk_pair(old_logp_LNK, new_logp_LNK)
    L, _, K = old_logp_LNK.shape
    if L == 0 or K == 0:
        raise ValueError(
            f"old_logp_LNK needs L >= 1 layers and K >= 1 experts, got {tuple(old_logp_LNK.shape)}"
        )
    sum_abs_N = router_shift_partial(old_logp_LNK, new_logp_LNK)
    return router_shift_from_partial(sum_abs_N, L, K, gamma_min)
