"""Name and shape map between the learner's global megatron tensors and Hugging Face
`Qwen3MoeForCausalLM` checkpoint tensors (pure torch; no megatron, no transformers).

A "megatron key" is a dist_checkpointing ShardedTensor key with its global shape: what a
checkpoint directory stores and what `moe_rl.learner.gather.iter_full_tensors` yields.
Per layer i (global numbering; layers < num_dense_layers have a dense MLP):

  megatron key (decoder.layers.{i}.)          shape               HF name (model.layers.{i}.)
  self_attention.linear_qkv.layer_norm_weight [H]                 input_layernorm.weight
  self_attention.linear_qkv.weight            [G*(Q/G+2)*D, H]    self_attn.{q,k,v}_proj.weight
  self_attention.q_layernorm.weight           [D]                 self_attn.q_norm.weight
  self_attention.k_layernorm.weight           [D]                 self_attn.k_norm.weight
  self_attention.linear_proj.weight           [H, Q*D]            self_attn.o_proj.weight
  mlp.linear_fc1.layer_norm_weight            [H]                 post_attention_layernorm.weight
  mlp.linear_fc1.weight          (dense)      [2F, H]             mlp.{gate,up}_proj.weight
  mlp.linear_fc2.weight          (dense)      [H, F]              mlp.down_proj.weight
  mlp.router.weight              (MoE)        [E, H]              mlp.gate.weight
  mlp.experts.experts.linear_fc1.weight       [E, 2Fe, H]         mlp.experts.{e}.{gate,up}_proj.weight
  mlp.experts.experts.linear_fc2.weight       [E, H, Fe]          mlp.experts.{e}.down_proj.weight
plus embedding.word_embeddings.weight -> model.embed_tokens.weight, decoder.final_layernorm
.weight -> model.norm.weight and output_layer.weight -> lm_head.weight (absent when tied).

Layouts (checked numerically by tests/test_convert.py against both implementations):
- linear_qkv rows are grouped per query group g: [the Q/G query heads of g, key head g,
  value head g], D rows each. HF's GQA serves query heads g*Q/G .. (g+1)*Q/G-1 with KV head
  g, so q_proj is the concatenation of every group's query block in group order.
- fused fc1 rows are [gate (F rows); up (F rows)] for the dense MLP and for each expert
  (megatron's SwiGLU takes silu of the first half times the second).
- expert ids are global: row e of the [E, ...] tensors is expert e whatever the EP layout
  the checkpoint was saved at (the expert axis is a prepended global axis).

Not representable in Qwen3-MoE, refused by `check_supported` (never silently dropped):
shared experts (transformers' Qwen3MoeForCausalLM has none; vLLM's qwen3_moe would load
one only behind a sigmoid gate that transformers lacks), the sigmoid router / expert bias
(Qwen3 routes by softmax), and disabled QK-norm (Qwen3 always normalises q and k).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.config import ModelConfig


class ConvertError(ValueError):
    """A conversion that cannot proceed; the message names the tensor key or config field."""


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor's shape (dtype comes from the data)."""

    name: str
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- support


def check_supported(m: ModelConfig) -> None:
    """Raise NotImplementedError, naming the field, for what Qwen3-MoE cannot express."""
    if m.moe_shared_expert_intermediate_size:
        raise NotImplementedError(
            f"model.moe_shared_expert_intermediate_size={m.moe_shared_expert_intermediate_size}: "
            "Qwen3-MoE has no shared expert (transformers' Qwen3MoeForCausalLM would ignore the "
            "tensors and compute a different model). Converting it needs a target architecture "
            "with QK-norm and an ungated shared expert in both transformers and vLLM; set it to 0 "
            "to train a convertible model"
        )
    if m.moe_router_score_function != "softmax" or m.moe_router_enable_expert_bias:
        raise NotImplementedError(
            f"model.moe_router_score_function={m.moe_router_score_function!r} / "
            f"model.moe_router_enable_expert_bias={m.moe_router_enable_expert_bias}: Qwen3-MoE "
            "routes by softmax with renormalised top-k and has no expert bias; a sigmoid router "
            "needs a DeepSeek-V3-style target (e_score_correction_bias), not implemented"
        )
    if not m.qk_layernorm:
        raise NotImplementedError(
            "model.qk_layernorm=false: Qwen3-MoE always applies RMSNorm to queries and keys "
            "(an all-ones norm weight is not the identity); not representable"
        )


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    return layer >= m.num_dense_layers


# --------------------------------------------------------------------------- key names

