"""Multi-turn episodes (`rl.max_turns > 1`): the policy's turns and the environment's
observations, one token sequence per episode, decoded with continuous batching.

    episodes = Episodes(task, tokenizer, template, rl=cfg.rl, task_cfg=cfg.task,
                        max_new_tokens=cfg.sampler.max_new_tokens)
    prompt_ids, states = episodes.start(problem, G)       # one environment per response
    pool = RolloutPool(max_new_tokens, segment_tokens, episodes)
    ...                                                    # pool.segment(...) until done
    response.episode.reward                                # final + per-turn, once it ends

An episode is a `PartialResponse` of the pool (`moe_rl.rollout.pool`) whose tokens are its
turns and observations in order, with `observed` marking the observations' tokens. Each
decoding round (`RolloutPool.segment`) feeds every running episode's ids so far and decodes
its next tokens, whichever turn it is at: an episode whose turn ended (EOS) is answered by
its environment at once and joins the next round with the observation's ids appended, so
episodes never wait for each other's turns, only for the round (at most `segment_tokens`
tokens; the engine batches the round's requests).

Token in, token out (`moe_rl.tokenization.turns`): the turn's ids are kept as sampled; the
turn is decoded only to parse its tool calls (`moe_rl.tokenization.tool_calls`) and for the
verifier; the observation is templated once and appended as ids.

What each token carries: a policy token its sampler log-prob and version; an observation
token log-prob 0, `observed` true (no loss, no entropy, no KL, no router-shift statistic:
`TokenBatch.observed_BT`) and the version of the turn it answers. Routes (R3) are recorded
for every position fed, observations included: an observation's positions are first fed by
the round after it was appended, whose prefill routes them, and that is the computation the
next turn's log-probs come from (`PartialResponse` keeps each position's routes from the
round that first fed it).

Limits: `rl.max_turns` assistant turns, `rl.max_turn_tokens` tokens per turn, and
`sampler.max_new_tokens` tokens of turns and observations together. An episode that hits
one (a turn cut without EOS, the turns used up, no room for the observation) ends truncated:
its finish reason is "length", it is scored as it stands, and counted in
`rollout/truncated_frac`. Rewards: the environment's final reward plus the sum of its
per-turn rewards; the group advantage is one per episode.

Resume: an episode's environment is not saved; a saved pool rebuilds it by replaying the
episode's turns (`replay`), which needs environments that are deterministic given the turns.
Under rollout tensor parallelism every rank of an engine runs the same episodes (its own
environments, the same tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from moe_rl.rollout.pool import EpisodeState, PartialResponse, PoolGroup, RolloutPool
from moe_rl.tasks.environment import (
    AssistantTurn,
    Environment,
    Observation,
    make_environment,
    replay,
)
from moe_rl.tokenization.tool_calls import tool_call_parser
from moe_rl.tokenization.turns import ChatTurns

if TYPE_CHECKING:
    from moe_rl.config import RLConfig, TaskConfig
    from moe_rl.sampler.base import Generates
    from moe_rl.tasks.base import Problem, Task


class Episodes:
    """The run's environments, chat template and limits, applied to the pool's episodes."""

    def __init__(self, task: Task, tokenizer: Any, template: str | None, *, rl: RLConfig, task_cfg: TaskConfig,
                 max_new_tokens: int) -> None:
        """Episodes of `task` with the environments, system prompt and tool-call format of its
        section `task_cfg`, within `rl`'s turn limits and `max_new_tokens` tokens each (the
        run's `sampler.max_new_tokens`)."""
        if template is None:
            raise ValueError(f"rl.max_turns={rl.max_turns}: multi-turn episodes need a chat template; set "
                             "task.chat_template=auto with a tokenizer that has one, or a .jinja file")
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = task_cfg.system_prompt
        self.make_env = make_environment(task_cfg, task)
        self.parse = tool_call_parser(task_cfg.tool_parser, template)
        self.max_turns = rl.max_turns
        self.max_turn_tokens = rl.max_turn_tokens or max_new_tokens
        self.max_new_tokens = max_new_tokens
        self._turns: dict[tuple[int, ...], ChatTurns] = {}

    def turns_for(self, env: Environment) -> ChatTurns:
        """The chat template with `env`'s tools (one per distinct tool set)."""
        key = tuple(id(t) for t in env.tools)
        if key not in self._turns:
            self._turns[key] = ChatTurns(self.tokenizer, self.template, env.tools, self.system_prompt)
        return self._turns[key]

    def start(self, problem: Problem, group_size: int) -> tuple[list[int], list[EpisodeState]]:
        """The prompt ids of `problem`'s episodes and one fresh episode per response."""
        envs = [self.make_env(problem) for _ in range(group_size)]
        openings = [env.start() for env in envs]
        return self.turns_for(envs[0]).opening(openings[0]), [EpisodeState(env) for env in envs]

    def admit(self, pool: RolloutPool, key: tuple[int, int, int], problem: Problem, seed: int,
              group_size: int) -> None:
        """`problem`'s group into `pool`: its prompt and one fresh episode per response."""
        prompt, states = self.start(problem, group_size)
        pool.admit(key, prompt, seed, group_size, states)

    def run(self, sampler: Generates, problems: Sequence[Problem], n: int, temperature: float, top_p: float,
            seeds: Sequence[int]) -> list[PoolGroup]:
        """`n` episodes of each problem decoded to the end on `sampler` (one engine alone: an
        evaluation), the groups in problem order; seeds as `base_seeds` gives them."""
        pool = RolloutPool(self.max_new_tokens, self.max_turn_tokens, self)
        for i, (problem, seed) in enumerate(zip(problems, seeds)):
            self.admit(pool, (0, 0, i), problem, seed, n)
        while pool.running:
            pool.segment(sampler, 0, temperature, top_p)
        return sorted(pool.done, key=lambda g: g.key)

    def turn_room(self, r: PartialResponse) -> int:
        """Tokens the turn in progress may still take."""
        assert r.episode is not None  # (admitted as an episode)
        return self.max_turn_tokens - (len(r.tokens) - r.episode.turn_start)

    def end_turn(self, r: PartialResponse, ended_on_eos: bool) -> None:
        """The turn in progress is over (EOS, or cut at a limit: `ended_on_eos` false): let
        the environment answer it, then append its observation or end the episode."""
        ep = r.episode
        assert ep is not None and ep.env is not None  # (a running episode has its environment)
        turn_ids = r.tokens[ep.turn_start:]
        ep.turns.append((ep.turn_start, len(r.tokens)))
        if not ended_on_eos:  # cut mid-turn: its calls are not run, it is the answer as it stands
            ep.env.step(AssistantTurn(self.tokenizer.decode(turn_ids)))
            return self._finish(r, truncated=True)
        obs = self._step(ep, turn_ids)
        if obs.done:
            return self._finish(r, truncated=False)
        ids = self.turns_for(ep.env).observation(obs.messages)
        if len(ep.turns) >= self.max_turns or len(r.tokens) + len(ids) >= self.max_new_tokens:
            return self._finish(r, truncated=True)
        version = r.versions[-1] if r.versions else 0
        r.tokens += ids
        r.logprobs += [0.0] * len(ids)
        r.versions += [version] * len(ids)  # (the turn it answers: observations draw nothing)
        r.observed += [True] * len(ids)
        ep.turn_start = len(r.tokens)
        r.finish = None
        return None

    def _turn(self, turn_ids: Sequence[int]) -> AssistantTurn:
        """A turn's ids as the environment sees them: decoded, its calls parsed."""
        parsed = self.parse(self.tokenizer.decode(turn_ids))
        return AssistantTurn(parsed.content, parsed.calls, parsed.error)

    def _step(self, ep: EpisodeState, turn_ids: Sequence[int]) -> Observation:
        turn = self._turn(turn_ids)
        ep.tool_calls += len(turn.calls)
        ep.parse_errors += turn.error is not None
        assert ep.env is not None  # (a running episode has its environment)
        obs = ep.env.step(turn)
        ep.turn_rewards += float(obs.reward)
        return obs

    @staticmethod
    def _finish(r: PartialResponse, truncated: bool) -> None:
        """End the episode and score it now: its reward is the environment's final reward plus
        the per-turn rewards (the environment is not needed after, nor saved)."""
        ep = r.episode
        assert ep is not None and ep.env is not None  # (a running episode has its environment)
        ep.truncated = truncated
        r.finish = "length" if truncated else "stop"
        ep.reward = float(ep.env.reward()) + ep.turn_rewards
        ep.reward_timeouts = int(getattr(ep.env, "reward_timeouts", 0))  # (a user's environment may not count)
        ep.env = None

    def restore(self, problem: Problem, r: PartialResponse) -> None:
        """Rebuild a resumed running episode's environment by showing a fresh one the turns it
        had (a finished one keeps its reward and needs none)."""
        ep = r.episode
        if r.finish is not None or ep is None:
            return
        ep.env = env = self.make_env(problem)
        replay(env, [self._turn(r.tokens[start:end]) for start, end in ep.turns])
