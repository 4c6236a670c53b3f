"""The loud checks behind routing replay (R2, R3): the router took the replayed ids, and the
replay ids cover every real token the source routed. Never a silent fallback."""

from __future__ import annotations

from typing import Any

import torch

from moe_rl.learner.microbatch import MicroBatch
from moe_rl.routing.record import ReplayIds


class ReplayError(RuntimeError):
    """Routing replay did not do what the plan asked: never a silent fallback."""


def replay_misses(routing_map_NE: torch.Tensor, used_NK: torch.Tensor, replayed_N: torch.Tensor) -> torch.Tensor:
    """How many replayed slots megatron's router sent to other experts than the replayed ids
    (a 0-dim count on the router's device: read once per micro-batch, `check_replay_took`,
    not once per layer, which would stall a GPU's queue at every MoE layer)."""
    chosen_NK = routing_map_NE.gather(1, used_NK.to(routing_map_NE.device))
    return (replayed_N & ~(chosen_NK.all(dim=1) & (routing_map_NE.sum(dim=1) == used_NK.shape[1]))).sum()


def check_replay_took(misses: list[tuple[int, torch.Tensor]], replayed: int) -> None:
    """Every MoE layer of the micro-batch routed every replayed slot to the replayed ids (the
    loud check behind R2 and R3); `misses`: (MoE layer, `replay_misses`) of each layer."""
    if not misses:
        return
    counts = torch.stack([m for _, m in misses]).cpu().tolist()
    for (layer, _), wrong in zip(misses, counts):
        if wrong:
            raise ReplayError(f"routing replay: MoE layer {layer} used other experts than the replayed ones on "
                              f"{wrong} of {replayed} replayed tokens")


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
