"""What a rollout is: the groups an engine sampled, what every rank learns of them, the rows
that travel to the data-parallel rank that trains on them, and the step's rollout."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_rl.step_batch import StepBatch

SCORE = "score_B"
"""StepBatch.extras key: each row's sequence score (its reward after overlong shaping),
which a critic's per-token rewards start from (`moe_rl.programs.ppo.critic_stage`)."""

VERSION_SPAN = "version_span_B"
"""StepBatch.extras key: each row's newest minus oldest token version (segmented decoding
mixes versions within a response; 0 otherwise), for the mismatch split by span."""


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
    """The policy version (weight pushes received) the engine sampled with: the oldest
    token's when the responses were decoded under several (`token_versions`)."""
    token_versions: list[list[int]] | None = None
    """Per response, the version that drew each token (segmented decoding:
    `moe_rl.rollout.pool`); None: every token was drawn with `version`."""
    carried: list[bool] | None = None
    """Per response, whether it continued across a step boundary (a partial rollout)."""
    observed: list[list[bool]] | None = None
    """Multi-turn episodes: per response, which tokens are the environment's observations."""
    episodes: list[tuple[int, ...]] | None = None
    """Multi-turn episodes: per episode, (turns, tool calls, tool-call parse errors), and for
    agent episodes (timed out, raised, resets) after them (`moe_rl.rollout.gateway.agents`).
    An episode is a response, unless `episode_of` says otherwise."""
    episode_of: list[int] | None = None
    """Agent episodes: per response (row), the index of its episode in `episodes`. An episode
    whose agent rewrote its history has a row per segment, one that was dropped (timed out or
    raised) has none; every row carries its episode's reward. None: response j is episode j."""

    def summary(self) -> GroupSummary:
        runs = None
        if self.token_versions is not None:
            runs = tuple(version_runs(v) for v in self.token_versions)
        return GroupSummary(len(self.prompt), tuple(len(r) for r in self.responses), tuple(self.rewards),
                            tuple(self.finish), self.version, runs,
                            tuple(self.carried) if self.carried is not None else None,
                            tuple(self.episodes) if self.episodes is not None else None,
                            tuple(self.episode_of) if self.episode_of is not None else None)

    def row(self, j: int, row_id: int) -> RowSample:
        """Response j as training row `row_id`."""
        versions = self.token_versions[j] if self.token_versions is not None else None
        return RowSample(row_id, self.prompt, self.responses[j], self.logprobs[j], self.texts[j],
                         self.routed[j] if self.routed is not None else None, self.version, versions,
                         self.observed[j] if self.observed is not None else None)


def version_runs(versions: list[int]) -> tuple[tuple[int, int], ...]:
    """Token versions as runs of (version, count), in token order."""
    return tuple((v, len(list(run))) for v, run in itertools.groupby(versions))


@dataclass(frozen=True)
class GroupSummary:
    """What every rank learns of a sampled group: enough to choose the step's groups (dynamic
    sampling), compute advantages and statistics and size the batch, and no tokens."""

    prompt_len: int
    response_lens: tuple[int, ...]
    rewards: tuple[float, ...]
    finish: tuple[str, ...]
    version: int = 0
    """The policy version that sampled the group (weight pushes the engine had received);
    under segmented decoding, its oldest token's."""
    version_runs: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Per response, its tokens' versions as (version, count) runs; None: all `version`."""
    carried: tuple[bool, ...] | None = None
    """Per response, whether it continued across a step boundary (a partial rollout)."""
    episodes: tuple[tuple[int, ...], ...] | None = None
    """Multi-turn episodes: per episode, (turns, tool calls, tool-call parse errors[, timed
    out, raised, resets] for agent episodes)."""
    episode_of: tuple[int, ...] | None = None
    """Agent episodes: per response (row), its episode's index in `episodes` (ScoredGroup's);
    None: response j is episode j."""

    def episode_rows(self) -> list[list[int]]:
        """The rows of each episode that has any, in episode order (an agent episode's
        segments; a dropped one has no row)."""
        if self.episode_of is None:
            return [[j] for j in range(len(self.response_lens))]
        rows: dict[int, list[int]] = {}
        for j, e in enumerate(self.episode_of):
            rows.setdefault(e, []).append(j)
        return [rows[e] for e in sorted(rows)]

    def episode_rewards(self) -> tuple[float, ...]:
        """Each trained episode's reward, once (what the group's advantages and the reward
        statistics count; every row of an episode carries it)."""
        return tuple(self.rewards[rows[0]] for rows in self.episode_rows())

    def spans(self) -> tuple[int, ...]:
        """Per response, newest minus oldest token version (0: one version)."""
        if self.version_runs is None:
            return (0,) * len(self.response_lens)
        return tuple(r[-1][0] - r[0][0] if r else 0 for r in self.version_runs)

    def tokens_older_than(self, version: int) -> int:
        """Response tokens drawn by a policy older than `version`."""
        if self.version_runs is None:
            return sum(self.response_lens) if self.version < version else 0
        return sum(n for runs in self.version_runs for v, n in runs if v < version)

    @property
    def has_signal(self) -> bool:
        """Rewards differ within the group (group advantages are not all zero)."""
        return len(set(self.episode_rewards())) > 1


