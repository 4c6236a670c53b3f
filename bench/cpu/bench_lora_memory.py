"""Peak host memory of RL updates with LoRA (rank 8 on attention and every expert) against
full fine-tuning, on a model whose weights and optimizer states dominate the update's memory
(hidden 512, 16 experts of 1024, 4 layers, 8 sequences of 64 tokens, fp32, CPU).

Each variant runs in its own fresh one-process torchrun child, so no variant inherits the
other's high-water mark. The child reads its resident set size after the imports and the
process group (the baseline: the interpreter, torch, megatron), builds the learner, resets
the kernel's RSS high-water mark, takes the first update, reads and resets the mark, takes
`UPDATES - 1` more and reads it again. Everything is reported above the baseline, next to
what the learner holds by count (weights, gradient buffers, Adam's two moments, fp32) and
the activations the last update saved for its backward (unique non-parameter storages seen
by autograd's saved-tensor hook).

Why the first update is not the measure (the earlier version of this file measured only it
and found LoRA saving ~10%): Adam's moments are allocated by the first optimizer step,
after the backward has freed the activations; the allocator keeps that freed memory and
the moments land in it, so the first update's peak is the activations' and misses the
moments. From the second update on the activations need fresh memory beside the moments:
that peak is what an RL run holds."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from bench.cpu.bench_update_memory import _rss
from moe_rl_testing.bench_common import at_once, markdown_table, run_module_worker, write_results

MIB = 2**20
FP32 = 4
UPDATES = 3
MODEL = ["model.hidden_size=512", "model.moe_ffn_hidden_size=1024", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=8", "model.num_query_groups=2", "model.kv_channels=64", "model.num_experts=16",
         "model.num_layers=4", "parallel.micro_batch_size=8", "model.layer_spec=local"]
QUICK = ["model.num_experts=4", "model.moe_ffn_hidden_size=512", "model.num_layers=2"]
SEQUENCES, PROMPT, RESPONSE = 8, 16, 48
VARIANTS = {"full fine-tuning": [], "LoRA rank 8, attention + experts":
            ["model.lora.rank=8", "model.lora.modules=[attention,experts]"]}


def _hwm() -> int:
    """VmHWM (peak resident set since the last reset), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here (Linux >= 4.0)


class SavedActivations:
    """Bytes of the distinct non-parameter storages autograd saves for the backward while
    active (a saved-tensor hook that keeps nothing itself)."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def worker(out: str, variant: str, quick: str) -> None:
    import torch

    from moe_rl.batch import TokenBatch
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, MicroBatchLoss, init_distributed, parallel_layout

    init_distributed()
    g = torch.Generator().manual_seed(0)
    batch = TokenBatch.from_lists([torch.randint(1, 128, (PROMPT,), generator=g).tolist() for _ in range(SEQUENCES)],
                                  [torch.randint(1, 128, (RESPONSE,), generator=g).tolist() for _ in range(SEQUENCES)],
                                  response_width=RESPONSE)
    adv = torch.randn(SEQUENCES, generator=g)
    total = float(batch.response_lens_B.sum())

    def loss_fn(logp_BT, mb):
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mb.batch.response_mask()).sum() / total)

    cfg = load_config(None, [*MODEL, *(QUICK if quick == "1" else []), *VARIANTS[variant]])
    baseline = _rss()
    with parallel_layout(cfg.parallel, seed=0) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=UPDATES)
        built = _rss()
        params = list(learner.gpt.parameters())
        saved = SavedActivations({p.untyped_storage().data_ptr() for p in params})
        _reset_hwm()
        learner.train_step(batch, loss_fn, extras={"adv_B": adv})
        first = _hwm()
        _reset_hwm()
        for i in range(UPDATES - 1):
            hooks = (saved.pack, lambda t: t) if i == UPDATES - 2 else (lambda t: t, lambda t: t)
            with torch.autograd.graph.saved_tensors_hooks(*hooks):
                learner.train_step(batch, loss_fn, extras={"adv_B": adv})
        later = _hwm()
    Path(out).write_text(json.dumps({
        "baseline": baseline, "built": built, "first_update_peak": first, "later_updates_peak": later,
        "params": sum(p.numel() for p in params), "trained": sum(p.numel() for p in params if p.requires_grad),
        "saved_activations": saved.bytes, "tokens": int(batch.response_lens_B.sum() + batch.prompt_lens_B.sum())}))


def expected(r: dict) -> dict[str, int]:
    """What the learner holds by count, fp32 bytes: every weight, a gradient buffer and
    Adam's two moments for what trains."""
    return {"weights": FP32 * r["params"], "grads": FP32 * r["trained"], "adam": 2 * FP32 * r["trained"]}


def row(name: str, r: dict) -> list:
    e = expected(r)
    held = sum(e.values())
    peak = r["later_updates_peak"] - r["baseline"]
    return [name, r["params"] / 1e6, r["trained"] / 1e6, e["weights"] / MIB, e["grads"] / MIB, e["adam"] / MIB,
            held / MIB, r["saved_activations"] / MIB, (r["built"] - r["baseline"]) / MIB,
            (r["first_update_peak"] - r["baseline"]) / MIB, peak / MIB, (peak - held) / MIB]


def main(quick: bool = False) -> None:
    """Both variants, `UPDATES` updates each; `quick`: a smaller model (4 experts of 512,
    2 layers), the same steps, the two children at once (one thread each)."""
    results = at_once({name: functools.partial(run_module_worker, "bench.cpu.bench_lora_memory", name,
                                               "1" if quick else "0", threads=1 if quick else 2)
                       for name in VARIANTS}, enabled=quick)
    rows = [row(name, r) for name, r in results.items()]
    table = markdown_table(
        ["variant", "params (M)", "trained (M)", "weights (MiB)", "grads (MiB)", "Adam states (MiB)",
         "expected: sum (MiB)", "saved activations (MiB)", "measured: after build (MiB)",
         "measured: 1st update peak (MiB)", "measured: later updates' peak (MiB)", "peak - expected (MiB)"], rows)
    full, lora = (results[n]["later_updates_peak"] - results[n]["baseline"] for n in VARIANTS)
    model = "4 experts of 512, 2 layers (quick)" if quick else "16 experts of 1024, 4 layers"
    notes = (f"Measured above each process's baseline (RSS after importing torch, megatron and moe_rl and "
             f"creating the process group: {results['full fine-tuning']['baseline'] / MIB:.0f} MiB). LoRA's peak "
             f"is {lora / full:.1%} of full fine-tuning's. Hidden 512, {model}, top-2, fp32, "
             f"{SEQUENCES} sequences x {PROMPT + RESPONSE} tokens per update, {UPDATES} updates, 1 process on CPU, "
             "a fresh process per variant. Expected: the learner's own bytes by count (weights; a gradient buffer "
             "and Adam's two moments for what trains). 'later updates' peak' (updates 2..N: Adam's moments exist) "
             "is the run's memory; the first update's peak misses the moments, allocated after the backward into "
             "memory its freed activations left. 'peak - expected': the activations, the optimizer step's "
             "temporaries and the allocator's slack.")
    write_results("lora_memory", {"results": results, "updates": UPDATES, "quick": quick}, table, notes)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        worker(sys.argv[i + 1], sys.argv[i + 2], sys.argv[i + 3])
    else:
        main(quick="--quick" in sys.argv)
