"""The agent gateway (`moe_rl.rollout.gateway`): the real `openai` client against the real
server, one server shared by the tests (the transformers sampler on the shipped tool base).
The same calculator episodes through the agent (examples/agents/calculator_agent.py) and
through the tool environment give identical ids, masks and routes, log-probs within 1e-4;
refused requests are 400 / 409 with their line; agents that hang or raise are dropped and
counted; a rewritten history is a counted reset; no port is left open."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import numpy as np
import openai
import pytest
import torch

from examples.agents.calculator_agent import TOOLS, solve
from moe_rl.config import load_config
from moe_rl.rollout.episodes import Episodes
from moe_rl.rollout.gateway.agents import agent_groups, run_agents
from moe_rl.rollout.gateway.server import Gateway
from moe_rl.rollout.gateway.trajectory import Budget
from moe_rl.rollout.pool import RolloutPool
from moe_rl.sampler import HFEngineConfig, make_sampler
from moe_rl.sampler.base import base_seeds
from moe_rl.tasks import make_task
from moe_rl.tokenization import load_tokenizer
from moe_rl_testing import ROOT

TURNS, TURN, EPISODE, G = 3, 40, 128, 4


@pytest.fixture(scope="module")
def tool_base_hf(tmp_path_factory):
    """The shipped tool base as a Hugging Face directory."""
    from moe_rl.convert import megatron_to_hf

    hf = tmp_path_factory.mktemp("toolbase") / "hf"
    megatron_to_hf(ROOT / "moe_rl/assets/tool_base", hf, force=True, trust=True)
    return hf


@pytest.fixture(scope="module")
def served(tool_base_hf):
    """(gateway, sampler, tokenizer, task, config): the shipped tool base served once."""
    hf = tool_base_hf
    cfg = load_config(None, ["task.name=calculator", "task.tokenizer=moe_rl/assets/tool_tokenizer", "task.min_digits=5",
                             "task.max_digits=7", f"rl.max_turns={TURNS}", f"rl.max_turn_tokens={TURN}",
                             f"sampler.max_new_tokens={EPISODE}", f"rl.group_size={G}", "model.vocab_size=512"])
    tok = load_tokenizer(cfg.task.tokenizer)
    sampler = make_sampler(hf, HFEngineConfig(batch_size=64, eos_token_ids=tok.eos_ids))
    gateway = Gateway(sampler, tok, tok.chat_template, budget=Budget(TURNS, TURN, EPISODE), sampling=(1.0, 1.0),
                      window_s=5.0)
    gateway.start()
    yield gateway, sampler, tok, make_task(cfg.task), cfg
    port = gateway.port
    gateway.stop()
    with socket.socket() as s:  # no port left open
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_calculator_episodes_through_the_agent_equal_the_tool_environments(served):
    """Same problems, seeds and batching: per episode the same prompt and ids, the same
    observation mask and routes, log-probs within 1e-4; tools called and several calls made;
    and the ids are the engine's: decoding and encoding again would change some."""
    gateway, sampler, tok, task, cfg = served
    problems, seeds = task.sample(3, 28), base_seeds(28, 3, G)
    episodes = Episodes(task, tok, tok.chat_template, rl=cfg.rl, task_cfg=cfg.task, max_new_tokens=EPISODE)
    pool = RolloutPool(EPISODE, TURN, episodes)
    for i, (p, s) in enumerate(zip(problems, seeds)):
        episodes.admit(pool, (1, 0, i), p, s, G)
    while pool.running:
        pool.segment(sampler, 0, 1.0, 1.0)
    env_groups = sorted(pool.done, key=lambda g: g.key)
    batches = gateway.batcher.batches
    outcomes = run_agents(gateway, solve, "calculator_agent:solve", problems, seeds, G, task, 120.0)
    assert gateway.batcher.batches - batches <= TURNS  # (one engine call per round, as the pool's)
    agent = agent_groups(outcomes, 0, tok.decode)
    calls = multi = 0
    for eg, ag, outs in zip(env_groups, agent, outcomes):
        assert ag.prompt == eg.prompt
        for r, ids, lps, obs, routed, o, reward in zip(eg.responses, ag.responses, ag.logprobs, ag.observed, ag.routed,
                                                       outs, ag.rewards):
            assert o.failure == "" and o.episode.resets == 0 and o.episode.parse_errors == 0
            assert ids == r.tokens and obs == r.observed
            torch.testing.assert_close(lps, r.logprobs, atol=1e-4, rtol=0)
            np.testing.assert_array_equal(routed, r.routed)
            assert routed.shape[0] == len(ag.prompt) + len(ids) - 1
            assert reward == r.episode.reward
            calls += o.episode.tool_calls
            multi += len(o.episode.segments[0].turns) > 1
    assert calls >= 1 and multi >= 1, (calls, multi)


