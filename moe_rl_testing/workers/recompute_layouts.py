"""Worker for tests/integration/learner/test_recompute.py (run under torchrun, 2 processes).

For TP2, EP2 (alltoall) and PP2 (six micro-batches through 1F1B), twice: without and with
`model.recompute=full`. Each run builds the same tiny MoE, records its routing (R2's old
record), perturbs the routers and takes two updates that capture, measure router shift and
replay the old record. Every rank compares what it holds of the two runs (its rows' log-probs
and routing record, the full parameters, the metrics) and counts the routers its recomputed
layers re-ran; the worst differences over ranks go to <out>/recompute_layouts.pt.
"""

import sys

import torch
import torch.distributed as dist

from moe_rl.config import load_config
from moe_rl.learner import init_distributed, parallel_layout
from moe_rl.learner.gather import iter_full_tensors
from moe_rl_testing.learner_utils import counting_router_reruns, learner_of, replayed_updates

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}
BASE = ["parallel.micro_batch_size=2", "optimizer.lr=1e-2"]


def run(overrides: list[str]) -> dict:
    cfg = load_config(None, overrides)
    with counting_router_reruns() as reruns, parallel_layout(cfg.parallel, seed=3) as layout:
        torch.manual_seed(3)
        learner = learner_of(cfg, layout)
        updates = replayed_updates(learner, perturb_seed=11)
        return {"metrics": [{k: v for k, v in u.metrics.items() if k != "tokens_per_s"} for u in updates],
                "logp": [u.logp_BT for u in updates],
                "ids": [u.record.ids_RSLK for u in updates], "rlogp": [u.record.logp_RSLK for u in updates],
                "params": dict(iter_full_tensors(learner.gpt)), "reruns": reruns["n"],
                "routers": len(learner.taps.routers), "microbatches": updates[0].metrics["microbatches"]}


def worst(a: dict, b: dict) -> dict:
    diff = lambda xs, ys: max((float((x - y).abs().max()) for x, y in zip(xs, ys) if x.numel()), default=0.0)  # noqa: E731
    keys = sorted(a["params"])
    return {"logp": diff(a["logp"], b["logp"]), "record_logp": diff(a["rlogp"], b["rlogp"]),
            "record_ids": diff([x.float() for x in a["ids"]], [y.float() for y in b["ids"]]),
            "params": diff([a["params"][k] for k in keys], [b["params"][k] for k in keys]),
            "metrics": max(abs(x[k] - y[k]) for x, y in zip(a["metrics"], b["metrics"]) for k in x)}


def main() -> None:
    out = sys.argv[1]
    rank, _ = init_distributed()
    result = {}
    for name, overrides in LAYOUTS.items():
        plain = run(BASE + overrides)
        full = run(BASE + overrides + ["model.recompute=full"])
        w = worst(plain, full)
        gaps = torch.tensor([w[k] for k in sorted(w)], dtype=torch.float64)
        dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
        result[name] = {"worst": dict(zip(sorted(w), gaps.tolist())), "reruns_plain": plain["reruns"],
                        "reruns_full": full["reruns"], "routers": full["routers"],
                        "microbatches": full["microbatches"], "metrics_keys": sorted(full["metrics"][0])}
    if rank == 0:
        torch.save(result, f"{out}/recompute_layouts.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
