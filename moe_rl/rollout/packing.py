"""The step's groups -> the training batch: reward shaping and group advantages (from every
group's summary, the same on every rank), the step's rollout statistics, and this rank's
rows packed into a `StepBatch` with the sampler's logprobs and routing on its grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.advantages import compute_advantages, filter_groups, overlong_penalty
from moe_rl.batch import TokenBatch, ragged_rows
from moe_rl.config import ModelConfig, RLConfig
from moe_rl.rollout.types import SCORE, VERSION_SPAN, GroupSummary, RowSample
from moe_rl.routing.record import ReplayIds, align_sampler_routing
from moe_rl.step_batch import StepBatch


@dataclass(frozen=True)
class StepPlan:
    """What every rank knows of the step's batch before any row arrives."""

    rewards_NG: torch.Tensor
    """[N, G] verifier rewards of the kept groups."""
    adv_NG: torch.Tensor
    """[N, G] group advantages (from the shaped rewards); zeros under rl.advantage=gae,
    whose token advantages the critic gives after the rollout (`moe_rl.programs.ppo.critic_stage`)."""
    scores_NG: torch.Tensor
    """[N, G] the shaped rewards (verifier reward plus overlong shaping)."""
    seq_len: int
    """S: the longest prompt + response of the batch, rounded up to the TP size."""
    stats: dict[str, float]
    """The step's rollout statistics."""

    @property
    def rows(self) -> int:
        return self.rewards_NG.numel()


