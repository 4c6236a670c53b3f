"""The GPU benchmark of `make gpu-check` (one Hopper GPU): the learner at the Qwen3-30B-A3B
layer shape in bf16 and each fp8 recipe, fp8 logprob drift, vLLM generation, weight sync.

    python -m bench.device.bench_gpu [--part learner|rollout|all] [--layers N] [--quick]
        # -> bench/results/gpu_<device>_learner.md/.json and gpu_<device>_rollout.md/.json

Model: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, QK-norm, 128
experts top-8 of FFN 768), as many layers as fit beside the optimizer (`--layers`, default
4), a 32768-token vocabulary (the real 151936 would make the output layer the benchmark),
random init, bf16 parameters, Transformer Engine spec. Every precision trains from the same
weights (a checkpoint of the bf16 learner), so drift and speed are comparable in one run:

- learner tokens/s: median over timed `train_step`s of B x S tokens; MFU = model FLOPs /
  (step time x peak dense bf16 FLOP/s of the GPU), model FLOPs by `moe_rl.plan.flops`
  (megatron's formula: every GEMM, router and output head included, and causal attention;
  what a run's `perf/mfu_learner` counts), the same formula for the fp8 rows (fp8 speed-up =
  their tokens/s over bf16's); a bf16 row with Transformer Engine's fused MoE token
  permutation (`model.moe_permute_fusion`), whose log-probs should match bf16's (a
  reordering). Results up to 2026-11-26 counted 6 x active parameters + attention, without
  the output head: 0.80x this count at the 4-layer default, so 1.26x their MFU in it (the
  H100's 1.4% is 1.8%);
- fp8 drift against bf16 on the same batch and weights: mean and max |dlogp|, k3;
- on-policy ratio: the update pass's logprobs against the scoring pass's (exactly 0 under
  current scaling);
- packed (THD, a token budget per micro-batch) against padded micro-batches on a batch of
  varied lengths, bf16: tokens/s of real tokens and the ratio;
- rollout part: vLLM bf16 generate tokens/s and weight-sync seconds and GB/s (learner ->
  in-process engine), and the GPU memory that sleep mode gives back. The learner there uses
  the TE spec when Transformer Engine imports, else the local spec (what the rollout needs
  of it is the weights).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import to_dict
from moe_rl.plan.flops import PEAK_BF16_TFLOPS, device_short_name, peak_bf16_flops, train_flops
from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, synced, time_fn, write_results

NEEDS_CUDA = True
"""`bench.run_all` skips this benchmark with one line without a CUDA GPU."""

PRECISIONS = (("bf16", []), ("bf16, fused permutation", ["model.moe_permute_fusion=true"]),
              ("fp8 blockwise", ["model.fp8=hybrid", "model.fp8_recipe=blockwise"]),
              ("fp8 tensorwise", ["model.fp8=hybrid", "model.fp8_recipe=tensorwise"]),
              ("fp8 delayed", ["model.fp8=hybrid", "model.fp8_recipe=delayed"]))


def shape_overrides(layers: int, spec: str = "te") -> list[str]:
    return [f"model.num_layers={layers}", "model.hidden_size=2048", "model.num_attention_heads=32",
            "model.num_query_groups=4", "model.kv_channels=128", "model.ffn_hidden_size=6144",
            "model.num_experts=128", "model.moe_router_topk=8", "model.moe_ffn_hidden_size=768",
            "model.qk_layernorm=true", "model.vocab_size=32768", "model.max_position_embeddings=4096",
            "model.rotary_base=1000000.0", f"model.layer_spec={spec}", "model.params_dtype=bf16",
            "model.moe_token_dispatcher_type=alltoall", "parallel.micro_batch_size=1"]


def peak_flops() -> float:
    """The GPU's dense bf16 peak (FLOP/s); an H100 SXM's for a GPU `moe_rl.plan.flops` lacks."""
    return peak_bf16_flops(torch.cuda.get_device_name()) or PEAK_BF16_TFLOPS["H100"] * 1e12


def bench_batch(batch_size: int, seq_len: int, vocab: int) -> tuple[Any, torch.Tensor]:
    from moe_rl.batch import TokenBatch

    g = torch.Generator().manual_seed(0)
    prompt = seq_len // 4
    prompts = [torch.randint(10, vocab, (prompt,), generator=g).tolist() for _ in range(batch_size)]
    responses = [torch.randint(10, vocab, (seq_len - prompt,), generator=g).tolist() for _ in range(batch_size)]
    return TokenBatch.from_lists(prompts, responses), torch.randn(batch_size, generator=g)


def reinforce(batch: Any) -> Any:
    from moe_rl.learner import MicroBatchLoss

    total = batch.response_lens_B.sum().clamp(min=1)

    def loss_fn(logp_BT: torch.Tensor, mb: Any) -> Any:
        mask = mb.batch.response_mask().to(logp_BT.device)
        adv = mb.extras["adv_B"].to(logp_BT.device)[:, None]
        return MicroBatchLoss(-(adv * logp_BT * mask).sum() / total, {}, weight=mask.sum())

    return loss_fn


def run_precision(name: str, overrides: list[str], base: Path, layout: Any, batch: Any, adv_B: torch.Tensor,
                  iters: int) -> dict[str, Any]:
    """One precision: load the shared weights, score (drift), the on-policy pass, timed steps."""
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, load_checkpoint

    cfg = load_config(ROOT / "examples/tiny_rspo.yaml", [*shape_overrides(_LAYERS), *overrides])
    learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=iters + 8)
    load_checkpoint(learner, base, load_optimizer=False)
    scored = learner.score_whole(batch)
    own = learner.update(learner.own_rows(batch, {"adv_B": adv_B}), reinforce(batch))
    mask = batch.response_mask()
    on_policy = float((own.logp_BT.float() - scored.logp_BT.float()).abs()[mask].max())
    timing = time_fn(lambda: synced(learner.train_step, batch, reinforce(batch), {"adv_B": adv_B}), warmup=1,
                     iters=iters)
    tokens = batch.batch_size * batch.seq_len
    out = {"precision": name, "step_s": timing["median_s"], "tokens_per_s": tokens / timing["median_s"],
           "mfu": train_flops(cfg.model, [batch.seq_len] * batch.batch_size) / timing["median_s"] / peak_flops(),
           "on_policy_max_abs_dlogp": on_policy, "logp_BT": scored.logp_BT.float().cpu(),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    return out  # (the learner is freed by the caller's collection)


def varied_batch(batch_size: int, max_len: int, vocab: int) -> tuple[Any, torch.Tensor]:
    """Lengths spread evenly from max_len / 8 to max_len (a quarter prompt): what RL rollouts
    look like, where padding to the longest wastes about 40% of a padded micro-batch."""
    from moe_rl.batch import TokenBatch

    g = torch.Generator().manual_seed(1)
    lengths = torch.linspace(max_len // 8, max_len, batch_size).long()[torch.randperm(batch_size, generator=g)]
    prompts, responses = [], []
    for n in lengths.tolist():
        prompts.append(torch.randint(10, vocab, (n // 4,), generator=g).tolist())
        responses.append(torch.randint(10, vocab, (n - n // 4,), generator=g).tolist())
    return TokenBatch.from_lists(prompts, responses), torch.randn(batch_size, generator=g)


def run_packing(base: Path, layout: Any, iters: int, quick: bool) -> list[dict[str, Any]]:
    """bf16 train_step tokens/s, packed with a token budget against padded micro-batches of
    4 sequences, on the same weights and the same varied-length batch."""
    from moe_rl.config import load_config
    from moe_rl.learner import Learner

    batch, adv_B = varied_batch(8 if quick else 32, 1024 if quick else 4096, 32768)
    real = int(batch.total_lens_B.sum())
    rows = []
    for name, ov in (("padded, 4 sequences per micro-batch", ["parallel.packing=false", "parallel.micro_batch_size=4"]),
                     ("packed, 16384-token budget", ["parallel.packing=true", "parallel.max_tokens_per_microbatch=16384"])):
        cfg = load_config(ROOT / "examples/tiny_rspo.yaml", [*shape_overrides(_LAYERS), "model.max_position_embeddings=8192",
                                                             *ov])
        step_s = _timed_steps(Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=iters + 8),
                              base, batch, adv_B, iters)
        rows.append({"layout": name, "step_s": step_s, "real_tokens": real, "tokens_per_s": real / step_s,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
        free_gpu()
    return rows


def _timed_steps(learner: Any, base: Path, batch: Any, adv_B: torch.Tensor, iters: int) -> float:
    """Median seconds of a train_step from the shared weights (the learner is dropped after)."""
    from moe_rl.learner import load_checkpoint

    load_checkpoint(learner, base, load_optimizer=False)
    return time_fn(lambda: synced(learner.train_step, batch, reinforce(batch), {"adv_B": adv_B}), warmup=1,
                   iters=iters)["median_s"]


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def drift(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    d = (ref - logp)[mask].double()  # log(p_bf16 / p_fp8) per token
    return {"mean_abs_dlogp": float(d.abs().mean()), "max_abs_dlogp": float(d.abs().max()),
            "k3": float((torch.exp(-d) - 1 + d).mean())}


def save_base(layout: Any, path: Path, spec: str = "te") -> Any:
    """The bf16 learner's random initial weights, shared by every precision."""
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, save_checkpoint

    cfg = load_config(ROOT / "examples/tiny_rspo.yaml", shape_overrides(_LAYERS, spec))
    learner = Learner(cfg.model, cfg.parallel, layout)
    save_checkpoint(learner, path, recipe=to_dict(cfg))
    return learner


