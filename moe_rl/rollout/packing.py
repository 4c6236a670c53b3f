"""The step's groups -> the training batch: reward shaping and group advantages (from every
group's summary, the same on every rank), the step's rollout statistics, and this rank's
rows packed into a `StepBatch` with the sampler's logprobs and routing on its grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.advantages import ADVANTAGES, compute_advantages, overlong_penalty
from moe_rl.batch import TokenBatch, ragged_rows
from moe_rl.config import ModelConfig, RLConfig
from moe_rl.rollout.types import SCORE, VERSION_SPAN, GroupSummary, RowSample
from moe_rl.routing.record import ReplayIds, align_sampler_routing
from moe_rl.step_batch import StepBatch


@dataclass(frozen=True)
class StepPlan:
    """What every rank knows of the step's batch before any row arrives. Rows are the kept
    groups' responses in order: G per group, unless agent episodes made them fewer (dropped
    episodes) or more (an episode's segments; `GroupSummary.episode_of`)."""

    rewards_R: torch.Tensor
    """[R] verifier rewards of the step's rows (an agent episode's rows all carry its reward)."""
    adv_R: torch.Tensor
    """[R] group advantages (from the shaped rewards of each group's episodes, an episode's on
    every row of it); zeros under rl.advantage=gae, whose token advantages the critic gives
    after the rollout (`moe_rl.programs.ppo.critic_stage`)."""
    scores_R: torch.Tensor
    """[R] the shaped rewards (verifier reward plus overlong shaping), an episode's on each of
    its rows (shaped by its last row's length: the segment its reward was earned in)."""
    seq_len: int
    """S: the longest prompt + response of the batch, rounded up to the TP size."""
    stats: dict[str, float]
    """The step's rollout statistics."""

    @property
    def rows(self) -> int:
        return self.rewards_R.numel()


def plan_step(kept: list[GroupSummary], drawn: list[GroupSummary], draws: int, rl: RLConfig,
              tp: int) -> StepPlan:
    """Advantages, batch width and statistics of the `kept` groups (dynamic sampling may have
    drawn more: `drawn` is every group of the step, for the statistics), shaped and estimated
    as `rl` says, the width rounded up to `tp` (the learner's tensor-parallel size)."""
    rewards_R = torch.tensor([r for g in kept for r in g.rewards], dtype=torch.float32)
    lengths_R = torch.tensor([n for g in kept for n in g.response_lens], dtype=torch.float32)
    shaped_R = rewards_R
    if rl.overlong_max_len:
        shaped_R = rewards_R + overlong_penalty(lengths_R, rl.overlong_max_len, rl.overlong_cache)
    episodes = step_episodes(kept)
    last_R = torch.zeros(rewards_R.numel(), dtype=torch.long)  # (each row's episode's last row)
    for rows in (rows for group in episodes for rows in group):
        last_R[rows] = rows[-1]
    shaped_R = shaped_R[last_R]
    critic = rl.uses_critic  # (its token advantages come once the step is scored)
    adv_R = (torch.zeros_like(shaped_R) if critic else
             episode_advantages(rl.advantage, shaped_R, episodes, rl.group_size))
    longest = max(g.prompt_len + max(g.response_lens, default=0) for g in kept)
    stats = rollout_stats(kept, drawn, draws, lengths_R, None if critic else adv_R)
    return StepPlan(rewards_R, adv_R, shaped_R, -(-longest // tp) * tp, stats)


def step_episodes(kept: list[GroupSummary]) -> list[list[list[int]]]:
    """Per kept group, the step's row ids of each of its trained episodes."""
    out, start = [], 0
    for g in kept:
        out.append([[start + j for j in rows] for rows in g.episode_rows()])
        start += len(g.response_lens)
    return out


def episode_advantages(estimator: str, shaped_R: torch.Tensor, episodes: list[list[list[int]]],
                       G: int) -> torch.Tensor:
    """[R] each episode's advantage within its group, over the group's trained episodes (an
    agent group's dropped ones left out, each episode counted once however many rows it
    has), on every row of the episode. Groups with as many episodes are estimated together
    (every group, but for dropped agent episodes: batch_std's scale is over those groups); a
    group left with fewer than `G` and than the estimator needs (rloo's 2) gets zeros."""
    adv_R = torch.zeros_like(shaped_R)
    by_size: dict[int, list[list[list[int]]]] = {}
    for group in episodes:
        if len(group) >= min(G, ADVANTAGES[estimator].min_group_size):
            by_size.setdefault(len(group), []).append(group)
    for same in by_size.values():
        last_NG = torch.tensor([[rows[-1] for rows in group] for group in same], dtype=torch.long)
        adv_NG = compute_advantages(estimator, shaped_R[last_NG])
        rows = [r for group in same for ep in group for r in ep]
        at = [n * len(same[0]) + e for n, group in enumerate(same) for e, ep in enumerate(group) for _ in ep]
        adv_R[rows] = adv_NG.flatten()[at].to(adv_R.dtype)
    return adv_R


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
        adv_B=plan.adv_R[row_ids],
        sampler_logp_BT=ragged_rows([r.logprobs for r in rows], T),
        sampler_routing=sampler_routing(rows, tokens, row_ids, model),
        version_B=torch.tensor([r.version for r in rows], dtype=torch.long),
        extras={SCORE: plan.scores_R[row_ids],
                VERSION_SPAN: torch.tensor([max(r.token_versions) - min(r.token_versions) if r.token_versions else 0
                                            for r in rows], dtype=torch.long)},
    )
    return batch, plan.rewards_R[row_ids], [r.text for r in rows]


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


def rollout_stats(kept: list[GroupSummary], drawn: list[GroupSummary], draws: int, lengths_R: torch.Tensor,
                  adv_R: torch.Tensor | None) -> dict[str, float]:
    """The step's reward, length and sampling statistics: rewards over the trained episodes
    (each once: an agent episode's segments are one episode, a dropped one is none), lengths
    over the rows (`advantage/abs_mean` of the rows' group advantages; under GAE the critic
    stage logs it)."""
    rewards_E = torch.tensor([r for g in kept for r in g.episode_rewards()], dtype=torch.float32)
    all_rewards = torch.tensor([r for g in drawn for r in g.episode_rewards()], dtype=torch.float32)
    finish = [f for g in kept for f in g.finish]
    some = rewards_E.numel() > 0
    stats = {
        "reward/mean": float(rewards_E.mean()) if some else 0.0,
        "reward/std": float(rewards_E.std()) if rewards_E.numel() > 1 else 0.0,
        "reward/solved_frac": float((rewards_E == 1).float().mean()) if some else 0.0,
        "reward/mean_all_draws": float(all_rewards.mean()) if all_rewards.numel() else 0.0,
        "reward/zero_variance_frac": sum(not g.has_signal for g in kept) / max(len(kept), 1),
        "response/length_mean": float(lengths_R.mean()) if lengths_R.numel() else 0.0,
        "response/length_max": float(lengths_R.max()) if lengths_R.numel() else 0.0,
        "response/truncated_frac": sum(f == "length" for f in finish) / max(len(finish), 1),
        "sampling/draws": float(draws),
        "sampling/groups": float(len(kept)),
        "sampling/groups_with_signal_frac": sum(g.has_signal for g in drawn) / max(len(drawn), 1),
    }
    if adv_R is not None:
        stats["advantage/abs_mean"] = float(adv_R.abs().mean()) if adv_R.numel() else 0.0
    stats.update(episode_stats([t for g in kept for t in (g.episodes or ())], stats["response/truncated_frac"]))
    return stats


def episode_stats(tallies: list[tuple[int, ...]], truncated_frac: float) -> dict[str, float]:
    """Multi-turn episodes' statistics (`moe_rl.rollout.episodes`) from their tallies; agent
    episodes (`moe_rl.rollout.gateway.agents`): turns and tool calls over the trained ones,
    timeouts, errors and resets over every one."""
    if not tallies:
        return {}
    agents = len(tallies[0]) > 3  # (..., timed out, raised, resets)
    trained = [t for t in tallies if not (agents and (t[3] or t[4]))]
    stats = {"rollout/turns_mean": sum(t[0] for t in trained) / max(len(trained), 1),
             "rollout/tool_calls_mean": sum(t[1] for t in trained) / max(len(trained), 1),
             "rollout/tool_parse_errors": float(sum(t[2] for t in trained)),
             "rollout/truncated_frac": truncated_frac}
    if agents:
        stats.update({"rollout/agent_timeouts": float(sum(t[3] for t in tallies)),
                      "rollout/agent_errors": float(sum(t[4] for t in tallies)),
                      "rollout/agent_resets": float(sum(t[5] for t in tallies)),
                      "rollout/agent_failed_frac": (len(tallies) - len(trained)) / len(tallies)})
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
