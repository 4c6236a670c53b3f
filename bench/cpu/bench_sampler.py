"""Sampler benchmark on the tiny MoE: vLLM weight-sync latency and generation time.

    python -m bench.cpu.bench_sampler [--quick]

Weight sync: a full update from an in-memory (name, tensor) stream, as the learner's
converter produces it, through `update_weights` (reload + CPU MoE repack + prefix-cache
reset); "stream" hands the iterator to the in-process engine, "disk" goes through a temp
safetensors directory (the path used for a separate engine process). Generation: 16
prompts x 8 samples x 16 new tokens (EOS disabled, so every response is 16 tokens), vLLM
and the transformers backend. Also records the fp32 agreement of vLLM's sample logprobs
with the transformers reference (max |delta logp|) at T=1 and T=0.7.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from moe_rl_testing.bench_common import markdown_table, time_fn, write_results


def main(quick: bool = False) -> None:
    from moe_rl.sampler import HFEngineConfig, VLLMEngineConfig, make_sampler
    from moe_rl.sampler.weights import iter_checkpoint
    from moe_rl_testing.sampler_utils import build_tiny_moe, prompts

    iters, warmup = (1, 1) if quick else (10, 2)
    num_prompts, n, new_tokens = (4, 4, 8) if quick else (16, 8, 16)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_moe(Path(tmp) / "hf")
        weights = list(iter_checkpoint(model_dir))
        weight_mb = sum(t.numel() * t.element_size() for _, t in weights) / 2**20
        ps = prompts(num_prompts)

        vllm = make_sampler(model_dir, VLLMEngineConfig(eos_token_ids=(), kv_cache_gib=0.25))
        hf = make_sampler(model_dir, HFEngineConfig(eos_token_ids=()))
        try:
            sync = {}
            for mode in ("stream", "disk"):
                vllm.weight_sync = mode
                sync[mode] = time_fn(lambda: vllm.update_weights(weights), warmup=warmup, iters=iters)
            vllm.weight_sync = "stream"
            seeds = iter(range(10**6))
            gen = {
                name: time_fn(
                    lambda s=s: s.generate(ps, n=n, max_new_tokens=new_tokens, seed=next(seeds)),
                    warmup=1,
                    iters=max(1 if quick else 3, iters // 2),
                )
                for name, s in (("vllm", vllm), ("transformers", hf))
            }
            agreement = {}
            for T in (1.0, 0.7):
                r = vllm.generate(ps, n=n, max_new_tokens=new_tokens, temperature=T, seed=0)
                ref = hf.score([r.prompt_token_ids[i] for i in r.prompt_index], r.response_token_ids, T)
                agreement[T] = max(abs(a - b) for x, y in zip(r.logprobs, ref) for a, b in zip(x, y))
        finally:
            vllm.close()

    tokens = num_prompts * n * new_tokens
    rows = [
        [f"weight sync, vLLM ({mode})", f"{weight_mb:.1f} MB", t["median_s"] * 1e3, t["min_s"] * 1e3, ""]
        for mode, t in sync.items()
    ]
    rows += [
        [f"generate, {name}", f"{num_prompts}x{n}x{new_tokens} tok", t["median_s"] * 1e3, t["min_s"] * 1e3, f"{tokens / t['median_s']:.0f} tok/s"]
        for name, t in gen.items()
    ]
    table = markdown_table(["what", "size", "median ms", "min ms", "throughput"], rows)
    notes = (
        "fp32 max |logp(vLLM sample) - logp(transformers, teacher-forced)|: "
        + ", ".join(f"T={T}: {d:.2e}" for T, d in agreement.items())
    )
    write_results(
        "sampler",
        {
            "quick": quick,
            "weight_mb": weight_mb,
            "weight_sync": sync,
            "generate": gen,
            "generate_shape": [num_prompts, n, new_tokens],
            "max_abs_dlogp_fp32": {str(T): d for T, d in agreement.items()},
        },
        table,
        notes,
    )
    print(table + "\n" + notes)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    main(quick=ap.parse_args().quick)
