"""Responses decoded a segment at a time: the engine's pause points for in-flight weight
updates and partial rollouts (`rl.inflight_weight_updates`, `rl.partial_rollouts`).

An engine rank keeps a pool of groups (G responses of one prompt). Each `segment` decodes
at most `rl.inflight_segment_tokens` more tokens of every unfinished response in one
`Sampler.generate` call, the prompt being the prompt plus the response so far. Between two
segments the engine has no request in flight, so it can take new weights there; the next
segment continues every response under them. That is vLLM's pause with the requests kept
and the cache cleared (`pause_generation(mode="keep", clear_cache=True)`): the running
responses' KV is recomputed under the new weights, because every weight update resets the
engine's prefix cache (`sampler.prefix_caching` reuses it only within a version) and the
transformers sampler keeps no cache between calls. No request started after a push reuses
a prefix cached under older weights.

What each token keeps (the behaviour policy of the correction, and R3):
- its sampler log-prob, from the distribution it was drawn from, under the weights of the
  segment that drew it;
- its version, the weight pushes the engine had received when it was drawn;
- the routed experts of each position fed: a position's routes are recorded by the segment
  in which it was last fed, i.e. the computation that produced the next token's log-prob.
  A continuation re-feeds the earlier positions (recomputing their KV) but only the new
  positions' routes are appended, so routes and log-probs are never paired across versions.

Seeds: response j of a group with base seed b draws its first segment with b + j (what a
one-shot `generate` uses, so one segment of `max_new_tokens` samples exactly the
synchronous rollout) and segment s > 0 with a seed drawn from (b, j, s): the same schedule
samples the same tokens.

Memory: the pool holds the groups admitted in the last k + 1 steps at most (a group whose
oldest token is more than `rl.max_staleness` versions behind the learner is dropped), so
its routing records are bounded by (k + 1) x prompts_per_step x G x (prompt + max_new_tokens)
x layers x top-k bytes (uint8 ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from moe_rl.rollout.types import ScoredGroup
from moe_rl.sampler.base import Generates
from moe_rl.tasks.base import Problem
from moe_rl.tasks.environment import Environment


def segment_seed(base: int, j: int, segment: int) -> int:
    """The seed of response j's `segment`-th segment (segment 0: `base + j`, as one call)."""
    if segment == 0:
        return base + j
    return int(np.random.default_rng([base, j, segment]).integers(0, 2**31 - 1))


@dataclass
class EpisodeState:
    """What an episode keeps besides its tokens: its environment and its tallies."""

    env: Environment | None = field(default=None, repr=False, compare=False)
    """The episode's `Environment` (rebuilt by `Episodes.restore` after a resume)."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each finished assistant turn in the episode's tokens."""
    turn_start: int = 0
    """Where the turn in progress starts."""
    tool_calls: int = 0
    parse_errors: int = 0
    turn_rewards: float = 0.0
    """Sum of the environment's per-turn rewards so far."""
    truncated: bool = False
    """Ended at a limit rather than by the environment."""
    reward: float | None = None
    """The episode's reward once it is over (final + per-turn)."""
    reward_timeouts: int = 0
    """Its final reward was cut at task.reward_timeout_s (the environment's `reward_timeouts`)."""

    def tally(self) -> tuple[int, int, int]:
        """(turns, tool calls, parse errors): what the rollout statistics count."""
        return len(self.turns), self.tool_calls, self.parse_errors

    def to_json(self) -> dict:
        return {"turns": self.turns, "turn_start": self.turn_start, "tool_calls": self.tool_calls,
                "parse_errors": self.parse_errors, "turn_rewards": self.turn_rewards, "truncated": self.truncated,
                "reward": self.reward, "reward_timeouts": self.reward_timeouts}

    @staticmethod
    def from_json(d: dict) -> EpisodeState:
        return EpisodeState(None, [tuple(t) for t in d["turns"]], d["turn_start"], d["tool_calls"],
                            d["parse_errors"], d["turn_rewards"], d["truncated"], d["reward"],
                            d.get("reward_timeouts", 0))


@runtime_checkable
class StreamingEngine(Protocol):
    """What the pool asks of a streaming engine (`moe_rl.sampler.vllm_stream`)."""

    epoch: int
    """Weight loads so far (tokens are drawn under the epoch they report)."""

    def submit(self, request_id: str, prompt: Sequence[int], *, seed: int, max_new_tokens: int,
               temperature: float, top_p: float) -> None: ...

    def poll(self, wait_s: float) -> list[Any]:
        """`StreamDelta`s: request_id, tokens, logprobs, epochs, finish, routed."""

    def abort(self, request_ids: Iterable[str]) -> None: ...


