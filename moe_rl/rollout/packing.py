"""Scored groups -> the training batch: reward shaping, group advantages, token packing,
the sampler's logprobs and routing on the batch grid, and the step's rollout statistics."""

from __future__ import annotations

import torch

from moe_rl.advantages import compute_advantages, filter_groups, overlong_penalty
from moe_rl.batch import TokenBatch
from moe_rl.config import Config
from moe_rl.rollout.types import Rollout, ScoredGroup
from moe_rl.routing.record import ReplayIds, align_sampler_routing


def pack_rollout(kept: list[ScoredGroup], drawn: list[ScoredGroup], draws: int, cfg: Config,
                 pad_id: int) -> Rollout:
    """The training batch from the groups that `kept` their place (dynamic sampling may have
    drawn more: `drawn` is every group of the step, for the statistics)."""
    G, T = cfg.rl.group_size, cfg.sampler.max_new_tokens
    rewards_NG = torch.tensor([g.rewards for g in kept], dtype=torch.float32)
    lengths_NG = torch.tensor([[len(r) for r in g.responses] for g in kept], dtype=torch.float32)
    shaped_NG = rewards_NG
    if cfg.rl.overlong_max_len:
        shaped_NG = rewards_NG + overlong_penalty(lengths_NG, cfg.rl.overlong_max_len, cfg.rl.overlong_cache)
    adv_NG = compute_advantages(cfg.rl.advantage, shaped_NG)
    batch = TokenBatch.from_lists([g.prompt for g in kept for _ in range(G)],
                                  [r for g in kept for r in g.responses], pad_id=pad_id,
                                  response_width=T, seq_multiple=cfg.parallel.tensor_model_parallel_size)
    logp_BT = torch.zeros(batch.batch_size, T)
    for b, lp in enumerate(lp for g in kept for lp in g.logprobs):
        logp_BT[b, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    stats = rollout_stats(kept, drawn, draws, rewards_NG, lengths_NG, adv_NG)
    return Rollout(batch, rewards_NG.flatten(), adv_NG.flatten(), logp_BT,
                   [t for g in kept for t in g.texts], sampler_routing(kept, batch, cfg), stats)


def sampler_routing(kept: list[ScoredGroup], batch: TokenBatch, cfg: Config) -> ReplayIds | None:
    """The sampler's routed experts on the batch grid, or None when it returned none."""
    if kept[0].routed is None:
        return None
    routed = [a for g in kept for a in g.routed]
    moe_layers = list(range(cfg.model.num_dense_layers, cfg.model.num_layers))
    ids_BSLK, valid_BS = align_sampler_routing(routed, batch, cfg.model.num_experts, moe_layers)
    return ReplayIds(torch.arange(batch.batch_size), ids_BSLK, valid_BS)


def rollout_stats(kept: list[ScoredGroup], drawn: list[ScoredGroup], draws: int, rewards_NG: torch.Tensor,
                  lengths_NG: torch.Tensor, adv_NG: torch.Tensor) -> dict[str, float]:
    all_rewards = torch.tensor([g.rewards for g in drawn], dtype=torch.float32)
    finish = [f for g in kept for f in g.finish]
    return {
        "reward/mean": float(rewards_NG.mean()),
        "reward/std": float(rewards_NG.std()) if rewards_NG.numel() > 1 else 0.0,
        "reward/solved_frac": float((rewards_NG == 1).float().mean()),
        "reward/mean_all_draws": float(all_rewards.mean()),
        "response/length_mean": float(lengths_NG.mean()),
        "response/length_max": float(lengths_NG.max()),
        "response/truncated_frac": sum(f == "length" for f in finish) / max(len(finish), 1),
        "sampling/draws": float(draws),
        "sampling/groups": float(len(kept)),
        "sampling/groups_with_signal_frac": float(filter_groups(all_rewards).float().mean()),
        "advantage/abs_mean": float(adv_NG.abs().mean()),
    }
