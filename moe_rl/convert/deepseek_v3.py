"""The Hugging Face `DeepseekV3ForCausalLM` layout (DeepSeek-V3 / V3.1 / R1, Kimi-K2; pure
torch): multi-latent attention, group-limited sigmoid routing with expert bias, shared
experts, leading dense layers, YaRN RoPE, and multi-token-prediction (MTP) layers.

What megatron computes for these models, configured as `model_config_from_hf` maps them,
is what transformers' DeepseekV3ForCausalLM (5.19) computes:
- attention (megatron's MLASelfAttention): queries through `q_a_proj` -> `q_a_layernorm` ->
  `q_b_proj` (or `q_proj` when q_lora_rank is null), per head [qk_nope | qk_rope] dims; keys
  and values from the `kv_a_proj_with_mqa` latent [kv_lora_rank | shared RoPE key], normed
  (`kv_a_layernorm`) and expanded by `kv_b_proj`, per head [k_nope | v]. megatron stores the
  same rows in the same order, so every tensor is a rename. RoPE on the rope dims only,
  interleaved pairs (`rope_interleave=true`, which megatron's MLA always applies); YaRN with
  factor, original_max_position_embeddings, beta_fast/slow, and the concentration factor
  mscale / mscale_all_dim (transformers uses mscale only together with mscale_all_dim, so
  a lone mscale maps to 1), and the softmax scale times (0.1 mscale_all_dim ln factor + 1)^2.
- router (`mlp.gate`): sigmoid scores; groups of n_routed_experts / n_group experts ranked
  by the sum of their top-2 biased scores, the best `topk_group` kept, the top-k of the
  biased scores within them (megatron sums the top topk / topk_group per group: equal when
  that is 2, which DeepSeek-V3's 8 / 4 is); weights are the unbiased chosen scores,
  normalised over the k (`norm_topk_prob`, megatron: exactly when k > 1), times
  `routed_scaling_factor`. `e_score_correction_bias` is megatron's `router.expert_bias`.
- the MoE block's tensors are named as Glm4-MoE's (`glm4_moe`: gate, expert bias, experts,
  `n_shared_experts * moe_intermediate_size` shared expert); the first
  `first_k_dense_replace` layers are dense.

MTP: the `num_nextn_predict_layers` layers (stored as layers num_hidden_layers ...) feed
nothing into the main model's logits, and transformers does not build them. The learner
does not build them either: import skips their tensors (logged), so they stay frozen and out
of the RL loss, and every export copies them unchanged from the source directory
(`hf_export`), keeping `num_nextn_predict_layers` in config.json, so the directory is complete.

Refused, naming the field: another scoring_func / topk_method, group-limited routing whose
per-group sum is not over the top 2, `rope_interleave=false`, attention biases, tied
embeddings, num_key_value_heads != num_attention_heads, moe_layer_freq != 1, rms_norm_eps !=
1e-6 (transformers' latent norms always use 1e-6), another rope type, a YaRN
attention_factor or truncate=false, and mscale_all_dim without mscale.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.glm4_moe import Glm4MoeLayout, n_shared_experts
from moe_rl.convert.hf_layout import (
    Part,
    TensorSpec,
    as_is,
    common_hf_config,
    common_model_fields,
    get_field,
    refuse,
    require_fields,
)
from moe_rl.convert.megatron_keys import ConvertError, megatron_shape

log = logging.getLogger(__name__)
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")

_MLA_RENAMES = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm / kv_a_layernorm with this eps whatever rms_norm_eps is."""


