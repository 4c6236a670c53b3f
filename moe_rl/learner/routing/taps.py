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

Host and device. A micro-batch's routing inputs are built on the host before its forward
and moved to the router's device once; everything the routers leave stays on the device,
added up over the pass, and the host reads it once per pass (`state`): no read
inside a micro-batch, which would make a GPU's host wait for its queue at every layer.

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
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import group_limited_topk
from megatron.core.transformer.moe.router import TopKRouter

from moe_rl.learner.megatron_patches.router_replay import drop_autograd_state, route, tap
from moe_rl.learner.microbatch import ForwardHooks, MicroBatch
from moe_rl.learner.parallel import Layout, all_reduce_, comm_device, wait_for_device
from moe_rl.learner.routing.checks import (
    ReplayError,
    check_replay_covers,
    check_replay_took,
    count_replay_misses,
)
from moe_rl.learner.routing.state import MicroBatchRouting, PassRouting
from moe_rl.learner.routing.tokens import (
    SlotSource,
    from_rows,
    slot_shard,
    slot_source,
    slots_to_rows,
    spread_topk,
)
from moe_rl.routing.record import ReplayIds, RoutingRecord, ids_dtype
from moe_rl.routing.shift import router_shift_from_partial
from moe_rl.routing.stats import gamma_stats
from moe_rl.runtime.collectives import all_gather_object

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


def _in_backward() -> bool:
    """Inside an autograd backward: where megatron's activation recompute runs a layer again."""
    return torch._C._current_graph_task_id() != -1


