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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moe_rl.learner.logprobs import response_positions
from moe_rl.learner.microbatch import ForwardHooks, MicroBatch
from moe_rl.learner.parallel import all_reduce_, comm_device
from moe_rl.routing.record import ReplayIds, RoutingRecord, ids_dtype, row_positions
from moe_rl.routing.shift import router_shift_from_partial
from moe_rl.routing.stats import gamma_stats, topk_set_changed


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
    mask_SB: torch.Tensor  # [S_local, mbs] positions that score a response token
    replay_NLK: torch.Tensor | None = None
    replay_valid_N: torch.Tensor | None = None
    old_ids_NLK: torch.Tensor | None = None
    old_logp_NLK: torch.Tensor | None = None
    captured_ids: list[torch.Tensor] = field(default_factory=list)
    captured_logp: list[torch.Tensor] = field(default_factory=list)
    captured_fresh: list[torch.Tensor] = field(default_factory=list)
    shift_sum_N: torch.Tensor | None = None
    stat_sums: torch.Tensor | None = None  # [3, L_stage]: flips, |dlog r|, token count

    def on(self, device: torch.device, name: str) -> torch.Tensor:
        """A per-micro-batch input moved to the router's device once (no-op on CPU)."""
        t = getattr(self, name)
        if t is not None and t.device != device:
            t = t.to(device, non_blocking=True)
            setattr(self, name, t)
        return t


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
        self.layers = [moe_layer_of[r.layer_number - 1] for r in self.routers]
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
        finally:
            for work in self._pending_sends:
                work.wait()
            self._pending_sends = []
            for router in self.routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
            self.plan = None
            self._state = None

    @property
    def idle(self) -> bool:
        return self.plan is None

    # ------------------------------------------------------------------ ForwardHooks

    def before_forward(self, mb: MicroBatch) -> None:
        if self.plan is None:
            return
        S = mb.batch.seq_len
        tp, tp_rank = self.layout.tp, self.layout.tp_rank
        s_local = S // tp if self.layout.sequence_parallel else S
        shard = slice(tp_rank * s_local, (tp_rank + 1) * s_local) if self.layout.sequence_parallel else slice(0, S)
        mask_BS = mb.batch.scored_positions()
        st = _MicroBatchState(mb=mb, shard=shard, mask_SB=mask_BS[:, shard].t().contiguous())
        if self.plan.replay is not None:
            r = self.plan.replay
            st.replay_NLK = _rows_to_tokens(r.rows, r.ids_RSLK, mb.rows_B, shard, fill_k=self.topk)
            if r.valid_RS is not None:
                st.replay_valid_N = _rows_to_tokens(r.rows, r.valid_RS[..., None, None], mb.rows_B, shard).reshape(-1)
        if self.plan.old is not None:
            o = self.plan.old
            st.old_ids_NLK = _rows_to_tokens(o.rows, o.ids_RSLK, mb.rows_B, shard, fill_k=self.topk)
            st.old_logp_NLK = _rows_to_tokens(o.rows, o.logp_RSLK, mb.rows_B, shard)
        self._state = st

    def after_forward(self, mb: MicroBatch) -> None:
        st = self._state
        if st is None:
            return
        mbs = mb.batch.batch_size
        if st.stat_sums is not None:
            self._stat_sums += st.stat_sums.cpu()
        if self.plan.capture and st.captured_ids:  # (a stage may hold no MoE layer)
            ids = torch.stack(st.captured_ids, dim=1)  # [N_local, L, K]
            logp = torch.stack(st.captured_logp, dim=1)
            fresh = torch.stack(st.captured_fresh, dim=1) if st.captured_fresh else None
            parts = [self._gather_sp(t.reshape(-1, mbs, *t.shape[1:])).cpu() for t in (ids, logp)]
            fresh_full = self._gather_sp(fresh.reshape(-1, mbs, *fresh.shape[1:])).cpu() if fresh is not None else None
            # [S, mbs, L, K] -> [mbs, S, L, K]
            self._captures.append((mb.rows_B, parts[0].transpose(0, 1), parts[1].transpose(0, 1),
                                   fresh_full.transpose(0, 1) if fresh_full is not None else None))
        if self.plan.old is not None:
            sums_N = st.shift_sum_N if st.shift_sum_N is not None else torch.zeros(
                st.mask_SB.numel(), device=comm_device())  # sent over NCCL on GPU: never a host tensor
            sums_SB = self._gather_sp(sums_N.reshape(-1, mbs))
            if not self.layout.is_last_stage:
                self._pending_sends.append(
                    dist.isend(sums_SB.contiguous(), dst=self._last_stage_rank(), group=self._side_group)
                )
            else:
                st.shift_sum_N = sums_SB  # now [S, mbs] over this stage's layers

    def loss_aux(self, mb: MicroBatch) -> dict[str, Any]:
        st = self._state
        if st is None or self.plan.old is None:
            return {}
        total_SB = st.shift_sum_N.clone()
        for src in self._earlier_stage_ranks():
            buf = torch.empty_like(total_SB)
            dist.recv(buf, src=src, group=self._side_group)
            total_SB += buf
        gamma_BS = router_shift_from_partial(
            total_SB.t().reshape(-1), self.num_moe_layers, self.topk, gamma_min=0.0
        ).reshape(mb.batch.batch_size, -1)
        gamma_BT = gamma_BS.gather(1, response_positions(mb.batch).to(gamma_BS.device))
        mask_BT = mb.batch.response_mask().to(gamma_BS.device)
        self._gammas.append(gamma_BT[mask_BT].cpu())
        return {"router_shift_BT": torch.where(mask_BT, gamma_BT, 1.0)}

    # ------------------------------------------------------------------ the tap

    def _make_tap(self, i: int, router: TopKRouter, original: Any) -> Any:
        """Router i's `routing`, wrapped. Everything stays on the router's device; the
        micro-batch's results move to the host once, in `after_forward`."""

        def routing(logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            st = self._state
            if self.plan is None or st is None:
                return original(logits, padding_mask)
            dev = logits.device
            logits_NE = logits.reshape(-1, self.num_experts)
            with torch.no_grad():
                logr_NE = self._log_routing_probs(router, logits_NE)
                fresh_NK = self._fresh_topk(router, logits_NE).sort(dim=-1).values
            replay = router.router_replay
            if st.replay_NLK is not None:
                target_NK = st.on(dev, "replay_NLK")[:, i].long()
                if st.replay_valid_N is not None:
                    target_NK = torch.where(st.on(dev, "replay_valid_N")[:, None], target_NK, fresh_NK)
                replay.target_topk_idx = target_NK
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                used_NK = target_NK.sort(dim=-1).values
            else:
                replay.clear_router_replay_action()
                used_NK = fresh_NK
            out = original(logits, padding_mask)
            replay.clear_router_replay_action()
            replay.target_topk_idx = None
            with torch.no_grad():
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
                    w = st.on(dev, "mask_SB").reshape(-1).to(dlogr_NK.dtype)
                    flips = topk_set_changed(fresh_NK[:, None], old_ids[:, None])[:, 0].to(w.dtype)
                    if st.stat_sums is None:
                        st.stat_sums = torch.zeros(3, len(self.routers), dtype=torch.float64, device=dev)
                    st.stat_sums[:, i] += torch.stack([(flips * w).sum(), (dlogr_NK.mean(-1) * w).sum(), w.sum()])
            return out

        return routing

    def _log_routing_probs(self, router: TopKRouter, logits_NE: torch.Tensor) -> torch.Tensor:
        """log r over all experts: softmax routers -> log softmax; sigmoid routers -> log of
        the scores normalised to sum to 1 (the distribution the top-k is taken from)."""
        x = logits_NE.float()
        if self.tcfg.moe_router_score_function == "sigmoid":
            logs = torch.nn.functional.logsigmoid(x)
            return logs - torch.logsumexp(logs, dim=-1, keepdim=True)
        return torch.log_softmax(x, dim=-1)

    def _fresh_topk(self, router: TopKRouter, logits_NE: torch.Tensor) -> torch.Tensor:
        """The ids megatron's router would pick without replay (same rule, same tie-breaking)."""
        if self.tcfg.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits_NE.float()).type_as(logits_NE)
            if router.expert_bias is not None:
                scores = scores + router.expert_bias
            return torch.topk(scores, self.topk, dim=1).indices
        return torch.topk(logits_NE, self.topk, dim=1).indices

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


