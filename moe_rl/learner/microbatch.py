"""What the learner's schedule hands around per micro-batch, and the hooks around it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_rl.batch import TokenBatch
from moe_rl.routing.record import RoutingRecord

FP8_TOKEN_MULTIPLE = 16
"""Transformer Engine's fp8 GEMMs want the token dimension divisible by 16 (8 for some
shapes; 16 covers both)."""


def padded_seq_len(seq_len: int, tp: int, fp8: bool) -> int:
    """The sequence length a micro-batch is padded to: a multiple of the TP size (sequence
    parallel splits S evenly over TP ranks) and, under fp8, of 16 * TP, so that every TP
    rank's token count is a multiple of 16 for any micro-batch size. Padding is masked out
    of the loss; it costs compute only."""
    multiple = tp * (FP8_TOKEN_MULTIPLE if fp8 else 1)
    return -(-max(seq_len, 1) // multiple) * multiple


@dataclass(frozen=True)
class BatchTotals:
    """Counts of the whole batch a learner pass runs on (the same on every rank and in every
    micro-batch): the global normalisers that make micro-batch loss contributions sum to
    the whole-batch loss."""

    response_tokens: float
    """Valid response tokens in the batch."""
    nonempty_sequences: float
    """Sequences with at least one response token (B')."""
    sequences: float
    """All sequences, empty ones included (B)."""

    @staticmethod
    def of(batch: TokenBatch) -> BatchTotals:
        lens = batch.response_lens_B
        return BatchTotals(float(lens.sum()), float((lens > 0).sum()), float(batch.batch_size))


@dataclass
class MicroBatch:
    """What a loss callback sees for one micro-batch on the last pipeline stage."""

    index: int
    """Micro-batch index within this rank's step."""
    batch: TokenBatch
    """The micro-batch's sequences."""
    rows_B: torch.Tensor
    """[mbs] global row id of each sequence (the rollout-batch row); -1 marks padding."""
    extras: dict[str, torch.Tensor]
    """Per-sequence tensors of the global batch (leading dim B), sliced to these rows
    (padding rows are zero)."""
    batch_pos_B: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """[mbs] position of each sequence in the batch passed to the learner; -1 for padding."""
    aux: dict[str, Any] = field(default_factory=dict)
    """Side data produced during the forward (e.g. router-shift weights)."""
    totals: BatchTotals | None = None
    """Counts of the whole batch this pass runs on (global loss normalisers)."""


@dataclass
class MicroBatchLoss:
    """A loss callback's answer for one micro-batch."""

    loss: torch.Tensor
    """Scalar: this micro-batch's contribution to the whole-batch loss."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-d tensors. Names ending in _max / _min reduce by max / min, others by weighted mean."""
    weight: float | torch.Tensor = 1.0
    """Weight of this micro-batch in mean-type metrics (e.g. its valid token count)."""


LossFn = Callable[[torch.Tensor, MicroBatch], MicroBatchLoss]


@dataclass
class ScoreResult:
    """A scoring pass's output."""

    logp_BT: torch.Tensor
    """[B, T] fp32 log-probabilities of the response tokens (0 where there is none)."""
    record: RoutingRecord | None = None
    """This rank's routing record when capture was asked for."""
    router_shift_BT: torch.Tensor | None = None
    """[B, T] router-shift weights against `RoutingPlan.old`, when one was given."""


class ForwardHooks:
    """Extension points around each micro-batch forward (routing capture/replay uses them).

    `before_forward` runs on every stage before the model's forward of a micro-batch;
    `after_forward` after it (before the loss on the last stage); `loss_aux` on the last
    stage returns side data for the loss callback."""

    def before_forward(self, mb: MicroBatch) -> None:
        pass

    def after_forward(self, mb: MicroBatch) -> None:
        pass

    def loss_aux(self, mb: MicroBatch) -> dict[str, Any]:
        return {}
