"""What the learner's schedule hands around per micro-batch, and the hooks around it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from moe_rl.batch import TokenBatch
from moe_rl.learner.model_input import ModelInput, ScoredTokens
from moe_rl.routing.record import RoutingRecord
from moe_rl.step_batch import StepBatch

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
    """Counts of the whole batch a learner pass runs on, over every data-parallel rank (the
    same on every rank and in every micro-batch): the global normalisers that make
    micro-batch loss contributions sum to the whole-batch loss."""

    response_tokens: float
    """Valid response tokens in the batch."""
    nonempty_sequences: float
    """Sequences with at least one response token (B')."""
    sequences: float
    """All sequences, empty ones included (B)."""

    @staticmethod
    def of(batch: TokenBatch) -> BatchTotals:
        """The counts of `batch` alone (one rank's share of a pass)."""
        lens = batch.response_mask().sum(1)  # (the policy's tokens: an episode's observations are not trained on)
        return BatchTotals(float(lens.sum()), float((lens > 0).sum()), float(batch.batch_size))


@dataclass
class MicroBatch:
    """What a loss callback sees for one micro-batch on the last pipeline stage."""

    index: int
    """Micro-batch index within this rank's pass."""
    step: StepBatch
    """The micro-batch's rows (padding rows: row id -1, no response tokens, zero fields)."""
    batch_pos_B: torch.Tensor
    """[mbs] position of each row in the StepBatch the pass runs on; -1 for padding."""
    totals: BatchTotals
    """Counts of the whole pass over every data-parallel rank (global loss normalisers)."""
    aux: dict[str, Any] = field(default_factory=dict)
    """Side data produced during the forward (e.g. router-shift weights)."""
    inp: ModelInput | None = None
    """How the rows enter the model (packed or padded), set by the learner."""
    padding_BS: torch.Tensor | None = None
    """[b_in, s_in] True on the model input's slots without a real token (this stage's
    shard), set by the learner with `inp`."""
    scored: ScoredTokens | None = None
    """`inp.scored` on the compute device, set by the learner before the forward."""

    @property
    def batch(self) -> TokenBatch:
        """The micro-batch's tokens."""
        return self.step.tokens

    @property
    def rows_B(self) -> torch.Tensor:
        """[mbs] global row id of each sequence; -1 marks padding."""
        return self.step.row_ids_B

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        """The custom per-row tensors of `StepBatch.extras`, cut to these rows."""
        return self.step.extras


def split_micro_batches(batch: StepBatch, micro_batch_size: int, most_rows: int, seq_len: int,
                        totals: BatchTotals) -> list[MicroBatch]:
    """This rank's rows cut into micro-batches of `min(micro_batch_size, most_rows)` rows,
    as many on every data-parallel rank (`most_rows`: the most rows any rank holds; the
    expert-parallel all-to-alls need every rank in every micro-batch): the last ones are
    filled with padding rows, which have no response tokens and contribute nothing to any
    loss. Tokens are widened to `seq_len` (the TP / fp8 multiple)."""
    most = max(most_rows, 1)
    mbs = min(micro_batch_size, most)
    n_micro = math.ceil(most / mbs)
    padded = pad_rows(batch, n_micro * mbs, seq_len)
    pos = torch.full((n_micro * mbs,), -1, dtype=torch.long)
    pos[: batch.batch_size] = torch.arange(batch.batch_size)
    out = []
    for i in range(n_micro):
        index = torch.arange(i * mbs, (i + 1) * mbs)
        out.append(MicroBatch(index=i, step=padded.select(index), batch_pos_B=pos[index], totals=totals))
    return out


def budget_micro_batches(batch: StepBatch, bins: list[list[int]], seq_len: int,
                         totals: BatchTotals) -> list[MicroBatch]:
    """One micro-batch per bin of row positions (`token_budget_bins`); an empty bin (a rank
    with fewer rows than bins elsewhere) holds one padding row. Tokens widened to `seq_len`."""
    padded = pad_rows(batch, batch.batch_size + 1, seq_len)  # the last row is the padding row
    out = []
    for i, rows in enumerate(bins):
        index = torch.tensor(rows or [batch.batch_size], dtype=torch.long)
        pos = index.clone() if rows else torch.tensor([-1])
        out.append(MicroBatch(index=i, step=padded.select(index), batch_pos_B=pos, totals=totals))
    return out


def bins_needed(cost_B: list[int], budget: int) -> int:
    """Micro-batches a first-fit-decreasing packing of these sequence costs into bins of
    `budget` tokens needs (a sequence longer than the budget takes a bin alone)."""
    free: list[int] = []
    for c in sorted(cost_B, reverse=True):
        for i, room in enumerate(free):
            if c <= room:
                free[i] -= c
                break
        else:
            free.append(max(budget - c, 0))
    return len(free)


def token_budget_bins(cost_B: list[int], budget: int, n_bins: int) -> list[list[int]] | None:
    """Row positions in `n_bins` bins of at most `budget` tokens (a sequence longer than the
    budget alone in a bin): longest first into the least-loaded bin that has room, for
    balanced token counts; when that strands a sequence, first-fit decreasing, which always
    succeeds with `bins_needed` bins or more. None: fewer bins than that."""
    order = sorted(range(len(cost_B)), key=lambda b: (-cost_B[b], b))
    for pick in (_least_loaded, _first):
        bins: list[list[int]] = [[] for _ in range(n_bins)]
        load = [0] * n_bins
        for b in order:
            fits = [i for i in range(n_bins) if load[i] + cost_B[b] <= budget or not bins[i]]
            if not fits:
                break
            i = pick(fits, load)
            bins[i].append(b)
            load[i] += cost_B[b]
        else:
            return [sorted(rows) for rows in bins]
    return None


def _least_loaded(fits: list[int], load: list[int]) -> int:
    return min(fits, key=lambda i: (load[i], i))


def _first(fits: list[int], load: list[int]) -> int:
    return fits[0]


def pad_rows(batch: StepBatch, rows: int, seq_len: int) -> StepBatch:
    """`batch` followed by padding rows up to `rows`, its tokens widened to `seq_len`."""
    b, extra = batch.batch_size, rows - batch.batch_size
    t = batch.tokens
    tokens_BS = t.tokens_BS.new_zeros((rows, seq_len))
    tokens_BS[:b, : t.seq_len] = t.tokens_BS
    tokens = TokenBatch(tokens_BS, torch.cat([t.prompt_lens_B, t.prompt_lens_B.new_ones(extra)]),
                        torch.cat([t.response_lens_B, t.response_lens_B.new_zeros(extra)]), t.response_width,
                        None if t.observed_BT is None else torch.cat([t.observed_BT, t.observed_BT.new_zeros((extra, t.response_width))]))

    def grow(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])

    return dataclasses.replace(
        batch, tokens=tokens, row_ids_B=torch.cat([batch.row_ids_B, batch.row_ids_B.new_full((extra,), -1)]),
        adv_B=grow(batch.adv_B), sampler_logp_BT=grow(batch.sampler_logp_BT), old_logp_BT=grow(batch.old_logp_BT),
        ref_logp_BT=grow(batch.ref_logp_BT), version_B=grow(batch.version_B),
        extras={k: torch.cat([v, v.new_zeros((extra, *v.shape[1:]))]) for k, v in batch.extras.items()})


