"""Starting an engine: its Hugging Face weights directory and the configured backend."""

from __future__ import annotations

from pathlib import Path

from moe_rl.config import Config, ConfigError
from moe_rl.sampler import Sampler, engine_config, make_sampler


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
        megatron_to_hf(source, hf_dir, force=True, trust=cfg.run.trust_checkpoint)  # as the learner read it
    return hf_dir


def build_sampler(cfg: Config, hf_dir: Path, eos_token_ids: list[int], group_env: dict[str, str] | None = None) -> Sampler:
    """The configured engine (`moe_rl.sampler.engine_config`) on `hf_dir`, as this rank's
    share of its rollout group (`group_env`: that group's world, rollout TP > 1)."""
    return make_sampler(hf_dir, engine_config(cfg, eos_token_ids, group_env=group_env))
