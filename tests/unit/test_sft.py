"""The supervised warm start on the learner: loss goes down, the base checkpoint is model-only."""

import json
import shutil

import pytest
import torch

from moe_rl.config import load_config


@pytest.mark.slow
def test_sft_learns_and_writes_a_model_only_checkpoint(megatron_world, tmp_path):
    from moe_rl.cli import run_program
    from moe_rl.learner.checkpoint import read_meta
    from moe_rl.programs.sft import SFTProgram

    def run(cfg):
        return run_program(SFTProgram, cfg)

    cfg = load_config("examples/tiny_sft.yaml", [
        "run.steps=30", "run.eval_every=15", "sft.eval_problems=64", "sft.batch_size=32", "sft.target_reward=0",
        "optimizer.lr=3e-3", f"run.output_dir={tmp_path}", f"sft.output={tmp_path / 'base'}",
        "logging.progress=false",
    ])
    summary = run(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/expected_reward"]) for r in rows if "eval/expected_reward" in r]
    assert [s for s, _ in evals] == [0, 15, 30] and [r["step"] for r in rows] == list(range(31))
    assert rows[-1]["learner/loss"] < rows[15]["learner/loss"] < 4.0  # random init is ~ln(128) = 4.85
    assert 0.0 <= evals[0][1] < 1e-3 <= evals[-1][1] + 1e-3
    meta = read_meta(tmp_path / "base")
    assert meta["has_optimizer"] is False and meta["sft"]["step"] == 30
    assert meta["sft"]["expected_reward"] == pytest.approx(evals[-1][1], rel=1e-6)
    assert summary["steps"] == 30 and summary["expected_reward"] == evals[-1][1]
    assert json.loads((cfg.run_dir / "summary.json").read_text())["checkpoint"] == str(tmp_path / "base")


@pytest.mark.slow
def test_sft_resumed_midway_ends_with_the_uninterrupted_runs_weights(megatron_world, tmp_path):
    """Each step's problems are a function of (run.seed, step), and the checkpoint holds the
    optimizer and schedule: a run resumed from step 2 ends with the uninterrupted run's model."""
    from moe_rl.cli import run_program
    from moe_rl.programs.sft import SFTProgram

    def run(cfg):
        return run_program(SFTProgram, cfg)

    small = ["sft.batch_size=8", "sft.eval_problems=8", "sft.target_reward=0", "run.eval_every=2",
             "logging.progress=false", "logging.tensorboard=false", f"run.output_dir={tmp_path}", "run.name=cut",
             "run.steps=4", "run.save_every=2"]
    run(load_config("examples/tiny_sft.yaml", small))
    whole = _weights(tmp_path / "cut" / "base")
    # as if killed after step 3: step 4's checkpoint and the base never written, step 3 logged
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000004")
    shutil.rmtree(tmp_path / "cut" / "base")
    run(load_config("examples/tiny_sft.yaml", [*small, "run.resume=true"]))
    cut = _weights(tmp_path / "cut" / "base")
    assert whole.keys() == cut.keys() and all(torch.equal(whole[k], cut[k]) for k in whole)
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]


def _weights(path):
    """The model tensors of a model-only checkpoint, read back through the converter."""
    from moe_rl.convert.dcp import DcpCheckpoint

    ckpt = DcpCheckpoint(path)
    return {k: ckpt.read(k).clone() for k in ckpt.tensors}


def test_expected_reward_is_the_probability_of_sampling_the_answer(megatron_world):
    """mean_i exp(sum_t log pi(y_it)): checked against the logprobs directly."""
    from moe_rl.batch import TokenBatch
    from moe_rl.learner import Learner, parallel_layout
    from moe_rl.programs.sft import expected_reward

    cfg = load_config("examples/tiny_model.yaml")
    batch = TokenBatch.from_lists([[5, 6], [7]], [[8, 9, 3], [10, 3]])
    with parallel_layout(cfg.parallel, seed=1) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout)
        logp = learner.logprobs(batch)
        want = (torch.exp(logp[0, :3].sum()) + torch.exp(logp[1, :2].sum())) / 2
        assert expected_reward(learner, batch) == pytest.approx(float(want), rel=1e-6)
