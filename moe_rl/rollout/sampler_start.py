"""Starting an engine: its Hugging Face weights directory and the configured backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moe_rl.config import Config, ConfigError
from moe_rl.rollout.placement import EnginePlacement
from moe_rl.sampler import Sampler, make_sampler
from moe_rl.sampler.precision import resolve_precision


def sampler_weights_dir(cfg: Config, run_dir: Path, source: Path | None, convert: bool = True) -> Path:
    """The Hugging Face directory the engines start from: `source` itself when it is one,
    else `<run_dir>/sampler_hf` converted from the megatron checkpoint `source` (by the
    caller with `convert`; the others only name it)."""
    from moe_rl.convert import megatron_to_hf

    if source is None:
        raise ConfigError("run.init_checkpoint is required (the sampler needs starting weights)")
    if (source / "config.json").is_file():
        return source
    hf_dir = run_dir / "sampler_hf"
    if convert:
        megatron_to_hf(source, hf_dir, force=True)
    return hf_dir


def build_sampler(cfg: Config, hf_dir: Path, eos_token_ids: list[int], placement: EnginePlacement,
                  group_env: dict[str, str] | None = None) -> Sampler:
    """The configured backend on `hf_dir`, as this rank's share of its rollout group."""
    s = cfg.sampler
    opts: dict[str, Any] = {}
    if s.backend == "vllm":
        opts = {"in_process": s.in_process, "kv_cache_gib": s.vllm_kv_cache_gib,
                "gpu_memory_utilization": s.gpu_memory_utilization,
                "return_routed_experts": cfg.rl.replay == "R3"}
        if s.sleep_between_steps:
            if not torch.cuda.is_available():
                raise ConfigError("sampler.sleep_between_steps needs a GPU (vLLM's sleep mode frees GPU memory; "
                                  "there is none to free on CPU)")
            opts["enable_sleep_mode"] = True
        if placement.ranks_per_engine > 1:
            opts.update(tensor_parallel_size=placement.ranks_per_engine,
                        distributed_executor_backend="external_launcher", group_env=group_env)
        if s.expert_parallel:
            opts["enable_expert_parallel"] = True
    elif torch.cuda.is_available():  # the transformers sampler on this rank's GPU
        opts["device"] = f"cuda:{torch.cuda.current_device()}"
    try:
        precision = resolve_precision(s.precision, torch.cuda.is_available())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return make_sampler(s.backend, hf_dir, precision=precision, seed=cfg.run.seed,
                        eos_token_id=eos_token_ids, **opts)