def bench_vllm(learner: Any, hf_dir: Path, quick: bool) -> dict[str, float]:
    """vLLM bf16 on the exported weights: generate tokens/s; weight sync from the learner;
    the memory sleep mode frees."""
    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.sampler import VLLMEngineConfig, make_sampler

    sampler = make_sampler(hf_dir, VLLMEngineConfig(precision="bf16", gpu_memory_utilization=0.3, max_model_len=2048,
                                                    sleep_mode=True))
    prompts = [[11 + (i * 7 + j) % 30000 for j in range(256)] for i in range(16 if quick else 64)]
    sampler.generate(prompts[:2], n=1, max_new_tokens=8, seed=0)  # warm-up (CUDA graphs)
    t0 = time.perf_counter()
    ro = sampler.generate(prompts, n=4, max_new_tokens=128 if quick else 512, seed=1)
    gen_s = time.perf_counter() - t0
    new_tokens = sum(len(r) for r in ro.response_token_ids)
    # dst=None: the path the trainer's colocated sync takes (full tensors assembled on the GPU);
    # the default dst=0 is the export path, which assembles them in host memory
    nbytes = sum(t.numel() * t.element_size() for _, t in hf_named_tensors(learner, dst=None))
    sync_s = []
    for _ in range(3):  # the first push also warms the engine's loader path
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler.update_weights(hf_named_tensors(learner, dst=None))
        torch.cuda.synchronize()
        sync_s.append(time.perf_counter() - t0)
    free_awake = torch.cuda.mem_get_info()[0]
    sampler.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    sampler.wake_up()
    sampler.close()
    best = min(sync_s)
    return {"generate_tokens_per_s": new_tokens / gen_s, "generated_tokens": new_tokens, "generate_s": gen_s,
            "sync_seconds": best, "sync_seconds_all": sync_s, "sync_gb": nbytes / 1e9, "sync_gb_per_s": nbytes / 1e9 / best,
            "sleep_freed_gib": freed / 2**30}


