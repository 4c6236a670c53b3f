"""The planner on DeepSeek-V3 (671B) and Kimi-K2 (1.04T), both `DeepseekV3ForCausalLM`:
totals counted from megatron's own modules (multi-latent attention included) on the meta
device equal transformers' meta-device counts of the same config.json, and match the model
cards; examples/gpu/deepseek_v3.yaml fits on its 256 H100s and restates the real config.json.
The planner runs in moe_rl_testing/workers/plan_worker.py (its meta build joins a fake process group).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.plan.published import CONFIGS, SIZES, write_config_dir
from moe_rl_testing import ROOT
from moe_rl_testing.plan_jobs import run_plan_jobs

RECIPE = ROOT / "examples" / "gpu" / "deepseek_v3.yaml"
# The recipe's layout for DeepSeek-V3 (256 GPUs); Kimi-K2's 384 experts at EP384 (384 GPUs;
# model.num_experts only lets the recipe's own section pass its check before config.json
# replaces it, as `python -m moe_rl.plan` does without the override).
LAYOUTS = {"DeepSeek-V3": (256, []),
           "Kimi-K2": (384, ["parallel.expert_model_parallel_size=384", "sampler.tensor_parallel_size=64",
                             "model.num_experts=384"])}


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, dict]:
    """The published config.json files as published (fp8 quantization_config included: the
    planner notes it and plans the bf16 model) with the recipe's training settings, and the
    recipe itself (its model section: no checkpoint here), at the LAYOUTS."""
    root = tmp_path_factory.mktemp("plans")
    jobs = [{"name": name, "recipe": str(RECIPE), "gpus": gpus,
             "overrides": [f"run.init_checkpoint={write_config_dir(name, root / name)}", *overrides]}
            for name, (gpus, overrides) in LAYOUTS.items()]
    jobs.append({"name": "recipe", "recipe": str(RECIPE), "overrides": [], "gpus": 256, "suggest": True})
    return run_plan_jobs(jobs, root)


def transformers_counts(name: str, tmp_path: Path) -> tuple[int, int]:
    """(total, active) parameters of transformers' DeepseekV3ForCausalLM of the config.json,
    built on the meta device (dequantized; Kimi-K2's model_type named as the architecture's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = write_config_dir(name, tmp_path / name, quantization_config=None, model_type="deepseek_v3")
    cfg = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, total - routed // E * (E - K)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_totals_equal_transformers_and_the_card(planned, name, tmp_path):
    p = planned[name]
    total, active = transformers_counts(name, tmp_path)
    assert (p["params_total"], p["params_active"]) == (total, active)
    assert p["params_by_kind"]["other"] == 0 and p["params_by_kind"]["attention"] > 0
    card_total, card_active, _, _ = SIZES[name]
    print(f"{name}: {total / 1e9:.2f} B total, {active / 1e9:.2f} B active")
    # the cards round to "671B / 37B" and "1T / 32B": within 3% (671.03 / 37.55, 1026.41 / 32.86)
    assert abs(total / 1e9 / card_total - 1) < 0.03 and abs(active / 1e9 / card_active - 1) < 0.03
    assert any("quantization_config" in n for n in p["notes"])


@pytest.mark.parametrize("name", ["recipe", "DeepSeek-V3", "Kimi-K2"])
def test_recipe_fits_on_its_h100s(planned, name):
    """examples/gpu/deepseek_v3.yaml on 256 H100 (its own model section, or DeepSeek-V3's
    config.json), and with Kimi-K2's config.json at EP384 on 384 H100."""
    p = planned[name]
    assert p["fits"] and p["phases"]["rollout"]["fits"] and p["phases"]["update"]["fits"]
    assert p["sampler"]["starts"]
    assert planned["recipe"]["params_total"] == planned["DeepSeek-V3"]["params_total"]


def test_recipe_restates_the_real_config_json(tmp_path):
    """Pointed at DeepSeek-V3's (bf16) config.json, the recipe's model section conflicts with
    nothing and stays as it is."""
    from moe_rl.config import load_recipe
    from moe_rl.recipe_source import model_from_checkpoint

    directory = write_config_dir("DeepSeek-V3", tmp_path / "v3", quantization_config=None)
    cfg, given = load_recipe(RECIPE)
    assert model_from_checkpoint(cfg.model, directory, given) == cfg.model


def test_mla_kv_cache_is_the_latent():
    """The rollout engines cache DeepSeek's 512 + 64 latent per layer and token (61 x 576 bf16
    values, on every rollout-TP rank), not per-head keys and values."""
    from moe_rl.convert import model_config_from_hf
    from moe_rl.plan.sampler import kv_bytes_per_token

    m = model_config_from_hf({k: v for k, v in CONFIGS["DeepSeek-V3"].items() if k != "quantization_config"})
    assert kv_bytes_per_token(m, "bf16", 1) == kv_bytes_per_token(m, "bf16", 64) == 61 * 576 * 2
