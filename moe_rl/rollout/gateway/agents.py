"""Agent programs as environments (`task.agent: module.path:function`).

    outcomes = run_agents(gateway, agent, "my_pkg.agents:solve", problems, seeds, G, task, timeout_s)
    groups = agent_groups(outcomes, version, decode)     # ScoredGroups, one per problem

Each of a problem's G episodes calls the agent once, concurrently: an `async def
agent(problem, client, task)` gets an `openai.AsyncOpenAI` bound to its episode (the
gateway's base URL, the episode's api key, `max_retries=0`: a refused call is the agent's to
handle, never silently retried); a plain function gets an `openai.OpenAI` and runs in a
worker thread. It returns the episode's reward: a number, or a dict with `reward` and
optionally `call_rewards` (per-call rewards, added to it).

`task.agent_timeout_s` ends an episode that hangs: an async agent is cancelled, a plain
function's thread abandoned (its late result, and any later call, ignored: the episode is
closed, its calls answered 409). An agent that raises is one line naming the function and
the problem. Either way the episode is dropped from the step: it has no row, its group's
advantages are computed over the episodes it kept and the reward statistics count only
those (`moe_rl.rollout.packing`); counted in rollout/agent_timeouts and
rollout/agent_errors, and above task.max_agent_failures_frac of a step's episodes (or when
none is left) the run stops with the first line (`check_agent_failures`).

An episode whose agent rewrote its history has several segments (`trajectory`), counted in
rollout/agent_resets: each is a row of its own, trained on with the episode's reward and
advantage. The episode counts once in its group's advantages (`ScoredGroup.episode_of`:
each row's episode), so a group's rows may be more than G, or fewer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_rl.rollout.gateway.server import Gateway
from moe_rl.rollout.gateway.trajectory import AgentEpisode, Budget
from moe_rl.rollout.types import ScoredGroup

log = logging.getLogger(__name__)


class AgentFailuresError(RuntimeError):
    """Too many of a step's agent episodes timed out or raised (one line)."""


@dataclass
class Outcome:
    """One agent episode as it ended."""

    episode: AgentEpisode
    reward: float | None
    """None: dropped (timed out or raised)."""
    failure: str = ""
    """"timeout" or "error" (dropped), "" (kept)."""
    line: str = ""
    """The one line on a failure."""


def _reward(result: Any) -> float:
    """The episode's reward: a number, or a dict's `reward` plus the sum of its `call_rewards`
    (per-call rewards, as an environment's per-turn rewards add to its final one)."""
    value = result.get("reward") if isinstance(result, dict) else result
    extra = result.get("call_rewards", ()) if isinstance(result, dict) else ()
    numbers = [value, *extra]
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in numbers):
        raise TypeError(f"returned {type(result).__name__} {str(result)[:60]!r}; return the reward (a number) "
                        "or a dict with 'reward' (and optionally 'call_rewards', a list of numbers)")
    return float(sum(numbers))


async def _call(agent: Callable[..., Any], problem: Any, task: Any, url: str, api_key: str, timeout_s: float,
                http: Any) -> Any:
    import openai

    if inspect.iscoroutinefunction(agent):  # (the episodes' clients share one connection pool, `http`)
        client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, http_client=http)
        return await asyncio.wait_for(agent(problem, client, task), timeout_s)
    sync_client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:  # (abandoned at the timeout: a daemon thread, its late result dropped)
        try:
            fut.set_result(agent(problem, sync_client, task))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=work, name=f"agent-{api_key}", daemon=True).start()
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)


async def _episode(gateway: Gateway, agent: Callable[..., Any], spec: str, problem: Any, task: Any, api_key: str,
                   timeout_s: float, http: Any) -> Outcome:
    try:
        result = await _call(agent, problem, task, gateway.url, api_key, timeout_s, http)
        reward, failure, line = _reward(result), "", ""
    except TimeoutError:
        reward, failure = None, "timeout"
        line = f"task.agent={spec} took longer than task.agent_timeout_s={timeout_s:g} s on {problem.prompt[:60]!r}"
    except Exception as e:  # (the user's program: whatever it raised)
        reward, failure = None, "error"
        line = f"task.agent={spec} raised on {problem.prompt[:60]!r}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    ep = gateway.close_episode(api_key)
    if failure == "" and not ep.segments:
        reward, failure, line = None, "error", f"task.agent={spec} made no call on {problem.prompt[:60]!r}"
    if line:
        log.warning("%s: its episode is dropped", line)
    return Outcome(ep, reward, failure, line)


def run_agents(gateway: Gateway, agent: Callable[..., Any], spec: str, problems: Sequence[Any], seeds: Sequence[int],
               group_size: int, task: Any, timeout_s: float) -> list[list[Outcome]]:
    """Every problem's `group_size` episodes through `agent` (named `spec`), concurrently, on
    the started `gateway`; the outcomes by problem then response."""
    for name in ("httpx", "httpx2"):  # (the openai client's HTTP library: not a line per agent call in the log)
        logging.getLogger(name).setLevel(logging.WARNING)
    keys = gateway.open([((i, j), seeds[i]) for i in range(len(problems)) for j in range(group_size)])

    async def everything() -> list[Outcome]:
        import openai

        async with openai.DefaultAsyncHttpxClient() as http:
            return await asyncio.gather(*[_episode(gateway, agent, spec, problems[i], task, keys[(i, j)], timeout_s,
                                                   http) for i in range(len(problems)) for j in range(group_size)])

    flat = asyncio.run(everything())
    return [flat[i * group_size:(i + 1) * group_size] for i in range(len(problems))]


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        n = next((k for k in range(n) if s[k] != first[k]), n)
    return first[:n]