_LAYERS = 4


def learner_report(rows: list[dict[str, Any]], drifts: dict[str, dict[str, float]], packing: list[dict[str, Any]],
                   batch: Any) -> tuple[str, str]:
    bf16 = rows[0]["tokens_per_s"]
    table = markdown_table(
        ["precision", "step s", "tokens/s", "MFU", "x bf16", "on-policy max |dlogp|", "mean |dlogp| vs bf16",
         "max |dlogp|", "k3", "peak GiB"],
        [[r["precision"], r["step_s"], r["tokens_per_s"], f"{100 * r['mfu']:.1f}%", r["tokens_per_s"] / bf16,
          r["on_policy_max_abs_dlogp"], *(drifts.get(r["precision"], {}).get(k, 0.0)
                                           for k in ("mean_abs_dlogp", "max_abs_dlogp", "k3")), r["peak_mem_gib"]]
         for r in rows])
    if packing:
        padded = packing[0]["tokens_per_s"]
        table += "\n\n" + markdown_table(
            ["micro-batches (bf16)", "step s", "real tokens", "tokens/s", "x padded", "peak GiB"],
            [[r["layout"], r["step_s"], r["real_tokens"], r["tokens_per_s"], r["tokens_per_s"] / padded,
              r["peak_mem_gib"]] for r in packing])
    notes = (f"Qwen3-30B-A3B layer shape x {_LAYERS} layers, vocab 32768, TE spec, bf16 params, one GPU; batch "
             f"{batch.batch_size} x {batch.seq_len} tokens per step. The packing rows use a batch of varied lengths "
             "(1/8 to all of the longest). `python -m bench.device.bench_gpu --part learner` "
             "(also a stage of `make gpu-check`).")
    return table, notes


