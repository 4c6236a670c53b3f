"""The long-tail workload's base model sampled at temperature 1: reward by answer length and
the response lengths, as the RL recipe's engine produces them.

    python -m bench.generators.long_tail_base                         # the shipped moe_rl/assets/long_tail_base
    python -m bench.generators.long_tail_base --checkpoint runs/long_tail_base --problems 256 --samples 4

Draws `--problems` held-out problems of the recipe's task (`examples/tiny_long_tail.yaml`:
`repeat` under `task.length_profile=long_tail`, from a seed apart from training's), samples
`--samples` responses each with the recipe's sampler (vLLM, fp32 on CPU, its
`sampler.max_new_tokens`) at temperature 1, and scores them with the task's exact-match
reward. Writes bench/results/long_tail_base.{json,md}: per answer-length bucket the
problems, the mean reward and the response lengths (mean; p50 / p90 / max); the response
lengths' percentiles over all responses; and the fraction cut at max_new_tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import markdown_table, write_results

RECIPE = ROOT / "examples" / "tiny_long_tail.yaml"
BASE = ROOT / "moe_rl" / "assets" / "long_tail_base"
"""The shipped base model of the long-tail recipe."""
HELD_OUT_SEED = 20_260_517
BUCKETS = ((1, 12), (13, 50), (51, 100), (101, 400))
"""Answer tokens (the space and the digits, EOS excluded), inclusive ranges."""


@contextlib.contextmanager
def hf_policy(checkpoint: str | Path) -> Iterator[Path]:
    """`checkpoint` as an HF directory the engines load (converted into a temporary one when it
    is a learner checkpoint)."""
    from moe_rl.convert import megatron_to_hf

    hf = Path(checkpoint)
    if (hf / "config.json").is_file():
        yield hf
        return
    with tempfile.TemporaryDirectory(prefix="long_tail_policy_") as tmp:
        megatron_to_hf(hf, Path(tmp) / "hf", force=True)
        yield Path(tmp) / "hf"


def held_out(checkpoint: str | Path, problems: int) -> tuple[Any, Any, Any, list[Any], list[list[int]]]:
    """The recipe's config (starting from `checkpoint`), tokenizer and task, and its first
    `problems` held-out problems with their prompt token ids."""
    from moe_rl.config import load_config
    from moe_rl.tasks import make_task
    from moe_rl.tokenization import PromptEncoder, load_tokenizer

    cfg = load_config(RECIPE, [f"run.init_checkpoint={checkpoint}"])
    task = make_task(cfg.task)
    tok = load_tokenizer(cfg.task.tokenizer, cfg.run.init_checkpoint)
    encoder = PromptEncoder.from_config(cfg.task, tok)
    drawn = task.sample(problems, np.random.default_rng(HELD_OUT_SEED))
    return cfg, tok, task, drawn, [encoder.encode(p) for p in drawn]


def sample(checkpoint: str, problems: int, samples: int) -> dict[str, Any]:
    """Rewards and response lengths of `samples` responses to each of `problems` problems."""
    from moe_rl.rollout.sampler_start import build_sampler

    cfg, tok, task, drawn, prompt_ids = held_out(checkpoint, problems)
    with hf_policy(checkpoint) as hf:
        sampler = build_sampler(cfg.sampler, cfg.rl, cfg.run.seed, hf, tok.eos_ids)
        try:
            ro = sampler.generate(prompt_ids, n=samples, max_new_tokens=cfg.sampler.max_new_tokens,
                                  temperature=1.0, seed=0)
        finally:
            sampler.close()
    texts = [tok.decode(r) for r in ro.response_token_ids]
    return {
        "answer_tokens": [len(tok.encode(task.completion(drawn[i]))) for i in ro.prompt_index],
        "rewards": task.rewards([drawn[i] for i in ro.prompt_index], texts),
        "response_tokens": [len(r) for r in ro.response_token_ids],  # EOS included when it stopped
        "cut": [f == "length" for f in ro.finish_reasons],
        "max_new_tokens": cfg.sampler.max_new_tokens,
    }


def summarize(raw: dict[str, Any]) -> tuple[list[list[Any]], dict[str, Any]]:
    """Rows of the bucket table and the overall numbers."""
    ans, rew, resp = (np.asarray(raw[k], dtype=float) for k in ("answer_tokens", "rewards", "response_tokens"))
    rows = []
    for lo, hi in BUCKETS:
        m = (ans >= lo) & (ans <= hi)
        if m.any():
            r = resp[m]
            rows.append([f"{lo}-{hi}", int(m.sum()), float(rew[m].mean()), float(ans[m].mean()), float(r.mean()),
                         int(np.percentile(r, 50)), int(np.percentile(r, 90)), int(r.max())])
    pct = {f"p{q}": float(np.percentile(resp, q)) for q in (50, 80, 90, 95, 99)}
    overall = {"responses": len(resp), "mean_reward": float(rew.mean()), "response_tokens_mean": float(resp.mean()),
               "response_tokens_max": int(resp.max()), "response_tokens_pct": pct,
               "cut_at_max_new_tokens": float(np.mean(raw["cut"])),
               "short_reward": float(rew[ans <= BUCKETS[0][1]].mean()) if (ans <= BUCKETS[0][1]).any() else None}
    return rows, overall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(BASE))
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4, help="responses per problem")
    ap.add_argument("--quick", action="store_true", help="16 problems x 1 sample")
    args = ap.parse_args(argv)
    problems, samples = (16, 1) if args.quick else (args.problems, args.samples)
    raw = sample(args.checkpoint, problems, samples)
    rows, overall = summarize(raw)
    table = markdown_table(["answer tokens", "responses", "reward", "answer mean", "response mean", "response p50",
                            "response p90", "response max"], rows)
    p, short = overall["response_tokens_pct"], overall["short_reward"]
    shown = Path(args.checkpoint).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    notes = (f"{shown}: {problems} held-out problems x {samples} samples at temperature 1 "
             f"(sampler.max_new_tokens={raw['max_new_tokens']}). Mean reward {overall['mean_reward']:.3f} "
             f"({'-' if short is None else f'{short:.3f}'} on answers of at most 12 tokens). "
             "Response tokens (EOS included): "
             f"mean {overall['response_tokens_mean']:.1f}, p50 {p['p50']:.0f}, p80 {p['p80']:.0f}, "
             f"p90 {p['p90']:.0f}, p95 {p['p95']:.0f}, p99 {p['p99']:.0f}, max {overall['response_tokens_max']}; "
             f"{overall['cut_at_max_new_tokens']:.1%} cut at max_new_tokens.")
    out = write_results("long_tail_base", {"checkpoint": str(shown), "problems": problems, "samples": samples,
                                           "buckets": rows, **overall, "raw": raw}, table, notes)
    print(table + "\n" + notes + f"\n-> {out}")


if __name__ == "__main__":
    main()
