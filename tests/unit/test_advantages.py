"""Advantage estimators, dynamic-sampling filter, overlong shaping: hand values, invariants
(property-based), and errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.advantages import (
    ADVANTAGES,
    compute_advantages,
    filter_groups,
    group_estimators,
    overlong_penalty,
)

EPS = 1e-6


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-6)


def test_grpo_hand_values():
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0], [2.0, 2.0, 2.0, 5.0]])
    # group 0: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    # group 1: mean 2.75, deviations -0.75 x3 and 2.25, var = (3 * 0.5625 + 5.0625) / 3 = 2.25, std 1.5
    s0, s1 = math.sqrt(1 / 3) + EPS, 1.5 + EPS
    close(
        compute_advantages("grpo", r),
        [[0.5 / s0, -0.5 / s0, 0.5 / s0, -0.5 / s0], [-0.75 / s1] * 3 + [2.25 / s1]],
    )
    # population std (seed 002's variant): group 0 std 0.5; group 1 var 6.75 / 4, std 1.299
    p0, p1 = 0.5 + EPS, math.sqrt(6.75 / 4) + EPS
    close(
        compute_advantages("grpo", r, unbiased=False),
        [[0.5 / p0, -0.5 / p0, 0.5 / p0, -0.5 / p0], [-0.75 / p1] * 3 + [2.25 / p1]],
    )


def test_dr_grpo_rloo_batch_std_hand_values():
    r = torch.tensor([[1.0, 0.0, 0.5], [3.0, 3.0, 3.0]])
    close(compute_advantages("dr_grpo", r), [[0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
    # rloo: 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0
    close(compute_advantages("rloo", r), [[0.75, -0.75, 0.0], [0.0, 0.0, 0.0]])
    # batch_std: centered [[0.5, -0.5, 0], [0, 0, 0]]; std of all six rewards [1, 0, .5, 3, 3, 3]:
    # mean 10.5/6 = 1.75, squared deviations .5625 + 3.0625 + 1.5625 + 3 * 1.5625 = 9.875, /5 = 1.975
    s = math.sqrt(1.975) + EPS
    close(compute_advantages("batch_std", r), [[0.5 / s, -0.5 / s, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "batch_std"])
def test_all_equal_groups_get_exact_zeros(name):
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: the zeros must still be exact.
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = compute_advantages(name, r)
    assert (adv[:2] == 0).all() and torch.isfinite(adv).all() and (adv[2] != 0).all()
    everything_equal = compute_advantages(name, torch.full((4, 3), 0.7))
    assert (everything_equal == 0).all()


def test_group_size_one():
    r = torch.tensor([[1.0], [0.0]])
    for name in ("grpo", "dr_grpo", "batch_std"):
        assert (compute_advantages(name, r) == 0).all()
    with pytest.raises(ValueError, match="'rloo' needs group size G >= 2, got G=1"):
        compute_advantages("rloo", r)
    assert not filter_groups(r).any()


def test_filter_groups():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.2, 0.3]])
    assert filter_groups(r).tolist() == [True, False, False, True]


def test_overlong_penalty():
    lengths = torch.tensor([0, 12, 13, 14, 16, 17, 100])
    # L_max = 16, L_c = 4: free up to 12, then (12 - len) / 4 down to -1 at 16, -1 beyond.
    close(overlong_penalty(lengths, 16, 4)[None], [[0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]])
    close(overlong_penalty(lengths, 16, 0)[None], [[0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -1.0]])
    close(overlong_penalty(lengths.float().reshape(7, 1), 16, 16).T, [[0.0, -0.75, -13 / 16, -14 / 16, -1.0, -1.0, -1.0]])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(lengths, 16, 17)
    with pytest.raises(ValueError, match="max_len"):
        overlong_penalty(lengths, 0, 0)


def test_errors():
    with pytest.raises(ValueError, match="valid names: grpo, dr_grpo, rloo, batch_std, gae"):
        compute_advantages("vtrace", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'std' for advantage 'grpo'; valid: eps, unbiased"):
        compute_advantages("grpo", torch.zeros(2, 2), std=True)
    with pytest.raises(ValueError, match="'eps' for advantage 'rloo'; valid: \\(none\\)"):
        compute_advantages("rloo", torch.zeros(2, 2), eps=1.0)
    with pytest.raises(ValueError, match=r"\[n_groups, G\]"):
        compute_advantages("grpo", torch.zeros(4))
    with pytest.raises(ValueError, match="NaN or inf"):
        compute_advantages("grpo", torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="eps"):
        compute_advantages("grpo", torch.zeros(2, 2), eps=0.0)
    assert compute_advantages("dr_grpo", torch.tensor([[1, 0]])).dtype == torch.float32  # ints ok


rewards = st.integers(1, 5).flatmap(
    lambda n: st.integers(1, 6).flatmap(
        lambda g: st.lists(
            st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0, 0.1, 1e6, -3.3]), min_size=g, max_size=g),
            min_size=n,
            max_size=n,
        )
    )
)


@settings(max_examples=100, deadline=None)
@given(r=rewards, name=st.sampled_from(group_estimators()))
def test_advantage_invariants(r, name):
    r = torch.tensor(r)
    G = r.shape[1]
    if G < ADVANTAGES[name].min_group_size:
        with pytest.raises(ValueError, match="G"):
            compute_advantages(name, r)
        return
    adv = compute_advantages(name, r)
    assert adv.shape == r.shape and torch.isfinite(adv).all()
    keep = filter_groups(r)
    # all-equal groups (exactly those filter_groups drops) are exactly zero, others are not
    assert (adv[~keep] == 0).all()
    assert (adv[keep].abs().sum(1) > 0).all()
    # every estimator is centred within the group
    scale = adv.abs().amax().item()
    assert (adv.double().mean(1).abs() <= 1e-6 * scale + 1e-9).all()
    # and ordered like the rewards
    assert ((adv[:, :, None] > adv[:, None, :]) == (r[:, :, None] > r[:, None, :])).all()


def test_the_registry_knows_which_estimator_needs_a_critic():
    """PPO's gae is a registered estimator that needs a critic (the RL program runs the
    critic component for it, the config's uses_critic says so); it has no group formula."""
    from moe_rl.config import load_config

    assert group_estimators() == ["grpo", "dr_grpo", "rloo", "batch_std"]
    assert ADVANTAGES["gae"].needs_critic and not any(ADVANTAGES[n].needs_critic for n in group_estimators())
    assert load_config(None, ["rl.advantage=gae", "rl.objective=grpo"]).rl.uses_critic
    assert not load_config(None, ["rl.advantage=rloo"]).rl.uses_critic
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("gae", torch.ones(2, 4))
