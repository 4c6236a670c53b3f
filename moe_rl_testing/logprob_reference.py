"""The plain full-logits computation that chunked log-probs must reproduce: one [N, V] tensor,
log_softmax, gather, entropy; autograd does the backward."""

from __future__ import annotations

import torch


def full_token_logprobs(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(target) [N], entropy [N]) from the whole vocabulary's logits."""
    logp_NV = torch.log_softmax(hidden_NH @ weight_VH.t() / temperature, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(1, targets_N[:, None]).squeeze(1), entropy_N


def logprob_case(n: int, h: int, v: int, seed: int, dtype: torch.dtype = torch.float64,
                 scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random hidden states, output weight, targets and upstream gradients for both outputs."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_NH": (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype),
        "weight_VH": torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype),
        "targets_N": torch.randint(0, v, (n,), generator=g),
        "g_logp_N": torch.randn(n, generator=g, dtype=torch.float64).to(dtype),
        "g_entropy_N": torch.randn(n, generator=g, dtype=torch.float64).to(dtype),
    }


def values_and_grads(fn, case: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """logp, entropy and d(g_logp . logp + g_H . H)/d(hidden, weight) of `fn` on `case`."""
    h = case["hidden_NH"].clone().requires_grad_(True)
    w = case["weight_VH"].clone().requires_grad_(True)
    logp_N, entropy_N = fn(h, w, case["targets_N"], **kwargs)
    grad_h, grad_w = torch.autograd.grad(
        (logp_N, entropy_N), (h, w), (case["g_logp_N"].to(logp_N.dtype), case["g_entropy_N"].to(logp_N.dtype)),
    )
    return {"logp": logp_N.detach(), "entropy": entropy_N.detach(), "grad_h": grad_h, "grad_w": grad_w}
