"""The supervised warm start on the learner: loss goes down, the base checkpoint is model-only."""

import json

import pytest
import torch

from moe_rl.config import load_config


@pytest.mark.slow
def test_sft_learns_and_writes_a_model_only_checkpoint(megatron_world, tmp_path):
    from moe_rl.learner.checkpoint import read_meta
    from moe_rl.sft import run

    cfg = load_config("examples/tiny_sft.yaml", [
        "sft.steps=30", "sft.eval_every=15", "sft.eval_problems=64", "sft.batch_size=32",
        "sft.target_reward=0", "optimizer.lr=3e-3", f"run.output_dir={tmp_path}", f"sft.output={tmp_path / 'base'}",
    ])
    summary = run(cfg)
    hist = summary["history"]
    assert [h["step"] for h in hist] == [0, 15, 30]
    assert hist[-1]["nll"] < hist[1]["nll"] < 4.0  # random init is ~ln(128) = 4.85
    assert 0.0 <= hist[0]["expected_reward"] < 1e-3 <= hist[-1]["expected_reward"] + 1e-3
    meta = read_meta(tmp_path / "base")
    assert meta["has_optimizer"] is False and meta["sft"]["step"] == 30
    assert json.loads((tmp_path / cfg.run.name / "sft_summary.json").read_text())["steps"] == 30


def test_expected_reward_is_the_probability_of_sampling_the_answer(megatron_world):
    """mean_i exp(sum_t log pi(y_it)): checked against the logprobs directly."""
    from moe_rl.batch import TokenBatch
    from moe_rl.learner import Learner, parallel_layout
    from moe_rl.sft import expected_reward

    cfg = load_config("examples/tiny_model.yaml")
    batch = TokenBatch.from_lists([[5, 6], [7]], [[8, 9, 3], [10, 3]])
    with parallel_layout(cfg.parallel, seed=1) as layout:
        learner = Learner(cfg, layout, trainable=False)
        logp = learner.logprobs(batch)
        want = (torch.exp(logp[0, :3].sum()) + torch.exp(logp[1, :2].sum())) / 2
        assert expected_reward(learner, batch) == pytest.approx(float(want), rel=1e-6)
