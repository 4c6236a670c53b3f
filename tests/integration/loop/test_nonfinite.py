"""Non-finite updates (issue 50): an update whose loss or gradient is NaN or inf is skipped,
counted and never applied; a run stops after run.max_skipped_updates in a row with one
line; no checkpoint is ever written with a non-finite weight. (TP2: test_learner_parallel.)"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from moe_rl.config import load_config, to_dict
from moe_rl_testing import ROOT, forked
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss

BASE = ROOT / "moe_rl" / "assets" / "tiny_base"


def _nan_loss(batch, factor: float):
    """The reinforce loss times `factor` (NaN or inf: every gradient non-finite)."""
    from moe_rl.learner import MicroBatchLoss

    loss_fn = reinforce_loss(batch)

    def poisoned(logp_BT, mb):
        out = loss_fn(logp_BT, mb)
        return MicroBatchLoss(out.loss * factor, out.metrics, out.weight)

    return poisoned


def _params(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.gpt.state_dict().items() if isinstance(v, torch.Tensor)}


def test_nan_and_inf_updates_are_skipped_without_a_trace(megatron_world):
    """Two poisoned updates then a good one leave exactly the weights, Adam state and
    schedule of the good update alone (a learner that never saw the poisoned ones)."""
    from moe_rl.learner import parallel_layout

    cfg = load_config(None, ["optimizer.lr=1e-2"])
    batch, adv_B = fixed_batch()
    extras = {"adv_B": adv_B}
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        before = _params(learner)
        nan = learner.train_step(batch, _nan_loss(batch, float("nan")), extras=extras)
        inf = learner.train_step(batch, _nan_loss(batch, float("inf")), extras=extras)
        assert (nan["update_skipped"], nan["skipped_in_a_row_max"]) == (1.0, 1.0) and math.isnan(nan["grad_norm"])
        assert (inf["update_skipped"], inf["skipped_in_a_row_max"]) == (1.0, 2.0)
        after = _params(learner)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert learner.scheduler.num_steps == 0
        good = learner.train_step(batch, reinforce_loss(batch), extras=extras)
        assert (good["update_skipped"], good["skipped_in_a_row_max"]) == (0.0, 0.0) and math.isfinite(good["grad_norm"])
        stepped = _params(learner)
    with parallel_layout(cfg.parallel, seed=3) as layout:
        clean = learner_of(cfg, layout)
        assert good == {**clean.train_step(batch, reinforce_loss(batch), extras=extras),
                        "tokens_per_s": good["tokens_per_s"]}
        reference = _params(clean)
    assert any(not torch.equal(before[k], stepped[k]) for k in before)  # the good update moved the weights
    assert all(torch.equal(stepped[k], reference[k]) for k in stepped)


def test_a_checkpoint_is_never_written_with_a_nonfinite_weight(megatron_world, tmp_path):
    from moe_rl.learner import parallel_layout, save_checkpoint
    from moe_rl.runtime.failures import RunFaultError

    cfg = load_config(None, [])
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        name, param = next(iter(learner.gpt.named_parameters()))
        with torch.no_grad():
            param.view(-1)[3] = float("inf")
        with pytest.raises(RunFaultError, match=f"refusing to save checkpoint .*step_000001: model parameter "
                                                f"{name} holds NaN or inf"):
            save_checkpoint(learner, tmp_path / "step_000001", recipe=to_dict(cfg))
    assert list(tmp_path.iterdir()) == []  # nothing of the save, not even a temp directory


@pytest.mark.slow
def test_a_run_stops_after_max_skipped_updates_in_a_row_and_resumes(tmp_path):
    """Update 2 alone is NaN (skipped, the run goes on), then updates 4 and 5 with
    run.max_skipped_updates=2: the run stops after step 5 with status 3 and one line, step 4
    (saved with the finite weights of step 3) is the latest checkpoint, and a resume
    without the fault finishes the run."""
    from moe_rl.checkpoints.directories import latest_checkpoint

    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(ROOT / "examples" / "tiny_rspo.yaml"),
           "rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "sampler.backend=transformers",
           "run.save_every=1", "logging.progress=false", "logging.tensorboard=false", f"run.init_checkpoint={BASE}",
           f"run.output_dir={tmp_path}", "run.name=nan", "run.steps=6", "run.max_skipped_updates=2",
           "run.export_hf=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    stopped = forked.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**env, "MOE_RL_TEST_NAN_AT": "2,4,5", "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in stopped.stderr.splitlines() if "error:" in ln]
    assert stopped.returncode == 3 and len(lines) == 1, stopped.stderr[-3000:]
    assert ("2 optimizer updates in a row had a NaN or inf loss or gradient (skipped since step 4; none was "
            "applied), so the run stopped after step 5, unsaved; the latest checkpoint is") in lines[0], lines[0]
    assert "step 2: skipped every update with a NaN or inf loss or gradient" in stopped.stderr
    run = tmp_path / "nan"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["learner/update_skipped"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert [r["learner/skipped_in_a_row_max"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert latest_checkpoint(run).name == "step_000004" and str(latest_checkpoint(run)) in lines[0]
    resumed = forked.run([*cmd, "run.resume=true"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**env, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["learner/update_skipped"] == 0.0