class EpisodeDriver(Protocol):
    """What the pool asks of multi-turn episodes (`moe_rl.rollout.episodes.Episodes`)."""

    def turn_room(self, r: PartialResponse) -> int:
        """Tokens the turn in progress may still take."""

    def end_turn(self, r: PartialResponse, ended_on_eos: bool) -> None:
        """The turn in progress is over: the environment answers (or the episode ends)."""

    def restore(self, problem: Problem, r: PartialResponse) -> None:
        """Rebuild a resumed running episode's environment."""


@dataclass
class PartialResponse:
    """One response as decoded so far."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each token (the behaviour policy that drew it)."""
    versions: list[int] = field(default_factory=list)
    """The policy version (weight pushes received) that drew each token."""
    routed: np.ndarray | None = None
    """Routed experts of the positions fed so far ([prompt + tokens - 1, layers, K])."""
    finish: str | None = None
    """"stop" (EOS), "length" (max_new_tokens or the context); None while it runs."""
    segments: int = 0
    """Segments that decoded it (its next segment's seed index)."""
    carried: bool = False
    """It was unfinished when an earlier step's batch was taken (a partial rollout)."""
    observed: list[bool] = field(default_factory=list)
    """A multi-turn episode: per token, whether the environment put it there (an
    observation) rather than the policy; empty for a single response."""
    episode: EpisodeState | None = None
    """A multi-turn episode's environment and tallies (`moe_rl.rollout.episodes`)."""

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "versions": self.versions,
                "routed": self.routed.tolist() if self.routed is not None else None,
                "dtype": str(self.routed.dtype) if self.routed is not None else None,
                "finish": self.finish, "segments": self.segments, "carried": self.carried,
                "observed": self.observed, "episode": self.episode.to_json() if self.episode is not None else None}

    @staticmethod
    def from_json(d: dict) -> PartialResponse:
        routed = np.asarray(d["routed"], dtype=d["dtype"]) if d["routed"] is not None else None
        episode = EpisodeState.from_json(d["episode"]) if d.get("episode") is not None else None
        return PartialResponse(d["tokens"], d["logprobs"], d["versions"], routed, d["finish"], d["segments"],
                               d["carried"], d.get("observed", []), episode)


@dataclass
class PoolGroup:
    """A prompt and its G responses, admitted for step `key[0]`."""

    key: tuple[int, int, int]
    """(step it was admitted for, draw, prompt index in that draw)."""
    prompt: list[int]
    seed: int
    """Base seed of its responses (`base_seeds` of the step and draw)."""
    responses: list[PartialResponse]
    rewards: list[float] | None = None
    """Its responses' rewards once scored as it finished (dynamic sampling screens groups
    then); None: scored when its batch is taken."""

    @property
    def finished(self) -> bool:
        return all(r.finish is not None for r in self.responses)

    @property
    def oldest(self) -> int | None:
        """The version of its oldest token (None before its first segment)."""
        return min((r.versions[0] for r in self.responses if r.versions), default=None)

    def episode_rewards(self) -> tuple[list[float], int]:
        """(Each finished episode's reward, how many were cut at task.reward_timeout_s): a
        multi-turn group's rewards, given as each episode ended."""
        eps = [r.episode for r in self.responses]
        if any(ep is None or ep.reward is None for ep in eps):
            raise RuntimeError(f"group {self.key}: an episode without a reward (not a finished multi-turn group)")
        return [ep.reward for ep in eps if ep is not None and ep.reward is not None], sum(
            ep.reward_timeouts for ep in eps if ep is not None)

    def scored(self, texts: list[str], rewards: list[float] | None = None) -> ScoredGroup:
        """The finished group as the rollout's `ScoredGroup`, with its responses' `texts` and
        `rewards` (None: its own, given as it finished)."""
        rewards = self.rewards if rewards is None else rewards
        if rewards is None:
            raise RuntimeError(f"group {self.key} has no rewards yet")
        rs = self.responses
        routed = [r.routed for r in rs if r.routed is not None]
        eps = [r.episode for r in rs if r.episode is not None]
        episodes = len(eps) == len(rs)
        finish = [r.finish for r in rs if r.finish is not None]
        assert len(finish) == len(rs)  # (a finished group)
        return ScoredGroup(self.prompt, [r.tokens for r in rs], [r.logprobs for r in rs], texts, rewards,
                           finish, routed if len(routed) == len(rs) else None, self.oldest or 0, [r.versions for r in rs],
                           [r.carried for r in rs], [r.observed for r in rs] if episodes else None,
                           [ep.tally() for ep in eps] if episodes else None)

    def to_json(self) -> dict:
        return {"key": list(self.key), "prompt": self.prompt, "seed": self.seed,
                "responses": [r.to_json() for r in self.responses], "rewards": self.rewards}

    @staticmethod
    def from_json(d: dict) -> PoolGroup:
        return PoolGroup(tuple(d["key"]), d["prompt"], d["seed"], [PartialResponse.from_json(r) for r in d["responses"]],
                         d.get("rewards"))


