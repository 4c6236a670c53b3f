"""One preflight, run once before anything is built: what it refuses on this device, and
that a training run calls it (and tokenizes the task's rows) exactly once."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl_testing import ROOT

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")


@cpu_only
@pytest.mark.parametrize("override, message", [
    ("model.params_dtype=bf16", "model.params_dtype=bf16 training needs CUDA"),
    ("optimizer.distributed=true", "optimizer.distributed=true needs CUDA"),
])
def test_the_learner_device_limits_are_one_line(override, message):
    from moe_rl.preflight import check_learner_device

    with pytest.raises(ConfigError, match=message):
        check_learner_device(load_config(RECIPE, [BASE, override]))


def test_full_recompute_passes_the_learner_checks():
    from moe_rl.preflight import check_learner_device

    check_learner_device(load_config(RECIPE, [BASE, "model.recompute=full"]))  # (tests/integration/learner/test_recompute.py runs it)


@cpu_only
@pytest.mark.parametrize("overrides, message", [
    (["rl.replay=R3", "sampler.backend=vllm"], "use sampler.backend=transformers"),
    (["sampler.sleep_between_steps=true"], "sleep_between_steps needs a GPU"),
])
def test_the_sampler_device_limits_are_one_line(overrides, message):
    from moe_rl.preflight import check_sampler

    with pytest.raises(ConfigError, match=message):
        check_sampler(load_config(RECIPE, [BASE, *overrides]))


def test_the_starting_weights_are_checked_first(tmp_path):
    from moe_rl.preflight import check_run

    with pytest.raises(ConfigError, match="does not exist"):
        check_run(load_config(RECIPE, [f"run.init_checkpoint={tmp_path / 'missing'}"]), 1)
    with pytest.raises(ConfigError, match=r"run\.init_checkpoint is required"):
        check_run(load_config(RECIPE, ["run.init_checkpoint="]), 1)


@pytest.mark.parametrize("rows, dp, k", [(16, 1, 16), (10, 4, 3), (8, 4, 2), (128, 2, 64)])
def test_every_minibatch_gets_a_row(rows, dp, k):
    """A rank holds at most ceil(rows / dp) rows: that many mini-batches run that many
    updates (minibatch_rows leaves none empty); one more is refused, for the actor's and the
    critic's, naming the key and the bound (the trainer would silently run fewer updates than
    the schedule and the planner count)."""
    from moe_rl.config import validate_minibatches
    from moe_rl.programs.rl.policy_loss import minibatch_rows

    assert len(minibatch_rows(rows, k, dp, seed=0)) == k
    assert len(minibatch_rows(rows, k + 1, dp, seed=0)) < k + 1
    size = [f"rl.prompts_per_step={rows}", "rl.group_size=1"]
    for key in ("rl.num_minibatches", "critic.num_minibatches"):
        ok = load_config(RECIPE, [BASE, *size, "rl.advantage=gae", "rl.objective=grpo", f"{key}={k}"])
        validate_minibatches(ok, dp)
        bad = load_config(RECIPE, [BASE, *size, "rl.advantage=gae", "rl.objective=grpo", f"{key}={k + 1}"])
        with pytest.raises(ConfigError) as e:
            validate_minibatches(bad, dp)
        assert str(e.value) == (f"{key}={k + 1} is more mini-batches than the {k} rows a data-parallel rank holds "
                                f"per step (rl.prompts_per_step x rl.group_size = {rows} over {dp} ranks); "
                                f"set it to at most {k}")
    # (the critic's count is the critic's concern only under PPO)
    validate_minibatches(load_config(RECIPE, [BASE, *size, f"critic.num_minibatches={k + 1}"]), dp)


@pytest.mark.parametrize("max_epochs", [1, 4, 31, 32, 100])
def test_every_step_and_pass_has_its_own_shuffle(max_epochs):
    """No two (step, pass) of a run share a shuffle seed, however many passes (step * 31 +
    pass collided at 31 passes: step 1's 32nd with step 2's first); below 31 passes the seeds
    are the ones every recorded run used."""
    from moe_rl.programs.rl.policy_loss import shuffle_seed

    seeds = [shuffle_seed(1234, step, epoch, max_epochs) for step in range(1, 201) for epoch in range(max_epochs)]
    assert len(set(seeds)) == len(seeds)
    if max_epochs <= 31:
        assert shuffle_seed(1234, 7, 2, max_epochs) == 1234 * 7919 + 7 * 31 + 2


def test_a_step_with_fewer_rows_than_minibatches_says_so_once(caplog):
    """Dynamic sampling can keep fewer groups than rl.prompts_per_step: the step then makes
    fewer updates than configured, which the log says (once) instead of hiding."""
    from types import SimpleNamespace

    from moe_rl.programs.rl.update_phase import UpdatePhase

    cfg = load_config(RECIPE, [BASE, "rl.num_minibatches=4", "rl.epochs=2"])
    phase = UpdatePhase(cfg.rl, cfg.sampler, cfg.run.seed, learner=None, components=[], dp=2, rank=0)
    full, short = SimpleNamespace(step_rows=16), SimpleNamespace(step_rows=6)
    with caplog.at_level("WARNING", logger="moe_rl.programs.rl"):
        assert len(phase.minibatches(3, full, 2, 4)) == 8
        assert caplog.text == ""
        assert len(phase.minibatches(4, short, 2, 4)) == 6  # 3 rows a rank: 3 mini-batches a pass
        assert len(phase.minibatches(5, short, 2, 4)) == 6
    assert caplog.text.count("step 4: 6 rows make 3 of the 4 mini-batches a pass asks for") == 1


def test_a_run_with_empty_minibatches_is_refused_before_anything_is_built():
    from moe_rl.preflight import check_run

    with pytest.raises(ConfigError, match=r"rl\.num_minibatches=129 is more mini-batches than the 128 rows"):
        check_run(load_config(RECIPE, [BASE, "rl.num_minibatches=129"]), 1)


def test_the_mismatched_model_lists_only_real_differences():
    """`params_dtype: auto` resolves to the checkpoint's fp32 on CPU: not a difference."""
    from moe_rl.preflight import check_init_model

    cfg = load_config(RECIPE, [BASE, "model.num_experts=4", "model.params_dtype=auto"])
    with pytest.raises(ConfigError) as e:
        check_init_model(cfg)
    assert "model.num_experts=4" in str(e.value) and "params_dtype" not in str(e.value)


@pytest.mark.slow
def test_a_run_checks_its_inputs_once(megatron_world, tmp_path, monkeypatch):
    """`python -m moe_rl.train`'s body runs every input check once per rank (no second pass
    in the entry point, the run directory or the program), so a dataset's rows are
    tokenized once per rank, not twice."""
    import moe_rl.preflight as preflight
    from moe_rl.programs.rl import train

    names = ["check_run", "check_task_inputs", "check_init_model", "check_reward", "check_sampler"]
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(preflight, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(preflight, name, counted)
    cfg = load_config(RECIPE, [BASE, "run.steps=1", "rl.prompts_per_step=2", "rl.group_size=2",
                               "sampler.max_new_tokens=4", "sampler.backend=transformers",
                               "logging.progress=false", f"run.output_dir={tmp_path}"])
    assert train(cfg)["steps"] == 1
    assert calls == dict.fromkeys(names, 1)
