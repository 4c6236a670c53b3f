"""Routing statistics logged each step: router shift, top-k flips, sampler-learner disagreement.

Everything takes the capture's storage layout: ids `[N, L, K]` (tokens, MoE layers, top-k;
uint8 / int16 / any integer dtype) and log routing probabilities `[N, L, K]`. Tokens are
either pre-selected (`valid_N=None`: every row counts) or chosen by a bool mask `valid_N`.
Rows outside the mask may hold garbage (NaN, padding ids): they never reach a result.

Every statistic is a 0-dim detached tensor (no `.item()`, no host sync), so the trainer can
log the dict as is. With no valid token the values are the "nothing observed" ones: rates
and |delta log r| are 0, gamma statistics are 1 (gamma = 1 means "no shift"), and
`routing/num_tokens` is 0 so a reader can tell. Never NaN.

Layer index l in the names is the position among the captured MoE layers (0..L-1), not the
transformer layer number (dense leading layers are not counted).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from moe_rl.routing.shift import abs_dlogr, router_shift_from_partial

PREFIX = "routing/"


# --------------------------------------------------------------------------- validation


def _check_nlk(name: str, x: Tensor, like: tuple[int, ...] | None = None) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [N, L, K], got shape {tuple(x.shape)}")
    if like is not None and tuple(x.shape) != like:
        raise ValueError(f"{name} must have shape {like} ([N, L, K]), got {tuple(x.shape)}")


def _check_ids(name: str, ids: Tensor, like: tuple[int, ...] | None = None) -> None:
    _check_nlk(name, ids, like)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer expert ids, got dtype {ids.dtype}")


def _valid_weights(valid_N: Tensor | None, N: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(w_N float32 in {0, 1}, n_valid float32 scalar) for a bool mask or "all valid"."""
    if valid_N is None:
        return torch.ones(N, device=device), torch.tensor(float(N), device=device)
    if valid_N.dtype != torch.bool or valid_N.dim() != 1 or valid_N.shape[0] != N:
        raise ValueError(
            f"valid_N must be a bool [N] mask with N={N}, "
            f"got dtype {valid_N.dtype} shape {tuple(valid_N.shape)}"
        )
    w_N = valid_N.to(device=device, dtype=torch.float32)
    return w_N, w_N.sum()


# --------------------------------------------------------------------------- top-k sets


def topk_set_changed(ids_a_NLK: Tensor, ids_b_NLK: Tensor) -> Tensor:
    """[N, L] bool: True where the SET of top-k ids differs (the order within k is ignored).

    Two-sided membership (every id of a is in b and every id of b is in a) is exact set
    equality for any input, needs no sort (no int64 index tensor the size of the ids), and
    costs 2 K^2 compares per token-layer: K is small (2..16).
    """
    _check_ids("ids_a_NLK", ids_a_NLK)
    _check_ids("ids_b_NLK", ids_b_NLK, tuple(ids_a_NLK.shape))
    N, L, K = ids_a_NLK.shape
    same_NL = torch.ones(N, L, dtype=torch.bool, device=ids_a_NLK.device)
    for k in range(K):
        same_NL &= (ids_a_NLK[..., k : k + 1] == ids_b_NLK).any(dim=-1)
        same_NL &= (ids_b_NLK[..., k : k + 1] == ids_a_NLK).any(dim=-1)
    return ~same_NL


