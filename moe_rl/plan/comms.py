"""Bytes each rank sends per RL step, by collective family, and the seconds they take.

Counted per rank (what leaves its GPU), every sequence at full length, balanced routing:
- TP (sequence parallel, megatron requires it for MoE under TP): per layer and micro-batch,
  each TP-sharded block (attention; a dense MLP or a shared expert) all-gathers its input and
  reduce-scatters its output in the forward, (t-1)/t of the s*b*h activation each; the
  backward does the transposed pair plus one more all-gather (the input again, for the
  weight gradient); recompute repeats the forward's. Expert-TP (ETP > 1) moves the K routed
  copies of each token the same way inside the expert-TP group.
- EP: per MoE layer and micro-batch, the alltoall dispatcher sends each of the rank's
  tokens to K experts and back (dispatch + combine), (ep-1)/ep of it off-rank, in the forward
  and again in the backward; the allgather dispatcher gathers every token of the EP group.
- PP: each stage boundary sends the micro-batch's hidden states forward (sequence-parallel
  shard) and their gradient back.
- DP: per optimizer update, the fp32 gradients: a ring all-reduce moves 2(d-1)/d of them;
  under the distributed optimizer a reduce-scatter (d-1)/d plus the parameter all-gather
  (d-1)/d of the params. Dense weights over the DP group, experts over the expert-DP group.
- weight sync: every engine rank receives its shard of the sampler's weights (an upper
  bound: the part a rank already holds need not move).
- PPO's critic (`rl.advantage: gae`) moves the same per pass: its value forward and its
  update passes (`critic_passes`), and its gradients per update (taken as the actor's, an
  upper bound: the frozen output layer's gradient is not reduced); the engines never
  receive its weights.
Time = bytes / (link bandwidth x efficiency), the link being NVLink when the group is inside
one node and InfiniBand when it spans nodes (all-to-alls: the off-node share at IB speed).
No overlap with compute is assumed: these are the exposed costs if nothing hides them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_rl.config import ModelConfig
from moe_rl.plan.activations import DTYPE_BYTES
from moe_rl.plan.hardware import Hardware
from moe_rl.plan.memory import Switches
from moe_rl.plan.workload import PlannedLayout, Workload

if TYPE_CHECKING:  # the meta-device build imports megatron; these modules need only its type
    from moe_rl.learner.meta import MetaRank

GB = 1e9


@dataclass(frozen=True)
class Traffic:
    family: str
    bytes_per_rank: int
    """Bytes this rank sends per step."""
    link: str
    """nvlink, ib, or nvlink+ib (an all-to-all across nodes)."""
    seconds: float


def _spans_nodes(group: tuple[int, ...], hw: Hardware) -> bool:
    return len({hw.node_of(r) for r in group}) > 1


def _ring_seconds(nbytes: float, group: tuple[int, ...], hw: Hardware) -> tuple[str, float]:
    link, bw = ("ib", hw.ib_gbps) if _spans_nodes(group, hw) else ("nvlink", hw.nvlink_gbps)
    return link, nbytes / (bw * GB * hw.bandwidth_efficiency)


def _alltoall_seconds(nbytes: float, group: tuple[int, ...], rank: int, hw: Hardware) -> tuple[str, float]:
    peers = [r for r in group if r != rank]
    if not peers:
        return "nvlink", 0.0
    off = sum(hw.node_of(r) != hw.node_of(rank) for r in peers) / len(peers)
    eff = hw.bandwidth_efficiency * GB
    seconds = max(nbytes * (1 - off) / (hw.nvlink_gbps * eff), nbytes * off / (hw.ib_gbps * eff))
    return ("nvlink+ib" if off else "nvlink"), seconds


@dataclass(frozen=True)
class Passes:
    """Micro-batch forwards and backwards a rank runs per step."""

    forwards: int
    backwards: int


def _passes(layout: PlannedLayout, work: Workload, sw: Switches, scoring_passes: int) -> Passes:
    score_micro = -(-work.sequences // (layout.dp * work.micro_batch))
    update_micro = work.updates * work.micro_batches
    recompute = update_micro if sw.recompute else 0
    return Passes(scoring_passes * score_micro + update_micro + recompute, update_micro)


def actor_passes(layout: PlannedLayout, work: Workload, sw: Switches) -> Passes:
    """The actor's: its scoring passes (old log-probs, reference) and its updates."""
    return _passes(layout, work, sw, work.scoring_passes)


