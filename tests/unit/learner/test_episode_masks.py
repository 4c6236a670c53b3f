"""Observation tokens of a multi-turn episode (`TokenBatch.observed_BT`, issue #49) are fed and
attended to but carry nothing: no gradient, no place in a loss's token count, no log-prob,
entropy, KL or router-shift statistic. Checked on the learner against autograd of the loss
written by hand over the policy's tokens only, and on the RL program's policy loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import load_config
from moe_rl_testing.learner_utils import episode_batch, learner_of


def reinforce_loss(batch: TokenBatch):
    """-sum_i A_i sum_t logp_it / (the policy's tokens), as a learner loss callback (the
    normaliser a program takes from `BatchTotals`)."""
    from moe_rl.learner import MicroBatchLoss
    from moe_rl.learner.microbatch import BatchTotals

    total = BatchTotals.of(batch).response_tokens

    def loss_fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mask).sum() / total, {}, weight=mask.sum())

    return loss_fn


@pytest.fixture(scope="module")
def learner(megatron_world):
    from moe_rl.learner import parallel_layout

    cfg = load_config(None, ["parallel.micro_batch_size=4"])
    with parallel_layout(cfg.parallel, seed=5) as layout:
        torch.manual_seed(5)
        yield learner_of(cfg, layout)


def test_masks_count_only_the_policys_tokens():
    batch, _ = episode_batch()
    span, policy = batch.span_mask(), batch.response_mask()
    assert int(batch.observed_BT.sum()) > 8
    assert torch.equal(policy, span & ~batch.observed_BT)
    assert int(batch.scored_positions().sum()) == int(policy.sum())
    # the ids stay the ids: an observation's token is still what the model reads
    assert torch.equal(batch.response_tokens()[span], dataclasses.replace(batch, observed_BT=None).response_tokens()[span])
    picked = batch.select(torch.tensor([3, 0]))
    assert torch.equal(picked.observed_BT, batch.observed_BT[[3, 0]])


def test_observation_tokens_get_no_gradient_and_no_place_in_the_token_count(learner):
    """The learner's gradient of a token-mean REINFORCE loss on a batch with observations
    equals autograd of the same loss written over the policy's tokens only: observations
    contribute nothing and the normaliser counts only the policy's tokens."""
    from moe_rl.learner.microbatch import BatchTotals
    from tests.unit.learner.test_learner import main_grads, plain_logprobs

    batch, adv_B = episode_batch()
    assert BatchTotals.of(batch).response_tokens == float(batch.response_mask().sum())
    total = batch.response_mask().sum()

    learner.model.zero_grad_buffer()
    learner.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    got = main_grads(learner)
    learner.model.zero_grad_buffer()
    logp = plain_logprobs(learner, batch)
    policy = batch.response_mask()
    (-(adv_B[:, None] * logp * policy).sum() / total).backward()
    want = main_grads(learner)
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-7, rtol=1e-5, msg=name)
    # and it is not the gradient over every token (the observations do matter if counted)
    learner.model.zero_grad_buffer()
    logp = plain_logprobs(learner, batch)
    span = batch.span_mask()
    (-(adv_B[:, None] * logp * span).sum() / span.sum()).backward()
    every = main_grads(learner)
    assert max((got[n] - every[n]).abs().max() for n in got) > 1e-5
    learner.model.zero_grad_buffer()
    got_logp = learner.logprobs(batch)
    assert got_logp[batch.observed_BT].abs().max() == 0  # no log-prob where the policy sampled nothing


def test_the_policy_loss_and_its_statistics_ignore_observations():
    """The objectives see the policy's mask: the loss's gradient w.r.t. the log-probs is zero at
    every observation token, for a token-level (grpo with KL and entropy) and a sequence-level
    (gspo) objective."""
    from moe_rl.objectives import PolicyBatch, policy_loss

    batch, adv_B = episode_batch()
    g = torch.Generator().manual_seed(3)
    mask = batch.response_mask()
    old = torch.where(batch.span_mask(), -torch.rand(batch.response_mask().shape, generator=g) - 0.5, 0.0)
    ref = old + 0.05 * torch.randn(old.shape, generator=g)
    for name in ("grpo", "gspo"):
        logp = (old + 0.1 * torch.randn(old.shape, generator=g)).requires_grad_(True)
        pb = PolicyBatch(logprobs=logp, old_logprobs=old, advantages=adv_B, response_mask=mask, ref_logprobs=ref)
        (grad,) = torch.autograd.grad(policy_loss(name, pb, kl_coef=0.1).loss, logp)
        assert grad[batch.observed_BT].abs().max() == 0, name
        assert grad[mask].abs().max() > 0, name
