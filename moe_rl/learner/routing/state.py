"""What the routing taps (`moe_rl.learner.routing.taps`) keep per micro-batch and per pass.

A micro-batch's inputs to its routers (the slots' replay ids, old routing, masks) are built
on the host before its forward from data the host holds, and moved to the router's device
once (`MicroBatchRouting.on`). What the routers leave (captured ids and log-probs, router
shift sums, per-layer statistics, replay miss counts) stays on the device and is added up
there; the host reads it once per pass (`PassRouting`), never inside a micro-batch, where
each read would make a GPU's host wait for its queue."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moe_rl.learner.microbatch import MicroBatch


@dataclass
class MicroBatchRouting:
    """One micro-batch's routing inputs (host, moved on first use) and outputs (device)."""

    mb: MicroBatch
    shard: slice
    real_N: torch.Tensor
    """[n_local] slots that hold a real token."""
    spread_NK: torch.Tensor | None = None
    """[n_local, K] `spread_topk` ids, forced where no real token is (None: every slot is real)."""
    active: bool = False
    """The plan captures, replays or measures (else the routers only spread padding)."""
    capture: bool = False
    """Record the routing."""
    needs_logr: bool = False
    """The routers' log-probabilities are read (capture, router shift)."""
    weight_N: torch.Tensor | None = None
    """[n_local] float: slots that score a response token (the router-shift statistics' weights)."""
    replay_NLK: torch.Tensor | None = None
    replay_valid_N: torch.Tensor | None = None
    """[n_local] slots that take replayed ids (None: all of them)."""
    replayed: int = 0
    """Replayed slots of this shard."""
    old_ids_NLK: torch.Tensor | None = None
    old_logp_NLK: torch.Tensor | None = None
    captured: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = field(
        default_factory=lambda: ([], [], []))
    """Per layer: the ids used, their log-probs, the router's own ids (under replay)."""
    shift_sum_N: torch.Tensor | None = None
    """[n_local] sum over this stage's layers of |dlog r| at the old ids."""
    layer_stats_2LN: torch.Tensor | None = None
    """[2, L, n_local] per layer and slot: top-k set changed (0/1), mean |dlog r|."""
    misses_L: torch.Tensor | None = None
    """[L] per layer: replayed slots routed elsewhere."""
    _moved: dict[tuple[str, bool], torch.Tensor] = field(default_factory=dict)

    @property
    def needs_fresh(self) -> bool:
        """The routers' own top-k is read: recorded or measured, or routed where nothing is forced."""
        return self.needs_logr or self.spread_NK is not None or (
            self.replay_NLK is not None and self.replay_valid_N is not None)

    def on(self, device: torch.device, name: str, long: bool = False) -> torch.Tensor:
        """A per-micro-batch input on the router's device (as int64 with `long`), moved (and
        widened) once per micro-batch, not once per layer; the caller checked it is set."""
        key = (name, long)
        t = self._moved.get(key)
        if t is None:
            t = getattr(self, name)
            if t is None:
                raise RuntimeError(f"routing input {name} is not set for this micro-batch")
            t = t.to(device, non_blocking=True)
            if long:
                t = t.long()
            self._moved[key] = t
        return t


class PassRouting:
    """A pass's routing results on the device, added up over its micro-batches."""

    def __init__(self, num_routers: int) -> None:
        self.num_routers = num_routers
        self.captures: list[tuple[Any, ...]] = []
        """Per micro-batch: (rows, model input, rows, S, [ids, logp, fresh] host copies under way)."""
        self.gammas: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per micro-batch: ([b, T] router shift on the device, [b, T] host response mask)."""
        self.stat_sums: torch.Tensor | None = None
        """[3, L] float64: flips, |dlog r| and count, weighted by the scored slots."""
        self.misses_L: torch.Tensor | None = None
        """[L] int64 replayed slots routed elsewhere."""
        self.replayed = 0

    def add_stats(self, st: MicroBatchRouting, device: torch.device) -> None:
        """The micro-batch's per-layer statistics, weighted by its scored slots."""
        w_N, stats_2LN = st.on(device, "weight_N"), st.layer_stats_2LN
        assert stats_2LN is not None  # (the caller's check)
        if self.stat_sums is None:
            self.stat_sums = torch.zeros(3, self.num_routers, dtype=torch.float64, device=device)
        self.stat_sums[:2] += stats_2LN @ w_N
        self.stat_sums[2] += w_N.sum()

    def add_misses(self, st: MicroBatchRouting) -> None:
        assert st.misses_L is not None  # (the caller's check)
        self.misses_L = st.misses_L if self.misses_L is None else self.misses_L.add_(st.misses_L)
        self.replayed += st.replayed

    def host_stat_sums(self) -> torch.Tensor:
        """[3, L] float64 on the host (zeros if no layer measured anything)."""
        if self.stat_sums is None:
            return torch.zeros(3, self.num_routers, dtype=torch.float64)
        return self.stat_sums.cpu()

    def host_gammas(self) -> torch.Tensor:
        """Every scored token's router shift, in micro-batch and row order, on the host."""
        if not self.gammas:
            return torch.zeros(0)
        values = torch.cat([g.reshape(-1) for g, _ in self.gammas]).cpu()
        return values[torch.cat([m.reshape(-1) for _, m in self.gammas])]
