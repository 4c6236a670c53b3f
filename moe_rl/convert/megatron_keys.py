"""The learner's global megatron tensors: keys, global shapes, aliases (pure torch).

A "megatron key" is a dist_checkpointing ShardedTensor key with its global shape: what a
checkpoint directory stores and what `moe_rl.learner.gather.iter_full_tensors` yields.
The set of keys follows from the ModelConfig alone, whatever Hugging Face layout the model
is later written in. Per layer i (global numbering; layers < num_dense_layers are dense):

  decoder.layers.{i}.                          shape
  self_attention.linear_qkv.layer_norm_weight  [H]
  self_attention.linear_qkv.weight             [G*(Q/G+2)*D, H]   rows per group: q heads, k, v
  self_attention.linear_qkv.bias               [G*(Q/G+2)*D]      same order (add_qkv_bias)
  self_attention.{q,k}_layernorm.weight        [D]                (qk_layernorm)
  self_attention.linear_proj.weight            [H, Q*D]
  mlp.linear_fc1.layer_norm_weight             [H]
  mlp.linear_fc1.weight             (dense)    [2F, H]            [gate; up]
  mlp.linear_fc2.weight             (dense)    [H, F]
  mlp.router.weight                 (MoE)      [E, H]
  mlp.router.expert_bias            (MoE)      [E] fp32           (moe_router_enable_expert_bias)
  mlp.experts.experts.linear_fc1.weight        [E, 2Fe, H]        global expert ids, [gate; up]
  mlp.experts.experts.linear_fc2.weight        [E, H, Fe]
  mlp.shared_experts.linear_fc1.weight         [2S, H]            (S = shared expert size > 0)
  mlp.shared_experts.linear_fc2.weight         [H, S]
plus embedding.word_embeddings.weight [V, H], decoder.final_layernorm.weight [H] and
output_layer.weight [V, H] (absent when the embeddings are tied).

Multi-latent attention (model.multi_latent_attention) replaces the attention keys with
(N heads, qk = qk_head_dim + qk_pos_emb_head_dim per head, rq / rkv the latent ranks):

  self_attention.linear_qkv.layer_norm_weight  [H]                the input norm (canonical name)
  self_attention.linear_q_proj.weight          [N*qk, H]          (q_lora_rank 0)
  self_attention.linear_q_down_proj.weight     [rq, H]            (q_lora_rank rq > 0)
  self_attention.q_layernorm.weight            [rq]               (q_lora_rank rq > 0)
  self_attention.linear_q_up_proj.weight       [N*qk, rq]         (q_lora_rank rq > 0)
  self_attention.linear_kv_down_proj.weight    [rkv + rope, H]    [latent; shared RoPE key]
  self_attention.kv_layernorm.weight           [rkv]
  self_attention.linear_kv_up_proj.weight      [N*(nope + v), rkv] per head [k without RoPE; v]
  self_attention.linear_proj.weight            [H, N*v_head_dim]
"""

from __future__ import annotations

import functools
import re

from moe_rl.config import ModelConfig


class ConvertError(ValueError):
    """A conversion that cannot proceed; the message names the tensor key or config field."""