def critic_passes(layout: PlannedLayout, work: Workload, sw: Switches) -> Passes:
    """PPO's critic (`work`: its workload): one value pass over the batch and its updates."""
    return _passes(layout, work, sw, 1)


def _tp_bytes(m: ModelConfig, rank: MetaRank, layout: PlannedLayout, work: Workload, p: Passes) -> float:
    t = layout.tp
    e = DTYPE_BYTES[m.dtype_on(True)]
    x = work.micro_batch_tokens * m.hidden_size * e
    dense = rank.num_layers - rank.num_moe_layers
    blocks = rank.num_layers + dense + (rank.num_moe_layers if m.moe_shared_expert_intermediate_size else 0)
    tp = blocks * x * (t - 1) / t * (2 * p.forwards + 3 * p.backwards)
    etp = layout.etp
    routed = m.moe_router_topk * (work.micro_batch_tokens / t) * m.hidden_size * e
    etp_bytes = rank.num_moe_layers * routed * (etp - 1) * (2 * p.forwards + 3 * p.backwards)
    return tp + etp_bytes


def _ep_bytes(m: ModelConfig, rank: MetaRank, layout: PlannedLayout, work: Workload, p: Passes) -> float:
    ep = layout.ep
    e = DTYPE_BYTES[m.dtype_on(True)]
    tokens = work.micro_batch_tokens / layout.tp
    if m.moe_token_dispatcher_type == "allgather":
        per = 2 * tokens * m.hidden_size * e * (ep - 1)
    else:
        per = 2 * m.moe_router_topk * tokens * m.hidden_size * e * (ep - 1) / ep
    return rank.num_moe_layers * per * (p.forwards + p.backwards)


def _dp_bytes(rank: MetaRank, layout: PlannedLayout, work: Workload, sw: Switches) -> tuple[float, float]:
    """(dense, expert) bytes per step."""
    out = []
    for expert, d in ((False, layout.dp), (True, layout.expert_dp)):
        bufs = [b for b in rank.buffers if b.expert == expert]
        grads = sum(b.params_numel * b.grad_elem_bytes for b in bufs)
        params = sum(b.params_numel * b.param_bytes_per_elem for b in bufs)
        if sw.distributed_optimizer:
            per_update = (grads + params) * (d - 1) / d
        else:
            per_update = 2 * grads * (d - 1) / d
        out.append(per_update * work.updates)
    return out[0], out[1]


def traffic(model: ModelConfig, rank: MetaRank, layout: PlannedLayout, work: Workload, sw: Switches,
            sampler_weights_bytes: int, hw: Hardware, passes: Passes | None = None) -> list[Traffic]:
    """Per-step traffic of `rank` by family, with link and seconds, for the actor's passes
    (or `passes`: the critic's)."""
    p = passes or actor_passes(layout, work, sw)
    g = rank.groups
    out = []
    tp = _tp_bytes(model, rank, layout, work, p)
    out.append(Traffic("tp", int(tp), *_ring_seconds(tp, g.tp, hw)))
    ep = _ep_bytes(model, rank, layout, work, p)
    out.append(Traffic("ep", int(ep), *_alltoall_seconds(ep, g.ep, rank.rank, hw)))
    e = DTYPE_BYTES[model.dtype_on(True)]
    boundary = work.micro_batch_tokens / layout.tp * model.hidden_size * e
    sends = (p.forwards if rank.pp_rank < layout.pp - 1 else 0) + (p.backwards if rank.pp_rank > 0 else 0)
    pp = boundary * sends
    out.append(Traffic("pp", int(pp), *_ring_seconds(pp, g.pp, hw)))
    dense, expert = _dp_bytes(rank, layout, work, sw)
    link_d, s_d = _ring_seconds(dense, g.dp, hw)
    link_e, s_e = _ring_seconds(expert, g.expert_dp, hw)
    out.append(Traffic("dp", int(dense + expert), link_d if link_d == link_e else "nvlink+ib", s_d + s_e))
    sync_group = tuple(sorted(set(g.pp) | set(g.ep) | set(g.tp)))
    out.append(Traffic("weight_sync", sampler_weights_bytes, *_ring_seconds(sampler_weights_bytes, sync_group, hw)))
    return out
