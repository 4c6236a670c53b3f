"""What every Hugging Face MoE layout shares: the map from the learner's global megatron
tensors to HF tensors (names, shapes, views of the megatron tensor) and the config.json
fields common to the architectures (pure torch; no megatron, no transformers).

A layout (`HFArchitecture` subclass: `qwen3_moe.Qwen3MoeLayout`, `glm4_moe.Glm4MoeLayout`) turns
each megatron key into an ordered list of parts, an HF `TensorSpec` plus the view of the
megatron tensor that holds its elements. Shared by all layouts (checked numerically by
tests/integration/convert/test_convert.py and tests/integration/convert/test_convert_glm4.py against transformers and vLLM):

  decoder.layers.{i}.                          model.layers.{i}.
  self_attention.linear_qkv.layer_norm_weight  input_layernorm.weight
  self_attention.linear_qkv.weight             self_attn.{q,k,v}_proj.weight   (de-interleaved)
  self_attention.linear_qkv.bias               self_attn.{q,k,v}_proj.bias     (de-interleaved alike)
  self_attention.{q,k}_layernorm.weight        self_attn.{q,k}_norm.weight
  self_attention.linear_proj.weight            self_attn.o_proj.weight
  mlp.linear_fc1.layer_norm_weight             post_attention_layernorm.weight
  mlp.linear_fc1.weight / linear_fc2.weight    mlp.{gate,up}_proj.weight / mlp.down_proj.weight
  mlp.router.weight                            mlp.gate.weight
  mlp.experts.experts.linear_fc1.weight        mlp.experts.{e}.{gate,up}_proj.weight
  mlp.experts.experts.linear_fc2.weight        mlp.experts.{e}.down_proj.weight
plus embedding.word_embeddings.weight -> model.embed_tokens.weight, decoder.final_layernorm
.weight -> model.norm.weight, output_layer.weight -> lm_head.weight.

- linear_qkv rows are grouped per query group g: [the Q/G query heads of g, key head g,
  value head g], D rows each. HF's GQA serves query heads g*Q/G .. (g+1)*Q/G-1 with KV head
  g, so q_proj is the concatenation of every group's query block in group order.
- fused fc1 rows are [gate (F rows); up (F rows)] for dense MLPs, experts and shared experts
  (megatron's SwiGLU takes silu of the first half times the second).
- expert ids are global: row e of the [E, ...] tensors is expert e whatever the EP layout
  the checkpoint was saved at (the expert axis is a prepended global axis).

Two kinds of parts exist beyond plain views: a spec with a fixed `dtype` (the router's
expert bias stays float32 whatever the output dtype, as megatron keeps it), and a `zero`
spec, an HF tensor with no megatron counterpart that the architecture still requires
(written as zeros, required to be zeros on import; `zero` names the config fields that
make it absent). A view may also appear twice (a tied output head written as its own
tensor); on import the two HF tensors must then be equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.megatron_keys import (
    ConvertError,
    canonical_key,
    check_shape,
    megatron_shape,
    megatron_specs,
    split_layer_key,
)


@dataclass(frozen=True)
class TensorSpec:
    """An HF tensor's name and shape (dtype comes from the data unless fixed here)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    """A fixed HF dtype; None: the megatron tensor's (or the requested output dtype)."""
    zero: str = ""
    """Non-empty for an all-zeros HF tensor with no megatron counterpart: why it is absent."""


View = Callable[[torch.Tensor], "torch.Tensor | None"]
Part = tuple[TensorSpec, View]


def as_is(w: torch.Tensor) -> torch.Tensor:
    """The view of a tensor that is renamed only."""
    return w


def _none(w: torch.Tensor) -> None:
    return None


# --------------------------------------------------------------------------- re-layouts


def qkv_views(w: torch.Tensor, m: ModelConfig) -> list[torch.Tensor]:
    """[q, k, v] strided views of an interleaved linear_qkv weight [G*(Q/G+2)*D, H] or its
    bias [G*(Q/G+2)*D] (megatron lays both out per query group: the group's q heads, k, v)."""
    G = m.num_query_groups
    qpg = m.num_attention_heads // G
    w4 = w.view(G, qpg + 2, m.kv_channels, *w.shape[1:])  # per group: q heads, k, v
    return [w4[:, :qpg], w4[:, qpg], w4[:, qpg + 1]]


def gate_up_parts(prefix: str, F: int, H: int) -> list[Part]:
    """A fused fc1 [2F, H] as `{prefix}gate_proj.weight` and `{prefix}up_proj.weight`."""
    return [
        (TensorSpec(prefix + "gate_proj.weight", (F, H)), lambda w: w[:F]),
        (TensorSpec(prefix + "up_proj.weight", (F, H)), lambda w: w[F:]),
    ]


def expert_parts(prefix: str, m: ModelConfig, fc: str) -> list[Part]:
    """The grouped experts' fc1 [E, 2Fe, H] or fc2 [E, H, Fe] as one HF tensor per global
    expert and projection (`{prefix}{e}.gate_proj.weight`, ...)."""
    E, F, H = m.num_experts, m.moe_ffn_hidden_size, m.hidden_size
    if fc == "fc2":
        return [(TensorSpec(f"{prefix}{e}.down_proj.weight", (H, F)), _expert_view(e)) for e in range(E)]
    return [
        part
        for e in range(E)
        for part in (
            (TensorSpec(f"{prefix}{e}.gate_proj.weight", (F, H)), _expert_view(e, slice(None, F))),
            (TensorSpec(f"{prefix}{e}.up_proj.weight", (F, H)), _expert_view(e, slice(F, None))),
        )
    ]


def _expert_view(e: int, rows: slice = slice(None)) -> View:
    """Expert `e`'s `rows` of a grouped [E, ...] tensor (all of them by default)."""
    return lambda w: w[e, rows]


def _qkv_view(j: int, m: ModelConfig) -> View:
    """The j-th of (q, k, v) of a fused linear_qkv weight or bias."""
    return lambda w: qkv_views(w, m)[j]


def _span(view: torch.Tensor) -> tuple[int, int] | None:
    """The first and last storage element a view reads; None when it reads none."""
    if view.numel() == 0:
        return None
    first = int(view.storage_offset())
    return first, first + sum((int(n) - 1) * int(stride) for n, stride in zip(view.shape, view.stride()))


def _unread_parts(parts: list[Part], shape: tuple[int, ...], wanted: Sequence[tuple]) -> set[int]:
    """Indices of `parts` whose place in a tensor of `shape` no `wanted` index reads, found on
    a meta tensor (no memory). Conservative: a part is kept when its span of storage overlaps
    a wanted span at all, when its view is not a view of the tensor, and when it is a zero
    spec (those are fetched to be checked)."""
    meta = torch.empty(shape, device="meta")
    spans = [span for idx in wanted if (span := _span(meta[idx])) is not None]
    unread = set()
    for i, (spec, view) in enumerate(parts):
        v = None if spec.zero else view(meta)
        if v is None or v._base is not meta:
            continue
        span = _span(v)
        if span is None or not any(span[0] <= hi and lo <= span[1] for lo, hi in spans):
            unread.add(i)
    return unread


def zero_parts(specs: list[TensorSpec]) -> list[Part]:
    return [(spec, _none) for spec in specs]


# --------------------------------------------------------------------------- layouts

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


class HFArchitecture:
    """A Hugging Face MoE architecture's tensor names and shapes, as a map from the
    learner's megatron tensors.

    Subclasses name the architecture, refuse what it cannot express (`check_supported`),
    add their own tensors (`layer_parts` / `global_parts`) and write / read config.json."""

    name = ""  # e.g. "Qwen3-MoE", in messages
    architecture = ""  # config.json "architectures"
    model_type = ""  # config.json "model_type"
    model_type_aliases: tuple[str, ...] = ()  # other model_types of the same architecture

    def check_supported(self, m: ModelConfig) -> None:
        raise NotImplementedError

    def hf_config(self, m: ModelConfig, dtype: torch.dtype, *, bos_token_id: int | None,
                  eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
        raise NotImplementedError

    def model_config_from_hf(self, cfg: dict[str, Any], base: ModelConfig | None = None, *,
                             notes: list[str] | None = None) -> ModelConfig:
        raise NotImplementedError

    def ignored_hf_tensor(self, name: str, cfg: dict[str, Any]) -> bool:
        """True for a tensor of the directory that the model the learner builds leaves out
        on purpose (e.g. Glm4-MoE's multi-token-prediction layers): import skips it."""
        return False

    # ------------------------------------------------------------------ the map

    def layer_parts(self, i: int, rest: str, m: ModelConfig) -> list[Part] | None:
        """HF parts of `decoder.layers.{i}.{rest}`; None when this layout has none."""
        p = f"model.layers.{i}."
        H, D = m.hidden_size, m.kv_channels
        if rest in _RENAMES:
            return [(TensorSpec(p + _RENAMES[rest], megatron_shape(f"decoder.layers.{i}.{rest}", m)), as_is)]
        if rest == "self_attention.linear_qkv.weight":
            shapes = [(m.num_attention_heads * D, H), (m.num_query_groups * D, H), (m.num_query_groups * D, H)]
            return [
                (TensorSpec(f"{p}self_attn.{n}_proj.weight", s), _qkv_view(j, m))
                for j, (n, s) in enumerate(zip("qkv", shapes))
            ]
        if rest == "self_attention.linear_qkv.bias":
            Q, G = m.num_attention_heads * D, m.num_query_groups * D
            return [
                (TensorSpec(f"{p}self_attn.{n}_proj.bias", (s,)), _qkv_view(j, m))
                for j, (n, s) in enumerate(zip("qkv", (Q, G, G)))
            ]
        if rest == "mlp.linear_fc1.weight":
            return gate_up_parts(p + "mlp.", m.ffn_hidden_size, H)
        if rest == "mlp.experts.experts.linear_fc1.weight":
            return expert_parts(p + "mlp.experts.", m, "fc1")
        if rest == "mlp.experts.experts.linear_fc2.weight":
            return expert_parts(p + "mlp.experts.", m, "fc2")
        return None

    def global_parts(self, key: str, m: ModelConfig) -> list[Part] | None:
        """HF parts of a key outside the decoder layers; None when this layout has none."""
        if key in _GLOBAL_RENAMES:
            return [(TensorSpec(_GLOBAL_RENAMES[key], megatron_shape(key, m)), as_is)]
        return None

    def parts(self, key: str, m: ModelConfig) -> list[Part]:
        key = canonical_key(key)
        megatron_shape(key, m)  # ConvertError when the model config has no such key
        layer = split_layer_key(key)
        parts = self.layer_parts(*layer, m) if layer else self.global_parts(key, m)
        if parts is None:
            raise ConvertError(
                f"megatron key {key!r} has no {self.name} counterpart (check_supported should have "
                "refused this model config)"
            )
        return parts

    def hf_specs(self, key: str, m: ModelConfig) -> list[TensorSpec]:
        """The HF tensors (names, shapes) that the megatron tensor `key` becomes."""
        return [spec for spec, _ in self.parts(key, m)]

    def hf_specs_all(self, m: ModelConfig) -> list[TensorSpec]:
        """Every HF tensor of the model, in megatron key order."""
        return [spec for key in megatron_specs(m) for spec in self.hf_specs(key, m)]

    def hf_views(self, key: str, w: torch.Tensor, m: ModelConfig) -> list[torch.Tensor | None]:
        """Views of megatron tensor `w`, one per HF tensor of `hf_specs(key)`, each holding that
        HF tensor's elements in order (reshape to the HF shape; q/k/v views are strided);
        None for a zero spec."""
        return [view(w) for _, view in self.parts(key, m)]

    def to_hf(self, key: str, tensor: torch.Tensor, m: ModelConfig,
              dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF tensors of megatron tensor `key`, cast to `dtype` (None: as stored) unless
        the spec fixes one. Renames, fc1 halves and experts are views of `tensor` (no copy
        when no cast); q, k and v are gathered from the interleaved rows (copies)."""
        key = canonical_key(key)
        check_shape(key, tuple(tensor.shape), megatron_shape(key, m), "megatron tensor")
        for spec, view in self.parts(key, m):
            want = spec.dtype or dtype or tensor.dtype
            t = view(tensor)
            t = torch.zeros(spec.shape, dtype=want) if t is None else t.reshape(spec.shape)
            yield spec.name, t.to(want)

    def from_hf(self, key: str, fetch: Callable[[str], torch.Tensor], m: ModelConfig,
                wanted: Sequence[tuple] | None = None) -> torch.Tensor:
        """The megatron tensor `key` assembled from HF tensors; `fetch(name)` returns one HF
        tensor (it should raise naming `name` when it is missing). Each HF tensor is copied
        into its place as it is fetched, so only one is held besides the result.

        `wanted`: the indices of the result a caller will read (a rank's pieces). HF tensors
        none of them touches are not fetched and their place is left unwritten, so a rank at
        expert parallelism reads its own experts only, and the pages of the rest of the
        result are never touched (not committed) either."""
        key = canonical_key(key)
        parts = self.parts(key, m)
        unread = _unread_parts(parts, megatron_shape(key, m), wanted) if wanted is not None else set()
        out: torch.Tensor | None = None
        views: list[torch.Tensor | None] = []
        for i, (spec, _) in enumerate(parts):
            if i in unread:
                continue
            t = fetch(spec.name)
            check_shape(spec.name, tuple(t.shape), spec.shape, "Hugging Face tensor")
            if spec.zero:
                if t.any():
                    raise ConvertError(
                        f"Hugging Face tensor {spec.name!r} is not all zeros, but {spec.zero}: the "
                        "megatron model has no such tensor (describe the model with that feature on)"
                    )
                continue
            if out is None:
                out = torch.empty(megatron_shape(key, m), dtype=t.dtype)
                views = [view(out) for _, view in parts]
            elif t.dtype != out.dtype and spec.dtype is None:
                raise ConvertError(f"Hugging Face tensor {spec.name!r} is {t.dtype}, its siblings {out.dtype}")
            dest = views[i]
            assert dest is not None  # (read: its view was made)
            twin = next((j for j in range(i) if j not in unread and views[j] is dest), None)
            if twin is None:
                dest.copy_(t.reshape(dest.shape))
            elif not torch.equal(dest, t.reshape(dest.shape).to(dest.dtype)):  # e.g. a tied head
                raise ConvertError(f"Hugging Face tensor {spec.name!r} differs from {parts[twin][0].name!r}")
        assert out is not None  # every key has a part that is not a zero spec
        return out


# --------------------------------------------------------------------------- config.json

TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
PARAMS_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def common_hf_config(m: ModelConfig, dtype: torch.dtype, *, bos_token_id: int | None,
                     eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
    """config.json fields that Qwen3-MoE and Glm4-MoE spell the same way."""
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "num_experts_per_tok": m.moe_router_topk,
        "hidden_act": "silu",
        "attention_bias": m.add_qkv_bias,
        "attention_dropout": 0.0,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": float(m.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": TORCH_DTYPE_NAMES[dtype],
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }


def generation_config(*, bos_token_id: int | None, eos_token_id: int | list[int] | None,
                      pad_token_id: int | None) -> dict[str, Any]:
    """generation_config.json: token ids only (no sampling defaults imposed on users)."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}


def get_field(cfg: dict[str, Any], name: str, *alts: str, default: Any = ...) -> Any:
    """config.json field `name` (or an alternative spelling); ConvertError when absent."""
    for n in (name, *alts):
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    if default is ...:
        raise ConvertError(f"config.json lacks {name!r}")
    return default


def refuse(message: str, notes: list[str] | None = None) -> None:
    """A config.json setting the learner cannot honour. Converting or training (`notes` is
    None): NotImplementedError. Planning (`notes` given, used only for settings that change
    the math but no parameter's shape, so the planner's counts stay exact): recorded there."""
    if notes is None:
        raise NotImplementedError(message)
    notes.append(message)


def require_fields(cfg: dict[str, Any], wanted: dict[str, tuple[Any, Any]],
                   notes: list[str] | None = None) -> None:
    """{field: (default, the only supported value)}: NotImplementedError naming the first
    field of `cfg` (or its default when absent) with another value (with `notes`: each one
    recorded there instead; pass only fields that leave every parameter shape unchanged)."""
    for field, (default, want) in wanted.items():
        got = cfg.get(field, default)
        if got != want:
            refuse(f"config.json {field}={got!r}: only {want!r} is supported", notes)


def qkv_bias_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields for config.json `attention_bias`: biases on q, k and v (GLM-4.5's;
    megatron's add_qkv_bias builds exactly those, o_proj stays without)."""
    return {"add_qkv_bias": bool(cfg.get("attention_bias", False))}


def rope_parameters(cfg: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The RoPE parameters of config.json (transformers 5 `rope_parameters`, or the older
    `rope_scaling`), refusing anything but plain RoPE (with `notes`: recording it)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        refuse(f"config.json {field} has rope_type={rope_type!r}: the learner's RoPE is unscaled; "
               f"remove {field} (and keep sequences within max_position_embeddings)", notes)
    return rope


def common_model_fields(cfg: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """ModelConfig fields that Qwen3-MoE and Glm4-MoE config.json spell the same way (with
    `notes`, the planner's mode: shape-neutral settings the learner lacks are recorded)."""
    heads = int(get_field(cfg, "num_attention_heads"))
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if dtype not in PARAMS_DTYPES:
        refuse(f"config.json dtype={dtype!r}: only float32 and bfloat16 are supported", notes)
        dtype = "bfloat16"
    rope = rope_parameters(cfg, notes)
    return dict(
        num_layers=int(get_field(cfg, "num_hidden_layers")),
        hidden_size=int(get_field(cfg, "hidden_size")),
        num_attention_heads=heads,
        num_query_groups=int(get_field(cfg, "num_key_value_heads", default=heads)),
        kv_channels=int(get_field(cfg, "head_dim", default=int(cfg["hidden_size"]) // heads)),
        ffn_hidden_size=int(get_field(cfg, "intermediate_size")),
        moe_router_topk=int(get_field(cfg, "num_experts_per_tok")),
        moe_ffn_hidden_size=int(get_field(cfg, "moe_intermediate_size")),
        vocab_size=int(get_field(cfg, "vocab_size")),
        max_position_embeddings=int(get_field(cfg, "max_position_embeddings")),
        rotary_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        norm_epsilon=float(get_field(cfg, "rms_norm_eps")),
        untie_embeddings_and_output_weights=not bool(cfg.get("tie_word_embeddings", False)),
        params_dtype=PARAMS_DTYPES[dtype],
        **qkv_bias_fields(cfg),
    )
