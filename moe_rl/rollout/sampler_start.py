"""Starting an engine: its Hugging Face weights directory and the configured backend."""

from __future__ import annotations

from pathlib import Path

from moe_rl.config import ConfigError, RLConfig, SamplerConfig
from moe_rl.sampler import Sampler, engine_config, make_sampler


def sampler_weights_dir(run_dir: Path, source: Path | None, trust_checkpoint: bool, convert: bool = True) -> Path:
    """The Hugging Face directory the engines start from: `source` itself when it is one,
    else `<run_dir>/sampler_hf` converted from the megatron checkpoint `source` (by the
    caller with `convert`; the others only name it). `trust_checkpoint`: the run's
    `run.trust_checkpoint` (a checkpoint without a manifest is read only with it)."""
    from moe_rl.convert import megatron_to_hf

    if source is None:
        raise ConfigError("run.init_checkpoint is required (the sampler needs starting weights)")
    if (source / "config.json").is_file():
        return source
    hf_dir = run_dir / "sampler_hf"
    if convert:
        megatron_to_hf(source, hf_dir, force=True, trust=trust_checkpoint)  # as the learner read it
    return hf_dir


def build_sampler(sampler: SamplerConfig, rl: RLConfig, seed: int, hf_dir: Path, eos_token_ids: list[int],
                  group_env: dict[str, str] | None = None) -> Sampler:
    """The engine the `sampler` section asks for (`moe_rl.sampler.engine_config`, seeded with
    the run's `seed`) on `hf_dir`, as this rank's share of its rollout group (`group_env`:
    that group's world, rollout TP > 1)."""
    return make_sampler(hf_dir, engine_config(sampler, rl, seed, eos_token_ids, group_env=group_env))
