"""The tensor contract of every policy loss: what goes in (`PolicyBatch`), what comes out
(`LossOutput`), and how per-micro-batch metrics are combined (`combine_metrics`).

Shapes: B sequences, T response positions, right-padded; `response_mask` says which
positions are real. Values at padded positions are never read (they may be garbage,
inf or NaN): every objective selects with `torch.where` before any arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moe_rl.runtime.metrics import reduction

if TYPE_CHECKING:
    from moe_rl.objectives.correction import CorrectionCounts


@dataclass
class PolicyBatch:
    """One (micro-)batch of scored responses. Validated on construction: a wrong shape,
    dtype or device raises ValueError naming the field."""

    logprobs: Tensor
    """[B,T] log-probabilities of the sampled tokens under the current policy; carries grad."""
    old_logprobs: Tensor
    """[B,T] the behaviour policy's log-probabilities as the learner recomputed them (detached)."""
    advantages: Tensor
    """[B] per-sequence or [B,T] per-token advantages (detached). Sequence-level objectives
    (gspo, gmpo, rspo) need [B]."""
    response_mask: Tensor
    """[B,T] bool, True on response tokens that count."""
    rollout_logprobs: Tensor | None = None
    """[B,T] the sampler's log-probabilities (for rollout_correction tis / mis / icepop)."""
    ref_logprobs: Tensor | None = None
    """[B,T] reference-policy log-probabilities (for the KL penalty and the kl_ref metric)."""
    router_shift: Tensor | None = None
    """[B,T] RSPO router-shift weight gamma in (0, 1], detached (moe_rl.routing.router_shift)."""

    def __post_init__(self) -> None:
        lp = self.logprobs
        if not isinstance(lp, Tensor) or lp.ndim != 2:
            raise ValueError(f"PolicyBatch.logprobs: expected a [B,T] tensor, got {_describe(lp)}")
        if not lp.is_floating_point():
            raise ValueError(f"PolicyBatch.logprobs: expected a floating dtype, got {lp.dtype}")
        shape = tuple(lp.shape)
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "router_shift"):
            x = getattr(self, name)
            if x is None and name != "old_logprobs":
                continue
            _check_float(name, x, shape, lp.device)
        adv = self.advantages
        if not isinstance(adv, Tensor) or tuple(adv.shape) not in (shape[:1], shape):
            raise ValueError(
                f"PolicyBatch.advantages: expected shape [B]={list(shape[:1])} or "
                f"[B,T]={list(shape)}, got {_describe(adv)}"
            )
        if not adv.is_floating_point() or adv.device != lp.device:
            raise ValueError(
                f"PolicyBatch.advantages: expected a floating tensor on {lp.device}, "
                f"got {adv.dtype} on {adv.device}"
            )
        m = self.response_mask
        if not isinstance(m, Tensor) or tuple(m.shape) != shape:
            raise ValueError(
                f"PolicyBatch.response_mask: expected shape {list(shape)} (like logprobs), "
                f"got {_describe(m)}"
            )
        if m.dtype != torch.bool or m.device != lp.device:
            raise ValueError(
                f"PolicyBatch.response_mask: expected a bool tensor on {lp.device}, "
                f"got {m.dtype} on {m.device}"
            )


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"shape {list(x.shape)}"
    return type(x).__name__


def _check_float(name: str, x: object, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(x, Tensor) or tuple(x.shape) != shape:
        raise ValueError(
            f"PolicyBatch.{name}: expected shape {list(shape)} (like logprobs), got {_describe(x)}"
        )
    if not x.is_floating_point() or x.device != device:
        raise ValueError(
            f"PolicyBatch.{name}: expected a floating tensor on {device}, got {x.dtype} on {x.device}"
        )


@dataclass
class LossOutput:
    """What `policy_loss` returns.

    `metrics` are detached 0-d tensors (no host sync). Names ending in `_max` / `_min` reduce
    across micro-batches and ranks by max / min; every other metric is a mean over the
    objective's units (valid tokens for token-level objectives, non-empty sequences for
    sequence-level ones), to be combined weighted by `num_tokens` or `num_sequences`
    (`combine_metrics` does exactly that). On a batch with no unit, means are 0 and
    `_max` / `_min` are -inf / +inf: the identities of their reductions.
    """

    loss: Tensor
    """0-d loss to minimise (the negative objective plus the KL penalty); fp32 for bf16 inputs."""
    metrics: dict[str, Tensor]
    """Detached 0-d diagnostics (clip_frac, ratio_*, approx_kl, ...), see docs/objectives.md."""
    num_tokens: Tensor
    """0-d count of valid response tokens in this (micro-)batch (kept ones: a token the
    rollout correction rejects is not valid)."""
    num_sequences: Tensor
    """0-d count of non-empty sequences in this (micro-)batch (B')."""
    counts: CorrectionCounts | None = None
    """Additive tallies of the rollout correction and OPSM (None without either): sum them
    over micro-batches and ranks for the step's kept counts and `fractions()`."""


def combine_metrics(outputs: Sequence[LossOutput], level: str) -> dict[str, Tensor]:
    """Combine the metrics of micro-batches (or gathered ranks) by the naming convention:
    `_max` -> max, `_min` -> min, anything else -> mean weighted by the units of `level`
    ("token": num_tokens, "sequence": num_sequences)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if not outputs:
        return {}
    weights = torch.stack(
        [(o.num_tokens if level == "token" else o.num_sequences).float() for o in outputs]
    )
    total = weights.sum().clamp(min=1.0)
    combined: dict[str, Tensor] = {}
    for key in outputs[0].metrics:
        values = torch.stack([o.metrics[key].float() for o in outputs])
        kind = reduction(key)
        if kind == "max":
            combined[key] = values.max()
        elif kind == "min":
            combined[key] = values.min()
        else:
            combined[key] = (values * weights).sum() / total
    return combined