def topk_disagreement(
    ids_a_NLK: Tensor, ids_b_NLK: Tensor, valid_N: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Fraction of valid tokens whose top-k set differs: (per layer [L], in >= 1 layer []).

    The one implementation behind the top-k flip rate (old vs new learner ids) and the
    sampler-learner disagreement (sampler vs learner ids), here and in `moe_rl.diagnostics`.
    """
    changed_NL = topk_set_changed(ids_a_NLK, ids_b_NLK)
    w_N, n = _valid_weights(valid_N, changed_NL.shape[0], changed_NL.device)
    per_layer_L = (changed_NL.float() * w_N[:, None]).sum(0) / n.clamp_min(1)
    any_ = (changed_NL.any(dim=1).float() * w_N).sum() / n.clamp_min(1)
    return per_layer_L, any_


# --------------------------------------------------------------------------- router shift


def dlogr_per_layer(
    old_logp_NLK: Tensor, new_logp_NLK: Tensor, valid_N: Tensor | None = None
) -> Tensor:
    """[L] mean over valid tokens and the K old experts of |log r_new - log r_old|."""
    _check_nlk("old_logp_NLK", old_logp_NLK)
    _check_nlk("new_logp_NLK", new_logp_NLK, tuple(old_logp_NLK.shape))
    a_NL = abs_dlogr(old_logp_NLK, new_logp_NLK).mean(dim=2)
    w_N, n = _valid_weights(valid_N, a_NL.shape[0], a_NL.device)
    a_NL = torch.where(w_N[:, None] > 0, a_NL, 0.0)  # garbage rows may be NaN
    return a_NL.sum(0) / n.clamp_min(1)


def _masked_quantile(x_N: Tensor, w_N: Tensor, n: Tensor, q: float) -> Tensor:
    """Linear-interpolated q-quantile of the valid entries (torch.quantile's rule), no sync.

    Invalid entries are pushed to +inf so the n valid ones sort first; torch.quantile is
    avoided because it refuses inputs above 2^24 elements.
    """
    xs = torch.where(w_N > 0, x_N, torch.inf).sort().values
    pos = q * (n - 1).clamp_min(0)
    lo, hi = pos.floor().long().view(1), pos.ceil().long().view(1)
    x_lo, x_hi = xs.gather(0, lo), xs.gather(0, hi)
    return (x_lo + (x_hi - x_lo) * (pos - lo)).squeeze(0)


def gamma_stats(
    gamma_N: Tensor, valid_N: Tensor | None = None, gamma_min: float | None = None
) -> dict[str, Tensor]:
    """mean / min / p05 of gamma and the fraction below 0.5 (and at the floor, if given).

    Pass the UNFLOORED gamma (`router_shift_from_partial(..., gamma_min=0.0)`) to see the
    router's real drift; `frac_gamma_floored` then says how often `gamma_min` bites.
    `routing/gamma_min` is the batch minimum of gamma, not the hyperparameter.
    """
    if gamma_N.dim() != 1:
        raise ValueError(f"gamma_N must be 1-D [N], got shape {tuple(gamma_N.shape)}")
    g_N = gamma_N.detach().float()
    w_N, n = _valid_weights(valid_N, g_N.shape[0], g_N.device)
    one = torch.ones((), device=g_N.device)
    if g_N.numel() == 0:  # static emptiness: nothing to sort or reduce
        g_N, w_N = one.view(1), torch.zeros(1, device=g_N.device)
    has, denom = n > 0, n.clamp_min(1)
    valid_N = w_N > 0
    out = {
        f"{PREFIX}gamma_mean": torch.where(has, torch.where(valid_N, g_N, 0.0).sum() / denom, one),
        f"{PREFIX}gamma_min": torch.where(has, torch.where(valid_N, g_N, torch.inf).amin(), one),
        f"{PREFIX}gamma_p05": torch.where(has, _masked_quantile(g_N, w_N, n, 0.05), one),
        f"{PREFIX}frac_gamma_below_0.5": ((g_N < 0.5).float() * w_N).sum() / denom,
    }
    if gamma_min is not None:
        out[f"{PREFIX}frac_gamma_floored"] = ((g_N < gamma_min).float() * w_N).sum() / denom
    return out


# --------------------------------------------------------------------------- all at once


def _layer_dict(name: str, values_L: Tensor) -> dict[str, Tensor]:
    return {f"{PREFIX}{name}_layer{i}": values_L[i] for i in range(values_L.shape[0])}


def _resolve_pairs(
    old_logp_NLK: Tensor | None,
    new_logp_NLK: Tensor | None,
    old_ids_NLK: Tensor | None,
    new_ids_NLK: Tensor | None,
    sampler_ids_NLK: Tensor | None,
    learner_ids_NLK: Tensor | None,
) -> Tensor | None:
    """Refuse a pair given half-way; return the learner ids to compare the sampler with."""
    if (old_logp_NLK is None) != (new_logp_NLK is None):
        raise ValueError("old_logp_NLK and new_logp_NLK must be given together")
    if (old_ids_NLK is None) != (new_ids_NLK is None):
        raise ValueError("old_ids_NLK and new_ids_NLK must be given together")
    if learner_ids_NLK is None:
        learner_ids_NLK = old_ids_NLK
    if sampler_ids_NLK is not None and learner_ids_NLK is None:
        raise ValueError("sampler_ids_NLK needs learner_ids_NLK (or old_ids_NLK) to compare with")
    return learner_ids_NLK


def _same_tokens_and_layers(
    named: list[tuple[str, Tensor | None]],
) -> tuple[int, int, torch.device]:
    """(N, L, device) shared by every given `[N, L, K]` input (K may differ: ids vs log r)."""
    given = [(nm, x) for nm, x in named if x is not None]
    if not given:
        raise ValueError("routing_stats needs at least one pair of inputs")
    ref_name, ref = given[0]
    _check_nlk(ref_name, ref)
    for nm, x in given[1:]:
        _check_nlk(nm, x)
        if x.shape[:2] != ref.shape[:2]:
            raise ValueError(
                f"{nm} must have the same [N, L] as {ref_name} {tuple(ref.shape[:2])}, "
                f"got {tuple(x.shape[:2])}"
            )
    N, L = ref.shape[:2]
    if L == 0:
        raise ValueError(f"{ref_name} needs at least one MoE layer, got shape {tuple(ref.shape)}")
    return N, L, ref.device


def _shift_stats(
    old_logp_NLK: Tensor, new_logp_NLK: Tensor, valid_N: Tensor | None, gamma_min: float | None
) -> dict[str, Tensor]:
    """gamma statistics and per-layer |delta log r| of the old top-k experts."""
    _check_nlk("new_logp_NLK", new_logp_NLK, tuple(old_logp_NLK.shape))
    _, L, K = old_logp_NLK.shape
    if K == 0:
        raise ValueError(f"old_logp_NLK needs K >= 1, got {tuple(old_logp_NLK.shape)}")
    a_NLK = abs_dlogr(old_logp_NLK, new_logp_NLK)
    # gamma from the same formula RSPO uses; unfloored so the statistics show real drift
    gamma_N = router_shift_from_partial(a_NLK.sum(dim=(1, 2)), L, K, gamma_min=0.0)
    out = gamma_stats(gamma_N, valid_N, gamma_min)
    dlogr_L = dlogr_per_layer(old_logp_NLK, new_logp_NLK, valid_N)
    out |= _layer_dict("dlogr", dlogr_L)
    out[f"{PREFIX}dlogr_mean"] = dlogr_L.mean()
    return out


def _topk_set_stats(
    name: str,
    any_name: str,
    ids_a_NLK: Tensor,
    ids_b_NLK: Tensor,
    valid_N: Tensor | None,
    *,
    mean: bool,
) -> dict[str, Tensor]:
    """`{name}_layer{l}` (+ `{name}_mean` when `mean`) and `any_name`: top-k sets that differ."""
    per_layer_L, any_ = topk_disagreement(ids_a_NLK, ids_b_NLK, valid_N)
    out = _layer_dict(name, per_layer_L)
    if mean:
        out[f"{PREFIX}{name}_mean"] = per_layer_L.mean()
    out[f"{PREFIX}{any_name}"] = any_
    return out


def routing_stats(
    old_logp_NLK: Tensor | None = None,
    new_logp_NLK: Tensor | None = None,
    *,
    old_ids_NLK: Tensor | None = None,
    new_ids_NLK: Tensor | None = None,
    sampler_ids_NLK: Tensor | None = None,
    learner_ids_NLK: Tensor | None = None,
    valid_N: Tensor | None = None,
    gamma_min: float | None = None,
) -> dict[str, Tensor]:
    """The per-step routing statistics as a flat dict of 0-dim tensors for TensorBoard.

    Each group is computed when its inputs are given (a pair given half-way is an error):
      old_logp_NLK + new_logp_NLK (log r at the OLD top-k ids, old and current router):
        routing/gamma_mean, gamma_min (batch minimum), gamma_p05, frac_gamma_below_0.5,
        frac_gamma_floored (only with `gamma_min`), dlogr_layer{l}, dlogr_mean.
        Gamma here is unfloored (see `gamma_stats`).
      old_ids_NLK + new_ids_NLK (top-k ids of the old and current router):
        routing/flip_rate_layer{l}, flip_rate_mean, flip_any (set changed in >= 1 layer).
      sampler_ids_NLK (+ learner_ids_NLK, default old_ids_NLK; the learner's own routing,
      not a replayed one, or the comparison is trivially 0):
        routing/sampler_disagree_layer{l}, sampler_disagree_any.
    Always: routing/num_tokens (valid tokens counted).
    """
    learner_ids_NLK = _resolve_pairs(
        old_logp_NLK, new_logp_NLK, old_ids_NLK, new_ids_NLK, sampler_ids_NLK, learner_ids_NLK
    )
    N, _, device = _same_tokens_and_layers(
        [
            ("old_logp_NLK", old_logp_NLK),
            ("old_ids_NLK", old_ids_NLK),
            ("sampler_ids_NLK", sampler_ids_NLK),
            ("learner_ids_NLK", learner_ids_NLK),
        ]
    )
    _, n = _valid_weights(valid_N, N, device)
    out: dict[str, Tensor] = {f"{PREFIX}num_tokens": n}
    if old_logp_NLK is not None and new_logp_NLK is not None:
        out |= _shift_stats(old_logp_NLK, new_logp_NLK, valid_N, gamma_min)
    if old_ids_NLK is not None and new_ids_NLK is not None:
        out |= _topk_set_stats(
            "flip_rate", "flip_any", old_ids_NLK, new_ids_NLK, valid_N, mean=True
        )
    if sampler_ids_NLK is not None and learner_ids_NLK is not None:  # (_resolve_pairs refused one without)
        out |= _topk_set_stats(
            "sampler_disagree",
            "sampler_disagree_any",
            sampler_ids_NLK,
            learner_ids_NLK,
            valid_N,
            mean=False,
        )
    return out


def per_layer(stats: Mapping[str, Tensor | float], name: str) -> Tensor:
    """[L] vector back from the flat dict, e.g. `per_layer(s, "flip_rate")` (heat-map rows)."""
    prefix = f"{PREFIX}{name}_layer"
    idx = sorted(int(key[len(prefix) :]) for key in stats if key.startswith(prefix))
    if not idx or idx != list(range(len(idx))):
        raise ValueError(f"no complete '{prefix}{{l}}' series in stats (layers found: {idx})")
    return torch.stack([torch.as_tensor(stats[f"{prefix}{i}"]).float() for i in idx])
