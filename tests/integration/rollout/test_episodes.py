"""Multi-turn episodes (`moe_rl.rollout.episodes`, issue #49) on the transformers sampler and
the shipped tool tokenizer: token in, token out over three turns (each turn the engine's own
ids from exactly the episode's ids so far, each observation the template's ids once, never a
text round trip), every token's log-prob and routes from the computation that drew it, the
limits, and the tool environment and call parsers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.rollout.episodes import Episodes
from moe_rl.rollout.pool import RolloutPool, segment_seed
from moe_rl.sampler import HFEngineConfig, make_sampler
from moe_rl.sampler.base import base_seeds
from moe_rl.sampler.hf_backend import HFSampler
from moe_rl.tasks import make_task
from moe_rl.tasks.environment import AssistantTurn, Environment, Observation, ToolEnvironment
from moe_rl.tokenization import load_tokenizer
from moe_rl.tokenization.tool_calls import ToolCall, parse_glm45, parse_hermes, tool_call_parser
from moe_rl.tokenization.turns import ChatTurns
from moe_rl_testing.sampler_utils import TINY, router_margin

TOOL_TOKENIZER = "moe_rl/assets/tool_tokenizer"
G, TURN, T = 3, 10, 1.0
IM_END = 2


class GoOn(Environment):
    """Never done: answers every turn with a user message, 0.25 per turn; the final reward is
    1 when the last turn said anything. (Named by task.environment=tests.integration.rollout.test_episodes:GoOn.)"""

    def __init__(self, problem, task) -> None:
        super().__init__(problem, task)
        self.last = ""

    def step(self, turn: AssistantTurn) -> Observation:
        self.last = turn.content
        return Observation(({"role": "user", "content": "go on"},), reward=0.25)

    def reward(self) -> float:
        return 1.0 if self.last.strip() else 0.0


@pytest.fixture(scope="module")
def tool_moe(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("toolmoe") / "hf"
    cfg = transformers.Qwen3MoeConfig(**{**TINY, "vocab_size": 512, "max_position_embeddings": 256},
                                      eos_token_id=[IM_END, 0])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
        # <|im_end|>'s output row along the mean final hidden state of an episode's context, its
        # logit there set ~1.4 below the others' logsumexp (~20% of the mass): most turns end
        # within TURN tokens
        tok = load_tokenizer(TOOL_TOKENIZER)
        prompt = ChatTurns(tok, tok.chat_template).opening([{"role": "user", "content": "What is 12345 + 67890?"}])
        tail = torch.randint(3, 508, (8, 24), generator=torch.Generator().manual_seed(0))
        ids = torch.cat([torch.tensor(prompt).expand(8, -1), tail], 1)
        h = model.model(ids).last_hidden_state[:, len(prompt) - 1:].reshape(-1, cfg.hidden_size)
        model.lm_head.weight[IM_END] = 0.0
        others = torch.logsumexp(model.lm_head(h), -1).mean()
        d = h.mean(0) / h.mean(0).norm()
        model.lm_head.weight[IM_END] = d * (others - 1.4) / (h @ d).mean()
    model.generation_config.eos_token_id = [IM_END, 0]
    model.save_pretrained(path)
    return path


def episode_cfg(*overrides: str):
    return load_config(None, ["task.name=calculator", f"task.tokenizer={TOOL_TOKENIZER}", "rl.max_turns=3",
                              f"rl.max_turn_tokens={TURN}", "sampler.max_new_tokens=120",
                              "task.environment=tests.integration.rollout.test_episodes:GoOn", f"rl.group_size={G}", "model.vocab_size=512",
                              *overrides])


def run_episodes(sampler, cfg, num: int = 4, seed: int = 11):
    tok = load_tokenizer(cfg.task.tokenizer)
    task = make_task(cfg.task)
    episodes = Episodes(task, tok, tok.chat_template, rl=cfg.rl, task_cfg=cfg.task,
                        max_new_tokens=cfg.sampler.max_new_tokens)
    problems = task.sample(num, seed)
    pool = RolloutPool(cfg.sampler.max_new_tokens, TURN, episodes)
    for i, (p, s) in enumerate(zip(problems, base_seeds(seed, num, G))):
        prompt, states = episodes.start(p, G)
        pool.admit((1, 0, i), prompt, s, G, states)
    rounds = 0
    while pool.running:
        pool.segment(sampler, 0, T, 1.0)
        rounds += 1
    return tok, episodes, sorted(pool.done, key=lambda g: g.key), rounds


def test_token_in_token_out_over_three_turns(tool_moe):
    """Every turn is what the engine samples from exactly the episode's ids so far (replayed
    alone with the turn's seed), every observation is the template's ids for the
    environment's message, the sampler's log-probs are the teacher-forced log-probs of the
    whole episode at the policy's tokens (0 at the observations), and decoding the episode
    and encoding the text again would have changed its ids."""
    hf = make_sampler(tool_moe, HFEngineConfig(batch_size=32))
    tok, _, groups, rounds = run_episodes(hf, episode_cfg())
    obs_ids = ChatTurns(tok, tok.chat_template).observation([{"role": "user", "content": "go on"}])
    replay = HFSampler(tool_moe)
    three, round_trip_differs = 0, 0
    for g in groups:
        for j, r in enumerate(g.responses):
            ep = r.episode
            assert r.finish == "length" and ep.truncated  # (GoOn is never done: a limit ends every episode)
            context = list(g.prompt)
            for k, (start, end) in enumerate(ep.turns):
                if k:  # the observation between turns k - 1 and k
                    assert r.tokens[ep.turns[k - 1][1]:start] == obs_ids
                    assert all(r.observed[ep.turns[k - 1][1]:start]) and not any(r.observed[start:end])
                    context += obs_ids
                again = replay.generate([context], n=1, max_new_tokens=TURN, temperature=T,
                                        prompt_seeds=[segment_seed(g.seed, j, k)])
                assert again.response_token_ids[0][: end - start] == r.tokens[start:end]
                context += r.tokens[start:end]
            assert context == g.prompt + r.tokens
            three += len(ep.turns) == 3
            lp = replay.score([g.prompt], [r.tokens], T)[0]
            policy = [not o for o in r.observed]
            torch.testing.assert_close([x for x, p in zip(r.logprobs, policy) if p],
                                       [x for x, p in zip(lp, policy) if p], atol=1e-4, rtol=0)
            assert all(x == 0.0 for x, p in zip(r.logprobs, policy) if not p)
            text = tok.hf.decode(r.tokens, skip_special_tokens=False)
            round_trip_differs += tok.hf.encode(text, add_special_tokens=False) != r.tokens
            assert ep.reward == pytest.approx(0.25 * len(ep.turns) + (1.0 if ep.turns else 0.0), abs=1.0)
    assert three >= 4, f"only {three} episodes reached 3 turns"
    assert round_trip_differs >= 1
    assert rounds <= 3 + 1  # (continuous batching: a round per turn, whatever turn each episode is at)


def test_each_position_keeps_the_routes_of_the_computation_that_fed_it(tool_moe):
    """R3's record of an episode covers every position fed, observations included; with fixed
    weights it is the teacher-forced routing of the whole episode (positions where two experts
    tie within fp32 noise aside)."""
    from tests.integration.rollout.test_rollout_pool import _routes

    hf = make_sampler(tool_moe, HFEngineConfig(batch_size=32))
    _, _, groups, _ = run_episodes(hf, episode_cfg(), num=3, seed=5)
    ref = HFSampler(tool_moe)
    assert check_episode_routes(groups, ref, lambda seq: _routes(ref, seq), margin=1e-5) >= 3


def check_episode_routes(groups, ref: HFSampler, whole_routes, margin: float, multi_turn_only: bool = False) -> int:
    """Every episode's routes cover each position fed, and equal `whole_routes(seq)` (the same
    weights' routing of the whole episode) where no router ties within `margin` under `ref`'s
    model; returns how many episodes were compared."""
    checked = 0
    for g in groups:
        for r in g.responses:
            seq = g.prompt + r.tokens
            assert r.routed is not None and r.routed.shape[0] == len(seq) - 1
            if (not multi_turn_only or len(r.episode.turns) > 1) and router_margin(ref.model, g.prompt, r.tokens) > margin:
                np.testing.assert_array_equal(r.routed, whole_routes(seq))
                checked += 1
    return checked


def test_hermes_and_glm45_calls_parse_and_malformed_ones_say_why():
    ok = parse_hermes('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>')
    assert ok.content == "I will add." and ok.calls == (ToolCall("add", {"a": 1, "b": 22}),) and ok.error is None
    as_string = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 3}"}</tool_call>')
    assert as_string.calls == (ToolCall("f", {"x": 3}),)
    for text, why in [('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "is not JSON"),
                      ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
                      ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not an object"),
                      ('<tool_call>{"name": "add"', "not closed")]:
        bad = parse_hermes(text)
        assert bad.error is not None and why in bad.error and "\n" not in bad.error, text
    glm = parse_glm45("ok<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>12</arg_value>\n"
                      "<arg_key>b</arg_key><arg_value>x y</arg_value></tool_call>")
    assert glm.content == "ok" and glm.calls == (ToolCall("add", {"a": 12, "b": "x y"}),)
    tok = load_tokenizer(TOOL_TOKENIZER)
    assert tool_call_parser("auto", tok.chat_template) is parse_hermes
    with pytest.raises(ValueError, match=r"task\.tool_parser"):
        tool_call_parser("auto", "{{ messages }}")


def test_the_tool_environment_runs_calls_and_answers_errors_in_the_tools_place():
    task = make_task(episode_cfg().task)
    problem = task.sample(1, 0)[0]
    a, b = problem.meta["a"], problem.meta["b"]
    env = ToolEnvironment(problem, task, task.tools)
    obs = env.step(AssistantTurn("", (ToolCall("add", {"a": a, "b": b}), ToolCall("mul", {}),
                                      ToolCall("add", {"a": 1}))))
    assert [m["role"] for m in obs.messages] == ["tool"] * 3 and not obs.done
    assert obs.messages[0]["content"] == str(int(a) + int(b))
    assert "no tool named 'mul'" in obs.messages[1]["content"]
    assert obs.messages[2]["content"].startswith("error: TypeError")
    assert env.step(AssistantTurn("", error="x is not JSON")).messages[0]["content"] == "error: x is not JSON"
    done = env.step(AssistantTurn(problem.answer))
    assert done.done and env.reward() == 1.0
    json.dumps([dict(m) for m in obs.messages])  # (messages are plain JSON: they go through the template)


def test_a_cut_turn_ends_its_episode_truncated_and_scored_as_it_stands(tool_moe):
    """With one-token turns every turn is cut before its EOS: one turn per episode, truncated,
    its text scored by the environment (GoOn: 1 when it said anything), no observation."""
    hf = make_sampler(tool_moe, HFEngineConfig(batch_size=32))
    cfg = episode_cfg("rl.max_turn_tokens=1")
    tok = load_tokenizer(cfg.task.tokenizer)
    task = make_task(cfg.task)
    episodes = Episodes(task, tok, tok.chat_template, rl=cfg.rl, task_cfg=cfg.task,
                        max_new_tokens=cfg.sampler.max_new_tokens)
    pool = RolloutPool(cfg.sampler.max_new_tokens, 1, episodes)
    prompt, states = episodes.start(task.sample(1, 0)[0], G)
    pool.admit((1, 0, 0), prompt, 7, G, states)
    while pool.running:
        pool.segment(hf, 0, T, 1.0)
    for r in pool.done[0].responses:
        assert len(r.episode.turns) == 1 and r.finish == ("stop" if r.tokens[-1] in (IM_END, 0) else "length")
        assert not any(r.observed)


def test_multi_turn_settings_are_checked_with_one_line_errors():
    from moe_rl.config import ConfigError

    for overrides, why in [(["task.chat_template=none"], "needs a chat template"),
                           (["rl.advantage=gae"], "not implemented with rl.advantage=gae"),
                           (["task.tool_parser=json"], "task.tool_parser=json"),
                           (["task.tools=[nocolon]"], "task.tools='nocolon'"),
                           (["rl.max_turns=0"], "rl.max_turns must be >= 1")]:
        with pytest.raises(ConfigError, match=why):
            episode_cfg(*overrides)