@dataclass
class RowSample:
    """One training row on its way from the engine that sampled it to the data-parallel rank
    that trains on it."""

    row_id: int
    """Global row id in the step's batch: the kept groups' rows in order (group index x G +
    response index, unless agent episodes made a group's rows fewer or more than G)."""
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    """The sampler's logprob of each response token."""
    text: str
    routed: np.ndarray | None
    """The sampler's routed experts in vLLM's layout ([prompt + response - 1, layers, K])."""
    version: int = 0
    """The policy version that sampled it (its oldest token's)."""
    token_versions: list[int] | None = None
    """The version that drew each token, when they differ (segmented decoding)."""
    observed: list[bool] | None = None
    """A multi-turn episode: which response tokens are the environment's observations."""


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
    dropped_stale: int = 0
    """Responses the engines dropped before delivery for exceeding rl.max_staleness
    (segmented decoding drops them from its pool; `deliver` counts its own drops too)."""
    reward_timeouts: int = 0
    """Responses whose reward was cut at task.reward_timeout_s (scored 0.0), over every
    engine and draw of the step."""


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
    dropped_stale: int = 0
    """Responses every engine dropped from its pool as too stale since the last batch."""
    reward_timeouts: int = 0
    """Responses every engine cut at task.reward_timeout_s while scoring this batch."""

    def public(self, engine_wait: float = 0.0) -> SampledSummary:
        return SampledSummary(self.kept, self.drawn, self.engine_seconds, engine_wait, self.dropped_stale,
                              self.reward_timeouts)


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

    def dump_rows(self, scored: StepBatch | None = None) -> list[dict]:
        """This rank's rows as JSON-ready dicts (the run directory's rollout dumps); with
        `scored` (the step's batch once the learner scored it: a `StepBatch` of the same rows),
        each row also carries the learner's log-probs of its response, the ones the update's
        ratio and the rollout correction read."""
        b = self.batch
        if b is None:
            return []
        assert b.adv_B is not None and b.sampler_logp_BT is not None  # (a rollout's rows carry both)
        learner = None
        if scored is not None and scored.old_logp_BT is not None:
            at = {int(r): i for i, r in enumerate(scored.row_ids_B.tolist())}
            learner = (at, scored.old_logp_BT)
        out = []
        for i in range(b.batch_size):
            p, r = int(b.tokens.prompt_lens_B[i]), int(b.tokens.response_lens_B[i])
            out.append({"row": int(b.row_ids_B[i]), "prompt_ids": b.tokens.tokens_BS[i, :p].tolist(),
                        "response_ids": b.tokens.tokens_BS[i, p:p + r].tolist(), "text": self.texts[i],
                        "reward": float(self.rewards_B[i]), "advantage": float(b.adv_B[i]),
                        "sampler_logprobs": b.sampler_logp_BT[i, :r].tolist()})
            if learner is not None:
                out[-1]["learner_logprobs"] = learner[1][learner[0][int(b.row_ids_B[i])], :r].tolist()
            if b.tokens.observed_BT is not None:  # (a multi-turn episode: which tokens the environment put there)
                out[-1]["observed"] = b.tokens.observed_BT[i, :r].tolist()
        return out