def rollout_report(vllm: dict[str, Any], spec: str) -> tuple[str, str]:
    table = markdown_table(["vLLM bf16 generate tokens/s", "generated tokens", "weight sync s", "GB", "GB/s",
                            "sleep frees GiB"],
                           [[vllm["generate_tokens_per_s"], vllm["generated_tokens"], vllm["sync_seconds"],
                             vllm["sync_gb"], vllm["sync_gb_per_s"], vllm["sleep_freed_gib"]]])
    notes = (f"Random-init Qwen3-MoE at the Qwen3-30B-A3B layer shape x {_LAYERS} layers (hidden 2048, 128 experts "
             "top-8 of 768, 32/4 heads of 128), vocab 32768, bf16, one GPU, `gpu_memory_utilization=0.3`, CUDA graphs. "
             "Generate: 64 prompts of 256 tokens x 4 samples x up to 512 new tokens. Weight sync: the best of 3 "
             f"in-process pushes from the learner ({spec} spec) of every HF-named tensor. "
             "`python -m bench.device.bench_gpu --part rollout`.")
    return table, notes


def main(part: str = "all", quick: bool = False, layers: int = 4, iters: int = 10) -> None:
    global _LAYERS
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner import init_distributed, parallel_layout
    from moe_rl.learner.model import transformer_engine_available

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    _LAYERS = 1 if quick else layers
    spec = "te" if transformer_engine_available() else "local"
    if part != "rollout" and spec != "te":
        raise SystemExit("bench_gpu --part learner needs Transformer Engine (transformer_engine.pytorch does not import)")
    init_distributed()
    batch, adv_B = bench_batch(2 if quick else 8, 1024 if quick else 2048, 32768)
    short = device_short_name(torch.cuda.get_device_name())
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as work, parallel_layout(_parallel(), seed=0) as layout:
        base = Path(work) / "base"
        learner = save_base(layout, base, spec)
        if part in ("rollout", "all"):
            hf_dir = megatron_to_hf(base, Path(work) / "hf")
            vllm = bench_vllm(learner, hf_dir, quick)
            table, notes = rollout_report(vllm, spec)
            print(table)
            print(write_results(f"gpu_{short}_rollout", {"layers": _LAYERS, "vllm": vllm, "quick": quick}, table, notes))
        del learner
        free_gpu()
        if part == "rollout":
            return
        iters = 3 if quick else iters
        rows, failed = [], {}
        for name, ov in PRECISIONS:
            row = _attempt(failed, name, run_precision, name, ov, base, layout, batch, adv_B, iters)
            if row is not None:
                rows.append(row)
                print(f"{name}: {row['tokens_per_s']:.4g} tokens/s, MFU {100 * row['mfu']:.1f}%, "
                      f"peak {row['peak_mem_gib']:.1f} GiB", flush=True)
            free_gpu()
        packing = _attempt(failed, "packing", run_packing, base, layout, iters, quick) or []
    if not rows or rows[0]["precision"] != "bf16":
        raise SystemExit(f"bench_gpu: the bf16 row failed, nothing to compare against: {failed}")
    mask = batch.response_mask()
    drifts = {r["precision"]: drift(r["logp_BT"], rows[0]["logp_BT"], mask) for r in rows[1:]}
    table, notes = learner_report(rows, drifts, packing, batch)
    if failed:
        notes += "\n\nFailed: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
    data = {"layers": _LAYERS, "rows": [{k: v for k, v in r.items() if k != "logp_BT"} for r in rows],
            "drift": drifts, "packing": packing, "failed": failed, "quick": quick}
    print(table)
    print(write_results(f"gpu_{short}_learner", data, table, notes))


def _attempt(failed: dict[str, str], name: str, fn: Any, *args: Any) -> Any:
    """fn(*args), or None with the one-line cause in `failed[name]`: on a lent GPU one failing
    recipe must not cost the other rows (the cause is a result too)."""
    try:
        return fn(*args)
    except Exception as exc:  # recorded and reported (the cause is a result), never swallowed
        text = str(exc).strip().splitlines()
        failed[name] = f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
        print(f"{name}: FAILED {failed[name]}", flush=True)
        free_gpu()
        return None


def _parallel() -> Any:
    from moe_rl.config import ParallelConfig

    return ParallelConfig(micro_batch_size=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("learner", "rollout", "all"), default="all",
                    help="learner (TE: bf16, fp8 recipes, packing), rollout (vLLM, weight sync, sleep), or both")
    ap.add_argument("--quick", action="store_true", help="1 layer, small batch (smoke test)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-30B-A3B shape (default 4)")
    ap.add_argument("--iters", type=int, default=10, help="timed train_steps per row, median reported (default 10)")
    args = ap.parse_args()
    main(part=args.part, quick=args.quick, layers=args.layers, iters=args.iters)
