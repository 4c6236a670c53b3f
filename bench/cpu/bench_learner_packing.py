"""Packed versus padded learner updates on a variable-length RL workload (issue #23).

Prompts of 16-256 tokens and responses of 8-512 tokens (uniform), 32 sequences, the tiny
MoE at 1 process (2 threads), fp32: the time of one update (forward, backward, Adam) and
real tokens per second, padded (every sequence of a micro-batch padded to the longest),
packed at the same sequences per micro-batch, and packed with a token budget. Run in a
torchrun child (`python -m bench.cpu.bench_learner_packing --worker OUT`)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from moe_rl_testing.bench_common import markdown_table, run_module_worker, write_results

SETTINGS = {
    "padded, 4 sequences / micro-batch": ["parallel.packing=false", "parallel.micro_batch_size=4"],
    "packed, 4 sequences / micro-batch": ["parallel.packing=true", "parallel.micro_batch_size=4"],
    "packed, 4096-token budget": ["parallel.packing=true", "parallel.max_tokens_per_microbatch=4096"],
}
MODEL = ["model.max_position_embeddings=1024", "model.hidden_size=128", "model.num_layers=4"]


def workload(n: int, seed: int = 0):
    import torch

    from moe_rl.batch import TokenBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (int(torch.randint(16, 257, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(1, 128, (int(torch.randint(8, 513, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    return TokenBatch.from_lists(prompts, responses, response_width=512), torch.randn(n, generator=g)


def worker(out: str, sequences: int, iters: int) -> None:
    import torch

    from moe_rl.config import load_config
    from moe_rl.learner import Learner, MicroBatchLoss, init_distributed, parallel_layout

    init_distributed()
    batch, adv_B = workload(sequences)
    total = float(batch.response_lens_B.sum())

    def loss_fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mask).sum() / total)

    cfgs = {name: load_config(None, [*MODEL, *overrides]) for name, overrides in SETTINGS.items()}
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    metrics: dict[str, dict] = {}
    with parallel_layout(next(iter(cfgs.values())).parallel, seed=1) as layout:
        learners = {}
        for name, cfg in cfgs.items():
            torch.manual_seed(1)
            learners[name] = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=100)
        for it in range(iters + 1):  # round-robin, so machine noise hits every setting alike
            for name, learner in learners.items():
                t0 = time.perf_counter()
                metrics[name] = learner.train_step(batch, loss_fn, extras={"adv_B": adv_B})
                if it:  # (the first round warms up)
                    times[name].append(time.perf_counter() - t0)
    real = int(batch.total_lens_B.sum())
    results = {}
    for name in SETTINGS:
        update_s = statistics.median(times[name])
        results[name] = {"update_s": update_s, "tokens_per_s": real / update_s, "pad_frac": metrics[name]["pad_frac"],
                         "microbatches": metrics[name]["microbatches"], "real_tokens": real, "sequences": sequences,
                         "times_s": times[name]}
    Path(out).write_text(json.dumps(results))


def main(quick: bool = False) -> None:
    sequences, iters = (8, 1) if quick else (32, 5)
    results = run_module_worker("bench.cpu.bench_learner_packing", str(sequences), str(iters))
    base = results["padded, 4 sequences / micro-batch"]["update_s"]
    rows = [[name, r["microbatches"], r["pad_frac"], r["update_s"], r["tokens_per_s"], base / r["update_s"]]
            for name, r in results.items()]
    table = markdown_table(["setting", "micro-batches", "pad fraction", "update s", "real tokens/s",
                            "speed-up vs padded"], rows)
    first = next(iter(results.values()))
    notes = (f"{first['sequences']} sequences, {first['real_tokens']} real tokens (prompts 16-256, responses "
             "8-512 tokens, uniform); tiny MoE (4 layers, hidden 128, 8 experts top-2), fp32, 1 process with "
             "2 threads; median of 5 timed updates each after a warm-up round, the settings taking turns in one process. Target "
             "(issue #23): packed at least 1.6x faster than padded.")
    write_results("learner_packing", {"results": results}, table, notes)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3]))
    else:
        main(quick="--quick" in sys.argv)
