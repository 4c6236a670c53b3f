"""Which Hugging Face layout a model converts to, and the converter's functions dispatched
on it (the names `moe_rl.convert` exports).

    layout_for(model_cfg)        # megatron -> HF: from the ModelConfig
    layout_for_hf(config_json)   # HF -> megatron: from config.json's model_type / architectures

Multi-latent attention means DeepseekV3 (DeepSeek-V3, Kimi-K2); otherwise a sigmoid router
or a shared expert means the DeepSeek-style family, written as Glm4-MoE; anything else is
written as Qwen3-MoE (the layout the learner's default model matches).
Each layout refuses, naming the fields, what it cannot express.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.deepseek_v3 import DEEPSEEK_V3
from moe_rl.convert.glm4_moe import GLM4_MOE
from moe_rl.convert.hf_layout import HFArchitecture, TensorSpec
from moe_rl.convert.megatron_keys import ConvertError
from moe_rl.convert.qwen3_moe import QWEN3_MOE

LAYOUTS: tuple[HFArchitecture, ...] = (QWEN3_MOE, GLM4_MOE, DEEPSEEK_V3)


def layout_for(m: ModelConfig) -> HFArchitecture:
    """The HF layout the model is written in (megatron -> HF)."""
    if m.multi_latent_attention:
        return DEEPSEEK_V3
    if m.moe_router_score_function == "sigmoid" or m.moe_shared_expert_intermediate_size:
        return GLM4_MOE
    return QWEN3_MOE


def layout_for_hf(cfg: dict[str, Any]) -> HFArchitecture:
    """The layout of an HF directory from its config.json dict (HF -> megatron)."""
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    for layout in LAYOUTS:
        known = model_type in (layout.model_type, *layout.model_type_aliases)
        if known or (model_type is None and layout.architecture in archs):
            return layout
    names = ", ".join(f"{lay.model_type!r} ({lay.architecture})" for lay in LAYOUTS)
    raise ConvertError(
        f"config.json has model_type={model_type!r} (architectures {archs}); supported: {names}"
    )


def check_supported(m: ModelConfig) -> None:
    """NotImplementedError naming the fields when the model has no HF layout."""
    layout_for(m).check_supported(m)


def hf_specs(key: str, m: ModelConfig) -> list[TensorSpec]:
    return layout_for(m).hf_specs(key, m)


def hf_specs_all(m: ModelConfig) -> list[TensorSpec]:
    return layout_for(m).hf_specs_all(m)


def hf_views(key: str, w: torch.Tensor, m: ModelConfig) -> list[torch.Tensor | None]:
    return layout_for(m).hf_views(key, w, m)


def to_hf(key: str, tensor: torch.Tensor, m: ModelConfig,
          dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    return layout_for(m).to_hf(key, tensor, m, dtype)


def from_hf(key: str, fetch: Callable[[str], torch.Tensor], m: ModelConfig) -> torch.Tensor:
    return layout_for(m).from_hf(key, fetch, m)


def hf_config(m: ModelConfig, dtype: torch.dtype, *, bos_token_id: int | None,
              eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
    return layout_for(m).hf_config(m, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                                   pad_token_id=pad_token_id)


def model_config_from_hf(cfg: dict[str, Any], base: ModelConfig | None = None, *,
                         notes: list[str] | None = None) -> ModelConfig:
    """Our ModelConfig from a config.json dict of any supported layout. With `notes` (the
    planner's mode), settings that change the math but no parameter's shape are recorded
    there instead of refused."""
    return layout_for_hf(cfg).model_config_from_hf(cfg, base, notes=notes)