class DeepseekV3Layout(Glm4MoeLayout):
    name = "DeepSeek-V3"
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    model_type_aliases = ("kimi_k2",)  # Kimi-K2's config.json (DeepseekV3ForCausalLM)
    carries_mtp = True  # exports copy the source's MTP layers (module docstring)

    def check_supported(self, m: ModelConfig) -> None:
        """Raise NotImplementedError, naming the field, for what DeepseekV3 cannot express."""
        wrong = {"multi_latent_attention": (m.multi_latent_attention, True),
                 "moe_router_score_function": (m.moe_router_score_function, "sigmoid"),
                 "untie_embeddings_and_output_weights": (m.untie_embeddings_and_output_weights, True),
                 "rotary_percent": (m.rotary_percent, 1.0), "norm_epsilon": (m.norm_epsilon, LATENT_NORM_EPS)}
        for field, (got, want) in wrong.items():
            if got != want:
                raise NotImplementedError(f"model.{field}={got!r}: DeepseekV3ForCausalLM needs {want!r}")
        super().check_supported(m)

    def check_groups(self, m: ModelConfig) -> None:
        """Group-limited routing as transformers and vLLM compute it (`_group_fields`)."""
        n_group, topk_group, topk = m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk
        if n_group > 1 and not _groups_as_transformers(n_group, topk_group, topk, m.num_experts):
            raise NotImplementedError(
                f"model.moe_router_num_groups={n_group}, model.moe_router_group_topk={topk_group} with "
                f"model.moe_router_topk={topk}, model.num_experts={m.num_experts}: transformers and vLLM rank "
                "groups by their top-2 scores and megatron by their top (moe_router_topk / moe_router_group_topk); "
                "exportable when that is 2 and the groups divide the experts"
            )

    # ------------------------------------------------------------------ the map

    def layer_parts(self, i: int, rest: str, m: ModelConfig) -> list[Part] | None:
        if rest in _MLA_RENAMES:
            shape = megatron_shape(f"decoder.layers.{i}.{rest}", m)
            return [(TensorSpec(f"model.layers.{i}.{_MLA_RENAMES[rest]}", shape), as_is)]
        return super().layer_parts(i, rest, m)

    def ignored_hf_tensor(self, name: str, cfg: dict[str, Any]) -> bool:
        """The MTP layers' tensors (layers num_hidden_layers ... + MTP - 1)."""
        return mtp_layer_of(name, cfg) is not None

    # ------------------------------------------------------------------ config.json

    def hf_config(self, m: ModelConfig, dtype: torch.dtype, *, bos_token_id: int | None,
                  eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
        """config.json of the DeepseekV3 model (the fields transformers 5.x and vLLM read).
        A model without a source directory has no MTP layers: num_nextn_predict_layers 0."""
        self.check_supported(m)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        if m.rope_type == "yarn":
            rope.update(rope_type="yarn", factor=m.rotary_scaling_factor, beta_fast=m.beta_fast,
                        beta_slow=m.beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
                        original_max_position_embeddings=m.original_max_position_embeddings)
        cfg = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            **common_hf_config(m, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
            "head_dim": m.qk_pos_emb_head_dim,
            "q_lora_rank": m.q_lora_rank or None,
            "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_head_dim,
            "qk_rope_head_dim": m.qk_pos_emb_head_dim,
            "v_head_dim": m.v_head_dim,
            "rope_interleave": True,
            "rope_parameters": rope,
            "n_routed_experts": m.num_experts,
            "n_shared_experts": n_shared_experts(m),
            "first_k_dense_replace": m.num_dense_layers,
            "moe_layer_freq": 1,
            "norm_topk_prob": m.moe_router_topk > 1,  # megatron renormalises only k > 1 scores
            "routed_scaling_factor": m.moe_router_topk_scaling_factor,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": m.moe_router_num_groups,
            "topk_group": m.moe_router_group_topk,
            "num_nextn_predict_layers": 0,
        }
        return cfg

    def model_config_from_hf(self, cfg: dict[str, Any], base: ModelConfig | None = None, *,
                             notes: list[str] | None = None) -> ModelConfig:
        """Our ModelConfig from a DeepseekV3 config.json dict (module docstring); training
        settings come from `base`. With `notes` (the planner's mode) settings that change the
        math but no parameter's shape are recorded there instead of refused."""
        if cfg.get("model_type") not in (self.model_type, *self.model_type_aliases):
            raise ConvertError(f"config.json has model_type={cfg.get('model_type')!r}, not {self.model_type!r}")
        _refuse_unbuilt_math(cfg, notes)
        heads = int(get_field(cfg, "num_attention_heads"))
        kv_heads = int(get_field(cfg, "num_key_value_heads", default=heads))
        if kv_heads != heads:
            raise NotImplementedError(f"config.json num_key_value_heads={kv_heads}: MLA expands keys and values "
                                      f"per head; only num_attention_heads ({heads}) is supported")
        n_shared = int(get_field(cfg, "n_shared_experts", default=1))
        if n_shared < 1:
            raise NotImplementedError(f"config.json n_shared_experts={n_shared}: only >= 1 is supported")
        mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        plain = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": _rope_theta(cfg)},
                 "rope_scaling": None, "attention_bias": False}
        fields, mla = common_model_fields(plain, notes), _mla_fields(cfg)
        fields.update(
            num_query_groups=heads,
            kv_channels=mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"],  # a query / key head
            qk_layernorm=True,  # megatron's MLA q/kv latent norms
            # (defaults for fields config.json leaves out: transformers' DeepseekV3Config's, as vLLM reads them)
            num_dense_layers=int(get_field(cfg, "first_k_dense_replace", default=3)),
            num_experts=int(get_field(cfg, "n_routed_experts")),
            moe_shared_expert_intermediate_size=n_shared * fields["moe_ffn_hidden_size"],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=float(get_field(cfg, "routed_scaling_factor", default=2.5)),
            moe_router_pre_softmax=False,  # sigmoid routing: megatron ignores it
            rotary_percent=1.0,
            mtp_num_layers=mtp,
            **_group_fields(cfg, fields["moe_router_topk"], int(get_field(cfg, "n_routed_experts")), notes),
            **mla,
            **_yarn_fields(cfg, notes),
        )
        if fields["moe_router_topk_scaling_factor"] <= 0:
            raise ConvertError("config.json routed_scaling_factor must be > 0")
        if mtp:
            msg = (f"config.json num_nextn_predict_layers={mtp}: the multi-token-prediction layers are not built "
                   "by the learner: frozen, out of the RL loss, and copied unchanged into every export")
            if notes is None:
                log.warning(msg)
            else:
                notes.append(msg + " (not counted)")
        return dataclasses.replace(base or ModelConfig(), **fields)