@dataclass
class MicroBatchLoss:
    """A loss callback's answer for one micro-batch."""

    loss: torch.Tensor
    """Scalar: this micro-batch's contribution to the whole-batch loss."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """0-d tensors. Names ending in _max / _min reduce by max / min, others by weighted mean."""
    weight: float | torch.Tensor = 1.0
    """Weight of this micro-batch in mean-type metrics (e.g. its valid token count)."""
    sums: dict[str, torch.Tensor] | None = None
    """Additive 0-d tallies (counts a loss decided during the forward): summed over the
    pass's micro-batches and data-parallel ranks into `UpdateResult.sums`."""


LossFn = Callable[[torch.Tensor, MicroBatch], MicroBatchLoss]


@runtime_checkable
class PassScaledLoss(Protocol):
    """A loss callback whose normalizers are only known once the whole pass has run (what it
    keeps or rejects is decided from the forward's own log-probs): the learner sums the
    micro-batches' `sums` over the pass and every data-parallel rank, then multiplies the
    accumulated gradient (and the reported loss) by `pass_scale(sums)` before the
    optimizer step. Exact, because every contribution carries the same global normalizer."""

    def __call__(self, logp_BT: torch.Tensor, mb: MicroBatch) -> MicroBatchLoss: ...

    def pass_scale(self, sums: dict[str, float]) -> float: ...


@dataclass
class ScoreResult:
    """A scoring pass's output, for the rows of the batch it ran on."""

    logp_BT: torch.Tensor
    """[B, T] fp32 log-probabilities of the response tokens (0 where there is none)."""
    record: RoutingRecord | None = None
    """This rank's routing record when capture was asked for."""
    router_shift_BT: torch.Tensor | None = None
    """[B, T] router-shift weights against `RoutingPlan.old`, when one was given."""
    entropy_BT: torch.Tensor | None = None
    """[B, T] entropy of the policy at each response token (chunked head only; 0 elsewhere)."""


OPTIMIZER_METRICS = ("grad_norm", "lr", "update_skipped", "skipped_in_a_row_max")
"""An update's own metrics beside its loss's: the gradient norm, the learning rate, whether
it was skipped (a NaN or inf loss or gradient) and the updates skipped in a row so far."""


@dataclass(frozen=True)
class PassWork:
    """What learner passes processed, over every data-parallel rank: what a program's
    throughput and MFU metrics are computed from (`moe_rl.plan.flops`). Passes add up."""

    tokens: float = 0.0
    """Real tokens, prompt and response (no right, alignment or row padding)."""
    squares: float = 0.0
    """Sum of each sequence's squared real length (what causal attention's cost grows with)."""
    seconds: float = 0.0
    """Wall seconds of the passes (an update's: forward, backward and the optimizer step)."""

    def __add__(self, other: PassWork) -> PassWork:
        return PassWork(self.tokens + other.tokens, self.squares + other.squares, self.seconds + other.seconds)


@dataclass
class UpdateResult:
    """One optimizer update: its metrics, and what its forward computed before the update
    (at one update per rollout, these are the old logprobs: the on-policy shortcut)."""

    metrics: dict[str, float]
    """Loss, objective and routing metrics, grad_norm, lr (the same on every rank)."""
    logp_BT: torch.Tensor
    """[b, T] fp32 logprobs of the batch's rows under the weights before the update."""
    record: RoutingRecord | None = None
    """This rank's routing record of the update's forward, when the plan captured it."""
    work: PassWork = field(default_factory=PassWork)
    """The update's tokens and seconds over every data-parallel rank (the same on every rank)."""
    sums: dict[str, float] = field(default_factory=dict)
    """The loss callback's additive tallies over the pass and every data-parallel rank
    (`MicroBatchLoss.sums`; the same on every rank)."""


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