def test_the_engines_ids_are_kept_where_re_encoding_the_history_would_change_them(served):
    """A turn the engine sampled in ids the tokenizer would not produce from its text (the
    round trip tests/integration/rollout/test_episodes.py finds): the agent sends the text back in its history,
    and the episode goes on from the engine's ids, the new user message appended as ids;
    rendering and encoding the agent's history would have given other ids."""
    gateway, _, tok, _, _ = served
    ep = gateway._episode((950, 0), 1)
    history = [{"role": "user", "content": "What is 1 + 2?"}]
    feed = ep.begin(history, TOOLS)
    word = "The answer is"
    split = [i for ch in word for i in tok.encode(ch)]  # (one id per character: not how `word` encodes)
    assert split != tok.encode(word)
    sampled = [*split, tok.eos_ids[0]]
    message, reason = ep.record(feed, sampled, [-0.5] * len(sampled), "stop", None)
    assert (message, reason) == ({"role": "assistant", "content": word}, "stop")
    history += [message, {"role": "user", "content": "Sure?"}]
    again = ep.begin(history, TOOLS)
    seg, turns = ep.segments[0], gateway.turns_for(TOOLS)
    observation = turns.observation([{"role": "user", "content": "Sure?"}])
    assert ep.resets == 0 and seg.tokens == sampled + observation and again.ids == seg.prompt + seg.tokens
    assert seg.observed == [False] * len(sampled) + [True] * len(observation)
    assert seg.logprobs == [-0.5] * len(sampled) + [0.0] * len(observation)
    re_encoded = turns.opening(history)  # (what re-encoding the history would have fed: the same text, other ids)
    assert re_encoded != again.ids
    assert tok.hf.decode(re_encoded, skip_special_tokens=False) == tok.hf.decode(again.ids, skip_special_tokens=False)


def _client(gateway: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url, api_key=key, max_retries=0, timeout=60)


Q = [{"role": "user", "content": "What is 12345 + 67890?"}]


@pytest.mark.parametrize(("kwargs", "line"), [
    ({"temperature": 0.5}, "temperature=0.5: this run samples at 1.0"),
    ({"top_p": 0.9}, "top_p=0.9: this run samples at 1.0"),
    ({"n": 2}, "n=2: an episode is one sequence of calls"),
    ({"tool_choice": "required"}, "tool_choice='required': the policy decides"),
    ({"max_tokens": TURN + 1}, f"max_tokens={TURN + 1}: a call may take at most {TURN} tokens"),
])
def test_what_the_learner_cannot_score_is_refused_with_one_line(served, kwargs, line):
    gateway = served[0]
    key = gateway.open([((900, 0), 5)])[(900, 0)]
    try:
        with pytest.raises(openai.BadRequestError) as e:
            _client(gateway, key).chat.completions.create(model="m", messages=Q, tools=TOOLS, **kwargs)
        assert e.value.status_code == 400 and line in e.value.message
    finally:
        gateway.close_episode(key)


