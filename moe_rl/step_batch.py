"""What one RL step trains on, as one data-parallel rank holds it (pure torch).

    batch = rollout.batch                          # StepBatch: this rank's rows only
    score = learner.score(batch, plan)             # old logprobs + routing record
    batch = batch.scored(score.logp_BT, score.record)
    for rows in minibatch_rows(batch.step_rows, n, dp, seed):
        result = learner.update(batch.take(rows), loss_fn, plan)

Rows. The step's batch has `step_rows` sequences (prompts_per_step x G; for agent episodes,
their segments), numbered by their global row id. Data-parallel rank d holds the rows whose
id is d mod dp (`dp_rows`), in every pass of the step, so per-row state (old logprobs, a
routing record) never moves between ranks; the ranks of one model replica (its TP / PP / EP
peers) hold the same rows. Only scalar metrics are reduced across data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moe_rl.batch import TokenBatch
from moe_rl.routing.record import ReplayIds, RoutingRecord, row_positions


def dp_rows(step_rows: int, dp_rank: int, dp: int) -> torch.Tensor:
    """Global row ids data-parallel rank `dp_rank` of `dp` holds: those equal to it mod dp."""
    return torch.arange(dp_rank, step_rows, dp)


def dp_rank_of_row(row_ids: torch.Tensor, dp: int) -> torch.Tensor:
    """The data-parallel rank that holds each global row id (the inverse of `dp_rows`)."""
    return row_ids % dp


def _tokens_on(tokens: TokenBatch, device: torch.device | str) -> TokenBatch:
    """`tokens.to(device)` without `TokenBatch`'s checks, which held on the host and would each
    read a value back from the device (a wait for a GPU's queue in every micro-batch)."""
    moved = object.__new__(TokenBatch)
    for f in dataclasses.fields(TokenBatch):
        value = getattr(tokens, f.name)
        if isinstance(value, torch.Tensor):
            value = value.to(device, non_blocking=True)
        object.__setattr__(moved, f.name, value)
    return moved


@dataclass(frozen=True)
class StepBatch:
    """This rank's rows of a step: tokens, advantages, the logprobs every pass needs, and
    the routing that replay and the router shift use. Per-row tensors lead with b, the
    number of rows held here."""

    tokens: TokenBatch
    """[b, S] prompt + response tokens, right-padded (S is the step's, the same on every rank)."""
    row_ids_B: torch.Tensor
    """[b] int64 global row ids, ascending; -1 marks a padding row (no response tokens)."""
    step_rows: int
    """Rows in the whole step's batch, over every data-parallel rank."""
    adv_B: torch.Tensor | None = None
    """Advantages: [b], one per sequence (the group estimators), or [b, T], one per response
    token (an estimator that needs a critic, PPO's `gae`; only token-level objectives take
    them). None: a batch that is only scored. (The name keeps its row-leading `_B`: every
    per-row tensor here is cut and moved by its first dimension.)"""
    sampler_logp_BT: torch.Tensor | None = None
    """[b, T] the sampler's logprob of each response token (0 on padding)."""
    old_logp_BT: torch.Tensor | None = None
    """[b, T] the learner's logprobs before the update (the scoring pass)."""
    ref_logp_BT: torch.Tensor | None = None
    """[b, T] the reference policy's logprobs (KL penalty)."""
    old_routing: RoutingRecord | None = None
    """The scoring pass's routing record (R2 replays it; the router shift compares with it)."""
    sampler_routing: ReplayIds | None = None
    """The sampler's routed experts on this batch's [b, S] grid (R3), rows by global id."""
    version_B: torch.Tensor | None = None
    """[b] int64 the policy version (learner update count) that sampled each row."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Further per-row tensors ([b, ...]) for a custom loss callback (SFT, tests)."""

    def __post_init__(self) -> None:
        b = self.tokens.batch_size
        if self.row_ids_B.shape != (b,):
            raise ValueError(f"row_ids_B must have shape [{b}], got {tuple(self.row_ids_B.shape)}")
        for name in ("adv_B", "sampler_logp_BT", "old_logp_BT", "ref_logp_BT", "version_B"):
            t = getattr(self, name)
            if t is not None and t.shape[0] != b:
                raise ValueError(f"StepBatch.{name} has {t.shape[0]} rows, the batch has {b}")
        for name, t in self.extras.items():
            if t.shape[0] != b:
                raise ValueError(f"StepBatch.extras[{name!r}] has {t.shape[0]} rows, the batch has {b}")

    @property
    def batch_size(self) -> int:
        return self.tokens.batch_size

    @staticmethod
    def whole(tokens: TokenBatch, **fields: object) -> StepBatch:
        """A batch that is the whole step (one rank, or every rank holding every row)."""
        B = tokens.batch_size
        return StepBatch(tokens, torch.arange(B), B, **fields)  # type: ignore[arg-type]

    def to(self, device: torch.device | str) -> StepBatch:
        """The same rows with their per-row tensors on `device` (routing stays where it is:
        the routing taps move what they use)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return dataclasses.replace(
            self, tokens=_tokens_on(self.tokens, device), adv_B=move(self.adv_B), sampler_logp_BT=move(self.sampler_logp_BT),
            old_logp_BT=move(self.old_logp_BT), ref_logp_BT=move(self.ref_logp_BT),
            extras={k: v.to(device, non_blocking=True) for k, v in self.extras.items()})

    def response_mask(self) -> torch.Tensor:
        """[b, T] bool: True where a response token exists."""
        return self.tokens.response_mask()

    def select(self, index: torch.Tensor) -> StepBatch:
        """The rows at local positions `index` (a 1-D long tensor), every per-row field cut alike."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return dataclasses.replace(
            self, tokens=self.tokens.select(index), row_ids_B=self.row_ids_B[index],
            adv_B=cut(self.adv_B), sampler_logp_BT=cut(self.sampler_logp_BT), old_logp_BT=cut(self.old_logp_BT),
            ref_logp_BT=cut(self.ref_logp_BT), version_B=cut(self.version_B),
            extras={k: v[index] for k, v in self.extras.items()})

    def take(self, row_ids: torch.Tensor) -> StepBatch:
        """The rows among global `row_ids` that this rank holds, in ascending id order
        (ids held by other data-parallel ranks are skipped). Routing records stay whole:
        they are looked up by row id."""
        held = torch.isin(row_ids, self.row_ids_B)
        wanted = row_ids[held].sort().values
        return self.select(row_positions(self.row_ids_B, wanted))

    def scored(self, old_logp_BT: torch.Tensor, old_routing: RoutingRecord | None) -> StepBatch:
        """This batch with the scoring pass's logprobs and routing record."""
        return dataclasses.replace(self, old_logp_BT=old_logp_BT, old_routing=old_routing)

    def with_reference(self, ref_logp_BT: torch.Tensor) -> StepBatch:
        return dataclasses.replace(self, ref_logp_BT=ref_logp_BT)