DEEPSEEK_V3 = DeepseekV3Layout()


def mtp_layer_of(name: str, cfg: dict[str, Any]) -> int | None:
    """The layer number of an MTP layer's tensor `name`; None for any other tensor."""
    match = _LAYER_NAME.match(name)
    first = int(cfg.get("num_hidden_layers") or 0)
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if match and first <= int(match.group(1)) < first + mtp:
        return int(match.group(1))
    return None


def _rope_theta(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _refuse_unbuilt_math(cfg: dict[str, Any], notes: list[str] | None) -> None:
    """DeepseekV3 settings that change the math but that megatron cannot build: refused, or
    recorded in `notes` (planning)."""
    require_fields(cfg, {"hidden_act": ("silu", "silu"), "scoring_func": ("sigmoid", "sigmoid"),
                         "topk_method": ("noaux_tc", "noaux_tc"), "rope_interleave": (True, True),
                         "moe_layer_freq": (1, 1), "rms_norm_eps": (LATENT_NORM_EPS, LATENT_NORM_EPS)}, notes)
    quant = cfg.get("quantization_config")
    if quant:
        refuse(f"config.json quantization_config (quant_method={quant.get('quant_method')!r}): the weights are "
               "stored quantized; convert them to bf16 first (DeepSeek's fp8_cast_bf16.py) and drop the field", notes)
    if cfg.get("attention_bias"):
        raise NotImplementedError("config.json attention_bias=true: megatron's MLA has no projection biases; "
                                  "only attention_bias=false is supported")
    if cfg.get("tie_word_embeddings"):
        raise NotImplementedError("config.json tie_word_embeddings=true: only untied output heads are supported "
                                  "for DeepseekV3")
    topk = int(get_field(cfg, "num_experts_per_tok"))
    if bool(cfg.get("norm_topk_prob", True)) != (topk > 1):
        refuse(f"config.json norm_topk_prob={cfg.get('norm_topk_prob', True)} with num_experts_per_tok={topk}: "
               "megatron normalises the chosen sigmoid scores exactly when more than one expert is chosen "
               f"(only norm_topk_prob={str(topk > 1).lower()} is supported)", notes)


def _groups_as_transformers(n_group: int, topk_group: int, topk: int, experts: int) -> bool:
    """Group-limited routing that megatron and transformers / vLLM compute alike: transformers
    ranks groups by their top-2 scores, megatron by their top (topk / topk_group)."""
    return experts % n_group == 0 and topk % topk_group == 0 and topk // topk_group == 2


def _group_fields(cfg: dict[str, Any], topk: int, experts: int, notes: list[str] | None) -> dict[str, int]:
    """moe_router_num_groups / moe_router_group_topk for n_group / topk_group (1 / 1 when
    every group is eligible: the same routing without the group step)."""
    n_group, topk_group = int(cfg.get("n_group", 8) or 1), int(cfg.get("topk_group", 4) or 1)  # (transformers')
    if topk_group >= n_group:
        return {"moe_router_num_groups": 1, "moe_router_group_topk": 1}
    if not _groups_as_transformers(n_group, topk_group, topk, experts):
        refuse(f"config.json n_group={n_group}, topk_group={topk_group} with num_experts_per_tok={topk}, "
               f"n_routed_experts={experts}: transformers ranks groups by their top-2 scores and megatron by "
               "their top (num_experts_per_tok / topk_group); supported when that is 2 and n_group divides "
               "the experts", notes)
    return {"moe_router_num_groups": n_group, "moe_router_group_topk": topk_group}


def _mla_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        multi_latent_attention=True,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(get_field(cfg, "kv_lora_rank")),
        qk_head_dim=int(get_field(cfg, "qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(get_field(cfg, "qk_rope_head_dim")),
        v_head_dim=int(get_field(cfg, "v_head_dim")),
    )


def _yarn_fields(cfg: dict[str, Any], notes: list[str] | None) -> dict[str, Any]:
    """ModelConfig RoPE fields from `rope_parameters` (transformers 5) or `rope_scaling`."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(field) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_type": "rope"}
    if kind != "yarn":
        refuse(f"config.json {field} has rope_type={kind!r}: only default and yarn are supported", notes)
        return {"rope_type": "rope"}
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        refuse(f"config.json {field}: attention_factor / truncate=false are not supported (megatron derives the "
               "factor from mscale / mscale_all_dim and rounds the correction range)", notes)
    mscale, mscale_all_dim = float(rope.get("mscale") or 0), float(rope.get("mscale_all_dim") or 0)
    if mscale_all_dim and not mscale:
        refuse(f"config.json {field} mscale_all_dim={mscale_all_dim} without mscale: not supported", notes)
    if not (mscale and mscale_all_dim):  # transformers then uses 0.1 ln(factor) + 1 (mscale 1)
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(get_field(rope, "factor")),
        original_max_position_embeddings=int(get_field(rope, "original_max_position_embeddings")),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=mscale, mscale_all_dim=mscale_all_dim,
    )