def test_models_unknown_keys_concurrent_and_late_calls(served):
    """GET /v1/models; an unknown key is 401; a second call while the episode's first is in
    flight is 409, as is a call after its episode closed; the first call still answers."""
    gateway = served[0]
    assert [m.id for m in _client(gateway, "x").models.list().data] == ["moe_rl"]
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, "nobody").chat.completions.create(model="m", messages=Q)
    keys = gateway.open([((901, 0), 5), ((901, 1), 5)])  # (the second never calls: the batch waits its window)
    gateway.batcher.window_s = 1.0
    first: list = []
    t = threading.Thread(target=lambda: first.append(_client(gateway, keys[(901, 0)]).chat.completions.create(
        model="m", messages=Q, tools=TOOLS)))
    t.start()
    while not gateway.episodes[keys[(901, 0)]].busy:
        time.sleep(0.01)
    with pytest.raises(openai.ConflictError) as e:
        _client(gateway, keys[(901, 0)]).chat.completions.create(model="m", messages=Q, tools=TOOLS)
    assert "has a call in flight: calls of one episode are sequential" in e.value.message
    t.join()
    gateway.batcher.window_s = 5.0
    reply = first[0]
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens == len(
        gateway.episodes[keys[(901, 0)]].segments[0].prompt)
    for k in keys.values():
        gateway.close_episode(k)
    with pytest.raises(openai.ConflictError) as e:
        _client(gateway, keys[(901, 0)]).chat.completions.create(model="m", messages=Q)
    assert "is over" in e.value.message


async def hangs_async(problem, client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": problem.prompt}])
    await asyncio.sleep(3600)


def hangs_plain(problem, client, task):
    time.sleep(3)
    return 1.0


async def raises(problem, client, task):
    raise ValueError("no answer today")


def test_an_agent_returns_a_number_or_a_dict_with_per_call_rewards():
    from moe_rl.rollout.gateway.agents import _reward

    assert _reward(1) == 1.0 and _reward({"reward": 0.5, "call_rewards": [0.25, -0.5]}) == 0.25
    with pytest.raises(TypeError, match="return the reward"):
        _reward("1.0")


@pytest.mark.parametrize(("agent", "failure", "line"), [
    (hangs_async, "timeout", "took longer than task.agent_timeout_s=1.5 s"),
    (hangs_plain, "timeout", "took longer than task.agent_timeout_s=1.5 s"),
    (raises, "error", "raised on 'What is"),
])
def test_agents_that_hang_or_raise_are_dropped_and_counted(served, agent, failure, line):
    gateway, _, tok, task, _ = served
    outcomes = run_agents(gateway, agent, f"t:{agent.__name__}", task.sample(1, 4), [9], 2, task, 1.5)
    assert [o.failure for o in outcomes[0]] == [failure, failure]
    assert all(line in o.line and o.line.startswith(f"task.agent=t:{agent.__name__}") for o in outcomes[0])
    assert all(e.closed for e in gateway.episodes.values()) and not gateway.batcher._waiting
    (group,) = agent_groups(outcomes, 0, tok.decode)
    assert group.responses == [] and group.rewards == [] and group.episode_of == []  # (dropped: no row)
    assert [t[3:5] for t in group.episodes] == [(failure == "timeout", failure == "error")] * 2


async def rewrites(problem, client, task):
    msgs = [{"role": "user", "content": problem.prompt}]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    msgs = [{"role": "system", "content": "Be brief."}, *msgs, r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "Again?"}]
    await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    return 0.5


