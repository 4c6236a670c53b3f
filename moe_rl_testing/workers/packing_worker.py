"""Worker for tests/integration/rollout/test_packing.py (torchrun): at one layout, the same learner scores and
takes gradients of a fixed batch packed and padded, plain and under R2 / R3 replay, and
with the chunked log-prob head against the full-logits one.

Writes <out>/<layout>-<model>.pt on rank 0 with the largest differences seen on any rank:
logprobs (absolute), gradients (relative to the largest gradient), and for replay the
number of real tokens whose used routing differs from the replayed one.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from moe_rl.config import load_config
from moe_rl.learner.parallel import init_distributed, parallel_layout
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss

LAYOUTS = {
    "one": [],
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2"],
    "tp2ep2": ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
    # (the second stage's padding mask is its own sequence-parallel shard: megatron shards it on the first only)
    "tp2pp2": ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
}
MODELS = {
    "qwen3": [],
    # GLM-4.5's shape: a dense first layer, RoPE on half of each head, q/k/v bias, a shared
    # expert, sigmoid routing with expert bias and scaled routed weights
    "glm4": ["model.num_dense_layers=1", "model.rotary_percent=0.5", "model.add_qkv_bias=true",
             "model.moe_shared_expert_intermediate_size=32", "model.moe_router_score_function=sigmoid",
             "model.moe_router_enable_expert_bias=true", "model.moe_router_topk_scaling_factor=2.5",
             "model.qk_layernorm=false"],
}
BASE = ["parallel.micro_batch_size=3", "parallel.packing=true"]


def grads(learner, batch, adv_B, routing=None):
    learner.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B}, routing=routing)
    return [p.main_grad.detach().clone() for p in learner.model.parameters() if p.requires_grad]


def sampler_routing(batch, layers, topk, experts):
    """Random distinct expert ids on every position the sampler routes (all but the last token)."""
    from moe_rl.routing.record import ReplayIds

    g = torch.Generator().manual_seed(5)
    B, S = batch.batch_size, batch.seq_len
    ids = torch.rand(B, S, layers, experts, generator=g).argsort(-1)[..., :topk].sort(-1).values.to(torch.uint8)
    valid = torch.arange(S)[None, :] < (batch.total_lens_B - 1)[:, None]
    return ReplayIds(torch.arange(B), ids, valid)


def used_differs(record, replay):
    """Real tokens whose used ids differ from the replayed ones (`replay` holds the record's
    layers on its L axis)."""
    from moe_rl.routing.record import row_positions

    pos = row_positions(replay.rows, record.rows)
    S = record.ids_RSLK.shape[1]
    valid = replay.valid_RS[pos][:, :S] if replay.valid_RS is not None else torch.ones(len(pos), S, dtype=bool)
    differ = (record.ids_RSLK.long() != replay.ids_RSLK[pos][:, :S].long()).any(-1).any(-1)
    return int((differ & valid).sum())


def compare(learner, batch, adv_B):
    from moe_rl.learner import RoutingPlan
    from moe_rl.routing.record import ReplayIds

    out = {}
    cfg = learner.model_cfg
    learner.packing = True
    packed = learner.score_whole(batch, routing=RoutingPlan(capture=True))
    g_packed = grads(learner, batch, adv_B)
    learner.packing = False
    padded = learner.score_whole(batch, routing=RoutingPlan(capture=True))
    g_padded = grads(learner, batch, adv_B)
    out["logp"] = float((packed.logp_BT - padded.logp_BT).abs().max())
    scale = max(float(g.abs().max()) for g in g_padded)
    out["grad"] = max(float((a - b).abs().max()) for a, b in zip(g_packed, g_padded)) / scale
    out["grad_scale"] = scale
    for mode in ("R2", "R3"):
        if mode == "R2":  # the learner's own record: this rank's rows, this stage's layers
            replay = ReplayIds.from_record(packed.record)
        else:  # the sampler's: every row, every MoE layer; a stage replays its own layers
            replay = sampler_routing(batch, cfg.num_layers - cfg.num_dense_layers, cfg.moe_router_topk,
                                     cfg.num_experts).select_layers(learner.taps.layers)
        plan = RoutingPlan(capture=True, replay=replay)
        learner.packing = True
        rp = learner.score_whole(batch, routing=plan)
        learner.packing = False
        rd = learner.score_whole(batch, routing=plan)
        out[f"{mode}_logp"] = float((rp.logp_BT - rd.logp_BT).abs().max())
        out[f"{mode}_used_differs"] = used_differs(rp.record, replay) + used_differs(rd.record, replay)
    learner.packing = True
    chunked = {}
    for chunk in (0, 5):  # the full-logits path against small chunks (several per micro-batch)
        learner.head.chunk_tokens = chunk
        chunked[chunk] = (learner.score_whole(batch), grads(learner, batch, adv_B))
    (full, g_full), (part, g_part) = chunked[0], chunked[5]
    out["chunk_logp"] = float((full.logp_BT - part.logp_BT).abs().max())
    out["chunk_grad"] = max(float((a - b).abs().max()) for a, b in zip(g_full, g_part)) / scale
    out["chunk_entropy_min"] = float(part.entropy_BT[batch.response_mask()].min())
    out["chunk_logp_max"] = float(part.logp_BT[batch.response_mask()].max())
    full = learner.parallel_cfg
    learner.parallel_cfg = dataclasses.replace(full, max_tokens_per_microbatch=24)
    g_budget = grads(learner, batch, adv_B)  # the rows of each rank binned by a 24-token budget
    learner.parallel_cfg = full
    out["budget_grad"] = max(float((a - b).abs().max()) for a, b in zip(g_budget, g_part)) / scale
    out["budget_microbatches"] = out["budget_microbatches_min"] = float(learner._num_microbatches)
    return out


AUX = ["model.moe_aux_loss_coeff=0.01", "model.moe_router_bias_update_rate=0.001"]
# megatron-core's z-loss is a mean over each sequence-parallel rank's own tokens: under TP the
# ranks' shares of real tokens differ between the packed and padded layouts, so it is
# compared where there is no TP
Z_LOSS = ["model.moe_z_loss_coeff=0.001"]


def compare_balancing(learner, batch, adv_B):
    """With the load-balancing and z losses on and, where the router has an expert bias, its
    update: packed and padded micro-batches (different padding) give the same gradients and
    bias updates, since padding slots count in neither."""
    routers = learner.taps.routers
    biased = [r for r in routers if r.expert_bias is not None]
    out, got = {}, {}
    before = [r.expert_bias.clone() for r in biased]
    for packing in (True, False):
        learner.packing = packing
        got[packing] = grads(learner, batch, adv_B), [r.expert_bias - b for r, b in zip(biased, before)]
        for r, b in zip(biased, before):  # (both passes from the same bias)
            r.expert_bias.copy_(b)
    (g_packed, d_packed), (g_padded, d_padded) = got[True], got[False]
    scale = max(float(g.abs().max()) for g in g_padded)
    out["balancing_grad"] = max(float((a - b).abs().max()) for a, b in zip(g_packed, g_padded)) / scale
    out["bias_update_differs"] = float(sum(int((a != b).sum()) for a, b in zip(d_packed, d_padded)))
    out["bias_updated_min"] = float(min((int((d != 0).sum()) for d in d_padded), default=-1))
    return out


def run_one(layout_name: str, model_name: str, out: str, batch, adv_B) -> None:
    """One (layout, model): every comparison, the worst over the ranks saved by rank 0."""
    cfg = load_config(None, BASE + MODELS[model_name] + LAYOUTS[layout_name])
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        mine = compare(learner, batch, adv_B)
        z_loss = Z_LOSS if "tp" not in layout_name else []
        balancing = load_config(None, BASE + MODELS[model_name] + LAYOUTS[layout_name] + AUX + z_loss)
        mine.update(compare_balancing(learner_of(balancing, layout), batch, adv_B))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        worst = {k: (min if k.endswith("_min") else max)(m[k] for m in everyone) for k in mine}
        torch.save(worst, f"{out}/{layout_name}-{model_name}.pt")


def main() -> None:
    """argv: OUT LAYOUT:MODEL [LAYOUT:MODEL ...], every layout of this world's size: one
    launch for all of them (a torchrun start costs more than a comparison)."""
    out, combos = sys.argv[1], [c.split(":") for c in sys.argv[2:]]
    init_distributed()
    for layout_name, model_name in combos:
        torch.manual_seed(11)
        batch, adv_B = fixed_batch()
        run_one(layout_name, model_name, out, batch, adv_B)
    dist.destroy_process_group()  # (exiting with gloo's threads alive can abort: "terminate called ...")


if __name__ == "__main__":
    main()
