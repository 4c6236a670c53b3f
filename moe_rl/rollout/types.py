"""What a rollout is: the groups an engine sampled, what every rank learns of them, the rows
that travel to the data-parallel rank that trains on them, and the step's rollout."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moe_rl.step_batch import StepBatch

SCORE = "score_B"
"""StepBatch.extras key: each row's sequence score (its reward after overlong shaping),
which a critic's per-token rewards start from (`moe_rl.programs.ppo.critic_stage`)."""


@dataclass
class ScoredGroup:
    """One prompt and its G responses as the sampler returned them, with their rewards.
    Held by the engine that sampled it; only its `summary` goes to every rank."""

    prompt: list[int]
    """Prompt token ids."""
    responses: list[list[int]]
    """G response token ids (a response that stopped on EOS ends with it)."""
    logprobs: list[list[float]]
    """The sampler's logprob of each response token."""
    texts: list[str]
    """Decoded responses (what the verifier scored)."""
    rewards: list[float]
    """Verifier rewards, before any shaping."""
    finish: list[str]
    """Finish reason per response: "stop" (EOS) or "length" (max_new_tokens)."""
    routed: list[np.ndarray] | None
    """Per response, the sampler's routed experts in vLLM's layout, when the backend returns them."""
    version: int = 0
    """The policy version (weight pushes received) the engine sampled with."""

    def summary(self) -> GroupSummary:
        return GroupSummary(len(self.prompt), tuple(len(r) for r in self.responses), tuple(self.rewards),
                            tuple(self.finish), self.version)

    def row(self, j: int, row_id: int) -> RowSample:
        """Response j as training row `row_id`."""
        return RowSample(row_id, self.prompt, self.responses[j], self.logprobs[j], self.texts[j],
                         self.routed[j] if self.routed is not None else None, self.version)


@dataclass(frozen=True)
class GroupSummary:
    """What every rank learns of a sampled group: enough to choose the step's groups (dynamic
    sampling), compute advantages and statistics and size the batch, and no tokens."""

    prompt_len: int
    response_lens: tuple[int, ...]
    rewards: tuple[float, ...]
    finish: tuple[str, ...]
    version: int = 0
    """The policy version that sampled the group (weight pushes the engine had received)."""

    @property
    def has_signal(self) -> bool:
        """Rewards differ within the group (group advantages are not all zero)."""
        return len(set(self.rewards)) > 1


@dataclass
class RowSample:
    """One training row on its way from the engine that sampled it to the data-parallel rank
    that trains on it."""

    row_id: int
    """Global row id in the step's batch (group index x G + response index)."""
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    """The sampler's logprob of each response token."""
    text: str
    routed: np.ndarray | None
    """The sampler's routed experts in vLLM's layout ([prompt + response - 1, layers, K])."""
    version: int = 0
    """The policy version that sampled it."""


@dataclass
class SampledSummary:
    """What every rank learns of a step's sampling: which groups the step trains on and
    every drawn group's summary, no tokens."""

    kept: list[tuple[int, int]]
    """(draw, group) of the groups the step trains on, in row order."""
    drawn: list[list[GroupSummary]]
    """Every draw's group summaries."""
    engine_seconds: list[list[float]]
    """Per draw, each engine's sampling seconds."""
    engine_wait: float = 0.0
    """Seconds the engines last waited for the learner's weights."""


@dataclass
class Sampled:
    """A step's sampling as one engine rank holds it: the decisions (the same on every engine)
    and the groups this engine leader sampled. Under `rl.max_staleness` it is made a step
    ahead, while the learner trains."""

    step: int
    version: int
    """Weight pushes the engine had received when it sampled."""
    kept: list[tuple[int, int]] = field(default_factory=list)
    drawn: list[list[GroupSummary]] = field(default_factory=list)
    engine_seconds: list[list[float]] = field(default_factory=list)
    held: dict[tuple[int, int], ScoredGroup] = field(default_factory=dict)
    """This engine leader's groups by (draw, group)."""

    def public(self, engine_wait: float = 0.0) -> SampledSummary:
        return SampledSummary(self.kept, self.drawn, self.engine_seconds, engine_wait)


@dataclass
class Rollout:
    """One step's rollout as this rank holds it: its rows of the training batch (with the
    sampler's logprobs, routing and the advantages) and the whole step's statistics."""

    batch: StepBatch | None
    """This data-parallel rank's rows (None on an engine-only rank)."""
    rewards_B: torch.Tensor
    """[b] verifier rewards (unshaped) of those rows."""
    texts: list[str]
    """[b] decoded responses of those rows."""
    stats: dict[str, float]
    """reward/*, response/*, sampling/* and advantage/* metrics of the whole step (every rank)."""

    def dump_rows(self) -> list[dict]:
        """This rank's rows as JSON-ready dicts (the run directory's rollout dumps)."""
        b = self.batch
        if b is None:
            return []
        out = []
        for i in range(b.batch_size):
            p, r = int(b.tokens.prompt_lens_B[i]), int(b.tokens.response_lens_B[i])
            out.append({"row": int(b.row_ids_B[i]), "prompt_ids": b.tokens.tokens_BS[i, :p].tolist(),
                        "response_ids": b.tokens.tokens_BS[i, p:p + r].tolist(), "text": self.texts[i],
                        "reward": float(self.rewards_B[i]), "advantage": float(b.adv_B[i]),
                        "sampler_logprobs": b.sampler_logp_BT[i, :r].tolist()})
        return out
