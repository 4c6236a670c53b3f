"""`make demo`'s first steps, pinned: rewards, losses and gradient norms of the demo's
first 5 RL steps (seed 1234, vLLM sampler, fp32) as recorded from the trainer before the
rollout package, the learner's routing plan and the typed objective config were split out
of it. A refactor that changes any of them changed behaviour.

Rewards are pinned exactly (the sampled tokens); loss and gradient norm to float32 rounding:
the same commit gives a grad norm of 2.093952236799219 on the machine that recorded it and
2.093951991287367 on an AMD EPYC (AVX-512) machine, whose matmul kernels round sums in
another order (3e-6 relative by step 5). A behaviour change moves them by far more than 1e-5.
The same rows carry the step's throughput (`perf/*`), checked against what it derives from."""

import json

import pytest

from moe_rl.config import load_config

# (reward/mean, learner/loss, learner/grad_norm) of steps 1..5, recorded at d5aa6a4 with
# `python -m moe_rl.demo run.steps=5 logging.progress=false`.
PINNED = [
    (0.3515625, 0.0, 2.093952236799219),
    (0.453125, 1.4901161193847656e-08, 2.180573604636266),
    (0.46875, -7.450580596923828e-09, 3.9526041878957323),
    (0.390625, 0.0, 2.5365048100066643),
    (0.640625, 1.4901161193847656e-08, 3.1503731005205466),
]


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_first_five_steps_are_pinned(megatron_world, tmp_path):
    from moe_rl.demo import BASE, RECIPE
    from moe_rl.programs.rl import train

    cfg = load_config(RECIPE, ["run.name=demo", f"run.output_dir={tmp_path}", f"run.init_checkpoint={BASE}",
                               "run.steps=5", "logging.progress=false"])
    train(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in rows] == [p[0] for p in PINNED]
    assert [r["learner/loss"] for r in rows] == pytest.approx([p[1] for p in PINNED], abs=1e-6)
    assert [r["learner/grad_norm"] for r in rows] == pytest.approx([p[2] for p in PINNED], rel=1e-5)
    for r in rows:  # throughput (docs/step.md, "Throughput"): one engine, one draw, one update, one process
        assert r["perf/engine_tokens"] == pytest.approx(r["response/length_mean"] * 16 * 8)
        assert r["perf/engine_tokens_per_s_per_gpu"] == pytest.approx(r["perf/engine_tokens"]
                                                                      / r["sampler/sample_seconds_max"])
        assert r["perf/learner_tokens"] > r["perf/engine_tokens"]  # (the prompts' tokens too)
        assert r["perf/learner_tokens_per_s_per_gpu"] == pytest.approx(r["learner/tokens_per_s"])
        assert 0 < r["perf/learner_tokens_per_s_per_gpu"] < 1e7 and 0 < r["perf/engine_tokens_per_s_per_gpu"] < 1e7
        assert "perf/mfu_learner" not in r  # (no MFU on CPU)
