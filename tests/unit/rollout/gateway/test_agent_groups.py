"""Agent episodes as training rows (`moe_rl.rollout.gateway.agents.agent_groups`) and their
advantages and statistics (`moe_rl.rollout.packing`), from hand-built episodes (no server):
a reset episode trains every segment with the episode's advantage, counted once in its
group; a dropped episode has no row and no part in any reward, sequence or token count."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.rollout.gateway.agents import (
    AgentFailuresError,
    Outcome,
    agent_groups,
    check_agent_failures,
)
from moe_rl.rollout.gateway.trajectory import AgentEpisode, Budget, Segment
from moe_rl.rollout.packing import pack_rows, plan_step
from moe_rl.rollout.types import GroupSummary


def _episode(e: int, resets: int, *segments: Segment) -> AgentEpisode:
    ep = AgentEpisode((0, e), 0, Budget(3, 8, 32), turns_for=lambda tools: None, parse=lambda text: None,
                      decode=lambda ids: " ".join(map(str, ids)))
    ep.segments, ep.resets = list(segments), resets
    return ep


def _segment(prompt: list[int], tokens: list[int], observed: list[bool]) -> Segment:
    logprobs = [0.0 if o else -0.1 * (k + 1) for k, o in enumerate(observed)]
    return Segment(prompt, tokens, logprobs, observed, turns=[(0, len(tokens))], finish="stop")


def _outcomes() -> list[Outcome]:
    """Rewards 1, 0 (two segments: the agent changed its system prompt), dropped, 1."""
    return [
        Outcome(_episode(0, 0, _segment([1, 2, 3, 5], [7, 8], [False, False])), 1.0),
        Outcome(_episode(1, 1, _segment([1, 2, 3, 6], [9], [False]),
                         _segment([1, 4, 4], [10, 11, 12], [False, True, False])), 0.0),
        Outcome(_episode(2, 0, _segment([1, 2, 3, 5], [14, 15], [False, False])), None, "timeout", "took longer"),
        Outcome(_episode(3, 0, _segment([1, 2, 3, 5], [13], [False])), 1.0),
    ]


def test_every_segment_trains_with_its_episodes_advantage_and_a_dropped_episode_nowhere():
    """GRPO over the kept episodes' rewards [1, 0, 1] (not the rows' [1, 0, 0, 1], not with the
    dropped one's 0): mean 2/3, unbiased std 1/sqrt(3), so +1/sqrt(3) for the solved ones and
    -2/sqrt(3) on both rows of the reset one; 4 rows of 6 trained tokens; reward/mean 2/3."""
    (group,) = agent_groups([_outcomes()], 5, decode=lambda ids: " ".join(map(str, ids)))
    assert group.prompt == [1] and group.episode_of == [0, 1, 1, 3] and group.rewards == [1.0, 0.0, 0.0, 1.0]
    assert group.responses == [[2, 3, 5, 7, 8], [2, 3, 6, 9], [4, 4, 10, 11, 12], [2, 3, 5, 13]]
    assert group.observed == [[True, True, True, False, False], [True, True, True, False],
                              [True, True, False, True, False], [True, True, True, False]]
    assert group.logprobs[2] == [0.0, 0.0, -0.1, 0.0, -0.30000000000000004]
    assert [t[3:] for t in group.episodes] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (0, 0, 0)]

    cfg = load_config(None, ["rl.advantage=grpo", "rl.group_size=4", "sampler.max_new_tokens=8"])
    summary = group.summary()
    plan = plan_step([summary], [summary], 1, cfg.rl, 1)
    a = 1 / math.sqrt(3)
    torch.testing.assert_close(plan.adv_R, torch.tensor([a, -2 * a, -2 * a, a]), atol=1e-5, rtol=0)
    assert plan.rows == 4 and plan.seq_len == 1 + 5
    s = plan.stats
    assert s["reward/mean"] == pytest.approx(2 / 3) and s["reward/std"] == pytest.approx(a)
    assert s["reward/solved_frac"] == pytest.approx(2 / 3) and s["reward/mean_all_draws"] == pytest.approx(2 / 3)
    assert s["response/length_mean"] == pytest.approx(18 / 4) and s["response/truncated_frac"] == 0.0
    assert s["advantage/abs_mean"] == pytest.approx(6 * a / 4, abs=1e-5)
    assert (s["rollout/agent_timeouts"], s["rollout/agent_errors"], s["rollout/agent_resets"]) == (1.0, 0.0, 1.0)
    assert s["rollout/agent_failed_frac"] == 0.25 and s["rollout/turns_mean"] == pytest.approx(4 / 3)

    rows = [group.row(j, j) for j in range(4)]
    batch, rewards_B, texts = pack_rows(rows, plan, cfg.model, 8, pad_id=0)
    torch.testing.assert_close(batch.adv_B, plan.adv_R)
    assert rewards_B.tolist() == [1.0, 0.0, 0.0, 1.0] and texts[2] == "10 11 12"
    mask_BT = batch.response_mask()
    assert mask_BT.sum(1).tolist() == [2, 1, 2, 1] and batch.step_rows == 4  # (the loss's token and sequence counts)
    assert mask_BT[2, :5].tolist() == [False, False, True, False, True]


def test_dropped_episodes_leave_a_groups_advantage_and_a_group_left_with_none_has_no_row():
    """dr_grpo over kept [1, 0, 1] beside a group of two plain rows [0, 1]: the agent group's
    mean is 2/3 (its dropped episode's 0 would make it 1/2), the plain group's 1/2; an
    agent group whose episodes all failed has no row; with no row in the step the run stops;
    rloo gives zeros to a group left with one episode, +-1 to [0, 1]."""
    rl = load_config(None, ["rl.advantage=dr_grpo", "rl.group_size=4"]).rl
    tallies = ((2, 1, 0, 0, 0, 0), (1, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0), (1, 0, 0, 0, 0, 0))
    agent = GroupSummary(5, (9, 3, 4, 3), (1.0, 0.0, 0.0, 1.0), ("stop",) * 4, episodes=tallies,
                         episode_of=(0, 1, 1, 3))
    plain = GroupSummary(2, (4, 6), (0.0, 1.0), ("stop", "length"))
    failed = GroupSummary(0, (), (), (), episodes=((1, 0, 0, 1, 0, 0), (1, 0, 0, 0, 1, 0)), episode_of=())
    plan = plan_step([agent, plain, failed], [agent, plain, failed], 1, rl, 1)
    torch.testing.assert_close(plan.adv_R, torch.tensor([1 / 3, -2 / 3, -2 / 3, 1 / 3, -0.5, 0.5]))
    s = plan.stats
    assert s["reward/mean"] == pytest.approx(3 / 5) and s["sampling/groups_with_signal_frac"] == pytest.approx(2 / 3)
    assert s["reward/zero_variance_frac"] == pytest.approx(1 / 3) and s["response/truncated_frac"] == pytest.approx(1 / 6)
    assert (s["rollout/agent_timeouts"], s["rollout/agent_errors"]) == (2.0, 1.0)
    assert s["rollout/agent_failed_frac"] == pytest.approx(3 / 6)
    check_agent_failures(s, 0.5, "a:b", plan.rows)
    with pytest.raises(AgentFailuresError, match=r"task.agent=a:b: 50% of the step's episodes timed out or raised "
                                                 r"\(2 timeouts, 1 errors\), above task.max_agent_failures_frac=0.4"):
        check_agent_failures(s, 0.4, "a:b", plan.rows)
    with pytest.raises(AgentFailuresError, match="leaving nothing to train on"):
        check_agent_failures(s, 1.0, "a:b", 0)
    rloo = load_config(None, ["rl.advantage=rloo", "rl.group_size=2"]).rl  # (one kept of two: no leave-one-out)
    lone = GroupSummary(5, (9,), (1.0,), ("stop",), episodes=((1, 0, 0, 0, 0, 0), (1, 0, 0, 1, 0, 0)), episode_of=(0,))
    assert plan_step([lone, plain], [lone, plain], 1, rloo, 1).adv_R.tolist() == [0.0, -1.0, 1.0]


def test_an_agent_groups_rows_survive_a_batch_saved_ahead(tmp_path):
    """A batch sampled ahead and saved for a resume keeps each row's episode, the tallies and
    the observation masks (else a resumed step would count segments as episodes)."""
    from moe_rl.rollout.ahead import load_ahead, save_ahead
    from moe_rl.rollout.types import Sampled

    (group,) = agent_groups([_outcomes()], 5, decode=str)
    sampled = Sampled(3, 5, [(0, 0)], [[group.summary()]], [[1.0]], held={(0, 0): group})
    save_ahead(tmp_path, 0, (1, 1), sampled)
    back, why = load_ahead(tmp_path, 3, 0, (1, 1))
    assert why == "" and back is not None
    assert back.drawn[0][0] == group.summary()
    got = back.held[(0, 0)]
    assert (got.episode_of, got.episodes, got.observed) == (group.episode_of, group.episodes, group.observed)
