"""What a rollout is: the scored groups the sampler returned, and the training batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_rl.batch import TokenBatch
from moe_rl.routing.record import ReplayIds


@dataclass
class ScoredGroup:
    """One prompt and its G responses as the sampler returned them, with their rewards."""

    prompt: list[int]
    """Prompt token ids."""
    responses: list[list[int]]
    """G response token ids (a response that stopped on EOS ends with it)."""
    logprobs: list[list[float]]
    """The sampler's logprob of each response token."""
    texts: list[str]
    """Decoded responses (what the verifier scored)."""
    rewards: list[float]
    """Verifier rewards, before any shaping."""
    finish: list[str]
    """Finish reason per response: "stop" (EOS) or "length" (max_new_tokens)."""
    routed: list[np.ndarray] | None
    """Per response, the sampler's routed experts in vLLM's layout, when the backend returns them."""

    @property
    def has_signal(self) -> bool:
        """Rewards differ within the group (group advantages are not all zero)."""
        return len(set(self.rewards)) > 1


@dataclass
class Rollout:
    """One step's training batch: built where the sampler ran, then broadcast to every rank."""

    batch: TokenBatch
    """prompts_per_step x G sequences, right-padded to the sampler's max_new_tokens."""
    rewards_B: torch.Tensor
    """[B] verifier rewards (unshaped)."""
    adv_B: torch.Tensor
    """[B] advantages (from the shaped rewards)."""
    rollout_logp_BT: torch.Tensor
    """[B, T] the sampler's logprobs of the response tokens (0 on padding): TIS/MIS and the
    sampler-learner mismatch metrics compare them with the learner's."""
    texts: list[str]
    """[B] decoded responses."""
    sampler_routing: ReplayIds | None
    """The sampler's top-k expert ids placed on the batch's [B, S] grid (rows 0..B-1, MoE
    layers in the learner's order, `valid_RS` marking the positions the sampler routed).
    Present when the sampler backend returns routed experts: R3 replays it, and the
    sampler-learner routing disagreement is measured against it. None otherwise."""
    stats: dict[str, float]
    """reward/*, response/*, sampling/* and advantage/* metrics of the step."""
