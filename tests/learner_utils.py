"""Shared by the learner tests and their torchrun workers: a learner of a test's config, a
fixed batch, a loss, and the critic's values by a plain forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moe_rl.batch import TokenBatch


def rl_updates(cfg) -> int:
    """An RL run's optimizer steps, run.steps x rl.num_minibatches x rl.epochs (at least 1):
    the schedule length the tests' learners had before the learner took an explicit count."""
    return max(1, cfg.run.steps * cfg.rl.num_minibatches * cfg.rl.epochs)


def learner_of(cfg, layout, *, trainable: bool = True, total_updates: int | None = None):
    """A `Learner` from the model, parallel and (trainable: optimizer) sections of `cfg`, its
    schedule over `total_updates` optimizer steps (default `rl_updates(cfg)`)."""
    from moe_rl.learner import Learner

    if not trainable:
        return Learner(cfg.model, cfg.parallel, layout)
    return Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer,
                   total_updates=rl_updates(cfg) if total_updates is None else total_updates)


def fixed_batch() -> tuple[TokenBatch, torch.Tensor]:
    """12 sequences with varied prompt/response lengths (one empty response), advantages."""
    g = torch.Generator().manual_seed(7)
    prompts, responses = [], []
    for i in range(12):
        plen = int(torch.randint(1, 6, (1,), generator=g))
        rlen = 0 if i == 5 else int(torch.randint(1, 9, (1,), generator=g))
        prompts.append(torch.randint(1, 128, (plen,), generator=g).tolist())
        responses.append(torch.randint(1, 128, (rlen,), generator=g).tolist())
    adv_B = torch.randn(12, generator=g)
    return TokenBatch.from_lists(prompts, responses, response_width=10), adv_B


def episode_batch() -> tuple[TokenBatch, torch.Tensor]:
    """The fixed batch as multi-turn episodes: observation tokens (an environment's, between
    the policy's turns) marked inside most responses (`TokenBatch.observed_BT`)."""
    import dataclasses

    batch, adv_B = fixed_batch()
    observed = torch.zeros(batch.batch_size, batch.response_width, dtype=torch.bool)
    for b in range(batch.batch_size):
        n = int(batch.response_lens_B[b])
        if n >= 4:
            observed[b, 1:n - 1:2] = True  # (interleaved: observation tokens between the policy's)
    return dataclasses.replace(batch, observed_BT=observed), adv_B


def reinforce_loss(batch: TokenBatch):
    """-sum_i A_i sum_t logp_it / (total tokens): contributions with a global normaliser."""
    from moe_rl.learner import MicroBatchLoss

    total_tokens = batch.response_lens_B.sum()

    def loss_fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        adv = mb.extras["adv_B"][:, None]
        contrib = -(adv * logp_BT * mask).sum() / total_tokens
        logp_mean = (logp_BT * mask).sum() / mask.sum().clamp(min=1)
        return MicroBatchLoss(contrib, {"logp_mean": logp_mean}, weight=mask.sum())

    return loss_fn


def replayed_updates(learner, count: int = 2, perturb_seed: int = 3) -> list:
    """The fixed batch's routing record A, the routers perturbed (N(0, 0.05^2) from
    `perturb_seed`), then `count` updates that capture, measure the router shift from A and
    replay A (R2): every routing path of an update at once."""
    from moe_rl.learner import RoutingPlan
    from moe_rl.routing.record import ReplayIds

    batch, adv_B = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    g = torch.Generator().manual_seed(perturb_seed)
    with torch.no_grad():
        for router in learner.taps.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * 0.05)
    rows = learner.own_rows(batch, {"adv_B": adv_B})
    plan = RoutingPlan(capture=True, old=old, replay=ReplayIds.from_record(old))
    return [learner.update(rows, reinforce_loss(batch), plan) for _ in range(count)]


@contextlib.contextmanager
def counting_router_reruns() -> Iterator[dict[str, int]]:
    """Counts, under "n", the router calls made inside a backward: a recomputed layer routing again."""
    import moe_rl.learner.routing as routing

    real, count = routing._in_backward, {"n": 0}

    def spy() -> bool:
        inside = real()
        count["n"] += int(inside)
        return inside

    routing._in_backward = spy
    try:
        yield count
    finally:
        routing._in_backward = real


@torch.no_grad()
def plain_values(critic, tokens) -> torch.Tensor:
    """Reference: the final hidden state at each response token's scoring position, h . w + b."""
    pos = torch.arange(tokens.seq_len).expand_as(tokens.tokens_BS)
    hidden_BSH = critic.gpt(input_ids=tokens.tokens_BS, position_ids=pos, attention_mask=None).float()
    head = critic.gpt.value_head
    out = torch.zeros(tokens.batch_size, tokens.response_width)
    for b in range(tokens.batch_size):
        p0 = int(tokens.prompt_lens_B[b])
        for j in range(int(tokens.response_lens_B[b])):
            out[b, j] = hidden_BSH[b, p0 + j - 1] @ head.weight.float() + head.bias.float()
    return out