# Other spellings of the same tensor (the Transformer Engine layer spec keeps the MoE
# layers' pre-MLP norm as its own module; the local spec folds both norms into the next
# linear's key). Canonical names are on the right.
_ALIASES = {
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    # MLA under the Transformer Engine spec: the latent norms fused into the up projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def canonical_key(key: str) -> str:
    """The canonical spelling of a megatron key (aliases resolved)."""
    match = _LAYER_KEY.match(key)
    if match and match.group(2) in _ALIASES:
        return f"decoder.layers.{match.group(1)}.{_ALIASES[match.group(2)]}"
    return key


def is_model_key(key: str) -> bool:
    """Model weights, as opposed to optimizer state (`chained_0.optimizer...`) or RNG."""
    return key.startswith(MODEL_KEY_PREFIXES) and "._extra_state" not in key


def split_layer_key(key: str) -> tuple[int, str] | None:
    """(layer, suffix) of `decoder.layers.{layer}.{suffix}`; None for global keys."""
    match = _LAYER_KEY.match(key)
    return (int(match.group(1)), match.group(2)) if match else None


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    return layer >= m.num_dense_layers


def megatron_specs(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global megatron key the model has, with its global shape, in layer order."""
    return dict(_megatron_specs(m))


@functools.cache
def _megatron_specs(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, D = m.hidden_size, m.kv_channels
    Q, G = m.num_attention_heads, m.num_query_groups
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (m.vocab_size, H)}
    for i in range(m.num_layers):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv.layer_norm_weight"] = (H,)
        if m.multi_latent_attention:
            out.update(_mla_specs(p + "self_attention.", m))
        else:
            out[p + "self_attention.linear_qkv.weight"] = ((Q + 2 * G) * D, H)
            if m.add_qkv_bias:
                out[p + "self_attention.linear_qkv.bias"] = ((Q + 2 * G) * D,)
            if m.qk_layernorm:
                out[p + "self_attention.q_layernorm.weight"] = (D,)
                out[p + "self_attention.k_layernorm.weight"] = (D,)
            out[p + "self_attention.linear_proj.weight"] = (H, Q * D)
        out[p + "mlp.linear_fc1.layer_norm_weight"] = (H,)
        if is_moe_layer(m, i):
            E, F = m.num_experts, m.moe_ffn_hidden_size
            out[p + "mlp.router.weight"] = (E, H)
            if m.moe_router_enable_expert_bias:
                out[p + "mlp.router.expert_bias"] = (E,)
            out[p + "mlp.experts.experts.linear_fc1.weight"] = (E, 2 * F, H)
            out[p + "mlp.experts.experts.linear_fc2.weight"] = (E, H, F)
            if m.moe_shared_expert_intermediate_size:
                S = m.moe_shared_expert_intermediate_size
                out[p + "mlp.shared_experts.linear_fc1.weight"] = (2 * S, H)
                out[p + "mlp.shared_experts.linear_fc2.weight"] = (H, S)
        else:
            F = m.ffn_hidden_size
            out[p + "mlp.linear_fc1.weight"] = (2 * F, H)
            out[p + "mlp.linear_fc2.weight"] = (H, F)
    out["decoder.final_layernorm.weight"] = (H,)
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = (m.vocab_size, H)
    return out


def _mla_specs(p: str, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention's keys under prefix `p` (module docstring)."""
    H, N = m.hidden_size, m.num_attention_heads
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    out: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank:
        out[p + "linear_q_down_proj.weight"] = (m.q_lora_rank, H)
        out[p + "q_layernorm.weight"] = (m.q_lora_rank,)
        out[p + "linear_q_up_proj.weight"] = (N * qk, m.q_lora_rank)
    else:
        out[p + "linear_q_proj.weight"] = (N * qk, H)
    out[p + "linear_kv_down_proj.weight"] = (m.kv_lora_rank + m.qk_pos_emb_head_dim, H)
    out[p + "kv_layernorm.weight"] = (m.kv_lora_rank,)
    out[p + "linear_kv_up_proj.weight"] = (N * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank)
    out[p + "linear_proj.weight"] = (H, N * m.v_head_dim)
    return out


def megatron_shape(key: str, m: ModelConfig) -> tuple[int, ...]:
    """Global shape of megatron tensor `key`; ConvertError naming it when the model has none."""
    specs = _megatron_specs(m)
    key = canonical_key(key)
    if key not in specs:
        raise ConvertError(f"unexpected megatron key {key!r} for this model config")
    return specs[key]


def check_shape(key: str, shape: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ConvertError(
            f"{what} {key!r} has shape {list(shape)} but the model config implies {list(expected)} "
            "(config.yaml / config.json does not match the weights?)"
        )
