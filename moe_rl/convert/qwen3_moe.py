"""The Hugging Face `Qwen3MoeForCausalLM` layout (pure torch; no megatron, no transformers).

The tensor map is the one every layout shares (`hf_layout`): GQA attention with QK-norm,
dense SwiGLU MLPs in the first `num_dense_layers` layers (`mlp_only_layers`), routed SwiGLU
experts behind a softmax router: `norm_topk_prob=true` renormalises the top-k
probabilities, which is megatron's softmax over the k selected logits
(`moe_router_pre_softmax=false`); `norm_topk_prob=false` keeps the top-k of the softmax over
all experts, which is megatron's `moe_router_pre_softmax=true`.

Not representable in Qwen3-MoE, refused by `check_supported` (never silently dropped):
shared experts (transformers' Qwen3MoeForCausalLM has none), the sigmoid router / expert
bias (Qwen3 routes by softmax) -- both go to the Glm4-MoE layout instead (`layouts.py`) --
disabled QK-norm with a softmax router (Qwen3 always normalises q and k), q/k/v biases
(transformers' Qwen3-MoE gives o_proj a bias too when `attention_bias` is set, vLLM's does
not, and the learner has none), partial rotary and a top-k scaling factor (Qwen3-MoE has
neither). From config.json: `decoder_sparse_step` other than 1 and `mlp_only_layers` other
than leading layers (the learner's dense layers are the first `num_dense_layers`).

The module-level functions are this layout's; `moe_rl.convert` exports the dispatching ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.hf_layout import (
    HFArchitecture,
    TensorSpec,
    common_hf_config,
    common_model_fields,
    generation_config,
    get_field,
    refuse,
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


class Qwen3MoeLayout(HFArchitecture):
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
        if m.moe_router_num_groups > 1:
            raise NotImplementedError(
                f"model.moe_router_num_groups={m.moe_router_num_groups}: Qwen3-MoE has no group-limited "
                "routing (transformers and vLLM would route over every expert); set model.moe_router_num_groups=1"
            )
        if not m.qk_layernorm:
            raise NotImplementedError(
                "model.qk_layernorm=false: Qwen3-MoE always applies RMSNorm to queries and keys "
                "(an all-ones norm weight is not the identity), and Glm4-MoE, which can leave it "
                "out, routes by sigmoid (model.moe_router_score_function=softmax here); not representable"
            )
        unsupported = {"add_qkv_bias": (m.add_qkv_bias, False), "rotary_percent": (m.rotary_percent, 1.0),
                       "moe_router_topk_scaling_factor": (m.moe_router_topk_scaling_factor, 1.0)}
        for field, (got, want) in unsupported.items():
            if got != want:
                raise NotImplementedError(
                    f"model.{field}={got} with a softmax router: Qwen3-MoE has no such setting and "
                    f"Glm4-MoE routes by sigmoid; use model.{field}={want} or the sigmoid router"
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
            "norm_topk_prob": not m.moe_router_pre_softmax,  # module docstring
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
        change no parameter's shape (sliding window, activation, top-1 renormalisation, RoPE
        scaling, fp16) are recorded there instead of refused; the others still raise."""
        if cfg.get("model_type") != self.model_type:
            raise ConvertError(f"config.json has model_type={cfg.get('model_type')!r}, not {self.model_type!r}")
        _refuse_unsupported(cfg, notes)
        dense = sorted(int(x) for x in cfg.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise NotImplementedError(
                f"config.json mlp_only_layers={dense}: only leading dense layers [0, 1, ..., k-1] are "
                "supported (the learner's dense layers are the first model.num_dense_layers)"
            )
        fields = dict(
            common_model_fields(cfg, notes),
            num_dense_layers=len(dense),
            num_experts=int(get_field(cfg, "num_experts", "num_local_experts")),
            moe_shared_expert_intermediate_size=0,
            moe_router_score_function="softmax",
            moe_router_enable_expert_bias=False,
            qk_layernorm=True,
            # transformers' Qwen3MoeConfig defaults norm_topk_prob to false
            moe_router_pre_softmax=not bool(cfg.get("norm_topk_prob", False)),
            moe_router_num_groups=1,  # Qwen3-MoE routes over every expert
            moe_router_group_topk=1,
        )
        return dataclasses.replace(base or ModelConfig(), **fields)


def _refuse_unsupported(cfg: dict[str, Any], notes: list[str] | None) -> None:
    """Qwen3-MoE config.json settings the learner cannot build: refused, naming the field
    (with `notes`, the shape-neutral ones are recorded there instead)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step != 1:
        raise NotImplementedError(
            f"config.json decoder_sparse_step={step}: only 1 is supported (every layer outside "
            "mlp_only_layers an MoE layer); the learner cannot interleave dense and MoE layers"
        )
    if cfg.get("attention_bias"):
        raise NotImplementedError(
            "config.json attention_bias=true: transformers' Qwen3-MoE then adds an o_proj bias too, "
            "which vLLM and the learner do not have; only attention_bias=false is supported"
        )
    rope = cfg.get("rope_parameters") or {}
    rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if rotary not in (None, 1, 1.0):
        raise NotImplementedError(
            f"config.json partial_rotary_factor={rotary}: Qwen3-MoE rotates whole heads; remove the field"
        )
    if int(get_field(cfg, "num_experts_per_tok")) == 1 and cfg.get("norm_topk_prob"):
        refuse("config.json norm_topk_prob=true with num_experts_per_tok=1: the chosen expert's weight "
               "would be 1, but megatron's top-1 softmax router needs pre-softmax (weight = its "
               "probability); only norm_topk_prob=false is supported at top-1", notes)
    require_fields(cfg, {"use_sliding_window": (False, False), "hidden_act": ("silu", "silu")}, notes)


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
