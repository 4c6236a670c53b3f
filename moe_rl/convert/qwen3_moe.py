"""The Hugging Face `Qwen3MoeForCausalLM` layout (pure torch; no megatron, no transformers).

The tensor map is the one every layout shares (`hf_layout`): GQA attention with QK-norm,
dense SwiGLU MLPs in the first `num_dense_layers` layers (`mlp_only_layers`), routed SwiGLU
experts behind a softmax router with renormalised top-k (`norm_topk_prob=true`: megatron's
softmax over the k selected logits is the same thing).

Not representable in Qwen3-MoE, refused by `check_supported` (never silently dropped):
shared experts (transformers' Qwen3MoeForCausalLM has none), the sigmoid router / expert
bias (Qwen3 routes by softmax) -- both go to the Glm4-MoE layout instead (`layouts.py`) --
and disabled QK-norm with a softmax router (Qwen3 always normalises q and k).

The module-level functions are this layout's; `moe_rl.convert` exports the dispatching ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.hf_layout import (
    HFLayout,
    TensorSpec,
    common_hf_config,
    common_model_fields,
    generation_config,
    get_field,
    require_fields,
)
from moe_rl.convert.megatron_keys import (
    ConvertError,
    canonical_key,
    check_shape,
    is_model_key,
    is_moe_layer,
    megatron_shape,
    megatron_specs,
)

__all__ = [
    "QWEN3_MOE",
    "ConvertError",
    "Qwen3MoeLayout",
    "TensorSpec",
    "canonical_key",
    "check_shape",
    "check_supported",
    "from_hf",
    "generation_config",
    "hf_config",
    "hf_specs",
    "hf_specs_all",
    "hf_views",
    "is_model_key",
    "is_moe_layer",
    "megatron_shape",
    "megatron_specs",
    "model_config_from_hf",
    "to_hf",
]


class Qwen3MoeLayout(HFLayout):
    name = "Qwen3-MoE"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"

    def check_supported(self, m: ModelConfig) -> None:
        """Raise NotImplementedError, naming the field, for what Qwen3-MoE cannot express."""
        if m.moe_shared_expert_intermediate_size:
            raise NotImplementedError(
                f"model.moe_shared_expert_intermediate_size={m.moe_shared_expert_intermediate_size}: "
                "Qwen3-MoE has no shared expert (transformers' Qwen3MoeForCausalLM would ignore the "
                "tensors and compute a different model); shared experts convert to the Glm4-MoE layout"
            )
        if m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias:
            raise NotImplementedError(
                f"model.moe_router_score_function={m.moe_router_score_function!r} / "
                f"model.moe_router_enable_expert_bias={m.moe_router_enable_expert_bias}: Qwen3-MoE "
                "routes by softmax with renormalised top-k and has no expert bias; sigmoid routers "
                "convert to the Glm4-MoE layout"
            )
        if not m.qk_layernorm:
            raise NotImplementedError(
                "model.qk_layernorm=false: Qwen3-MoE always applies RMSNorm to queries and keys "
                "(an all-ones norm weight is not the identity), and Glm4-MoE, which can leave it "
                "out, routes by sigmoid (model.moe_router_score_function=softmax here); not representable"
            )

    def hf_config(self, m: ModelConfig, dtype: torch.dtype, *, bos_token_id: int | None,
                  eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
        """config.json of the Qwen3-MoE model (the fields transformers 5.x and vLLM read)."""
        self.check_supported(m)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            **common_hf_config(m, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
            "num_experts": m.num_experts,
            "norm_topk_prob": True,  # megatron's softmax over the top-k logits == renormalised top-k
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(m.num_dense_layers)),
            "use_sliding_window": False,
            "sliding_window": None,
        }

    def model_config_from_hf(self, cfg: dict[str, Any], base: ModelConfig | None = None, *,
                             notes: list[str] | None = None) -> ModelConfig:
        """Our ModelConfig from a Qwen3-MoE config.json dict. Fields HF does not describe
        (training settings: aux-loss coefficient, dispatcher, init) come from `base`.

        With `notes` (the planner's mode), settings the learner cannot honour but that
        change no parameter's shape (sliding window, activation, top-k normalisation, RoPE
        scaling, fp16) are recorded there instead of refused; shape-changing ones still raise."""
        if cfg.get("model_type") != self.model_type:
            raise ConvertError(f"config.json has model_type={cfg.get('model_type')!r}, not {self.model_type!r}")
        require_fields(cfg, {"decoder_sparse_step": (1, 1)})
        require_fields(cfg, {
            "use_sliding_window": (False, False),
            "hidden_act": ("silu", "silu"),
            "norm_topk_prob": (False, True),
        }, notes)
        dense = sorted(int(x) for x in cfg.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise NotImplementedError(
                f"config.json mlp_only_layers={dense}: only leading dense layers [0, 1, ..., k-1] are supported"
            )
        fields = dict(
            common_model_fields(cfg, notes),
            num_dense_layers=len(dense),
            num_experts=int(get_field(cfg, "num_experts", "num_local_experts")),
            moe_shared_expert_intermediate_size=0,
            moe_router_score_function="softmax",
            moe_router_enable_expert_bias=False,
            qk_layernorm=True,
        )
        return dataclasses.replace(base or ModelConfig(), **fields)


QWEN3_MOE = Qwen3MoeLayout()

# This layout's map as functions (the names this module has always had).
check_supported = QWEN3_MOE.check_supported
hf_specs = QWEN3_MOE.hf_specs
hf_specs_all = QWEN3_MOE.hf_specs_all
hf_views = QWEN3_MOE.hf_views
to_hf = QWEN3_MOE.to_hf
from_hf = QWEN3_MOE.from_hf
hf_config = QWEN3_MOE.hf_config
model_config_from_hf = QWEN3_MOE.model_config_from_hf