# Other spellings of the same tensor (the Transformer Engine layer spec keeps the MoE
# layers' pre-MLP norm as its own module; the local spec folds both norms into the next
# linear's key). Canonical names are on the right.
_ALIASES = {
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
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
        out[p + "self_attention.linear_qkv.weight"] = ((Q + 2 * G) * D, H)
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


# Per-layer renames that keep the tensor as is: megatron suffix -> HF suffix.
_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _split_key(key: str) -> tuple[int, str]:
    match = _LAYER_KEY.match(key)
    if not match:
        raise ConvertError(f"unexpected megatron key {key!r}: not part of a Qwen3-MoE model")
    return int(match.group(1)), match.group(2)


def hf_specs(key: str, m: ModelConfig) -> list[TensorSpec]:
    """The HF tensors (names, shapes) that the megatron tensor `key` becomes."""
    key = canonical_key(key)
    if key in _GLOBAL_RENAMES:
        return [TensorSpec(_GLOBAL_RENAMES[key], megatron_shape(key, m))]
    i, rest = _split_key(key)
    p = f"model.layers.{i}."
    H, D = m.hidden_size, m.kv_channels
    if rest in _RENAMES:
        return [TensorSpec(p + _RENAMES[rest], megatron_shape(key, m))]
    if rest == "self_attention.linear_qkv.weight":
        return [
            TensorSpec(p + "self_attn.q_proj.weight", (m.num_attention_heads * D, H)),
            TensorSpec(p + "self_attn.k_proj.weight", (m.num_query_groups * D, H)),
            TensorSpec(p + "self_attn.v_proj.weight", (m.num_query_groups * D, H)),
        ]
    if rest == "mlp.linear_fc1.weight":
        F = m.ffn_hidden_size
        return [TensorSpec(p + "mlp.gate_proj.weight", (F, H)), TensorSpec(p + "mlp.up_proj.weight", (F, H))]
    if rest == "mlp.experts.experts.linear_fc1.weight":
        F = m.moe_ffn_hidden_size
        return [
            TensorSpec(f"{p}mlp.experts.{e}.{proj}_proj.weight", (F, H))
            for e in range(m.num_experts)
            for proj in ("gate", "up")
        ]
    if rest == "mlp.experts.experts.linear_fc2.weight":
        F = m.moe_ffn_hidden_size
        return [TensorSpec(f"{p}mlp.experts.{e}.down_proj.weight", (H, F)) for e in range(m.num_experts)]
    raise ConvertError(
        f"megatron key {key!r} has no Qwen3-MoE counterpart (check_supported should have refused "
        "this model config)"
    )


def megatron_shape(key: str, m: ModelConfig) -> tuple[int, ...]:
    """Global shape of megatron tensor `key`; ConvertError naming it when the model has none."""
    specs = _megatron_specs(m)
    key = canonical_key(key)
    if key not in specs:
        raise ConvertError(f"unexpected megatron key {key!r} for this model config")
    return specs[key]


def hf_specs_all(m: ModelConfig) -> list[TensorSpec]:
    """Every HF tensor of the model, in megatron key order."""
    return [spec for key in megatron_specs(m) for spec in hf_specs(key, m)]


# --------------------------------------------------------------------------- tensors


def check_shape(key: str, shape: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ConvertError(
            f"{what} {key!r} has shape {list(shape)} but the model config implies {list(expected)} "
            "(config.yaml / config.json does not match the weights?)"
        )


def hf_views(key: str, w: torch.Tensor, m: ModelConfig) -> list[torch.Tensor]:
    """Views of megatron tensor `w`, one per HF tensor of `hf_specs(key)`, each holding that
    HF tensor's elements in order (reshape to the HF shape; q/k/v views are strided)."""
    key = canonical_key(key)
    rest = _split_key(key)[1] if key.startswith("decoder.layers.") else key
    if rest == "self_attention.linear_qkv.weight":
        G = m.num_query_groups
        qpg = m.num_attention_heads // G
        w4 = w.view(G, qpg + 2, m.kv_channels, w.shape[-1])  # per group: q heads, k, v
        return [w4[:, :qpg], w4[:, qpg], w4[:, qpg + 1]]
    if rest == "mlp.linear_fc1.weight":
        return list(w.chunk(2, dim=0))  # [gate; up]
    if rest == "mlp.experts.experts.linear_fc1.weight":
        F = m.moe_ffn_hidden_size
        return [w[e, half] for e in range(m.num_experts) for half in (slice(0, F), slice(F, 2 * F))]
    if rest == "mlp.experts.experts.linear_fc2.weight":
        return list(w.unbind(0))
    return [w]


def to_hf(key: str, tensor: torch.Tensor, m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of megatron tensor `key`. Renames, fc1 halves and experts are views of
    `tensor` (no copy); q, k and v are gathered from the interleaved rows (copies)."""
    key = canonical_key(key)
    check_shape(key, tuple(tensor.shape), megatron_shape(key, m), "megatron tensor")
    for spec, view in zip(hf_specs(key, m), hf_views(key, tensor, m)):
        yield spec.name, view.reshape(spec.shape)


def from_hf(key: str, fetch: Callable[[str], torch.Tensor], m: ModelConfig) -> torch.Tensor:
    """The megatron tensor `key` assembled from HF tensors; `fetch(name)` returns one HF
    tensor (it should raise naming `name` when it is missing). Each HF tensor is copied
    into its place as it is fetched, so only one is held besides the result."""
    key = canonical_key(key)
    out: torch.Tensor | None = None
    views: list[torch.Tensor] = []
    for i, spec in enumerate(hf_specs(key, m)):
        t = fetch(spec.name)
        check_shape(spec.name, tuple(t.shape), spec.shape, "Hugging Face tensor")
        if out is None:
            out = torch.empty(megatron_shape(key, m), dtype=t.dtype)
            views = hf_views(key, out, m)
        elif t.dtype != out.dtype:
            raise ConvertError(f"Hugging Face tensor {spec.name!r} is {t.dtype}, its siblings {out.dtype}")
        views[i].copy_(t.reshape(views[i].shape))
    return out


# --------------------------------------------------------------------------- configs

_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_PARAMS_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def hf_config(
    m: ModelConfig,
    dtype: torch.dtype,
    *,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
) -> dict[str, Any]:
    """config.json of the Qwen3-MoE model (the fields transformers 5.x and vLLM read)."""
    check_supported(m)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "norm_topk_prob": True,  # megatron's softmax over the top-k logits == renormalised top-k
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.num_dense_layers)),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": float(m.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "rms_norm_eps": m.norm_epsilon,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": _TORCH_DTYPE_NAMES[dtype],
        "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
    }


def generation_config(*, bos_token_id: int | None, eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
    """generation_config.json: token ids only (no sampling defaults imposed on users)."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}


def _get(cfg: dict[str, Any], name: str, *alts: str, default: Any = ...) -> Any:
    for n in (name, *alts):
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if default is ...:
        raise ConvertError(f"config.json lacks {name!r}")
    return default


def model_config_from_hf(cfg: dict[str, Any], base: ModelConfig | None = None) -> ModelConfig:
    """Our ModelConfig from a Qwen3-MoE config.json dict. Fields HF does not describe
    (training settings: aux-loss coefficient, dispatcher, init) come from `base`."""
    import dataclasses

    if cfg.get("model_type") != "qwen3_moe":
        raise ConvertError(
            f"config.json has model_type={cfg.get('model_type')!r}; only 'qwen3_moe' "
            "(Qwen3MoeForCausalLM) is supported"
        )
    unsupported = {
        "attention_bias": (cfg.get("attention_bias", False), False),
        "use_sliding_window": (cfg.get("use_sliding_window", False), False),
        "hidden_act": (cfg.get("hidden_act", "silu"), "silu"),
        "norm_topk_prob": (cfg.get("norm_topk_prob", False), True),
        "decoder_sparse_step": (cfg.get("decoder_sparse_step", 1), 1),
    }
    for field, (got, want) in unsupported.items():
        if got != want:
            raise NotImplementedError(f"config.json {field}={got!r}: only {want!r} is supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"config.json rope_type={rope_type!r}: only plain RoPE is supported")
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = int(_get(cfg, "num_attention_heads"))
    layers = int(_get(cfg, "num_hidden_layers"))
    dense = sorted(int(x) for x in cfg.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise NotImplementedError(
            f"config.json mlp_only_layers={dense}: only leading dense layers [0, 1, ..., k-1] are supported"
        )
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if dtype not in _PARAMS_DTYPES:
        raise NotImplementedError(f"config.json dtype={dtype!r}: only float32 and bfloat16 are supported")
    fields = dict(
        num_layers=layers,
        hidden_size=int(_get(cfg, "hidden_size")),
        num_attention_heads=heads,
        num_query_groups=int(_get(cfg, "num_key_value_heads", default=heads)),
        kv_channels=int(_get(cfg, "head_dim", default=int(cfg["hidden_size"]) // heads)),
        ffn_hidden_size=int(_get(cfg, "intermediate_size")),
        num_dense_layers=len(dense),
        num_experts=int(_get(cfg, "num_experts", "num_local_experts")),
        moe_router_topk=int(_get(cfg, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")),
        moe_shared_expert_intermediate_size=0,
        moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False,
        vocab_size=int(_get(cfg, "vocab_size")),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings")),
        rotary_base=float(rope_theta),
        norm_epsilon=float(_get(cfg, "rms_norm_eps")),
        qk_layernorm=True,
        untie_embeddings_and_output_weights=not bool(cfg.get("tie_word_embeddings", False)),
        params_dtype=_PARAMS_DTYPES[dtype],
    )
    return dataclasses.replace(base or ModelConfig(), **fields)
