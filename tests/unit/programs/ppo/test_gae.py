"""GAE, rewards on the last token (with k1 KL-in-reward), whitening and the clipped value loss
(moe_rl.programs.ppo.gae) against plain-Python loops of the formulas, for any gamma, lambda, lengths and
masks (holes included)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.programs.ppo.gae import (
    adaptive_kl_coef,
    clipped_value_loss,
    explained_variance,
    gae,
    masked_whiten,
    token_rewards,
)


def _random_grid(seed: int, B: int = 7, T: int = 9):
    """Rewards, values, and a mask with ragged lengths, an empty row and holes."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, T + 1, (B,), generator=g)
    lens[0], lens[1] = 0, T
    mask = torch.arange(T)[None, :] < lens[:, None]
    holes = torch.rand(B, T, generator=g) < 0.2
    mask = mask & ~holes
    return torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64), mask


def _explicit_gae(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    """A_k = sum_l (gamma lambda)^l delta_{k+l} over a row's valid tokens, written out."""
    n = len(r)
    delta = [r[k] + gamma * (v[k + 1] if k + 1 < n else 0.0) - v[k] for k in range(n)]
    return [sum((gamma * lam) ** j * delta[k + j] for j in range(n - k)) for k in range(n)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7), (1.0, 0.0), (0.9, 1.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_the_explicit_sum(gamma, lam, seed):
    rewards, values, mask = _random_grid(seed)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b in range(mask.shape[0]):
        idx = mask[b].nonzero().squeeze(1).tolist()
        want = _explicit_gae([float(rewards[b, t]) for t in idx], [float(values[b, t]) for t in idx], gamma, lam)
        for k, t in enumerate(idx):
            assert float(adv[b, t]) == pytest.approx(want[k], abs=1e-6)
            assert float(ret[b, t]) == pytest.approx(want[k] + float(values[b, t]), abs=1e-6)
        assert not adv[b][~mask[b]].any() and not ret[b][~mask[b]].any()


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards, values, mask = _random_grid(5, B=3, T=6)
    mask[:] = True
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    to_go = rewards.flip(1).cumsum(1).flip(1)
    assert torch.allclose(adv, to_go - values, atol=1e-12)


def test_score_sits_on_the_last_valid_token_and_k1_on_every_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    kl = torch.arange(15, dtype=torch.float64).reshape(3, 5) / 10
    r = token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask, kl, kl_coef=0.5)
    want = torch.zeros(3, 5, dtype=torch.float64)
    want[0, 3], want[2, 0] = 2.0, -1.0
    want -= 0.5 * kl * mask
    assert torch.allclose(r, want, atol=1e-12)
    assert torch.equal(token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)[0], torch.tensor([0, 0, 0, 2.0, 0],
                                                                                           dtype=torch.float64))
    with pytest.raises(ValueError, match="k1"):
        token_rewards(torch.ones(3), mask, None, kl_coef=0.1)


def test_whitening_over_the_valid_tokens():
    x, _, mask = _random_grid(3)
    w = masked_whiten(x * 3 + 2, mask)
    valid = [float(v) for v in (x * 3 + 2)[mask]]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / (len(valid) - 1)
    for got, v in zip(w[mask].tolist(), valid):
        assert got == pytest.approx((v - mean) / math.sqrt(var + 1e-8), abs=1e-9)
    assert w[~mask].abs().max() == 0


@pytest.mark.parametrize("clip", [0.2, 0.5, 10.0])
def test_clipped_value_loss_and_gradient_match_the_closed_form(clip):
    g = torch.Generator().manual_seed(9)
    values = torch.randn(4, 6, generator=g, dtype=torch.float64).requires_grad_()
    old = values.detach() + torch.randn(4, 6, generator=g, dtype=torch.float64)
    returns = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) < 0.7
    loss, clipfrac = clipped_value_loss(values, old, returns, mask, clip, total_tokens=40)
    loss.backward()
    want_loss = want_frac = 0.0
    for b in range(4):
        for t in range(6):
            v, o, R = float(values[b, t]), float(old[b, t]), float(returns[b, t])
            vc = min(max(v, o - clip), o + clip)
            plain, clipped = (v - R) ** 2, (vc - R) ** 2
            grad = 0.0
            if mask[b, t]:
                want_loss += 0.5 * max(plain, clipped) / 40
                want_frac += (clipped > plain) / 40
                grad = ((v - R) if plain >= clipped else (vc - R) * (o - clip < v < o + clip)) / 40
            assert float(values.grad[b, t]) == pytest.approx(grad, abs=1e-9)
    assert float(loss) == pytest.approx(want_loss, abs=1e-9) and float(clipfrac) == pytest.approx(want_frac, abs=1e-9)
    if clip == 0.2:  # both terms win somewhere
        assert 0 < float(clipfrac) < float(mask.sum()) / 40


def test_explained_variance():
    _, returns, mask = _random_grid(4)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    mean = returns[mask].mean()
    assert explained_variance(torch.full_like(returns, float(mean)), returns, mask) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask))


@pytest.mark.parametrize("kl,want", [
    (0.11, 0.1 * (1 + 0.1 * 64 / 1000)),   # 10% above the target: the weight grows by 0.1 B / horizon
    (0.095, 0.1 * (1 - 0.05 * 64 / 1000)),  # 5% below: it shrinks
    (5.0, 0.1 * (1 + 0.2 * 64 / 1000)),    # far above: the error is clipped at 0.2
    (0.0, 0.1 * (1 - 0.2 * 64 / 1000)),    # no KL at all: clipped at -0.2
])
def test_adaptive_kl_coef_by_hand(kl, want):
    assert adaptive_kl_coef(0.1, kl, target=0.1, responses=64, horizon=1000) == pytest.approx(want, rel=1e-12)