def agent_groups(outcomes: list[list[Outcome]], version: int,
                 decode: Callable[[Sequence[int]], str]) -> list[ScoredGroup]:
    """Each problem's episodes as one `ScoredGroup`: a row per segment of each kept episode
    (the prompt every row shares, and per row the rest of its segment's prompt, observed,
    then its tokens), each row with its episode's reward and index (`episode_of`); a
    dropped episode (or one that sampled nothing) has no row. The tallies are per episode,
    dropped ones too."""
    groups = []
    for outs in outcomes:
        segs = [(e, seg) for e, o in enumerate(outs) if o.reward is not None
                for seg in o.episode.segments if seg.turns]
        prompt = _common_prefix([seg.prompt for _, seg in segs]) if segs else []
        if segs and not prompt:
            raise RuntimeError("an agent group's segments share no prompt token (the chat template's openings "
                               "differ from their first token); use a chat template that starts every conversation alike")
        routed_ok = bool(segs) and all(seg.routed is not None for _, seg in segs)
        trained = {e for e, _ in segs}
        rows = []
        for _, seg in segs:
            extra = seg.prompt[len(prompt):]
            rows.append((extra + seg.tokens, [0.0] * len(extra) + seg.logprobs, [True] * len(extra) + seg.observed))
        raised = [o.failure == "error" or (o.failure == "" and e not in trained) for e, o in enumerate(outs)]
        tallies: list[tuple[int, ...]] = [(*o.episode.tally(), int(o.failure == "timeout"), int(raised[e]),
                                           o.episode.resets) for e, o in enumerate(outs)]
        groups.append(ScoredGroup(prompt, [r[0] for r in rows], [r[1] for r in rows],
                                  [decode(seg.tokens) for _, seg in segs], [float(outs[e].reward or 0.0) for e, _ in segs],
                                  [seg.finish or "stop" for _, seg in segs],
                                  _all_routed([seg.routed for _, seg in segs]) if routed_ok else None, version,
                                  observed=[r[2] for r in rows], episodes=tallies, episode_of=[e for e, _ in segs]))
    return groups


def check_agent_failures(stats: dict[str, float], max_frac: float, spec: str, rows: int = 1) -> None:
    """Stop the run when more than `max_frac` of the step's agent episodes failed, or when
    no episode is left to train on (`rows`: the step's)."""
    frac = stats.get("rollout/agent_failed_frac", 0.0)
    if frac > max_frac or rows == 0:
        raise AgentFailuresError(
            f"task.agent={spec}: {frac:.0%} of the step's episodes timed out or raised "
            f"({stats.get('rollout/agent_timeouts', 0):.0f} timeouts, {stats.get('rollout/agent_errors', 0):.0f} "
            f"errors), {'leaving nothing to train on' if rows == 0 else f'above task.max_agent_failures_frac={max_frac:g}'}; "
            "fix the agent (the log names each failure) or raise task.agent_timeout_s")


def draw_agent_groups(sampler: Any, tokenizer: Any, template: str | None, task: Any, *, task_cfg: Any, rl: Any,
                      sampler_cfg: Any, problems: Sequence[Any], seeds: Sequence[int],
                      version: int) -> list[ScoredGroup]:
    """One draw's problems through `task_cfg.agent`, G episodes each, on a gateway over
    `sampler` served for the draw alone (started, then stopped: no port stays open), with
    the run's sampling settings (`sampler_cfg`) and turn limits (`rl`)."""
    from moe_rl.tasks.user_code import load_object

    if template is None:
        raise ValueError(f"task.agent={task_cfg.agent}: the gateway renders the agent's messages with a chat "
                         "template; set task.chat_template=auto with a tokenizer that has one, or a .jinja file")
    agent = load_object(task_cfg.agent, "task.agent")
    budget = Budget(rl.max_turns, rl.max_turn_tokens or sampler_cfg.max_new_tokens, sampler_cfg.max_new_tokens)
    gateway = Gateway(sampler, tokenizer, template, budget=budget, sampling=(sampler_cfg.temperature, sampler_cfg.top_p),
                      tool_parser=task_cfg.tool_parser)
    gateway.start()
    try:
        outcomes = run_agents(gateway, agent, task_cfg.agent, problems, seeds, rl.group_size, task,
                              task_cfg.agent_timeout_s)
    finally:
        gateway.stop()
    return agent_groups(outcomes, version, tokenizer.decode)


def _all_routed(routes: list[np.ndarray | None]) -> list[np.ndarray]:
    """Every row's routes (a group is routed only when each of its rows is)."""
    out = [r for r in routes if r is not None]
    if len(out) != len(routes):
        raise RuntimeError("an agent group mixes rows with and without routed experts")
    return out
