"""One preflight, run once before anything is built: what it refuses on this device, and
that a training run calls it (and tokenizes the task's rows) exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")


@cpu_only
@pytest.mark.parametrize("override, message", [
    ("model.params_dtype=bf16", "model.params_dtype=bf16 training needs CUDA"),
    ("optimizer.distributed=true", "optimizer.distributed=true needs CUDA"),
    ("model.recompute=full", "model.recompute=full is not supported"),
])
def test_the_learner_device_limits_are_one_line(override, message):
    from moe_rl.preflight import check_learner_device

    with pytest.raises(ConfigError, match=message):
        check_learner_device(load_config(RECIPE, [BASE, override]))


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


def test_the_mismatched_model_lists_only_real_differences():
    """`params_dtype: auto` resolves to the checkpoint's fp32 on CPU: not a difference."""
    from moe_rl.preflight import check_init_model

    cfg = load_config(RECIPE, [BASE, "model.num_experts=4", "model.params_dtype=auto"])
    with pytest.raises(ConfigError) as e:
        check_init_model(cfg)
    assert "model.num_experts=4" in str(e.value) and "params_dtype" not in str(e.value)


@pytest.mark.slow
def test_a_run_checks_its_inputs_once(megatron_world, tmp_path, monkeypatch):
    """Every rank runs the preflight once (no second pass in the run directory or the
    trainer), so a dataset's rows are tokenized once per rank, not twice."""
    import moe_rl.preflight as preflight
    from moe_rl.trainer import Trainer

    calls = {"check_run": 0, "check_task_inputs": 0}
    for name in calls:
        real = getattr(preflight, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(preflight, name, counted)
    import moe_rl.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "check_run", preflight.check_run)
    cfg = load_config(RECIPE, [BASE, "run.steps=1", "rl.prompts_per_step=2", "rl.group_size=2",
                               "sampler.max_new_tokens=4", "sampler.backend=transformers",
                               "logging.progress=false", f"run.output_dir={tmp_path}"])
    Trainer(cfg).fit()
    assert calls == {"check_run": 1, "check_task_inputs": 1}
