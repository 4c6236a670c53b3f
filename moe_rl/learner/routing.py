"""Routing capture, router-shift weights and routing replay inside the megatron learner.

Each `TopKRouter` of a model gets a tap around its `routing(logits)` call. Per micro-batch
the tap can:
  - capture the top-k ids that were used and the router's log-probability of them
    (log softmax over all experts, or log of the normalised sigmoid score);
  - replay given ids through megatron-core's `RouterReplay` (REPLAY_FORWARD): gate weights
    are recomputed from the current router at the replayed ids, so the router keeps its
    gradient; positions without replay ids (R3: the last token, padding) route afresh;
  - measure router shift against an old record: sum over the old top-k of
    |log r_now(e) - log r_old(e)| per token, plus per-layer flip rates and |dlog r|.

Layouts. The router sees this rank's sequence-parallel shard `[S/tp, mbs]` of the
micro-batch, flattened s-major. Captures and shift sums are all-gathered over TP to the
full `[S, mbs]`. Each pipeline stage owns its MoE layers: records hold only those layers,
and the per-token shift sums of earlier stages travel to the last stage (where the loss
is) over a dedicated per-pipeline process group, sent right after each stage's forward of
the micro-batch, received before its loss. gamma = exp(-sum / (L*K)) is a product over
layers, so the stage sums add up exactly.

State. `RouterReplay` keeps per-router state and megatron registers every instance in one
class-level list; we take this model's instances out of that list and drive them
directly, and `RouterTaps.run(plan)` is the context manager that sets and always clears
them. A second model in the same process (a reference policy) has its own taps and never
sees this model's replay data.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import group_limited_topk
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moe_rl.collectives import all_gather_object
from moe_rl.learner.microbatch import ForwardHooks, MicroBatch
from moe_rl.learner.parallel import all_reduce_, comm_device
from moe_rl.learner.routing_checks import (
    ReplayError,
    check_replay_covers,
    check_replay_took,
    replay_misses,
)
from moe_rl.learner.routing_tokens import rows_to_slots, slot_shard, slots_to_rows, spread_topk
from moe_rl.routing.record import ReplayIds, RoutingRecord, ids_dtype
from moe_rl.routing.shift import router_shift_from_partial
from moe_rl.routing.stats import gamma_stats, topk_set_changed

__all__ = ["ReplayError", "RouterTaps", "RoutingPlan"]


@dataclass
class RoutingPlan:
    """What the taps do during one learner pass (a scoring pass or a train step)."""

    capture: bool = False
    """Record the routing of every row this rank processes."""
    replay: ReplayIds | None = None
    """Force these ids (R2: the old record's; R3: the sampler's)."""
    old: RoutingRecord | None = None
    """Measure router shift against this record (update passes). The loss gets the raw
    gamma in (0, 1]; its floor is the objective's hyperparameter (rspo's gamma_min), applied
    there and only there."""


@dataclass
class _MicroBatchState:
    mb: MicroBatch
    shard: slice
    mask_N: torch.Tensor  # [n_local] slots that score a response token
    real_N: torch.Tensor  # [n_local] slots that hold a real token
    spread_NK: torch.Tensor | None = None  # [n_local, K] `spread_topk` ids, forced where no real token is
    replay_NLK: torch.Tensor | None = None
    replay_valid_N: torch.Tensor | None = None
    old_ids_NLK: torch.Tensor | None = None
    old_logp_NLK: torch.Tensor | None = None
    captured_ids: list[torch.Tensor] = field(default_factory=list)
    captured_logp: list[torch.Tensor] = field(default_factory=list)
    captured_fresh: list[torch.Tensor] = field(default_factory=list)
    shift_sum_N: torch.Tensor | None = None
    replayed: int = 0  # replayed slots of this shard
    replay_misses: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (MoE layer, device count)
    stat_sums: torch.Tensor | None = None  # [3, L_stage]: flips, |dlog r|, token count

    def on(self, device: torch.device, name: str) -> torch.Tensor:
        """A per-micro-batch input moved to the router's device once (no-op on CPU)."""
        t = getattr(self, name)
        if t is not None and t.device != device:
            t = t.to(device, non_blocking=True)
            setattr(self, name, t)
        return t


def _drop_autograd_state(dispatcher: Any) -> None:
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


