"""The routing taps' hold on megatron-core's routers: each `TopKRouter.routing` call wrapped
(per instance), its `RouterReplay` driven directly (taken out of megatron's class-level list
of instances, so a second model never sees this one's replay data), and the dispatchers'
kept autograd state dropped after a pass. What the taps do with it is
`moe_rl.learner.routing.taps`'."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

UPSTREAM = ("megatron.core.transformer.moe.router:TopKRouter.routing",
            "megatron.core.transformer.moe.router_replay:RouterReplay.global_router_replay_instances",
            "megatron.core.transformer.moe.router_replay:RouterReplay.set_router_replay_action",
            "megatron.core.transformer.moe.router_replay:RouterReplay.clear_router_replay_action",
            "megatron.core.transformer.moe.router_replay:RouterReplay.clear_indices",
            "megatron.core.transformer.moe.router_replay:RouterReplayAction.RECORD",
            "megatron.core.transformer.moe.router_replay:RouterReplayAction.REPLAY_FORWARD")
SIGNATURES = {"megatron.core.transformer.moe.router:TopKRouter.routing": ("self", "logits", "padding_mask")}


def tap(router: TopKRouter, make: Callable[[Any], Any]) -> None:
    """Wrap `router.routing` with `make(original)` and take its `RouterReplay` out of
    megatron's global list (the caller drives it)."""
    if router.router_replay is None:
        raise RuntimeError("routers were built without moe_enable_routing_replay")
    with contextlib.suppress(ValueError):
        RouterReplay.global_router_replay_instances.remove(router.router_replay)
    router.routing = make(router.routing)


def drop_autograd_state(dispatcher: Any) -> None:
    """Forget the last forward's routing tensors that a token dispatcher keeps on itself.

    megatron's dispatchers keep the last micro-batch's `probs` (and kin) as attributes; after
    a training pass these still carry their autograd graph, whose gradient-accumulator nodes
    hold DDP's hooks, which hold the model: a cycle through C++ that Python's collector
    cannot break, so a discarded learner's weights, grads and Adam states stayed allocated
    (found on an H100: about 8 GiB per learner at the 30B layer shape). Each forward sets
    these afresh, so nothing reads them after the pass."""
    for name, value in list(vars(dispatcher).items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            setattr(dispatcher, name, None)


def route(router: TopKRouter, original: Any, logits: torch.Tensor, padding_mask: torch.Tensor | None, *,
           force: torch.Tensor | None = None, record: bool = False, count: bool = True) -> tuple[Any, Any]:
    """megatron-core's routing, and the [N, K] ids it used (None unless forced or recorded).

    `force`: route to these ids (megatron's REPLAY_FORWARD: gates from the current router at
    them); `record`: keep the ids megatron picked, in its own order (its RECORD action), so
    that forcing them again reproduces the gates bit for bit. `count`: add this pass's real
    tokens to the expert-bias token count (aux-loss-free balancing). Counted here rather than
    by megatron-core 0.16, which masks the [N, E] routing map with the [N] padding mask (fails
    to broadcast, or with N = E masks the wrong axis) and counts whenever gradients are on,
    so a recomputed layer would count its tokens again."""
    replay = router.router_replay
    if force is not None:
        replay.target_topk_idx = force
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    elif record:
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    bias_on, router.enable_expert_bias = router.enable_expert_bias, False
    try:
        probs, routing_map = original(logits, padding_mask)
        used = force if force is not None else replay.recorded_topk_idx
    finally:
        router.enable_expert_bias = bias_on
        replay.clear_router_replay_action()
        replay.target_topk_idx = None
        replay.recorded_topk_idx = None
    if bias_on and count:
        with torch.no_grad():
            real = routing_map if padding_mask is None else routing_map & ~padding_mask.reshape(-1, 1)
            router.local_tokens_per_expert += real.sum(dim=0)
    return (probs, routing_map), used