class RouterTaps(ForwardHooks):
    """Owns the routers (and their RouterReplay instances) of one model."""

    def __init__(self, gpt: torch.nn.Module, tcfg: Any, layout: Layout) -> None:
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
            tap(router, partial(self._make_tap, i, router))
        self.plan: RoutingPlan | None = None
        self._state: MicroBatchRouting | None = None
        self._pass = PassRouting(len(self.routers))
        self._pending_sends: list[Any] = []
        self._side_group = _pipeline_side_group(layout)

    # ------------------------------------------------------------------ pass control

    @contextlib.contextmanager
    def run(self, plan: RoutingPlan) -> Iterator[None]:
        """Activate `plan` for one pass; replay state is cleared on exit, whatever happens.
        The replay check reads its device counters here, once per pass."""
        self.plan = plan
        self._pass = PassRouting(len(self.routers))
        try:
            yield
            left = sum(len(p) for p in self._for_recompute)
            if left:
                raise RuntimeError(f"recompute: {left} routings of this pass's forwards were never re-run in a "
                                   "backward (a micro-batch's backward did not run)")
            if self._pass.misses_L is not None:
                check_replay_took(self.layers, self._pass.misses_L.tolist(), self._pass.replayed)
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
                drop_autograd_state(dispatcher)
            self.plan = None
            self._state = None

    # ------------------------------------------------------------------ ForwardHooks

    def before_forward(self, mb: MicroBatch) -> None:
        """The micro-batch's routing inputs, on the host (its tensors are still there)."""
        inp = mb.inp
        assert inp is not None  # (the learner sets it before the forward)
        shard = slot_shard(inp, self.layout.tp, self.layout.tp_rank, self.layout.sequence_parallel)
        whole = shard.stop - shard.start == inp.slots
        real_N = inp.real_N if whole else inp.real_N[shard]
        st = MicroBatchRouting(mb=mb, shard=shard, real_N=real_N)
        if not (inp.all_real if whole else bool(real_N.all())):  # padding never loads an expert more than another
            st.spread_NK = spread_topk(torch.arange(shard.start, shard.stop), self.num_experts, self.topk)
        plan = self.plan
        self._state = st
        if plan is None or not (plan.capture or plan.replay is not None or plan.old is not None):
            return
        st.active, st.capture = True, plan.capture
        st.needs_logr = plan.capture or plan.old is not None
        if plan.old is not None:
            o = plan.old
            src = slot_source(o.rows, o.ids_RSLK.shape[1], mb.rows_B, inp, shard)
            st.old_ids_NLK = from_rows(o.ids_RSLK, src, fill_k=self.topk)
            st.old_logp_NLK = from_rows(o.logp_RSLK, src)
            scored_N = torch.zeros(inp.slots, dtype=torch.bool)  # slots that score a response token
            scored_N[inp.scored.slot_BT[inp.scored.mask_BT]] = True
            st.weight_N = scored_N[shard].float()
        if plan.replay is not None:
            self._replay_inputs(st, plan.replay, src if plan.old is not None and plan.replay.rows is o.rows else None)

    def _replay_inputs(self, st: MicroBatchRouting, r: ReplayIds, src: SlotSource | None) -> None:
        """The slots' replay ids, which slots take them, and the coverage check (host); `src`:
        the slots' rows in `r`, when already found (R2 replays the old record's rows)."""
        mb, inp, shard = st.mb, st.mb.inp, st.shard
        assert inp is not None  # (before_forward's)
        if src is None:
            src = slot_source(r.rows, r.ids_RSLK.shape[1], mb.rows_B, inp, shard, missing_ok=True)
        st.replay_NLK = from_rows(r.ids_RSLK, src, fill_k=self.topk)
        valid_N = src.covered_N if r.valid_RS is None else from_rows(r.valid_RS, src) & src.covered_N
        st.replayed = int(valid_N.sum())
        check_replay_covers(mb, inp, r, valid_N, shard)
        st.replay_valid_N = None if st.replayed == valid_N.numel() else valid_N  # (None: every slot)

    def after_forward(self, mb: MicroBatch) -> None:
        """The micro-batch's results added to the pass's, on the device; captures start
        their way to the host (read once the pass is over)."""
        st = self._state
        if st is None or not st.active:
            return
        if st.misses_L is not None:
            self._pass.add_misses(st)
        if st.layer_stats_2LN is not None:
            self._pass.add_stats(st, st.layer_stats_2LN.device)
        if st.capture and st.captured[0]:  # (a stage may hold no MoE layer)
            copies = [None if not parts else self._gather_sp(torch.stack(parts, dim=1)).to("cpu", non_blocking=True)
                      for parts in st.captured]
            self._pass.captures.append((mb.rows_B, mb.inp, mb.batch.batch_size, mb.batch.seq_len, copies))
        if self.plan is not None and self.plan.old is not None:  # (active: a plan is set)
            sums_N = st.shift_sum_N if st.shift_sum_N is not None else torch.zeros(
                st.real_N.numel(), device=comm_device())  # sent over NCCL on GPU: never a host tensor
            sums_N = self._gather_sp(sums_N)
            if not self.layout.is_last_stage:
                self._pending_sends.append(
                    dist.isend(sums_N.contiguous(), dst=self._last_stage_rank(), group=self._side_group)
                )
            else:
                st.shift_sum_N = sums_N  # now every slot's, over this stage's layers

    def loss_aux(self, mb: MicroBatch) -> dict[str, Any]:
        """The router shift of each response token ([b, T], 1 elsewhere), on the device."""
        st = self._state
        if st is None or self.plan is None or self.plan.old is None:
            return {}
        total_N, inp = st.shift_sum_N, mb.inp
        assert total_N is not None and inp is not None  # (plan.old: after_forward summed this stage's shift)
        earlier = self._earlier_stage_ranks()
        if earlier:
            total_N = total_N.clone()
        for src in earlier:
            buf = torch.empty_like(total_N)
            dist.recv(buf, src=src, group=self._side_group)
            total_N += buf
        gamma_N = router_shift_from_partial(total_N, self.num_moe_layers, self.topk, gamma_min=0.0)
        scored = mb.scored if mb.scored is not None else inp.scored
        gamma_BT = torch.where(scored.mask_BT, gamma_N[scored.slot_BT], 1.0)
        self._pass.gammas.append((gamma_BT, inp.scored.mask_BT))
        return {"router_shift_BT": gamma_BT}

    # ------------------------------------------------------------------ the tap

    def _make_tap(self, i: int, router: TopKRouter, original: Any) -> Any:
        """Router i's `routing`, wrapped. Everything stays on the router's device; the
        pass's results move to the host once, when the pass is over.

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
                return route(router, original, logits, padding_mask, force=pending.popleft().long(), count=False)[0]
            count = torch.is_grad_enabled() or keep  # (a recomputed layer's first forward runs without grad)
            st = self._state
            if st is None or (not st.needs_fresh and st.replay_NLK is None):  # nothing to force, record or measure
                out, used = route(router, original, logits, padding_mask, record=keep, count=count)
                if keep:
                    pending.append(used.to(self._ids_dtype))  # (kept until the backward: 1-2 bytes per id)
                return out
            dev = logits.device
            logits_NE = logits.reshape(-1, self.num_experts)
            with torch.no_grad():
                fresh_NK = self._fresh_topk(router, logits_NE).sort(dim=-1).values if st.needs_fresh else None
                logr_NE = self._log_routing_probs(router, logits_NE) if st.needs_logr else None
            target_NK = self._target_ids(st, i, dev, fresh_NK)
            out, ids = route(router, original, logits, padding_mask, force=target_NK,
                              record=keep and target_NK is None, count=count)
            if keep:
                pending.append(ids.to(self._ids_dtype))
            if st.active:
                with torch.no_grad():
                    self._record(st, i, dev, out[1], logr_NE, fresh_NK, target_NK)
            return out

        return routing

    def _target_ids(self, st: MicroBatchRouting, i: int, dev: torch.device,
                    fresh_NK: torch.Tensor | None) -> torch.Tensor | None:
        """The ids to force through router i: replayed ids where the plan replays, the
        router's own elsewhere, `spread_topk` on slots without a real token; None: route freely."""
        target = None
        if st.replay_NLK is not None:
            target = st.on(dev, "replay_NLK", long=True)[:, i]
            if st.replay_valid_N is not None:
                assert fresh_NK is not None  # (needs_fresh: slots without replay ids route freely)
                target = torch.where(st.on(dev, "replay_valid_N")[:, None], target, fresh_NK)
        if st.spread_NK is not None:  # (a where, not mask indexing, which waits for a GPU at every layer)
            assert fresh_NK is not None  # (needs_fresh)
            target = torch.where(st.on(dev, "real_N")[:, None], fresh_NK if target is None else target,
                                 st.on(dev, "spread_NK"))
        return target

    def _record(self, st: MicroBatchRouting, i: int, dev: torch.device, routing_map_NE: torch.Tensor,
                logr_NE: torch.Tensor | None, fresh_NK: torch.Tensor | None, target_NK: torch.Tensor | None) -> None:
        """Capture, router-shift statistics and the replay check of router i on this
        micro-batch shard, all into device tensors."""
        L = len(self.routers)
        if st.replay_NLK is not None:
            assert target_NK is not None  # (replayed ids are forced)
            if st.misses_L is None:
                st.misses_L = torch.empty(L, dtype=torch.long, device=dev)
            valid_N = None if st.replay_valid_N is None else st.on(dev, "replay_valid_N")
            count_replay_misses(routing_map_NE, target_NK, valid_N, st.misses_L[i])
        if st.capture:
            assert logr_NE is not None and fresh_NK is not None  # (capture needs both: needs_logr, needs_fresh)
            used_NK = fresh_NK if target_NK is None else target_NK.sort(dim=-1).values
            st.captured[0].append(used_NK.to(self._ids_dtype))
            st.captured[1].append(logr_NE.gather(1, used_NK))
            if st.replay_NLK is not None:
                st.captured[2].append(fresh_NK.to(self._ids_dtype))
        if st.old_ids_NLK is not None:
            assert logr_NE is not None and fresh_NK is not None  # (plan.old needs both: needs_logr, needs_fresh)
            old_ids = st.on(dev, "old_ids_NLK", long=True)[:, i]
            dlogr_NK = (logr_NE.gather(1, old_ids) - st.on(dev, "old_logp_NLK")[:, i]).abs()
            part = dlogr_NK.sum(-1)
            st.shift_sum_N = part if st.shift_sum_N is None else st.shift_sum_N.add_(part)
            if st.layer_stats_2LN is None:
                st.layer_stats_2LN = torch.empty(2, L, part.numel(), dtype=part.dtype, device=dev)
            # Both id lists are sorted sets of K distinct ids: the set changed iff a place differs.
            st.layer_stats_2LN[0, i] = (fresh_NK != old_ids).any(dim=-1)
            torch.mean(dlogr_NK, dim=-1, out=st.layer_stats_2LN[1, i])

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
        caps = self._pass.captures
        if not caps:
            if self.plan is not None and self.plan.capture:  # a stage without MoE layers
                z = torch.zeros(0, 0, 0, self.topk)
                return RoutingRecord(torch.zeros(0, dtype=torch.long), [], z.to(ids_dtype(self.num_experts)), z)
            return None
        wait_for_device()  # (the captures' copies to the host, started in each micro-batch)
        grids: list[list[torch.Tensor]] = [[], [], []]
        for _, inp, rows, S, copies in caps:
            for j, (full_N, fill_k) in enumerate(zip(copies, (self.topk, None, self.topk))):
                if full_N is not None:
                    grids[j].append(slots_to_rows(full_N, inp, rows, S, fill_k=fill_k))
        rows = torch.cat([c[0] for c in caps])
        keep = rows >= 0
        cat = lambda j: torch.cat(grids[j])[keep]  # noqa: E731
        return RoutingRecord(rows[keep], list(self.layers), cat(0), cat(1), cat(2) if grids[2] else None)

    def shift_metrics(self) -> dict[str, float]:
        """Router-shift statistics of the pass (collective over the whole world)."""
        sums = self._pass.host_stat_sums()
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
        mine = self._pass.host_gammas() if self.layout.is_last_stage else torch.zeros(0)
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


def _pipeline_side_group(layout: Layout) -> Any:
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
