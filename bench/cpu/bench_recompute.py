"""What full activation recompute (`model.recompute=full`) buys and costs in one learner
update: the bytes autograd keeps from the forward for the backward (parameters aside; the
forward's, not the recomputed layers' own), the process's resident-set growth over the
update, and the update's wall time, without and with recompute.

Each variant runs in a fresh torchrun child: an 8-layer MoE (hidden 256, 8 experts top-2,
fp32, vocabulary 4096 so that the layers, not the logits, hold the memory) takes one small
warm-up update (Adam's states then exist), then timed updates of one packed micro-batch of
`TOKENS` tokens; the saved bytes are counted with `torch.autograd.graph.saved_tensors_hooks`
during the last one, the RSS high-water mark is read after the first. Recompute should keep
about one layer input ([tokens, h] fp32) per layer plus what lies outside the layers, and
cost about one more forward (roughly a third more than forward + backward)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import sys
from pathlib import Path

from moe_rl_testing.bench_common import at_once, markdown_table, run_module_worker, write_results

MIB = 2**20
LAYERS, HIDDEN, TOKENS = 8, 256, 8192
MODEL = [f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", "model.num_attention_heads=8",
         "model.num_query_groups=4", "model.kv_channels=32", "model.num_experts=8", "model.moe_router_topk=2",
         f"model.moe_ffn_hidden_size={HIDDEN}", "model.vocab_size=4096", "model.max_position_embeddings=1024"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(out: str, recompute: str, tokens: int, iters: int) -> None:
    import time

    import torch

    from moe_rl.batch import TokenBatch
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, MicroBatchLoss, init_distributed, parallel_layout

    init_distributed()
    g = torch.Generator().manual_seed(0)
    per = 512
    n = tokens // per
    batch = TokenBatch.from_lists([torch.randint(1, 4096, (16,), generator=g).tolist() for _ in range(n)],
                                  [torch.randint(1, 4096, (per - 16,), generator=g).tolist() for _ in range(n)],
                                  response_width=per - 16)
    adv = torch.randn(n, generator=g)
    total = float(batch.response_lens_B.sum())

    def loss_fn(logp_BT, mb):
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mb.batch.response_mask()).sum() / total)

    cfg = load_config(None, [*MODEL, f"parallel.max_tokens_per_microbatch={tokens}", f"model.recompute={recompute}"])
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=iters + 1)
        params = {p.untyped_storage().data_ptr() for p in learner.gpt.parameters()}
        learner.train_step(batch.select(torch.arange(1)), loss_fn, extras={"adv_B": adv[:1]})
        base = _rss()
        seconds, saved = [], {}
        for i in range(iters):
            hooks = _counting_saved(saved, params) if i == iters - 1 else contextlib.nullcontext()
            t0 = time.perf_counter()
            with hooks:
                learner.train_step(batch, loss_fn, extras={"adv_B": adv})
            seconds.append(time.perf_counter() - t0)
            if i == 0:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"base": base, "added": peak - base, "seconds": seconds,
                                     "saved_bytes": sum(saved.values()), "tokens": tokens}))


def _counting_saved(storages: dict[int, int], params: set[int]):
    """Count the storages autograd saves outside a backward (the forward's), parameters aside."""
    import torch

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def main(quick: bool = False) -> None:
    tokens, iters = (1024, 1) if quick else (TOKENS, 4)
    res = at_once({mode: functools.partial(run_module_worker, "bench.cpu.bench_recompute", mode, str(tokens), str(iters),
                                           threads=1 if quick else 2)
                   for mode in ("none", "full")}, enabled=quick)  # (quick: both children at once, a thread each)
    plain, full = res["none"], res["full"]
    med = lambda r: sorted(r["seconds"])[len(r["seconds"]) // 2]  # noqa: E731
    inputs = LAYERS * tokens * HIDDEN * 4
    rows = [[mode, r["saved_bytes"] / MIB, r["saved_bytes"] / plain["saved_bytes"], r["added"] / MIB, med(r),
             med(r) / med(plain)] for mode, r in res.items()]
    table = markdown_table(["model.recompute", "forward keeps (MiB)", "x none", "RSS added by the update (MiB)",
                            "update s (median)", "x none"], rows)
    notes = (f"One update of a {tokens}-token packed micro-batch, {LAYERS}-layer MoE (hidden {HIDDEN}, 8 experts "
             f"top-2, fp32, vocabulary 4096), 1 process, {iters} timed updates after a warm-up; fresh process per "
             f"mode. The layers' inputs alone are {inputs / MIB:.1f} MiB; with recompute the forward keeps "
             f"{full['saved_bytes'] / MIB:.1f} MiB ({full['saved_bytes'] / plain['saved_bytes']:.1%} of "
             f"{plain['saved_bytes'] / MIB:.1f}), and an update takes {med(full) / med(plain):.2f}x the time.")
    write_results("recompute", {"results": res, "layers": LAYERS, "hidden": HIDDEN}, table, notes)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], sys.argv[i + 2], int(sys.argv[i + 3]), int(sys.argv[i + 4]))
    else:
        main(quick="--quick" in sys.argv)