def plan_step(kept: list[GroupSummary], drawn: list[GroupSummary], draws: int, rl: RLConfig,
              tp: int) -> StepPlan:
    """Advantages, batch width and statistics of the `kept` groups (dynamic sampling may have
    drawn more: `drawn` is every group of the step, for the statistics), shaped and estimated
    as `rl` says, the width rounded up to `tp` (the learner's tensor-parallel size)."""
    rewards_NG = torch.tensor([g.rewards for g in kept], dtype=torch.float32)
    lengths_NG = torch.tensor([g.response_lens for g in kept], dtype=torch.float32)
    shaped_NG = rewards_NG
    if rl.overlong_max_len:
        shaped_NG = rewards_NG + overlong_penalty(lengths_NG, rl.overlong_max_len, rl.overlong_cache)
    critic = rl.uses_critic  # (its token advantages come once the step is scored)
    adv_NG = torch.zeros_like(shaped_NG) if critic else over_kept(compute_advantages(rl.advantage, shaped_NG),
                                                                   shaped_NG, kept, rl.advantage)
    longest = max(g.prompt_len + max(g.response_lens, default=0) for g in kept)
    stats = rollout_stats(kept, drawn, draws, rewards_NG, lengths_NG, None if critic else adv_NG)
    return StepPlan(rewards_NG, adv_NG, shaped_NG, -(-longest // tp) * tp, stats)


def over_kept(adv_NG: torch.Tensor, shaped_NG: torch.Tensor, kept: list[GroupSummary], estimator: str) -> torch.Tensor:
    """Agent episodes (`moe_rl.rollout.gateway.agents`): a group's advantages over the
    episodes it kept, 0 for those dropped (timed out or raised; tally entries 3 and 4); a
    group with fewer kept than the estimator needs gets zeros."""
    for n, g in enumerate(kept):
        if not g.episodes or len(g.episodes[0]) <= 3 or not any(t[3] or t[4] for t in g.episodes):
            continue
        idx = [j for j, t in enumerate(g.episodes) if not (t[3] or t[4])]
        adv_NG[n] = 0.0
        if idx:
            try:
                adv_NG[n, idx] = compute_advantages(estimator, shaped_NG[n, idx][None])[0]
            except ValueError:  # (too few kept for the estimator, rloo's one)
                pass
    return adv_NG


def pack_rows(rows: list[RowSample], plan: StepPlan, model: ModelConfig, max_new_tokens: int,
              pad_id: int) -> tuple[StepBatch, torch.Tensor, list[str]]:
    """This rank's rows (ascending row id) as a StepBatch on the step's [b, S] grid
    (responses `max_new_tokens` wide: `sampler.max_new_tokens`), with their rewards and
    texts; the sampler's routes laid out for `model`'s MoE layers."""
    T = max_new_tokens
    episodes = any(r.observed is not None for r in rows)
    tokens = TokenBatch.from_lists([r.prompt for r in rows], [r.response for r in rows], pad_id=pad_id,
                                   response_width=T, min_seq_len=plan.seq_len,
                                   observed=[r.observed or [False] * len(r.response) for r in rows] if episodes else None)
    row_ids = torch.tensor([r.row_id for r in rows], dtype=torch.long)
    batch = StepBatch(
        tokens, row_ids, plan.rows,
        adv_B=plan.adv_NG.flatten()[row_ids],
        sampler_logp_BT=ragged_rows([r.logprobs for r in rows], T),
        sampler_routing=sampler_routing(rows, tokens, row_ids, model),
        version_B=torch.tensor([r.version for r in rows], dtype=torch.long),
        extras={SCORE: plan.scores_NG.flatten()[row_ids],
                VERSION_SPAN: torch.tensor([max(r.token_versions) - min(r.token_versions) if r.token_versions else 0
                                            for r in rows], dtype=torch.long)},
    )
    return batch, plan.rewards_NG.flatten()[row_ids], [r.text for r in rows]


def sampler_routing(rows: list[RowSample], tokens: TokenBatch, row_ids: torch.Tensor,
                    model: ModelConfig) -> ReplayIds | None:
    """The sampler's routed experts on the rows' grid (`model`'s MoE layers), or None when it
    returned none."""
    if not rows or rows[0].routed is None:
        return None
    moe_layers = list(range(model.num_dense_layers, model.num_layers))
    routed = [r.routed for r in rows if r.routed is not None]
    if len(routed) != len(rows):
        raise ValueError(f"{len(rows) - len(routed)} of {len(rows)} rows lack the sampler's routed experts")
    ids_BSLK, valid_BS = align_sampler_routing(routed, tokens, model.num_experts, moe_layers)
    return ReplayIds(row_ids, ids_BSLK, valid_BS)


def rollout_stats(kept: list[GroupSummary], drawn: list[GroupSummary], draws: int, rewards_NG: torch.Tensor,
                  lengths_NG: torch.Tensor, adv_NG: torch.Tensor | None) -> dict[str, float]:
    """The step's reward, length and sampling statistics (`advantage/abs_mean` of group
    advantages; under GAE the critic stage logs it)."""
    all_rewards = torch.tensor([g.rewards for g in drawn], dtype=torch.float32)
    finish = [f for g in kept for f in g.finish]
    stats = {
        "reward/mean": float(rewards_NG.mean()),
        "reward/std": float(rewards_NG.std()) if rewards_NG.numel() > 1 else 0.0,
        "reward/solved_frac": float((rewards_NG == 1).float().mean()),
        "reward/mean_all_draws": float(all_rewards.mean()),
        "reward/zero_variance_frac": sum(not g.has_signal for g in kept) / max(len(kept), 1),
        "response/length_mean": float(lengths_NG.mean()),
        "response/length_max": float(lengths_NG.max()),
        "response/truncated_frac": sum(f == "length" for f in finish) / max(len(finish), 1),
        "sampling/draws": float(draws),
        "sampling/groups": float(len(kept)),
        "sampling/groups_with_signal_frac": float(filter_groups(all_rewards).float().mean()),
    }
    if adv_NG is not None:
        stats["advantage/abs_mean"] = float(adv_NG.abs().mean())
    tallies = [t for g in kept for t in (g.episodes or ())]
    if tallies:  # multi-turn episodes (`moe_rl.rollout.episodes`)
        stats.update({"rollout/turns_mean": sum(t[0] for t in tallies) / len(tallies),
                      "rollout/tool_calls_mean": sum(t[1] for t in tallies) / len(tallies),
                      "rollout/tool_parse_errors": float(sum(t[2] for t in tallies)),
                      "rollout/truncated_frac": stats["response/truncated_frac"]})
        if len(tallies[0]) > 3:  # agent episodes: (..., timed out, raised, resets)
            failed = sum(bool(t[3] or t[4]) for t in tallies)
            stats.update({"rollout/agent_timeouts": float(sum(t[3] for t in tallies)),
                          "rollout/agent_errors": float(sum(t[4] for t in tallies)),
                          "rollout/agent_resets": float(sum(t[5] for t in tallies)),
                          "rollout/agent_failed_frac": failed / len(tallies)})
    return stats


def staleness_stats(kept: list[GroupSummary], current: int, dropped_rows: int) -> dict[str, float]:
    """How many weight pushes older than the learner's policy (`current`) the step's rows
    are (by their oldest token), how many rows were dropped for exceeding
    `rl.max_staleness`, and what segmented decoding mixes: the versions within a response
    (`version_span_*`), the tokens drawn by an older policy than the learner's
    (`tokens_stale_frac`) and the responses continued from an earlier step (`partial_frac`)."""
    stale = [current - g.version for g in kept]
    spans = [s for g in kept for s in g.spans()]
    tokens = sum(sum(g.response_lens) for g in kept)
    carried = [c for g in kept for c in (g.carried or (False,) * len(g.response_lens))]
    return {"rollout/staleness_mean": sum(stale) / max(len(stale), 1),
            "rollout/staleness_max": float(max(stale, default=0)),
            "rollout/dropped_stale": float(dropped_rows),
            "rollout/version_span_mean": sum(spans) / max(len(spans), 1),
            "rollout/version_span_max": float(max(spans, default=0)),
            "rollout/tokens_stale_frac": sum(g.tokens_older_than(current) for g in kept) / max(tokens, 1),
            "rollout/partial_frac": sum(carried) / max(len(carried), 1)}