class RolloutPool:
    """The groups an engine is decoding (`running`, admission order) and those finished but
    not yet trained on (`done`, completion order). With `episodes`, each response is a
    multi-turn episode whose turns end in its environment's answer (`moe_rl.rollout.episodes`)."""

    def __init__(self, max_new_tokens: int, segment_tokens: int, episodes: EpisodeDriver | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.segment_tokens = segment_tokens
        self.episodes = episodes
        self.running: list[PoolGroup] = []
        self.done: list[PoolGroup] = []
        self.requests: dict[str, tuple[PoolGroup, PartialResponse]] = {}
        """A streaming engine's running requests (`stream`), by request id."""
        self.dropped_stale = 0
        """Responses dropped for exceeding the staleness bound since the last batch taken."""

    def admit(self, key: tuple[int, int, int], prompt: list[int], seed: int, group_size: int,
              episodes: list[EpisodeState] | None = None) -> None:
        """A group of `group_size` responses to `prompt` (`episodes`: one fresh episode each)."""
        responses = [PartialResponse() for _ in range(group_size)]
        for r, ep in zip(responses, episodes or []):
            r.episode = ep
        self.running.append(PoolGroup(key, list(prompt), seed, responses))

    def segment(self, sampler: Generates, version: int, temperature: float, top_p: float) -> int:
        """Decode one segment of every unfinished response with the engine's weights
        (`version`); move groups that finished to `done`. Returns the tokens decoded."""
        rows = [(g, r, j) for g in self.running for j, r in enumerate(g.responses) if r.finish is None]
        if not rows:
            return 0
        ro = sampler.generate([g.prompt + r.tokens for g, r, _ in rows], n=1, max_new_tokens=self.segment_tokens,
                              temperature=temperature, top_p=top_p,
                              prompt_seeds=[segment_seed(g.seed, j, r.segments) for g, r, j in rows])
        decoded = 0
        for i, (g, r, _) in enumerate(rows):
            routed = ro.routed_experts[i] if ro.routed_experts is not None else None
            tokens = ro.response_token_ids[i]
            n, cut = self._extend(r, len(g.prompt), tokens, ro.logprobs[i], [version] * len(tokens), routed)
            r.segments += 1
            # (fewer tokens than asked without an EOS: the context is full)
            self._end(r, "stop" if ro.finish_reasons[i] == "stop" else
                      "length" if len(tokens) < self.segment_tokens or len(r.tokens) >= self.max_new_tokens else None,
                      cut)
            decoded += n
        self._retire()
        return decoded

    def stream(self, engine: StreamingEngine, version_of: Callable[[int], int], temperature: float, top_p: float,
               wait_s: float) -> int:
        """The streaming engine's turn (`rl.inflight_kv: keep`): abort the requests of groups no
        longer in the pool, submit every unfinished response not yet running (its prompt and
        tokens so far, up to its room), and take what the engine decoded within `wait_s`
        (`version_of`: the policy version of an engine epoch). Returns the tokens decoded."""
        live = {self._request_id(g, j, r): (g, r) for g in self.running for j, r in enumerate(g.responses)
                if r.finish is None}
        engine.abort([rid for rid in self.requests if rid not in live])
        self.requests = {rid: v for rid, v in self.requests.items() if rid in live}
        for g in self.running:
            for j, r in enumerate(g.responses):
                if r.finish is None and (rid := self._request_id(g, j, r)) not in self.requests:
                    engine.submit(rid, g.prompt + r.tokens, seed=segment_seed(g.seed, j, r.segments),
                                  max_new_tokens=self._room(r), temperature=temperature, top_p=top_p)
                    self.requests[rid] = (g, r)
        decoded = 0
        for d in engine.poll(wait_s):
            if (gr := self.requests.get(d.request_id)) is None:
                continue  # (a request of a group dropped meanwhile)
            g, r = gr
            n, cut = self._extend(r, len(g.prompt), d.tokens, d.logprobs, [version_of(e) for e in d.epochs], d.routed)
            decoded += n
            if d.finish is not None or cut:
                if d.finish is None:
                    engine.abort([d.request_id])
                del self.requests[d.request_id]
                r.segments += 1  # (its next request, after a turn, draws from the next seed)
                self._end(r, d.finish if not cut else "length", cut)
        self._retire()
        return decoded

    @staticmethod
    def _request_id(g: PoolGroup, j: int, r: PartialResponse) -> str:
        """A response's engine request (its seed index tells a continuation from the first)."""
        return f"{'-'.join(map(str, g.key))}-{j}-{r.segments}"

    def _room(self, r: PartialResponse) -> int:
        room = self.max_new_tokens - len(r.tokens)
        return min(room, self.episodes.turn_room(r)) if r.episode is not None and self.episodes is not None else room

    def _extend(self, r: PartialResponse, prompt_len: int, tokens: list[int], logprobs: list[float],
                versions: list[int], routed: np.ndarray | None) -> tuple[int, bool]:
        """Append decoded tokens (at most the response's room) with their log-probs and
        versions, and the routes of the positions fed for the first time. Returns (tokens
        kept, whether the room cut them)."""
        room = self._room(r)
        cut = len(tokens) > room
        tokens, logprobs, versions = tokens[:room], logprobs[:room], versions[:room]
        if routed is not None:
            fed_before = 0 if r.routed is None else len(r.routed)  # (prompt + tokens - 1 after a segment)
            new = routed[fed_before:prompt_len + len(r.tokens) + len(tokens) - 1]
            r.routed = new if r.routed is None else np.concatenate([r.routed, new])
        r.tokens += tokens
        r.logprobs += logprobs
        r.versions += versions
        if r.episode is not None:
            r.observed += [False] * len(tokens)
        return len(tokens), cut

    def _end(self, r: PartialResponse, finish: str | None, cut: bool) -> None:
        """Set the finish a decoding call reported ("stop" on EOS unless the room cut it,
        "length" at a limit, None: it goes on); a multi-turn turn that ended is answered by
        the environment."""
        if finish == "stop" and not cut:
            r.finish = "stop"
        elif cut or finish is not None or (r.episode is not None and self.episodes is not None
                                           and self.episodes.turn_room(r) <= 0):
            r.finish = "length"
        if r.episode is not None and r.finish is not None and self.episodes is not None:  # a turn ended: the environment answers
            self.episodes.end_turn(r, ended_on_eos=r.finish == "stop")

    def _retire(self) -> None:
        """Move the groups that finished to `done`."""
        self.done += [g for g in self.running if g.finished]
        self.running = [g for g in self.running if not g.finished]

    def ready(self, quota: int) -> bool:
        """`quota` finished groups wait, or nothing is left running."""
        return len(self.done) >= quota or not self.running

    def take(self, quota: int) -> list[PoolGroup]:
        """The first `quota` finished groups; every response still running is now a partial
        rollout (it continues into a later step)."""
        out, self.done = self.done[:quota], self.done[quota:]
        for g in self.running:
            for r in g.responses:
                r.carried = r.carried or bool(r.tokens)
        return out

    def drop_older_than(self, version: int) -> None:
        """Drop every group (running or done) holding a token drawn before `version`."""
        def fresh(g: PoolGroup) -> bool:
            return g.oldest is None or g.oldest >= version

        for g in self.running + self.done:
            if not fresh(g):
                self.dropped_stale += len(g.responses)
        self.running = [g for g in self.running if fresh(g)]
        self.done = [g for g in self.done if fresh(g)]

    def to_json(self) -> dict:
        return {"running": [g.to_json() for g in self.running], "done": [g.to_json() for g in self.done],
                "dropped_stale": self.dropped_stale}

    def load_json(self, doc: dict) -> None:
        self.running = [PoolGroup.from_json(g) for g in doc["running"]]
        self.done = [PoolGroup.from_json(g) for g in doc["done"]]
        self.dropped_stale = doc["dropped_stale"]
