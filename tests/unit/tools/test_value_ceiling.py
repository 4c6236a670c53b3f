"""tools/value_ceiling.py: the best possible value under an exact-match reward, by hand."""

from __future__ import annotations

import importlib.util

import pytest

from moe_rl.config import to_dict
from moe_rl_testing import ROOT

_spec = importlib.util.spec_from_file_location("value_ceiling", ROOT / "tools" / "value_ceiling.py")
value_ceiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(value_ceiling)

ANSWER = [5, 7, 9, 2]        # three answer tokens and EOS (2)
P = [0.5, 0.8, 0.9, 0.6]     # the policy's teacher-forced probability of each


def test_on_track_the_value_is_the_product_of_the_probabilities_still_to_come() -> None:
    values = value_ceiling.exact_values(ANSWER, P, ANSWER)
    expected = [0.5 * 0.8 * 0.9 * 0.6, 0.8 * 0.9 * 0.6, 0.9 * 0.6, 0.6]
    assert values == pytest.approx(expected, abs=1e-12)


def test_the_value_is_zero_from_the_state_after_the_first_wrong_token() -> None:
    # the second token is wrong: the state before it still has the on-track value
    values = value_ceiling.exact_values(ANSWER, P, [5, 3, 9, 2, 4])
    assert values == pytest.approx([0.5 * 0.8 * 0.9 * 0.6, 0.8 * 0.9 * 0.6, 0.0, 0.0, 0.0], abs=1e-12)
    # a response that runs on past the answer's EOS position is off track there
    assert value_ceiling.exact_values([2], [0.7], [4, 4]) == pytest.approx([0.7, 0.0])


def test_a_bad_count_or_directory_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    assert value_ceiling.main(["--policy", str(tmp_path), "--prompts", "0"]) == 2
    assert capsys.readouterr().err.strip() == "value_ceiling: --prompts must be at least 1, got 0"
    assert value_ceiling.main(["--policy", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not a Hugging Face directory (no config.json)" in err


PROMPT = [10, 11, 12]        # the problem's tokens; ANSWER's first three are the reply


def test_state_kinds_name_the_token_that_left_the_answer() -> None:
    kinds = value_ceiling.state_kinds
    on, (moved, foreign, past) = value_ceiling.ON_TRACK, value_ceiling.OFF_KINDS
    assert kinds(PROMPT, ANSWER, ANSWER) == [on] * 4
    # the second token is 11, a prompt token, where the answer has 7: off track after it
    assert kinds(PROMPT, ANSWER, [5, 11, 9, 2]) == [on, on, moved, moved]
    assert kinds(PROMPT, ANSWER, [5, 8, 2]) == [on, on, foreign]
    # the answer's three tokens, then 10 where its EOS was due
    assert kinds(PROMPT, ANSWER, [5, 7, 9, 10, 2]) == [on, on, on, on, past]
    # a wrong last token leaves no state after it; an early EOS neither
    assert kinds(PROMPT, ANSWER, [5, 7, 8]) == [on] * 3
    assert kinds(PROMPT, ANSWER, [5, 2]) == [on] * 2


def test_critic_report_by_hand() -> None:
    R = value_ceiling.Rollout
    rollouts = [R(PROMPT, ANSWER, [], [5, 7, 9, 2], 1.0), R(PROMPT, ANSWER, [], [5, 11, 9, 2], 0.0)]
    values = [[0.5, 0.5, 0.5, 1.0], [0.5, 0.5, 1.0, 0.5]]
    rep = value_ceiling.critic_report(rollouts, values)
    r = [1.0] * 4 + [0.0] * 4
    v = [x for row in values for x in row]

    def ev(vs):  # 1 - Var(R - V) / Var(R), unbiased
        d = [a - b for a, b in zip(r, vs)]
        var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1)  # noqa: E731
        return 1 - var(d) / var(r)

    assert rep["all"]["explained_variance"] == pytest.approx(ev(v), abs=1e-12)
    moved = rep[value_ceiling.OFF_KINDS[0]]  # the second rollout's last two states
    sq = [(a - b) ** 2 for a, b in zip(r, v)]
    assert moved["share"] == 0.25 and moved["value"] == 0.75 and moved["return"] == 0.0
    assert moved["error_share"] == pytest.approx((1.0 + 0.25) / sum(sq), abs=1e-12)
    assert moved["valued_0"] == pytest.approx(ev([*v[:6], 0.0, 0.0]), abs=1e-12)
    assert rep[value_ceiling.OFF_TRACK]["valued_0"] == moved["valued_0"]
    assert rep[value_ceiling.ON_TRACK]["share"] == 0.75 and value_ceiling.OFF_KINDS[1] not in rep


def test_critic_values_read_a_ppo_checkpoints_critic(megatron_world, tmp_path) -> None:
    """The tool's values (a checkpoint saved with a critic, loaded on one process) equal the
    saved critic's own: h . w + b of the final hidden state at each scoring slot."""
    import torch

    from moe_rl.batch import TokenBatch
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, parallel_layout, save_checkpoint
    from moe_rl.learner.critic import Critic
    from moe_rl_testing.learner_utils import plain_values

    cfg = load_config(ROOT / "examples" / "tiny_ppo.yaml", ["parallel.micro_batch_size=2"])
    g = torch.Generator().manual_seed(3)
    rollouts = [value_ceiling.Rollout(torch.randint(4, 120, (n,), generator=g).tolist(), [], [],
                                      torch.randint(4, 120, (m,), generator=g).tolist(), 0.0)
                for n, m in [(7, 5), (9, 3), (6, 8)]]
    with parallel_layout(cfg.parallel, seed=5) as layout:
        actor = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=1)
        critic = Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=1)
        critic.init_value_head(0.5, seed=11)  # (a head that is not zero, as after training)
        save_checkpoint(actor, tmp_path / "ckpt", recipe=to_dict(cfg), components={"critic": critic})
        tokens = TokenBatch.from_lists([r.prompt for r in rollouts], [r.response for r in rollouts])
        expected_BT = plain_values(critic, tokens)
    got = value_ceiling.critic_values(tmp_path / "ckpt", rollouts, rows_per_pass=2)
    assert expected_BT.abs().max() > 0.1
    for b, (g_row, r) in enumerate(zip(got, rollouts)):
        assert g_row == pytest.approx(expected_BT[b, :len(r.response)].tolist(), abs=1e-5)


def test_a_critic_that_is_no_ppo_checkpoint_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert value_ceiling.main(["--policy", str(tmp_path), "--critic", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nope is not a moe_rl checkpoint; give one of a PPO run's" in err
    # a policy's checkpoint (the shipped base): no critic in it
    assert value_ceiling.main(["--policy", str(tmp_path), "--critic", str(ROOT / "moe_rl/assets/tiny_base")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tiny_base holds no critic (it was saved by a run without rl.advantage=gae)" in err
