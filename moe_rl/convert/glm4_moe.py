"""The Hugging Face `Glm4MoeForCausalLM` (GLM-4.5 MoE) layout, for DeepSeek-style models:
sigmoid router with expert bias, shared expert, optional QK-norm (pure torch).

Glm4-MoE is the architecture in both transformers (5.19) and vLLM (0.32) that computes what
megatron computes for these models, configured as `hf_config` writes it:
- attention: GQA, biases on q/k/v (not o) iff `attention_bias` (megatron's add_qkv_bias),
  per-head q/k RMSNorm iff `use_qk_norm`, RoPE on the first `partial_rotary_factor` of each
  head (megatron's rotary_percent; written at top level and in `rope_parameters`, since both
  libraries default to 0.5 when absent), rotate-half style within those dimensions like
  megatron's non-interleaved RoPE; the rest of the head passes through (transformers'
  `apply_rotary_pos_emb`, vLLM's neox-style `get_rope` with rotary_dim = int(D * factor),
  megatron's int(kv_channels * rotary_percent): the same dimensions and frequencies).
- the first `first_k_dense_replace` layers are dense (`intermediate_size`).
- router (`mlp.gate`): sigmoid scores; top-k chosen on scores + `e_score_correction_bias`
  (megatron's `router.expert_bias`, float32); weights are the chosen scores, normalised to
  sum to 1 when k > 1 (`norm_topk_prob`; megatron leaves a single score as it is), times
  `routed_scaling_factor` (megatron's `moe_router_topk_scaling_factor`, applied after the
  normalisation in both);
  `n_group=topk_group=1` (no group-limited routing).
- shared expert: an ungated SwiGLU MLP of `n_shared_experts * moe_intermediate_size`
  added to the routed output, as megatron's `shared_experts` (no `moe_shared_expert_gate`).

Tensors beyond the common map (`hf_layout`), per MoE layer i (prefix model.layers.{i}.):
  mlp.router.expert_bias                 [E] fp32   mlp.gate.e_score_correction_bias
  mlp.shared_experts.linear_fc1.weight   [2S, H]    mlp.shared_experts.{gate,up}_proj.weight
  mlp.shared_experts.linear_fc2.weight   [H, S]     mlp.shared_experts.down_proj.weight
The architecture always has both; a model without them is written with zeros in their place
(zero bias: selection by scores alone; zero shared expert of `moe_intermediate_size`: adds
exactly 0, at the cost of computing it), and importing requires them to be zeros. vLLM's
Glm4MoE has no tied output head, so a tied model also writes `lm_head.weight` (the
embedding's values; `tie_word_embeddings` stays true for transformers).

Multi-token-prediction layers (`num_nextn_predict_layers`, GLM-4.5's speculative-decoding
head, stored as layers num_hidden_layers ...) feed nothing into the main model's logits, and
neither transformers' Glm4MoeForCausalLM nor vLLM without speculative decoding runs them: import
skips their tensors (with a warning), and export writes `num_nextn_predict_layers=0`, since the
learner neither has nor trains them (a stale MTP head would mispredict after training).

Refused (NotImplementedError naming the fields): a softmax router (GLM's router is sigmoid,
and Qwen3-MoE has no shared expert, so a softmax model with a shared expert has no target
in both libraries), and a shared expert size that is not a multiple of the routed experts'.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.hf_layout import (
    HFArchitecture,
    Part,
    TensorSpec,
    as_is,
    common_hf_config,
    common_model_fields,
    gate_up_parts,
    get_field,
    refuse,
    require_fields,
    zero_parts,
)
from moe_rl.convert.megatron_keys import ConvertError

log = logging.getLogger(__name__)
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
NO_BIAS = "model.moe_router_enable_expert_bias=false"
NO_SHARED = "model.moe_shared_expert_intermediate_size=0"


def n_shared_experts(m: ModelConfig) -> int:
    """Glm4-MoE's `n_shared_experts` for the megatron shared expert size (1 when there is
    none: a zero shared expert of `moe_intermediate_size` stands in)."""
    return max(m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size, 1)


class Glm4MoeLayout(HFArchitecture):
    name = "Glm4-MoE"
    architecture = "Glm4MoeForCausalLM"
    model_type = "glm4_moe"

    def check_supported(self, m: ModelConfig) -> None:
        """Raise NotImplementedError, naming the fields, for what Glm4-MoE cannot express."""
        if m.moe_router_score_function != "sigmoid":
            raise NotImplementedError(
                f"model.moe_router_score_function={m.moe_router_score_function!r} with "
                f"model.moe_shared_expert_intermediate_size={m.moe_shared_expert_intermediate_size}: "
                "no Hugging Face architecture served by both transformers and vLLM has a softmax "
                "router and an ungated shared expert (Glm4-MoE routes by sigmoid, Qwen3-MoE has no "
                "shared expert, Qwen2-MoE gates its shared expert); use the sigmoid router or no shared expert"
            )
        self.check_groups(m)
        S, F = m.moe_shared_expert_intermediate_size, m.moe_ffn_hidden_size
        if S % F:
            raise NotImplementedError(
                f"model.moe_shared_expert_intermediate_size={S} is not a multiple of "
                f"model.moe_ffn_hidden_size={F}: Glm4-MoE sizes its shared expert as "
                "n_shared_experts * moe_intermediate_size"
            )

    def check_groups(self, m: ModelConfig) -> None:
        """Group-limited routing: not written by this layout (n_group = topk_group = 1), so a
        model that routes by groups would be served without them."""
        if m.moe_router_num_groups > 1:
            raise NotImplementedError(
                f"model.moe_router_num_groups={m.moe_router_num_groups}: the {self.name} export writes "
                "n_group = topk_group = 1 (every group eligible); group-limited routing converts to the "
                "DeepseekV3 layout (model.multi_latent_attention=true), or set model.moe_router_num_groups=1"
            )

    # ------------------------------------------------------------------ the map

    def layer_parts(self, i: int, rest: str, m: ModelConfig) -> list[Part] | None:
        p = f"model.layers.{i}.mlp."
        E, H, S = m.num_experts, m.hidden_size, m.moe_shared_expert_intermediate_size
        if rest == "mlp.router.expert_bias":
            return [(TensorSpec(p + "gate.e_score_correction_bias", (E,), torch.float32), as_is)]
        if rest == "mlp.shared_experts.linear_fc1.weight":
            return gate_up_parts(p + "shared_experts.", S, H)
        if rest == "mlp.shared_experts.linear_fc2.weight":
            return [(TensorSpec(p + "shared_experts.down_proj.weight", (H, S)), as_is)]
        parts = super().layer_parts(i, rest, m)
        if rest == "mlp.router.weight" and parts is not None:  # what the architecture has and this model lacks: zeros
            zeros = []
            if not m.moe_router_enable_expert_bias:
                zeros.append(TensorSpec(p + "gate.e_score_correction_bias", (E,), torch.float32, NO_BIAS))
            if not S:
                F = m.moe_ffn_hidden_size
                zeros += [TensorSpec(p + "shared_experts.gate_proj.weight", (F, H), zero=NO_SHARED),
                          TensorSpec(p + "shared_experts.up_proj.weight", (F, H), zero=NO_SHARED),
                          TensorSpec(p + "shared_experts.down_proj.weight", (H, F), zero=NO_SHARED)]
            parts = parts + zero_parts(zeros)
        return parts

    def global_parts(self, key: str, m: ModelConfig) -> list[Part] | None:
        parts = super().global_parts(key, m)
        if key == "embedding.word_embeddings.weight" and not m.untie_embeddings_and_output_weights:
            # vLLM's Glm4MoeForCausalLM never ties lm_head to the embedding: write it.
            parts = [*(parts or []), (TensorSpec("lm_head.weight", (m.vocab_size, m.hidden_size)), as_is)]
        return parts

    # ------------------------------------------------------------------ config.json

    def hf_config(self, m: ModelConfig, dtype: torch.dtype, *, bos_token_id: int | None,
                  eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
        """config.json of the Glm4-MoE model (the fields transformers 5.x and vLLM read)."""
        self.check_supported(m)
        cfg = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            **common_hf_config(m, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id),
            "n_routed_experts": m.num_experts,
            "n_shared_experts": n_shared_experts(m),
            "first_k_dense_replace": m.num_dense_layers,
            "norm_topk_prob": m.moe_router_topk > 1,  # megatron renormalises only k > 1 scores
            "routed_scaling_factor": m.moe_router_topk_scaling_factor,
            "n_group": 1,
            "topk_group": 1,
            "use_qk_norm": m.qk_layernorm,
            "partial_rotary_factor": m.rotary_percent,  # both places: both libraries default to 0.5
            "num_nextn_predict_layers": 0,  # the learner has no MTP layers (module docstring)
        }
        cfg["rope_parameters"]["partial_rotary_factor"] = m.rotary_percent
        return cfg

    def ignored_hf_tensor(self, name: str, cfg: dict[str, Any]) -> bool:
        """The multi-token-prediction layers' tensors (layers num_hidden_layers ... + MTP - 1)."""
        match = _LAYER_NAME.match(name)
        first = int(cfg.get("num_hidden_layers") or 0)
        mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        return match is not None and first <= int(match.group(1)) < first + mtp

    def model_config_from_hf(self, cfg: dict[str, Any], base: ModelConfig | None = None, *,
                             notes: list[str] | None = None) -> ModelConfig:
        """Our ModelConfig from a Glm4-MoE config.json dict. Fields HF does not describe
        (training settings) come from `base`. HF always has an expert bias and a shared
        expert: they are taken as on, unless `base` is a sigmoid-router model without them
        (then the files must hold zeros there, which `from_hf` checks).

        With `notes` (the planner's mode), settings the learner cannot honour but that change
        no parameter's shape (group-limited routing, top-k normalisation) are recorded there
        instead of refused. Multi-token-prediction layers are left out either way (module
        docstring): noted with `notes`, else logged as a warning."""
        if cfg.get("model_type") != self.model_type:
            raise ConvertError(f"config.json has model_type={cfg.get('model_type')!r}, not {self.model_type!r}")
        require_fields(cfg, {"hidden_act": ("silu", "silu")}, notes)
        _refuse_unbuilt_math(cfg, notes)
        n_shared = int(get_field(cfg, "n_shared_experts", default=1))
        if n_shared < 1:
            raise NotImplementedError(
                f"config.json n_shared_experts={n_shared}: vLLM cannot serve a zero-size shared expert "
                "(this converter writes n_shared_experts=1 with zero weights instead)"
            )
        fields = common_model_fields(cfg, notes)
        plain_sigmoid = base is not None and base.moe_router_score_function == "sigmoid"
        bias = not (plain_sigmoid and base is not None and not base.moe_router_enable_expert_bias)
        shared = n_shared * fields["moe_ffn_hidden_size"]
        if plain_sigmoid and base is not None and not base.moe_shared_expert_intermediate_size and n_shared == 1:
            shared = 0
        fields.update(
            num_dense_layers=int(get_field(cfg, "first_k_dense_replace", default=1)),
            num_experts=int(get_field(cfg, "n_routed_experts", "num_local_experts")),
            moe_shared_expert_intermediate_size=shared,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=bias,
            qk_layernorm=bool(cfg.get("use_qk_norm", False)),
            rotary_percent=_rotary_percent(cfg),
            moe_router_topk_scaling_factor=_routed_scaling(cfg),
            moe_router_pre_softmax=False,  # sigmoid routing: megatron ignores it
            moe_router_num_groups=1,  # (group-limited routing was refused above)
            moe_router_group_topk=1,
        )
        return dataclasses.replace(base or ModelConfig(), **fields)


