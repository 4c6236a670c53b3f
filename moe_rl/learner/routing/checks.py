"""The loud checks behind routing replay (R2, R3): the router took the replayed ids, and the
replay ids cover every real token the source routed. Never a silent fallback.

Both cost the device nothing it must answer at once: coverage is counted on the host from
the replay ids, and what each router did is counted on the device, per MoE layer, into a
counter the host reads once per pass (`check_replay_took`)."""

from __future__ import annotations

from typing import Any

import torch

from moe_rl.learner.microbatch import MicroBatch
from moe_rl.routing.record import ReplayIds


class ReplayError(RuntimeError):
    """Routing replay did not do what the plan asked: never a silent fallback."""


def count_replay_misses(routing_map_NE: torch.Tensor, ids_NK: torch.Tensor, replayed_N: torch.Tensor | None,
                        out: torch.Tensor) -> None:
    """Into the 0-dim `out` (on the router's device): how many replayed slots megatron's
    router did not send to all of their replayed ids (`replayed_N` None: every slot is
    replayed). Under top-k routing each slot takes exactly K experts, so holding the K
    replayed ones is taking exactly them."""
    took_N = routing_map_NE.gather(1, ids_NK).all(dim=1)
    missed_N = took_N.logical_not() if replayed_N is None else replayed_N > took_N  # (replayed and not took)
    torch.sum(missed_N, dim=0, out=out)


def check_replay_took(layers: list[int], misses_L: list[int], replayed: int) -> None:
    """Every MoE layer of the pass routed every replayed slot to the replayed ids (the loud
    check behind R2 and R3); `misses_L`: each layer's count of slots it routed elsewhere,
    `replayed`: the replayed slots of the pass on this rank."""
    for layer, wrong in zip(layers, misses_L):
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
