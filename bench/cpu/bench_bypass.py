"""Bypass mode's saving: the step time of off-policy GRPO (4 mini-batch updates a rollout,
so the learner's scoring pass exists) with the learner's old log-probs (the default) against
bypass (`rl.old_logprobs=sampler`: the sampler's log-probs are the old policy, no scoring
pass), on the shipped tiny MoE with the vLLM sampler, one process, 2 threads, at a learning
rate too small to move the weights (the same responses and work in both modes). The two runs
alternate (A B A B) so that drift on a shared machine hits both; medians of the steps after
warm-up, with the old-logprob and update parts."""

from __future__ import annotations

import functools
import statistics
import sys

from bench.cpu.bench_trainer import run
from moe_rl_testing.bench_common import at_once, markdown_table, write_results

COMMON = ["rl.objective=grpo", "rl.num_minibatches=4", "optimizer.lr=1e-12"]
"""lr 1e-12 leaves the fp32 weights bit-identical (an Adam step of ~1e-12 is below their
rounding), so both modes sample the same responses and update on the same tokens: the
difference is the scoring pass alone, not two training trajectories of different lengths."""
VARIANTS = {"learner old log-probs (scoring pass)": [], "bypass (rl.old_logprobs=sampler)": ["rl.old_logprobs=sampler"]}
PARTS = ["step", "old_logprob", "update", "sample", "sync"]


def main(quick: bool = False) -> None:
    steps, warmup, rounds = (2, 1, 1) if quick else (22, 2, 3)
    times: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PARTS} for name in VARIANTS}
    rewards: dict[str, list[float]] = {}
    per_run: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):  # (quick: both runs at once, moe_rl_testing.bench_common.at_once)
        hists = at_once({name: functools.partial(run, steps, [*COMMON, *overrides], threads=1 if quick else None)
                         for name, overrides in VARIANTS.items()}, enabled=quick)  # (quick: a thread each)
        for name, hist in hists.items():
            rewards[name] = [h["reward/mean"] for h in hist]
            per_run[name].append(statistics.median(h["time/step"] for h in hist[warmup:]))
            for h in hist[warmup:]:
                for p in PARTS:
                    times[name][p].append(h.get(f"time/{p}", 0.0))
    first, second = rewards.values()
    if first != second:
        raise RuntimeError(f"the two modes sampled different responses (rewards {first} vs {second}): "
                           "the comparison would not be of the same work")
    med = {name: {p: statistics.median(v) for p, v in parts.items()} for name, parts in times.items()}
    report({"median_s": med, "per_run_median_s": per_run, "steps": steps, "warmup": warmup, "rounds": rounds,
            "overrides": {"common": COMMON, **VARIANTS}})


def report(data: dict) -> None:
    """bench/results/bypass.{json,md} from the measured medians."""
    med, per_run, rounds = data["median_s"], data["per_run_median_s"], data["rounds"]
    default, bypass = (med[name] for name in VARIANTS)
    rows = [[name, m["step"] * 1e3, default["step"] / m["step"], " / ".join(f"{t * 1e3:.0f}" for t in per_run[name]),
             *(m[p] * 1e3 for p in PARTS[1:])] for name, m in med.items()]
    table = markdown_table(["mode", "median step ms", "speed vs default", "each run's median ms",
                            *(f"{p} ms" for p in PARTS[1:])], rows)
    runs = [t for name in VARIANTS for t in per_run[name]]
    spread = (max(per_run[next(iter(VARIANTS))]) - min(per_run[next(iter(VARIANTS))])) / default["step"]
    notes = (f"{rounds} alternating rounds of {data['steps']} steps each ({data['warmup']} warm-up steps dropped "
             f"per run), {len(runs) // len(VARIANTS) * (data['steps'] - data['warmup'])} timed steps per mode; "
             "examples/tiny_rspo.yaml's model and batch (16 prompts x 8 samples, <= 16 new tokens) with "
             f"{' '.join(data['overrides']['common'])} (weights unchanged, so both modes sample the same responses: "
             "checked by the rewards, equal step by step). old_logprob is the learner's scoring pass (0 in "
             f"bypass); the rest is the same work in both. The pass bypass skips takes {default['old_logprob'] * 1e3:.0f}"
             f" ms, {default['old_logprob'] / default['step']:.0%} of the default step; the whole steps differ by "
             f"{default['step'] / bypass['step']:.2f}x, while one mode's runs spread by {spread:.0%} of its median on "
             "this shared machine (the other parts' differences are that spread, not work). Bypass changes the "
             "ratio's denominator to the sampler's log-probs, so it is a different estimator, not a free speed-up "
             "(docs/rollout_correction.md).")
    write_results("bypass", data, table, notes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
