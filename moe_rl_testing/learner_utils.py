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


@contextlib.contextmanager
def default_learner(seed: int) -> Iterator:
    """A learner of the default recipe in a one-process layout, its weights drawn from `seed`
    (a module's learner fixture: `with default_learner(4) as learner: yield learner`)."""
    from moe_rl.config import load_config
    from moe_rl.learner import parallel_layout

    cfg = load_config(None, [])
    with parallel_layout(cfg.parallel, seed=seed) as layout:
        torch.manual_seed(seed)
        yield learner_of(cfg, layout)


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
    import moe_rl.learner.routing.taps as routing

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


CORRECTION_MATRIX = {
    "dapo-token_is_token_rs": ["rl.objective=dapo", "rl.rollout_correction=is_rs",
                               "rl.rollout_correction_args.is_level=token", "rl.rollout_correction_args.rs_level=token",
                               "rl.rollout_correction_args.rs_high=1.5"],
    "grpo-geometric_rs_veto": ["rl.objective=grpo", "rl.rollout_correction=is_rs",
                               "rl.rollout_correction_args.is_level=geometric",
                               "rl.rollout_correction_args.rs_level=geometric", "rl.rollout_correction_args.rs_high=1.12",
                               "rl.rollout_correction_args.veto_below=0.5",
                               "rl.rollout_correction_args.is_batch_normalize=true"],
    "gspo-opsm": ["rl.objective=gspo", "rl.opsm_delta=0.0"],
}
"""The rollout corrections whose normalizers cross data-parallel ranks (token counts,
sequence counts, the weights' mean, OPSM's sequences), for the layout tests."""


def correction_matrix(learner, base: list[str]) -> dict[str, tuple[float, float, dict[str, float]]]:
    """For each CORRECTION_MATRIX case, scored and on-policy (`<case>/scored`, `<case>/on_policy`):
    (loss, global gradient norm, the pass's tallies) of one pass over this rank's rows of the
    fixed batch, the sampler's log-probs the learner's plus fixed noise. No optimizer step."""
    import dataclasses

    from moe_rl.config import load_config
    from moe_rl.programs.rl.policy_loss import PolicyLossFn

    tokens, adv_B = fixed_batch()
    logp_BT = learner.score_whole(tokens).logp_BT
    g = torch.Generator().manual_seed(11)
    sampler_BT = torch.where(tokens.response_mask(), logp_BT + 0.3 * torch.randn(logp_BT.shape, generator=g), 0.0)
    rows = learner.own_rows(tokens)
    ids = rows.row_ids_B
    rows = dataclasses.replace(rows, adv_B=adv_B[ids], sampler_logp_BT=sampler_BT[ids])

    def dp_sum(t: torch.Tensor) -> torch.Tensor:
        return torch.stack(learner.dp_gather_object(t)).sum(0)

    out = {}
    for case, overrides in CORRECTION_MATRIX.items():
        cfg = load_config(None, [*base, *overrides])
        for path, batch in (("scored", rows.scored(logp_BT[ids], None)), ("on_policy", rows)):
            loss_fn = PolicyLossFn(cfg.rl, cfg.sampler.max_new_tokens, on_policy=path == "on_policy")
            loss_fn.prepare(batch, [torch.arange(tokens.batch_size)], dp_sum)
            metrics, _, _, sums = learner._gradients(batch, loss_fn, None, 1.0)
            learner.optimizer.prepare_grads()
            out[f"{case}/{path}"] = (metrics["loss"], float(learner.optimizer.get_grad_norm()), sums)
    return out
