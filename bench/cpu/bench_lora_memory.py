"""Peak host memory of one RL update (its first: gradients and Adam's states come to exist)
with LoRA (rank 8 on attention and every expert) against full fine-tuning, on a model wide
enough for weights and optimizer states to dominate (hidden 512, 8 experts of 512, 4
layers, fp32, CPU). Each variant runs in a fresh torchrun child: it builds the learner,
reads its resident set size (the weights; DDP's gradient buffers are allocated here), resets
the kernel's RSS high-water mark (the build's own peak is not the update's), takes one update
of a fixed batch and reads the high-water mark."""

from __future__ import annotations

import functools
import json
import resource
import sys
from pathlib import Path

from bench.cpu.bench_update_memory import _rss
from moe_rl_testing.bench_common import at_once, markdown_table, run_module_worker, write_results

MIB = 2**20
MODEL = ["model.hidden_size=512", "model.moe_ffn_hidden_size=512", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=8", "model.num_query_groups=2", "model.kv_channels=64", "model.num_experts=8",
         "model.num_layers=4", "parallel.micro_batch_size=16"]
VARIANTS = {"full fine-tuning": [], "LoRA rank 8, attention + experts":
            ["model.lora.rank=8", "model.lora.modules=[attention,experts]"]}


def _hwm() -> int:
    """VmHWM (peak resident set since the last reset), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(out: str, variant: str) -> None:
    import torch

    from moe_rl.batch import TokenBatch
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, MicroBatchLoss, init_distributed, parallel_layout

    init_distributed()
    g = torch.Generator().manual_seed(0)
    batch = TokenBatch.from_lists([torch.randint(1, 128, (16,), generator=g).tolist() for _ in range(16)],
                                  [torch.randint(1, 128, (48,), generator=g).tolist() for _ in range(16)],
                                  response_width=48)
    adv = torch.randn(16, generator=g)
    total = float(batch.response_lens_B.sum())

    def loss_fn(logp_BT, mb):
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mb.batch.response_mask()).sum() / total)

    cfg = load_config(None, [*MODEL, *VARIANTS[variant]])
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=2)
        base = _rss()
        build_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here (Linux >= 4.0)
        learner.train_step(batch, loss_fn, extras={"adv_B": adv})
        peak = _hwm()
        params = sum(p.numel() for p in learner.gpt.parameters())
        trained = sum(p.numel() for p in learner.gpt.parameters() if p.requires_grad)
    Path(out).write_text(json.dumps({"base": base, "peak": peak, "build_peak": build_peak, "params": params,
                                     "trained": trained}))


def main(quick: bool = False) -> None:
    """Both variants, one update each (the two children are the smallest run that measures the
    peak; `quick` runs them at once)."""
    results = at_once({name: functools.partial(run_module_worker, "bench.cpu.bench_lora_memory", name,
                                               threads=1 if quick else 2) for name in VARIANTS}, enabled=quick)
    full = results["full fine-tuning"]
    rows = [[name, r["params"] / 1e6, r["trained"] / 1e6, r["base"] / MIB, r["peak"] / MIB,
             (r["peak"] - r["base"]) / MIB, (r["peak"] - r["base"]) / (full["peak"] - full["base"])]
            for name, r in results.items()]
    table = markdown_table(["variant", "params (M)", "trained (M)", "RSS after build (MiB)", "update peak (MiB)",
                            "update adds (MiB)", "x full's"], rows)
    notes = ("One RL update (the first: gradients and Adam's states allocated) of 16 sequences x 64 tokens, "
             "hidden 512, 8 experts of 512, 4 layers, fp32, 1 process on CPU; a fresh process per variant. "
             "RSS includes the interpreter, torch and megatron (the same in both).")
    write_results("lora_memory", {"results": results}, table, notes)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], sys.argv[i + 2])
    else:
        main(quick="--quick" in sys.argv)