def _route(router: TopKRouter, original: Any, logits: torch.Tensor, padding_mask: torch.Tensor | None, *,
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


def _in_backward() -> bool:
    """Inside an autograd backward: where megatron's activation recompute runs a layer again."""
    return torch._C._current_graph_task_id() != -1


class RouterTaps(ForwardHooks):
    """Owns the routers (and their RouterReplay instances) of one model."""

    def __init__(self, gpt: torch.nn.Module, tcfg: Any, layout: Any) -> None:
        self.layout = layout
        self.tcfg = tcfg
        self.num_experts = tcfg.num_moe_experts
        self.topk = tcfg.moe_router_topk
        freq = tcfg.moe_layer_freq
        freq = freq if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(tcfg.num_layers)]
        moe_layer_of = {li: k for k, li in enumerate(i for i, f in enumerate(freq) if f)}
        self.num_moe_layers = len(moe_layer_of)
        self.routers: list[TopKRouter] = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
        self.dispatchers = [m.token_dispatcher for m in gpt.modules() if isinstance(m, MoELayer)]
        self.layers = [moe_layer_of[r.layer_number - 1] for r in self.routers]
        self.recompute = tcfg.recompute_granularity == "full"
        self._ids_dtype = ids_dtype(self.num_experts)
        self._for_recompute: list[deque[torch.Tensor]] = [deque() for _ in self.routers]
        for i, router in enumerate(self.routers):
            if router.router_replay is None:
                raise RuntimeError("routers were built without moe_enable_routing_replay")
            with contextlib.suppress(ValueError):
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.routing = self._make_tap(i, router, router.routing)
        self.plan: RoutingPlan | None = None
        self._state: _MicroBatchState | None = None
        self._captures: list[tuple[torch.Tensor, ...]] = []
        self._gammas: list[torch.Tensor] = []
        self._stat_sums = torch.zeros(3, len(self.routers), dtype=torch.float64)  # flips, dlogr, count
        self._pending_sends: list[Any] = []
        self._side_group = _pipeline_side_group(layout)

    # ------------------------------------------------------------------ pass control

    @contextlib.contextmanager
    def run(self, plan: RoutingPlan) -> Iterator[None]:
        """Activate `plan` for one pass; replay state is cleared on exit, whatever happens."""
        self.plan = plan
        self._captures, self._gammas = [], []
        self._stat_sums.zero_()
        try:
            yield
            left = sum(len(p) for p in self._for_recompute)
            if left:
                raise RuntimeError(f"recompute: {left} routings of this pass's forwards were never re-run in a "
                                   "backward (a micro-batch's backward did not run)")
        finally:
            for pending in self._for_recompute:
                pending.clear()
            for work in self._pending_sends:
                work.wait()
            self._pending_sends = []
            for router in self.routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
            for dispatcher in self.dispatchers:
                _drop_autograd_state(dispatcher)
            self.plan = None
            self._state = None

    # ------------------------------------------------------------------ ForwardHooks

    def before_forward(self, mb: MicroBatch) -> None:
        inp = mb.inp
        shard = slot_shard(inp, self.layout.tp, self.layout.tp_rank, self.layout.sequence_parallel)
        real_N = inp.real_N[shard]
        spread = None
        if not bool(real_N.all()):  # padding never loads an expert more than another
            spread = spread_topk(torch.arange(shard.start, shard.stop), self.num_experts, self.topk)
        if self.plan is None:
            self._state = _MicroBatchState(mb=mb, shard=shard, mask_N=real_N, real_N=real_N, spread_NK=spread)
            return
        scored_BS = mb.batch.scored_positions()
        rows_N, pos_N = inp.rows_N[shard], inp.pos_N[shard]
        mask_N = real_N & scored_BS[rows_N.clamp(min=0), pos_N.clamp(max=scored_BS.shape[1] - 1)]
        st = _MicroBatchState(mb=mb, shard=shard, mask_N=mask_N, real_N=real_N, spread_NK=spread)
        if self.plan.replay is not None:
            r = self.plan.replay
            st.replay_NLK = rows_to_slots(r.rows, r.ids_RSLK, mb.rows_B, inp, shard, fill_k=self.topk, missing_ok=True)
            valid = r.valid_RS[..., None, None] if r.valid_RS is not None else torch.ones(
                *r.ids_RSLK.shape[:2], 1, 1, dtype=torch.bool)
            st.replay_valid_N = rows_to_slots(r.rows, valid, mb.rows_B, inp, shard, missing_ok=True).reshape(-1) & real_N
            st.replayed = int(st.replay_valid_N.sum())  # (a host tensor here)
            check_replay_covers(mb, inp, r, st.replay_valid_N, shard)
        if self.plan.old is not None:
            o = self.plan.old
            st.old_ids_NLK = rows_to_slots(o.rows, o.ids_RSLK, mb.rows_B, inp, shard, fill_k=self.topk)
            st.old_logp_NLK = rows_to_slots(o.rows, o.logp_RSLK, mb.rows_B, inp, shard)
        self._state = st

    def after_forward(self, mb: MicroBatch) -> None:
        st = self._state
        if st is None or self.plan is None:
            return
        check_replay_took(st.replay_misses, st.replayed)
        if st.stat_sums is not None:
            self._stat_sums += st.stat_sums.cpu()
        rows, S = mb.batch.batch_size, mb.batch.seq_len
        if self.plan.capture and st.captured_ids:  # (a stage may hold no MoE layer)
            grids = []
            for parts, fill_k in ((st.captured_ids, self.topk), (st.captured_logp, None),
                                  (st.captured_fresh, self.topk)):
                if not parts:
                    grids.append(None)
                    continue
                full_N = self._gather_sp(torch.stack(parts, dim=1)).cpu()  # [N, L, K]
                grids.append(slots_to_rows(full_N, mb.inp, rows, S, fill_k=fill_k))
            self._captures.append((mb.rows_B, *grids))
        if self.plan.old is not None:
            sums_N = st.shift_sum_N if st.shift_sum_N is not None else torch.zeros(
                st.mask_N.numel(), device=comm_device())  # sent over NCCL on GPU: never a host tensor
            sums_N = self._gather_sp(sums_N)
            if not self.layout.is_last_stage:
                self._pending_sends.append(
                    dist.isend(sums_N.contiguous(), dst=self._last_stage_rank(), group=self._side_group)
                )
            else:
                st.shift_sum_N = sums_N  # now every slot's, over this stage's layers

    def loss_aux(self, mb: MicroBatch) -> dict[str, Any]:
        st = self._state
        if st is None or self.plan is None or self.plan.old is None:
            return {}
        total_N = st.shift_sum_N.clone()
        for src in self._earlier_stage_ranks():
            buf = torch.empty_like(total_N)
            dist.recv(buf, src=src, group=self._side_group)
            total_N += buf
        gamma_N = router_shift_from_partial(total_N, self.num_moe_layers, self.topk, gamma_min=0.0)
        gamma_BS = slots_to_rows(gamma_N.cpu(), mb.inp, mb.batch.batch_size, mb.batch.seq_len, fill=1.0)
        gamma_BT = gamma_BS.gather(1, mb.batch.scoring_positions()).to(gamma_N.device)
        mask_BT = mb.batch.response_mask().to(gamma_N.device)
        self._gammas.append(gamma_BT[mask_BT].cpu())
        return {"router_shift_BT": torch.where(mask_BT, gamma_BT, 1.0)}

    # ------------------------------------------------------------------ the tap

    def _make_tap(self, i: int, router: TopKRouter, original: Any) -> Any:
        """Router i's `routing`, wrapped. Everything stays on the router's device; the
        micro-batch's results move to the host once, in `after_forward`.

        Under full recompute a training micro-batch routes twice: in its forward, and again in
        its backward when megatron re-runs the layer. The forward keeps the ids it used (its
        own, replayed or spread), per router and in micro-batch order (the schedules run
        backwards in forward order); the re-run takes them back and is forced to them, so it
        computes the forward's gates exactly and records, measures and counts nothing."""
        pending = self._for_recompute[i]

        def routing(logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            keep = self.recompute and router.training
            if keep and _in_backward():
                if not pending:
                    raise RuntimeError(f"recompute: router of MoE layer {self.layers[i]} re-ran a layer its "
                                       "forward did not route")
                return _route(router, original, logits, padding_mask, force=pending.popleft().long(), count=False)[0]
            count = torch.is_grad_enabled() or keep  # (a recomputed layer's first forward runs without grad)
            st = self._state
            if st is None or (self.plan is None and st.spread_NK is None):
                out, used = _route(router, original, logits, padding_mask, record=keep, count=count)
                if keep:
                    pending.append(used.to(self._ids_dtype))  # (kept until the backward: 1-2 bytes per id)
                return out
            dev = logits.device
            logits_NE = logits.reshape(-1, self.num_experts)
            with torch.no_grad():
                logr_NE = self._log_routing_probs(router, logits_NE)
                fresh_NK = self._fresh_topk(router, logits_NE).sort(dim=-1).values
            target_NK = self._target_ids(st, i, dev, fresh_NK)
            used_NK = target_NK.sort(dim=-1).values if target_NK is not None else fresh_NK
            out, ids = _route(router, original, logits, padding_mask, force=target_NK,
                              record=keep and target_NK is None, count=count)
            if keep:
                pending.append(ids.to(self._ids_dtype))
            if self.plan is not None:
                with torch.no_grad():
                    if st.replay_valid_N is not None:
                        st.replay_misses.append(
                            (self.layers[i], replay_misses(out[1], used_NK, st.on(dev, "replay_valid_N"))))
                    self._record(st, i, dev, logr_NE, fresh_NK, used_NK)
            return out

        return routing

    def _target_ids(self, st: _MicroBatchState, i: int, dev: torch.device,
                    fresh_NK: torch.Tensor) -> torch.Tensor | None:
        """The ids to force through router i: replayed ids where the plan replays, the
        router's own elsewhere, `spread_topk` on slots without a real token; None: route freely."""
        target = None
        if st.replay_NLK is not None:
            target = torch.where(st.on(dev, "replay_valid_N")[:, None], st.on(dev, "replay_NLK")[:, i].long(),
                                 fresh_NK)
        if st.spread_NK is not None:  # (a where, not mask indexing, which waits for a GPU at every layer)
            target = torch.where(st.on(dev, "real_N")[:, None], fresh_NK if target is None else target,
                                 st.on(dev, "spread_NK"))
        return target

    def _record(self, st: _MicroBatchState, i: int, dev: torch.device, logr_NE: torch.Tensor,
                fresh_NK: torch.Tensor, used_NK: torch.Tensor) -> None:
        """Capture and router-shift statistics of router i on this micro-batch shard."""
        if self.plan.capture:
            st.captured_ids.append(used_NK.to(ids_dtype(self.num_experts)))
            st.captured_logp.append(logr_NE.gather(1, used_NK))
            if st.replay_NLK is not None:
                st.captured_fresh.append(fresh_NK.to(ids_dtype(self.num_experts)))
        if self.plan.old is not None:
            old_ids = st.on(dev, "old_ids_NLK")[:, i].long()
            dlogr_NK = (logr_NE.gather(1, old_ids) - st.on(dev, "old_logp_NLK")[:, i]).abs()
            part = dlogr_NK.sum(-1)
            st.shift_sum_N = part if st.shift_sum_N is None else st.shift_sum_N + part
            w = st.on(dev, "mask_N").to(dlogr_NK.dtype)
            flips = topk_set_changed(fresh_NK[:, None], old_ids[:, None])[:, 0].to(w.dtype)
            if st.stat_sums is None:
                st.stat_sums = torch.zeros(3, len(self.routers), dtype=torch.float64, device=dev)
            st.stat_sums[:, i] += torch.stack([(flips * w).sum(), (dlogr_NK.mean(-1) * w).sum(), w.sum()])

    def _log_routing_probs(self, router: TopKRouter, logits_NE: torch.Tensor) -> torch.Tensor:
        """log r over all experts: softmax routers -> log softmax; sigmoid routers -> log of
        the scores normalised to sum to 1 (the distribution the top-k is taken from)."""
        x = logits_NE.float()
        if self.tcfg.moe_router_score_function == "sigmoid":
            logs = torch.nn.functional.logsigmoid(x)
            return logs - torch.logsumexp(logs, dim=-1, keepdim=True)
        return torch.log_softmax(x, dim=-1)

    def _fresh_topk(self, router: TopKRouter, logits_NE: torch.Tensor) -> torch.Tensor:
        """The ids megatron's router would pick without replay (same rule, same tie-breaking):
        the final top-k after group selection (DeepSeek-V3's group-limited routing) and bias."""
        scores = logits_NE
        if self.tcfg.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits_NE.float()).type_as(logits_NE)
            if router.expert_bias is not None:
                scores = scores + router.expert_bias
        groups, group_topk = self.tcfg.moe_router_num_groups, self.tcfg.moe_router_group_topk
        if groups and group_topk:
            return group_limited_topk(scores, self.topk, scores.shape[0], self.num_experts, groups, group_topk)[1]
        return torch.topk(scores, self.topk, dim=1).indices

    # ------------------------------------------------------------------ results

    def record(self) -> RoutingRecord | None:
        """The capture of the pass that just ran: this rank's rows, this stage's layers."""
        if not self._captures:
            if self.plan is not None and self.plan.capture:  # a stage without MoE layers
                z = torch.zeros(0, 0, 0, self.topk)
                return RoutingRecord(torch.zeros(0, dtype=torch.long), [], z.to(ids_dtype(self.num_experts)), z)
            return None
        rows = torch.cat([c[0] for c in self._captures])
        keep = rows >= 0
        cat = lambda j: torch.cat([c[j] for c in self._captures])[keep]  # noqa: E731
        fresh = cat(3) if self._captures[0][3] is not None else None
        return RoutingRecord(rows[keep], list(self.layers), cat(1), cat(2), fresh)

    def shift_metrics(self) -> dict[str, float]:
        """Router-shift statistics of the pass (collective over the whole world)."""
        sums = self._stat_sums.clone()
        for group in (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()):
            if dist.get_world_size(group) > 1:
                all_reduce_(sums, group=group)
        per_layer = {}
        count = sums[2].clamp(min=1)
        for i, layer in enumerate(self.layers):
            per_layer[f"routing/flip_rate_layer{layer}"] = float(sums[0, i] / count[i])
            per_layer[f"routing/dlogr_layer{layer}"] = float(sums[1, i] / count[i])
        out: dict[str, float] = {}
        if self.layout.pp > 1:
            gathered: list[dict[str, float]] = [None] * self.layout.pp  # type: ignore[list-item]
            dist.all_gather_object(gathered, per_layer, group=ps.get_pipeline_model_parallel_group())
            for d in gathered:
                out.update(d)
        else:
            out.update(per_layer)
        n = self.num_moe_layers
        out["routing/flip_rate_mean"] = sum(out[f"routing/flip_rate_layer{j}"] for j in range(n)) / n
        out["routing/dlogr_mean"] = sum(out[f"routing/dlogr_layer{j}"] for j in range(n)) / n
        gam = self._gathered_gammas()
        if gam is not None:
            out.update({k: float(v) for k, v in gamma_stats(gam).items()})
        return out

    def _gathered_gammas(self) -> torch.Tensor | None:
        if not self.layout.is_last_stage or not self._gammas:
            mine = torch.zeros(0)
        else:
            mine = torch.cat(self._gammas)
        parts: list[torch.Tensor] = [mine]
        if self.layout.dp > 1 and self.layout.is_last_stage:
            parts = [None] * self.layout.dp  # type: ignore[list-item]
            dist.all_gather_object(parts, mine, group=ps.get_data_parallel_group())
        g = torch.cat(parts)
        if self.layout.pp > 1:
            box = [g]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            g = box[0]
        return g if g.numel() else None

    # ------------------------------------------------------------------ plumbing

    def _gather_sp(self, t_SB: torch.Tensor) -> torch.Tensor:
        """All-gather a [S_local, ...] tensor over TP along S (sequence parallel)."""
        if not self.layout.sequence_parallel or self.layout.tp == 1:
            return t_SB
        group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(t_SB) for _ in range(self.layout.tp)]
        dist.all_gather(parts, t_SB.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    def _last_stage_rank(self) -> int:
        return ps.get_pipeline_model_parallel_last_rank()

    def _earlier_stage_ranks(self) -> list[int]:
        if self.layout.pp == 1:
            return []
        return list(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[:-1])


def _pipeline_side_group(layout: Any) -> Any:
    """A process group per pipeline (same members as megatron's), used only for the
    router-shift sums so they never interleave with megatron's activation messages."""
    if layout.pp == 1:
        return None
    mine = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    everyone: list[list[int]] = all_gather_object(mine)
    my_group = None
    for ranks in sorted({tuple(r) for r in everyone}):
        g = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            my_group = g
    return my_group