def _rows_to_tokens(
    rows: torch.Tensor, data_RS: torch.Tensor, mb_rows: torch.Tensor, shard: slice, fill_k: int | None = None
) -> torch.Tensor:
    """Gather per-row data [R, S, ...] for a micro-batch's rows and this rank's S shard,
    flattened s-major like the router's tokens: [S_local * mbs, ...]. Padding rows get
    distinct placeholder ids 0..K-1 (ids) or zeros."""
    idx = row_positions(rows, mb_rows)
    S_needed = shard.stop
    if data_RS.shape[1] < S_needed:
        raise ValueError(f"routing data covers {data_RS.shape[1]} positions, micro-batch needs {S_needed}")
    out = data_RS[idx.clamp(min=0)][:, shard]  # [mbs, S_local, ...]
    pad = idx < 0
    if bool(pad.any()):
        out = out.clone()
        if fill_k is not None:
            out[pad] = torch.arange(fill_k, dtype=out.dtype)
        else:
            out[pad] = 0
    return out.transpose(0, 1).reshape(-1, *out.shape[2:])


def _pipeline_side_group(layout: Any) -> Any:
    """A process group per pipeline (same members as megatron's), used only for the
    router-shift sums so they never interleave with megatron's activation messages."""
    if layout.pp == 1:
        return None
    mine = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    everyone: list[list[int]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    my_group = None
    for ranks in sorted({tuple(r) for r in everyone}):
        g = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            my_group = g
    return my_group


def sampler_disagreement(
    record: RoutingRecord, sampler: ReplayIds, scored_RS: torch.Tensor, layout: Any
) -> dict[str, float]:
    """Per-layer fraction of scored positions where the sampler's top-k set differs from
    the learner's own routing (the router's choice, even under replay), the fraction
    differing in at least one layer, and that fraction for the routing the pass used
    (`sampler_used_disagree_any`: exactly 0 under R3). `scored_RS` marks the positions to count, per row of
    the record. Collective: sums over data-parallel ranks, layers gathered over stages."""
    pos = row_positions(sampler.rows, record.rows)
    S = record.ids_RSLK.shape[1]
    theirs = sampler.ids_RSLK[pos][:, :S]
    valid = scored_RS[:, :S] & (sampler.valid_RS[pos][:, :S] if sampler.valid_RS is not None else True)
    diff_RSL = topk_set_changed(
        record.own_ids_RSLK.reshape(-1, *record.ids_RSLK.shape[2:]), theirs.reshape(-1, *theirs.shape[2:])
    ).reshape(*record.ids_RSLK.shape[:3])
    any_RS = _any_stage(diff_RSL.any(-1), layout)
    # The routing the pass *used* against the sampler's: 0 under R3 replay (the check that
    # replay took effect), the same as the router's own choice without replay.
    used_RSL = topk_set_changed(
        record.ids_RSLK.reshape(-1, *record.ids_RSLK.shape[2:]), theirs.reshape(-1, *theirs.shape[2:])
    ).reshape(*record.ids_RSLK.shape[:3])
    used_any_RS = _any_stage(used_RSL.any(-1), layout)
    w = valid.double()
    sums = torch.cat([(diff_RSL.double() * w[..., None]).sum((0, 1)), (used_any_RS.double() * w).sum()[None],
                      (any_RS.double() * w).sum()[None], w.sum()[None]])
    if layout.dp > 1:
        all_reduce_(sums, group=ps.get_data_parallel_group())
    n = float(sums[-1].clamp(min=1))
    per_layer = {f"routing/sampler_disagree_layer{layer}": float(sums[i]) / n for i, layer in enumerate(record.layers)}
    if layout.pp > 1:
        parts: list[Any] = [None] * layout.pp
        dist.all_gather_object(parts, per_layer, group=ps.get_pipeline_model_parallel_group())
        per_layer = {k: v for p in parts for k, v in p.items()}
    per_layer["routing/sampler_disagree_any"] = float(sums[-2]) / n
    per_layer["routing/sampler_used_disagree_any"] = float(sums[-3]) / n
    return per_layer


def _any_stage(any_RS: torch.Tensor, layout: Any) -> torch.Tensor:
    """A token differs "in at least one layer" if any pipeline stage's layers differ for it;
    the stages of one pipeline hold the same rows, so OR their [R, S] maps."""
    if layout.pp == 1:
        return any_RS
    mine = any_RS.to(torch.uint8).to(comm_device()).contiguous()  # gloo has no bool collectives
    maps = [torch.zeros_like(mine) for _ in range(layout.pp)]
    dist.all_gather(maps, mine, group=ps.get_pipeline_model_parallel_group())
    return torch.stack(maps).bool().any(0).cpu()
