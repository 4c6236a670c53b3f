"""Worker for tests/integration/learner/test_routing_learner.py (run under torchrun).

One launch of 4 processes (`dist_helpers.one_process_then_world`):
reference (rank 0 alone, a one-process world): a tiny MoE -> `ckpt_a`; routing record A of a fixed batch; the
    routers perturbed -> `ckpt_b`; under `ckpt_b`: gamma against A, the ids a replay of A
    routes (for 1, 2 and 4 micro-batches) and the ids fresh routing picks.
layouts (4 processes): for TP2, EP2, PP2, TP2xEP2 the same from the checkpoints; every rank
    compares its own rows and its stage's layers with the reference and the worst
    differences are written out.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from moe_rl.config import load_config, to_dict
from moe_rl.learner import (
    Learner,
    RoutingPlan,
    load_checkpoint,
    parallel_layout,
    save_checkpoint,
)
from moe_rl.routing.record import ReplayIds
from moe_rl_testing.dist_helpers import one_process_then_world
from moe_rl_testing.learner_utils import fixed_batch, learner_of

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "tp2ep2": ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
}
BASE = ["parallel.micro_batch_size=3"]


def perturb_routers(learner: Learner, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for router in learner.taps.routers:
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * std)


def with_mbs(cfg, mbs: int):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, micro_batch_size=mbs))


def reference(out: str) -> dict:
    batch, _ = fixed_batch()
    cfg = load_config(None, BASE)
    res: dict = {}
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        save_checkpoint(learner, f"{out}/ckpt_a", recipe=to_dict(cfg))
        a = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
        res["A_ids"], res["A_logp"] = a.ids_RSLK, a.logp_RSLK
        perturb_routers(learner)
        save_checkpoint(learner, f"{out}/ckpt_b", recipe=to_dict(cfg))
        res["gamma"] = learner.score_whole(batch, routing=RoutingPlan(old=a)).router_shift_BT
        res["fresh_ids"] = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record.ids_RSLK
        for mbs in (12, 6, 3):  # 1, 2 and 4 micro-batches
            lr = learner_of(with_mbs(cfg, mbs), layout)
            load_checkpoint(lr, f"{out}/ckpt_b")
            rec = lr.score_whole(batch, routing=RoutingPlan(capture=True, replay=ReplayIds.from_record(a))).record
            res[f"replayed_ids_mbs{mbs}"] = rec.ids_RSLK
    return res


def layouts(out: str) -> dict:
    batch, _ = fixed_batch()
    ref = torch.load(f"{out}/reference.pt")
    res: dict = {}
    for name, overrides in LAYOUTS.items():
        cfg = load_config(None, BASE + overrides)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            learner = learner_of(cfg, layout)
            load_checkpoint(learner, f"{out}/ckpt_a")
            a = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record

            def cmp(key, t, rows=a.rows, layers=a.layers):
                return (ref[key][rows][:, :, layers].to(t.dtype) != t).sum()

            err = torch.zeros(5, dtype=torch.float64)
            err[0] = cmp("A_ids", a.ids_RSLK)
            if a.rows.numel():
                err[1] = (ref["A_logp"][a.rows][:, :, a.layers] - a.logp_RSLK).abs().max()
            load_checkpoint(learner, f"{out}/ckpt_b")
            gamma = learner.score_whole(batch, routing=RoutingPlan(old=a)).router_shift_BT
            err[2] = (gamma - ref["gamma"]).abs().max()
            replayed = learner.score_whole(batch, routing=RoutingPlan(capture=True, replay=ReplayIds.from_record(a))).record
            err[3] = (replayed.ids_RSLK != a.ids_RSLK).sum()
            fresh = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
            err[4] = cmp("fresh_ids", fresh.ids_RSLK)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            res[name] = {"layout": layout.name, "A_ids_mismatch": float(err[0]), "A_logp_err": float(err[1]),
                         "gamma_err": float(err[2]), "replay_mismatch": float(err[3]),
                         "fresh_vs_ref_mismatch": float(err[4]),
                         "fresh_vs_A_changed": float((fresh.ids_RSLK != a.ids_RSLK).any())}
    return res


def main() -> None:
    out = sys.argv[1]
    one_process_then_world(out, lambda: reference(out), lambda: layouts(out), world_size=4)


if __name__ == "__main__":
    main()
