"""Timed learner passes at one layout (run under torchrun by bench_learner / bench_routing).

    torchrun --nproc-per-node N moe_rl_testing/workers/learner_bench_worker.py OUT.json MODE [--iters N]
        [--warmup N] [overrides...]

--iters (default 15) timed passes after --warmup (default 3) of each kind; the old-logprob
passes of MODE routing are min(10, iters). The benchmarks' --quick runs pass fewer.

MODE learner: fwd+bwd (train_step) time and tokens/s.
MODE routing: update step time with capture+gamma off/on and R2 replay off/on, interleaved
    in the same run, plus routing-state bytes per token.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moe_rl.batch import TokenBatch
from moe_rl.config import load_config
from moe_rl.learner import (
    Learner,
    MicroBatchLoss,
    RoutingPlan,
    init_distributed,
    parallel_layout,
)
from moe_rl.routing.record import ReplayIds

RECIPE = "examples/tiny_model.yaml"
B, PROMPT, RESPONSE = 128, 12, 16  # one RL step of the demo: 16 prompts x 8 samples


def rl_batch(seed: int = 0) -> tuple[TokenBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 128, (PROMPT,), generator=g).tolist() for _ in range(B)]
    responses = [torch.randint(4, 128, (int(torch.randint(4, RESPONSE + 1, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(B)]
    return TokenBatch.from_lists(prompts, responses, response_width=RESPONSE, seq_multiple=2), torch.randn(B, generator=g)


def loss_fn(batch: TokenBatch):
    total = batch.response_lens_B.sum()

    def fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mask).sum() / total)

    return fn


def timed(fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("mode", choices=["learner", "routing"])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_intermixed_args(sys.argv[1:])
    out, mode, overrides, iters, warmup = args.out, args.mode, args.overrides, args.iters, args.warmup
    rank, world = init_distributed()
    torch.set_num_threads(max(1, 2 // world))
    cfg = load_config(RECIPE, ["parallel.micro_batch_size=128", "optimizer.lr=1e-5", *overrides])
    batch, adv = rl_batch()
    tokens = int(batch.total_lens_B.sum())
    result = {"layout": None, "world": world, "threads_per_rank": torch.get_num_threads(),
              "batch": {"sequences": B, "tokens": tokens, "response_tokens": int(batch.response_lens_B.sum())}}
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer,
                          total_updates=max(1, cfg.run.steps * cfg.rl.num_minibatches * cfg.rl.epochs))
        result["layout"] = layout.name
        step = lambda plan=None: learner.train_step(batch, loss_fn(batch), {"adv_B": adv}, routing=plan)  # noqa: E731
        if mode == "learner":
            t = timed(step, iters=iters, warmup=warmup)
            result["fwd_bwd_step_s"] = statistics.median(t)
            result["tokens_per_s"] = tokens / statistics.median(t)
            fwd = timed(lambda: learner.score_whole(batch), iters=iters, warmup=warmup)
            result["fwd_only_s"] = statistics.median(fwd)
        else:
            old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
            plans = {"plain": None,
                     "capture_gamma": RoutingPlan(old=old),
                     "capture_gamma_r2": RoutingPlan(old=old, replay=ReplayIds.from_record(old))}
            times = {k: [] for k in plans}
            for _ in range(warmup):  # warm-up every variant
                for plan in plans.values():
                    step(plan)
            for _ in range(iters):  # interleaved so drift in machine load hits all variants alike
                for k, plan in plans.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    step(plan)
                    dist.barrier()
                    times[k].append(time.perf_counter() - t0)
            result["step_s"] = {k: statistics.median(v) for k, v in times.items()}
            result["record_bytes_per_token"] = old.nbytes / max(old.ids_RSLK.shape[0] * old.ids_RSLK.shape[1], 1)
            scores = min(10, iters)
            t0 = time.perf_counter()
            for _ in range(scores):
                learner.score_whole(batch, routing=RoutingPlan(capture=True))
            result["capture_score_s"] = (time.perf_counter() - t0) / scores
            t0 = time.perf_counter()
            for _ in range(scores):
                learner.score_whole(batch)
            result["plain_score_s"] = (time.perf_counter() - t0) / scores
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
