"""The `model` section: the decoder's architecture."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from moe_rl.config.errors import ConfigError, require_all, require_positive
from moe_rl.config.lora import LoraConfig, validate_freeze

ParamsDtype = Literal["auto", "fp32", "bf16"]
"""`ModelConfig.params_dtype`'s values (for a value checked elsewhere, as a type)."""


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE-shaped decoder (GQA, QK-RMSNorm, RoPE, SwiGLU experts), or with
    multi_latent_attention a DeepSeek-V3-shaped one (MLA, YaRN, group-limited routing)."""

    num_layers: int = 4
    """Transformer layers. Layers after the first `num_dense_layers` are MoE layers."""
    hidden_size: int = 64
    """Residual stream width."""
    num_attention_heads: int = 4
    """Query heads; must be divisible by parallel.tensor_model_parallel_size."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups); must divide num_attention_heads and be divisible by TP."""
    kv_channels: int = 32
    """Head dimension. vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, 256."""
    ffn_hidden_size: int = 128
    """Hidden size of the dense SwiGLU MLP in the first `num_dense_layers` layers."""
    num_dense_layers: int = 0
    """Leading layers with a dense MLP instead of experts (DeepSeek's first_k_dense)."""
    num_experts: int = 8
    """Routed experts per MoE layer; must be divisible by parallel.expert_model_parallel_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to (K)."""
    moe_ffn_hidden_size: int = 64
    """Hidden size of each routed expert's SwiGLU MLP."""
    moe_shared_expert_intermediate_size: int = 0
    """Hidden size of the always-on shared expert; 0 disables it."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """softmax: Qwen3 style (softmax over experts, top-k, renormalised). sigmoid: DeepSeek-V3
    style (sigmoid scores, top-k on score + expert bias, weights normalised over the k)."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3 aux-loss-free balancing: a per-expert bias added for top-k selection only
    (requires the sigmoid score function)."""
    moe_router_bias_update_rate: float = 0.0
    """Step size of the expert-bias update when moe_router_enable_expert_bias is on. 0 (the
    default, slime's choice for RL): the bias stays as pre-training left it, since a bias that
    moves between rollout and update is itself a router shift. Pre-training uses ~1e-3."""
    moe_router_num_groups: int = 1
    """Expert groups for group-limited routing (config.json n_group; DeepSeek-V3: 8). 1: off."""
    moe_router_group_topk: int = 1
    """Groups a token may route into, chosen by the sum of each group's top
    (moe_router_topk / moe_router_group_topk) biased scores (config.json topk_group)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Load-balancing loss flavour (megatron-core names)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss; 0 disables it."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss; 0 disables it."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach experts on other expert-parallel ranks."""
    vocab_size: int = 128
    """Vocabulary size; must be >= the tokenizer's. Padded internally for TP."""
    max_position_embeddings: int = 128
    """Longest prompt + response the model is built for."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    qk_layernorm: bool = True
    """RMSNorm on queries and keys per head (Qwen3)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate output projection (Qwen3-MoE) instead of reusing the input embedding."""
    init_method_std: float = 0.02
    """Std of the normal initialisation of fresh weights."""
    add_qkv_bias: bool = False
    """Biases on the q/k/v projections (GLM-4.5's attention_bias)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates, in (0, 1] (config.json
    partial_rotary_factor; GLM-4.5 rotates half): the first rotary_percent * kv_channels
    dimensions, rotate-half style, the rest pass through unrotated."""
    moe_router_topk_scaling_factor: float = 1.0
    """Multiplier of the routed experts' top-k weights (config.json routed_scaling_factor:
    2.5 in GLM-4.5, 1.0 in GLM-4.5-Air)."""
    moe_router_pre_softmax: bool = False
    """softmax router only. False: softmax over the k selected logits (top-k weights sum to 1,
    Qwen3's norm_topk_prob=true). True: softmax over all experts, then top-k, not renormalised
    (norm_topk_prob=false). megatron requires True at moe_router_topk=1."""
    multi_latent_attention: bool = False
    """DeepSeek-V2/V3 multi-latent attention (MLA) instead of GQA: queries (optionally through
    a q_lora_rank latent) and a shared kv_lora_rank latent expanded per head; kv_channels,
    num_query_groups, qk_layernorm and add_qkv_bias do not apply."""
    q_lora_rank: int = 0
    """MLA: rank of the query latent (DeepSeek-V3: 1536); 0 projects queries directly
    (DeepSeek-V2-Lite's q_lora_rank null)."""
    kv_lora_rank: int = 0
    """MLA: rank of the shared key/value latent (DeepSeek-V3: 512)."""
    qk_head_dim: int = 0
    """MLA: per-head query/key dimensions without RoPE (config.json qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 0
    """MLA: per-head query/key dimensions with RoPE, the key's shared by all heads
    (config.json qk_rope_head_dim)."""
    v_head_dim: int = 0
    """MLA: per-head value dimensions."""
    rope_type: Literal["rope", "yarn"] = "rope"
    """MLA's RoPE: plain, or YaRN-scaled (config.json rope_scaling type yarn) with the five
    fields below."""
    rotary_scaling_factor: float = 1.0
    """YaRN: context extension factor (config.json rope_scaling.factor; DeepSeek-V3: 40)."""
    original_max_position_embeddings: int = 4096
    """YaRN: the pre-extension context length whose frequencies are kept."""
    beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept as is."""
    beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is fully interpolated."""
    mscale: float = 1.0
    """YaRN: numerator coefficient of the cos/sin concentration factor."""
    mscale_all_dim: float = 0.0
    """YaRN: denominator coefficient of that factor; the softmax scale is multiplied by
    (0.1 * mscale_all_dim * ln(factor) + 1)^2."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers the Hugging Face source holds (num_nextn_predict_layers).
    The learner does not build them: they stay frozen, out of the RL loss, and every export
    copies them unchanged from the source directory."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation: full keeps only each transformer layer's input and runs the
    layer again in the backward (megatron's recompute_granularity=full, uniform, 1 layer): one
    more forward per update for a fraction of the activations (`python -m moe_rl.plan` counts
    both). The recomputed routers take the experts their forward chose, so the update is the
    one without recompute, bit for bit on CPU (tests/integration/learner/test_recompute.py)."""
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """auto: Transformer Engine spec when CUDA and TE are present, else the local spec."""
    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Parameter / compute dtype: auto is bf16 on a GPU and fp32 on CPU (a Hugging Face
    checkpoint's config.json dtype when the model comes from one). bf16 keeps fp32 main
    weights in the optimizer."""
    fp8: Literal["none", "e4m3", "hybrid"] = "none"
    """FP8 format through Transformer Engine (Hopper GPUs): e4m3 everywhere, or hybrid (e4m3
    forward, e5m2 gradients)."""
    fp8_recipe: Literal["blockwise", "tensorwise", "delayed", "mxfp8"] = "blockwise"
    """How fp8 scales are chosen. blockwise (128x128 weight / 1x128 activation blocks, the
    large MoE recipes' choice) and tensorwise are current scaling: a tensor is quantized
    with its own amax, so scoring and update passes of the same weights quantize alike and
    the on-policy ratio is exactly 1. delayed uses an amax history: each pass scales with the
    previous passes' amaxes, so two passes over the same weights differ (docs/gpu.md). mxfp8
    needs Blackwell."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: amax history length."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling: the scale's amax from the history (max) or the last step."""
    moe_permute_fusion: bool = False
    """Transformer Engine's fused token permutation in the MoE dispatcher (GPU, TE spec
    only). Its unpermute sums expert outputs in a fixed order, so two passes over the same
    weights and tokens agree exactly and the on-policy ratio is 1; megatron's unfused path
    differed by up to 0.071 in log-prob at 4 layers of the Qwen3-30B-A3B shape (H100,
    bench/results/gpu_h100_learner.md, 0.87x the speed there). The GPU recipes
    set it."""
    gradient_accumulation_fusion: bool = False
    """Weight gradients accumulated straight into megatron's fp32 `main_grad` buffers by the
    GEMM that computes them (Transformer Engine's `fuse_wgrad_accumulation`), instead of a
    separate gradient tensor added afterwards (GPU, TE spec only). megatron's own linears
    (the output layer) need apex's `fused_weight_gradient_mlp_cuda` for it; without apex they
    keep the unfused path. Written, not yet run on a GPU (`bench/device/gpu_learner_levers.py`)."""
    cuda_graph_scope: str = "none"
    """CUDA graphs over parts of every MoE layer, megatron-core's own implementation
    (`cuda_graph_impl=local`: recorded in the first training forward-backward, replayed
    after wherever the inputs match, scoring passes included): none; moe_router (the pre-MLP
    norm and the router, and the combine after the experts), optionally with moe_preprocess
    (the dispatch's preprocessing too), comma-separated; or full (whole layers, attention
    included: needs moe_pad_expert_input_to_capacity, as the dropless dispatch syncs with the
    host). GPU, TE spec only. A graphed router replays its kernels without the learner's
    routing taps, so every scope is refused with routing replay (rl.replay) and routing
    capture (rl.capture_routing, the router shift). Attention alone is not offered:
    megatron's local graphs take attention only inside a whole layer, and Transformer
    Engine's graphs want one fixed micro-batch shape, which packed batches do not have.
    Written, not yet run on a GPU."""
    moe_expert_capacity_factor: float = 0.0
    """Expert capacity as a multiple of the even share (tokens x top-k / experts); tokens
    routed past it are dropped (megatron's `moe_expert_capacity_factor`, lowest-probability
    first). 0: no capacity, nothing dropped. Dropping changes the model: the learner then
    computes other log-probs than the sampler, so it is refused with routing replay. GPU,
    TE spec only; for throughput experiments (a sync-free dispatch with the pad below).
    Written, not yet run on a GPU."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (megatron's
    `moe_pad_expert_input_to_capacity`): fixed shapes, so the dispatch needs no
    device-to-host sync (what whole-layer CUDA graphs need). Needs
    moe_expert_capacity_factor > 0. Written, not yet run on a GPU."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (rank 0: off): base weights frozen, only the adapters train;
    pushes and exports carry W + (alpha / rank) B A (docs/lora.md). CPU / local spec only."""
    freeze: tuple[str, ...] = ()
    """Parameter groups that do not train: any of router, embeddings, output_head,
    attention, experts (their adapters too). A frozen router also turns its auxiliary
    losses (moe_aux_loss_coeff, moe_z_loss_coeff) and expert-bias updates off."""

    @property
    def router_frozen(self) -> bool:
        """The router does not train (model.freeze lists it, or LoRA freezes every base weight)."""
        return "router" in self.freeze or self.lora.enabled

    def training_notes(self) -> list[str]:
        """What LoRA and freezing change, one line each (the run's config summary)."""
        notes = []
        if self.lora.enabled:
            notes.append(f"LoRA rank {self.lora.rank} (alpha {self.lora.alpha:g}) on {', '.join(self.lora.modules)}: "
                         "base weights frozen, only adapters train; pushes and exports are merged")
        if self.freeze:
            notes.append(f"frozen parameter groups: {', '.join(self.freeze)}")
        if self.router_frozen and (self.moe_aux_loss_coeff or self.moe_z_loss_coeff or self.moe_router_bias_update_rate):
            notes.append("router frozen: its auxiliary losses (moe_aux_loss_coeff, moe_z_loss_coeff) and "
                         "expert-bias updates are off")
        return notes

    def gpu_only_settings(self) -> dict[str, object]:
        """The settings that need the Transformer Engine layer spec on a GPU and are on, by
        key (`model.<field>`): what the preflight and the learner refuse elsewhere."""
        return {f"model.{name}": getattr(self, name) for name, off in GPU_ONLY_DEFAULTS.items()
                if getattr(self, name) != off}

    def dtype_on(self, on_gpu: bool) -> Literal["fp32", "bf16"]:
        """`params_dtype` made concrete for a machine (auto: bf16 on a GPU, fp32 on CPU)."""
        if self.params_dtype == "auto":
            return "bf16" if on_gpu else "fp32"
        return self.params_dtype


    def validate(self) -> None:
        """The section's own rules (ConfigError naming the key); those against other
        sections are `moe_rl.config.cross_section`'s."""
        m = self
        require_positive({
            "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
            "model.num_attention_heads": m.num_attention_heads, "model.num_query_groups": m.num_query_groups,
            "model.kv_channels": m.kv_channels, "model.num_experts": m.num_experts,
            "model.moe_router_topk": m.moe_router_topk, "model.moe_ffn_hidden_size": m.moe_ffn_hidden_size,
            "model.vocab_size": m.vocab_size,
        })
        if m.moe_router_topk > m.num_experts:
            raise ConfigError(f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_experts={m.num_experts}")
        if m.num_attention_heads % m.num_query_groups:
            raise ConfigError(f"model.num_query_groups={m.num_query_groups} must divide "
                              f"model.num_attention_heads={m.num_attention_heads}")
        if not 0 <= m.num_dense_layers < m.num_layers:
            raise ConfigError(f"model.num_dense_layers={m.num_dense_layers} must be in [0, num_layers) "
                              "(at least one MoE layer)")
        if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
            raise ConfigError("model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid")
        self._validate_ranges()
        self._validate_throughput_levers()
        self.lora.validate()
        validate_freeze(self.freeze, self.lora)

    def _validate_ranges(self) -> None:
        m = self
        require_all({
            "model.max_position_embeddings": (m.max_position_embeddings >= 1, f">= 1, got {m.max_position_embeddings}"),
            "model.ffn_hidden_size": (m.ffn_hidden_size >= 1, f">= 1, got {m.ffn_hidden_size}"),
            "model.norm_epsilon": (m.norm_epsilon > 0, f"> 0, got {m.norm_epsilon}"),
            "model.init_method_std": (m.init_method_std > 0, f"> 0, got {m.init_method_std}"),
            "model.rotary_base": (m.rotary_base > 0, f"> 0, got {m.rotary_base}"),
            "model.rotary_percent": (0 < m.rotary_percent <= 1, f"in (0, 1], got {m.rotary_percent}"),
            "model.moe_router_topk_scaling_factor": (m.moe_router_topk_scaling_factor > 0,
                                                     f"> 0, got {m.moe_router_topk_scaling_factor}"),
            "model.moe_aux_loss_coeff": (m.moe_aux_loss_coeff >= 0, f">= 0, got {m.moe_aux_loss_coeff}"),
            "model.moe_z_loss_coeff": (m.moe_z_loss_coeff >= 0, f">= 0, got {m.moe_z_loss_coeff}"),
            "model.moe_router_bias_update_rate": (m.moe_router_bias_update_rate >= 0,
                                                  f">= 0, got {m.moe_router_bias_update_rate}"),
        })

    def _validate_throughput_levers(self) -> None:
        """Capacity and its padding, and the CUDA graph scopes megatron-core accepts (their
        device is the preflight's; what they mean for routing, the cross-section rules')."""
        m = self
        if m.moe_expert_capacity_factor < 0:
            raise ConfigError(f"model.moe_expert_capacity_factor must be >= 0 (0: no capacity), got "
                              f"{m.moe_expert_capacity_factor}")
        if m.moe_pad_expert_input_to_capacity and not m.moe_expert_capacity_factor:
            raise ConfigError("model.moe_pad_expert_input_to_capacity needs model.moe_expert_capacity_factor > 0 "
                              "(the capacity it pads to)")
        scopes = cuda_graph_scopes(m.cuda_graph_scope)
        unknown = [x for x in scopes if x not in CUDA_GRAPH_SCOPES]
        if unknown or (not scopes and m.cuda_graph_scope.strip() != "none"):
            raise ConfigError(f"model.cuda_graph_scope={m.cuda_graph_scope!r}: expected none or a comma-separated "
                              f"subset of {', '.join(CUDA_GRAPH_SCOPES)}")
        rules = (
            ("full" in scopes and len(scopes) > 1, "full (whole layers) takes no other scope"),
            ("full" in scopes and not m.moe_pad_expert_input_to_capacity,
             "full needs model.moe_pad_expert_input_to_capacity=true (a whole MoE layer is graphed only with the "
             "capacity-padded dispatch: the dropless one syncs with the host)"),
            ("moe_preprocess" in scopes and "moe_router" not in scopes,
             "moe_preprocess needs moe_router (megatron graphs the preprocessing only after the router)"),
            (scopes and m.recompute != "none", "CUDA graphs cannot take model.recompute=full (megatron recomputes "
                                               "under graphs only for whole-iteration graphs); set one of them off"),
            ("moe_preprocess" in scopes and m.moe_expert_capacity_factor and m.moe_token_dispatcher_type == "alltoall",
             "moe_preprocess cannot take model.moe_expert_capacity_factor under the alltoall dispatcher (its "
             "preprocessing syncs with the host there)"),
        )
        for broken, why in rules:
            if broken:
                raise ConfigError(f"model.cuda_graph_scope={m.cuda_graph_scope}: {why}")


GPU_ONLY_DEFAULTS: dict[str, Any] = {
    "moe_permute_fusion": False,
    "gradient_accumulation_fusion": False,
    "cuda_graph_scope": "none",
    "moe_expert_capacity_factor": 0.0,
    "moe_pad_expert_input_to_capacity": False,
}
"""The model settings that need the Transformer Engine spec on a GPU, at their off values
(`ModelConfig.gpu_only_settings`; the planner's meta-device build resets them)."""

CUDA_GRAPH_SCOPES = ("full", "moe_router", "moe_preprocess")
"""What `model.cuda_graph_scope` may list (full: megatron-core's whole-layer scope; the
others are its CudaGraphScope names)."""


def cuda_graph_scopes(scope: str) -> list[str]:
    """`model.cuda_graph_scope` as a list ([] for none)."""
    return [] if scope.strip() == "none" else [s.strip() for s in scope.split(",") if s.strip()]