def _refuse_unbuilt_math(cfg: dict[str, Any], notes: list[str] | None) -> None:
    """Glm4-MoE settings that change what the model computes but no parameter the learner
    builds: refused (`notes` None) or recorded in `notes` (planning)."""
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp:
        msg = (f"config.json num_nextn_predict_layers={mtp}: the multi-token-prediction layers are "
               "left out (they do not change the model's logits; the learner neither runs nor trains them)")
        if notes is None:
            log.warning(msg)
        else:
            notes.append(msg)
    n_group, topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if topk_group != n_group:
        refuse(
            f"config.json n_group={n_group}, topk_group={topk_group}: group-limited routing is "
            "not supported (only topk_group == n_group, i.e. every group eligible)", notes
        )
    topk = int(get_field(cfg, "num_experts_per_tok"))
    if bool(cfg.get("norm_topk_prob", True)) != (topk > 1):
        refuse(
            f"config.json norm_topk_prob={cfg.get('norm_topk_prob', True)} with "
            f"num_experts_per_tok={topk}: megatron normalises the chosen sigmoid scores exactly "
            f"when more than one expert is chosen (only norm_topk_prob={str(topk > 1).lower()} is "
            "supported)", notes
        )


GLM4_MOE = Glm4MoeLayout()


def _rotary_percent(cfg: dict[str, Any]) -> float:
    """`partial_rotary_factor` (transformers 5 keeps it in `rope_parameters`, older files at
    top level; absent means Glm4-MoE's default 0.5 in transformers and vLLM alike)."""
    rope = cfg.get("rope_parameters") or {}
    rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rotary = 0.5 if rotary is None else float(rotary)
    if not 0.0 < rotary <= 1.0:
        raise ConvertError(f"config.json partial_rotary_factor={rotary}: must be in (0, 1] (the fraction of "
                           "each head that RoPE rotates; GLM-4.5 uses 0.5)")
    return rotary


def _routed_scaling(cfg: dict[str, Any]) -> float:
    """`routed_scaling_factor`; megatron skips a zero factor (transformers would zero the
    routed output), so only positive ones are taken."""
    scale = float(get_field(cfg, "routed_scaling_factor", default=1.0))
    if scale <= 0:
        raise ConvertError(f"config.json routed_scaling_factor={scale}: must be > 0 (GLM-4.5 uses 2.5)")
    return scale
