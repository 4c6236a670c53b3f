"""The loud checks behind routing replay (R2, R3): the router took the replayed ids, and the
replay ids cover every real token the source routed. Never a silent fallback."""

from __future__ import annotations

from typing import Any

import torch

from moe_rl.learner.microbatch import MicroBatch
from moe_rl.routing.record import ReplayIds


class ReplayError(RuntimeError):
    """Routing replay did not do what the plan asked: never a silent fallback."""


def check_replay_took(routing_map_NE: torch.Tensor, used_NK: torch.Tensor, replayed_N: torch.Tensor,
                       layer: int) -> None:
    """The experts megatron's router actually selected equal the replayed ids on every
    replayed slot (the loud check behind R2 and R3)."""
    chosen_NK = routing_map_NE.gather(1, used_NK.to(routing_map_NE.device))
    wrong = replayed_N & ~(chosen_NK.all(dim=1) & (routing_map_NE.sum(dim=1) == used_NK.shape[1]))
    if bool(wrong.any()):
        raise ReplayError(f"routing replay: MoE layer {layer} used other experts than the replayed ones on "
                          f"{int(wrong.sum())} of {int(replayed_N.sum())} replayed tokens")


def check_replay_covers(mb: MicroBatch, inp: Any, replay: ReplayIds, replayed_N: torch.Tensor,
                         shard: slice) -> None:
    """Every real token a replay source routed is replayed: R2 records every real token, the
    sampler (R3) every real token but each sequence's last. Counted on this rank's shard."""
    rows_N, pos_N = inp.rows_N[shard], inp.pos_N[shard]
    lens_N = mb.batch.total_lens_B[rows_N.clamp(min=0)]
    last_routed = lens_N - (1 if replay.valid_RS is not None else 0)
    expected = int((inp.real_N[shard] & (pos_N < last_routed)).sum())
    got = int(replayed_N.sum())
    if got != expected:
        raise ReplayError(f"routing replay: {got} replayed tokens on this rank's micro-batch {mb.index}, "
                          f"expected {expected} (every real token the source routed): the replay ids do "
                          "not cover the batch's rows")
