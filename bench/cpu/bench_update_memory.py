"""Peak host memory of one learner update at vocabulary 151,936 with a 4,096-token packed
micro-batch: the chunked log-prob head (`parallel.logprob_chunk_tokens=1024`) against
megatron's full-logits cross entropy (0). Each variant runs in a fresh torchrun child: it
builds the learner (tiny MoE, hidden 64), takes one small warm-up update (so Adam's states
exist), reads its resident set size, runs the measured update and reads the RSS high-water
mark; "added" is what the update held above the model and optimizer (issue #23's target:
chunked adds at most 25% of what the full path adds)."""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
from pathlib import Path

from moe_rl_testing.bench_common import at_once, markdown_table, run_module_worker, write_results

MIB = 2**20
VOCAB, TOKENS = 151936, 4096
QUICK_VOCAB = 32768  # (make bench-smoke: the same paths at a fifth of the head's work)


def model(vocab: int) -> list[str]:
    return [f"model.vocab_size={vocab}", "model.max_position_embeddings=1024", "parallel.max_tokens_per_microbatch=4096"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(out: str, chunk: int, tokens: int, vocab: int = VOCAB) -> None:
    import time

    import torch

    from moe_rl.batch import TokenBatch
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, MicroBatchLoss, init_distributed, parallel_layout

    init_distributed()
    g = torch.Generator().manual_seed(0)
    per = 512
    n = tokens // per
    batch = TokenBatch.from_lists([torch.randint(1, vocab, (16,), generator=g).tolist() for _ in range(n)],
                                  [torch.randint(1, vocab, (per - 16,), generator=g).tolist() for _ in range(n)],
                                  response_width=per - 16)
    small = batch.select(torch.arange(1))
    adv = torch.randn(n, generator=g)
    total = float(batch.response_lens_B.sum())

    def loss_fn(logp_BT, mb):
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mb.batch.response_mask()).sum() / total)

    cfg = load_config(None, [*model(vocab), f"parallel.logprob_chunk_tokens={chunk}"])
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=4)
        learner.train_step(small, loss_fn, extras={"adv_B": adv[:1]})  # Adam's states now exist
        base = _rss()
        t0 = time.perf_counter()
        metrics = learner.train_step(batch, loss_fn, extras={"adv_B": adv})
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"base": base, "peak": peak, "added": peak - base, "seconds": seconds,
                                     "microbatches": metrics["microbatches"], "tokens": tokens, "vocab": vocab}))


def run(chunk: int, tokens: int, vocab: int = VOCAB, threads: int = 2) -> dict:
    return run_module_worker("bench.cpu.bench_update_memory", str(chunk), str(tokens), str(vocab), threads=threads)


def main(quick: bool = False) -> None:
    tokens, vocab = (1024, QUICK_VOCAB) if quick else (TOKENS, VOCAB)
    results = at_once({name: functools.partial(run, chunk, tokens, vocab, threads=1 if quick else 2)
                       for name, chunk in (("full logits", 0), ("chunked, 1024 tokens", 1024))},
                      enabled=quick)  # (quick: both children at once, a thread each)
    full = results["full logits"]["added"]
    rows = [[name, r["base"] / MIB, r["added"] / MIB, r["added"] / full, r["seconds"]] for name, r in results.items()]
    table = markdown_table(["head", "model + optimizer RSS (MiB)", "update adds (MiB)", "x full path's", "update s"],
                           rows)
    ratio = results["chunked, 1024 tokens"]["added"] / full
    notes = (f"One update of a {tokens}-token packed micro-batch, vocabulary {vocab}, tiny MoE (hidden 64, fp32), "
             f"1 process; fresh process per head. Chunked adds {ratio:.1%} of what the full path adds "
             "(target <= 25%).")
    write_results("update_memory", {"results": results}, table, notes)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3]), int(sys.argv[i + 4]))
    else:
        main(quick="--quick" in sys.argv)