def test_a_rewritten_history_is_a_counted_reset_not_a_wrong_sequence(served):
    gateway, _, tok, task, _ = served
    (outs,) = run_agents(gateway, rewrites, "t:rewrites", task.sample(1, 6), [3], 1, task, 60.0)
    ep = outs[0].episode
    assert outs[0].reward == 0.5 and ep.resets == 1 and len(ep.segments) == 2
    turns = gateway.turns_for(TOOLS)
    assert ep.segments[0].prompt == turns.opening([{"role": "user", "content": task.sample(1, 6)[0].prompt}])
    assert tok.hf.decode(ep.segments[1].prompt, skip_special_tokens=False).startswith("<|im_start|>system\nBe brief.")
    (group,) = agent_groups([outs], 0, tok.decode)  # (each segment a row of the episode)
    assert group.episodes[0][5] == 1 and group.episode_of == [0, 0]
    assert [group.prompt + r for r in group.responses] == [s.prompt + s.tokens for s in ep.segments]


def test_serve_answers_the_openai_client_with_any_sampling_settings(tool_base_hf):
    """`moe_rl.serve` (no run): any key, n, temperature and seed; tool calls parsed into the
    standard shape; the same seed answers the same; the port is closed once stopped."""
    from moe_rl.serve import start_server

    gateway = start_server(tool_base_hf, tokenizer="moe_rl/assets/tool_tokenizer", max_tokens=TURN)
    try:
        client = _client(gateway, "anything")
        ask = {"model": "m", "messages": Q, "tools": TOOLS, "n": 8, "temperature": 0.9, "seed": 3}
        first, again = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
        assert len(first.choices) == 8 and first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
        assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
        called = [c for c in first.choices if c.message.tool_calls]
        assert called and all(c.finish_reason == "tool_calls" for c in called)
        args = json.loads(called[0].message.tool_calls[0].function.arguments)
        assert called[0].message.tool_calls[0].function.name == "add" and set(args) == {"a", "b"}
    finally:
        port = gateway.port
        gateway.stop()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize(("overrides", "line"), [
    (["rl.max_turns=1"], "task.agent=m:f: an agent's episode is multi-turn; set rl.max_turns > 1"),
    (["rl.partial_rollouts=true", "rl.max_staleness=1", "sampler.placement=separate", "sampler.engine_ranks=1",
      "rl.rollout_correction=tis"],
     "task.agent=m:f: partial rollouts and in-flight weight updates would need"),
    (["task.environment=m:E"], "task.agent=m:f and task.environment=m:E: an episode runs either"),
    (["task.agent_timeout_s=0"], "task.agent_timeout_s"),
    (["task.max_agent_failures_frac=2"], "task.max_agent_failures_frac"),
])
def test_agent_settings_are_checked_with_one_line_errors(overrides, line):
    from moe_rl.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=calculator", "task.tokenizer=moe_rl/assets/tool_tokenizer", "task.agent=m:f",
                           "rl.max_turns=3", "model.vocab_size=512", *overrides])
    assert line in str(e.value) and "\n" not in str(e.value)


@pytest.mark.multiproc
@pytest.mark.slow
def test_r3_replays_whole_agent_episodes_exactly_with_a_separate_engine(tmp_path):
    """examples/tiny_agent.yaml under torchrun (one learner rank, one engine rank running the
    agents, one step ahead), the transformers sampler recording routes through the gateway:
    used = replayed at every position of every episode, tools called, several calls made."""
    from moe_rl_testing.async_runs import train

    rows = train(ROOT / "examples" / "tiny_agent.yaml",
                 ["sampler.backend=transformers", "sampler.placement=separate", "sampler.engine_ranks=1",
                  "rl.max_staleness=1", "rl.rollout_correction=tis", "rl.replay=R3", "rl.prompts_per_step=4",
                  "rl.group_size=4", "run.steps=3", "run.save_every=0", "logging.progress=false",
                  "logging.tensorboard=false"], tmp_path, "r3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["routing/sampler_used_disagree_any"] == 0 for r in rows)
    assert max(r["rollout/turns_mean"] for r in rows) > 1.0 and max(r["rollout/tool_calls_mean"] for r in rows) > 0
    assert all(r["rollout/agent_errors"] == 0 and r["rollout/agent_timeouts"] == 0 for r in rows)
