"""Build the Qwen3-MoE-shaped GPT with megatron-core, wrapped in megatron's DDP.

Architecture (matches Hugging Face `Qwen3MoeForCausalLM`, so conversion is a re-layout):
pre-RMSNorm decoder layers; GQA attention with per-head RMSNorm on queries and keys and
RoPE; MoE MLP of SwiGLU experts behind a softmax top-k router whose top-k weights are
renormalised (megatron's `moe_router_pre_softmax=False`: softmax over the k selected
logits, identical to Qwen3's `norm_topk_prob=True`); optional shared expert and
DeepSeek-V3-style sigmoid router with expert bias; untied output layer by default. GLM-4.5's
extras (Hugging Face `Glm4MoeForCausalLM`): q/k/v biases (`add_qkv_bias`), RoPE on part of
each head (`rotary_percent`) and scaled routed weights (`moe_router_topk_scaling_factor`).
DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`): megatron's multi-latent attention
(`MLATransformerConfig`, YaRN RoPE; `mla_settings`) and group-limited routing.

Layer spec: the Transformer Engine spec on CUDA when TE imports (needed for fp8), the
local megatron-core spec otherwise; `model.layer_spec` overrides.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from moe_rl.config import ConfigError, ModelConfig, ParallelConfig
from moe_rl.config.model import GPU_ONLY_DEFAULTS, cuda_graph_scopes
from moe_rl.learner.megatron_patches import mla_te_linear, unfused_linears
from moe_rl.learner.mla_attention import MLADotProductAttention
from moe_rl.learner.packed_attention import PackedDotProductAttention
from moe_rl.learner.parallel import graph_safe_rng, sequence_parallel_for

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformer_engine_available() -> bool:
    """CUDA and Transformer Engine's torch extension. `import transformer_engine` alone
    succeeds without the compiled `transformer_engine_torch` (it is a separate, source-only
    package), so the check imports `transformer_engine.pytorch`."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def _check_fp8(model: ModelConfig, spec: str) -> None:
    """fp8 needs the TE spec on a GPU that has the recipe's kernels."""
    if model.fp8 == "none":
        return
    if spec != "te":
        why = ("Transformer Engine's torch extension does not import here (transformer_engine.pytorch)"
               if torch.cuda.is_available() else "there is no GPU here")
        raise ConfigError(f"model.fp8={model.fp8} needs the Transformer Engine layer spec, and {why}; "
                          "set model.fp8=none, or install TE (make install on a CUDA machine)")
    if model.fp8_recipe == "mxfp8" and torch.cuda.get_device_capability() < (10, 0):
        raise ConfigError(f"model.fp8_recipe=mxfp8 needs a Blackwell GPU; this is {torch.cuda.get_device_name()} "
                          "(use blockwise, the Hopper default, or tensorwise/delayed)")


def _refuse_lora_on_te(model: ModelConfig) -> None:
    raise ConfigError(f"model.lora.rank={model.lora.rank} needs the local layer spec (the Transformer Engine / "
                      "grouped-experts path is not verified with LoRA yet): set model.layer_spec=local")


def resolve_layer_spec(model: ModelConfig) -> str:
    """'te' or 'local' for this machine; an explicit 'te' without TE/CUDA is an error, and so
    is fp8 or the fused MoE permutation without the TE spec (checked here, before megatron
    fails deep in a layer)."""
    if model.lora.enabled and model.layer_spec == "te":
        _refuse_lora_on_te(model)
    if model.layer_spec == "auto":
        spec = "te" if transformer_engine_available() else "local"
    elif model.layer_spec == "te" and not transformer_engine_available():
        raise ConfigError("model.layer_spec=te needs CUDA and Transformer Engine's torch extension "
                          "(transformer_engine.pytorch); use auto or local")
    else:
        spec = model.layer_spec
    _check_fp8(model, spec)
    if spec == "te" and model.lora.enabled:
        _refuse_lora_on_te(model)
    if spec != "te":
        for key, value in model.gpu_only_settings().items():
            off = GPU_ONLY_DEFAULTS[key.removeprefix("model.")]
            raise ConfigError(f"{key}={yaml_scalar(value)} needs the Transformer Engine layer spec on a GPU "
                              f"(the layer spec here is {spec}): set it to {yaml_scalar(off)}")
    return spec


def yaml_scalar(value: object) -> str:
    """A setting's value as a recipe writes it (true/false for booleans)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def fp8_settings(model: ModelConfig) -> dict:
    """TransformerConfig's fp8 fields: format, recipe, and the delayed-scaling knobs. The
    scoring pass and the update pass run under this one config, so both quantize with the
    same recipe."""
    if model.fp8 == "none":
        return {"fp8": None}
    out: dict[str, object] = {"fp8": model.fp8, "fp8_recipe": model.fp8_recipe}
    if model.fp8_recipe == "delayed":
        out.update(fp8_amax_history_len=model.fp8_amax_history_len,
                   fp8_amax_compute_algo=model.fp8_amax_compute_algo)
    return out


def mla_settings(model: ModelConfig) -> dict:
    """MLATransformerConfig's multi-latent-attention and RoPE fields ({} without MLA). Plain
    RoPE keeps scaling factor 1 and mscale_all_dim 0, so megatron's softmax scale stays
    1/sqrt(q head dim); YaRN passes config.json's values (`moe_rl.convert.deepseek_v3`)."""
    if not model.multi_latent_attention:
        return {}
    if min(model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim) < 1:
        raise ConfigError("model.multi_latent_attention needs model.kv_lora_rank, qk_head_dim, "
                          "qk_pos_emb_head_dim and v_head_dim >= 1")
    yarn = model.rope_type == "yarn"
    return dict(
        q_lora_rank=model.q_lora_rank or None,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type=model.rope_type,
        rotary_base=model.rotary_base,
        rotary_scaling_factor=model.rotary_scaling_factor if yarn else 1.0,
        original_max_position_embeddings=model.original_max_position_embeddings,
        beta_fast=model.beta_fast,
        beta_slow=model.beta_slow,
        mscale=model.mscale if yarn else 1.0,
        mscale_all_dim=model.mscale_all_dim if yarn else 0.0,
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig for our architecture and layout."""
    on_cpu = not torch.cuda.is_available()
    dtype = DTYPES[model.dtype_on(torch.cuda.is_available())]
    spec = resolve_layer_spec(model)
    moe_layer_freq = [0] * model.num_dense_layers + [1] * (model.num_layers - model.num_dense_layers)
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    return config_class(
        **mla_settings(model),
        # architecture
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,  # GLM-4.5's attention_bias
        hidden_dropout=0.0,  # RL fine-tuning: dropout would make old/new logprobs disagree
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        # MoE
        num_moe_experts=model.num_experts,
        moe_layer_freq=moe_layer_freq,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        # megatron skips a falsy factor; 1.0 multiplies by one, exactly
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        # a frozen router (model.freeze, or LoRA's frozen base) keeps its bias and has no aux losses
        moe_router_bias_update_rate=0.0 if model.router_frozen else model.moe_router_bias_update_rate,
        # DeepSeek-V3's group-limited routing (None: off)
        moe_router_num_groups=model.moe_router_num_groups if model.moe_router_num_groups > 1 else None,
        moe_router_group_topk=model.moe_router_group_topk if model.moe_router_num_groups > 1 else None,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=0.0 if model.router_frozen else model.moe_aux_loss_coeff,
        moe_z_loss_coeff=None if model.router_frozen else (model.moe_z_loss_coeff or None),
        moe_router_dtype="fp32",  # routing decisions in fp32 even for bf16 models
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_grouped_gemm=spec == "te",
        moe_permute_fusion=model.moe_permute_fusion,
        moe_router_fusion=False,  # the fused router bypasses RouterReplay
        # capacity (0: none, megatron's None) and the sync-free padded dispatch
        moe_expert_capacity_factor=model.moe_expert_capacity_factor or None,
        moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
        moe_enable_routing_replay=True,  # idle unless the learner sets a replay action
        # parallelism
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        sequence_parallel=sequence_parallel_for(parallel),
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **fp8_settings(model),
        # CPU: build weights on the host, no CUDA-only fusions
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=not on_cpu,
        bias_dropout_fusion=not on_cpu,
        apply_rope_fusion=False,
        # (the local spec's fused masked softmax needs apex's kernels: a GPU without them failed
        # there, on an H200; TE's attention does not use it)
        masked_softmax_fusion=spec == "te",
        gradient_accumulation_fusion=model.gradient_accumulation_fusion,  # (TE spec on a GPU only)
        **cuda_graph_settings(model),
        # packed micro-batches differ in length: pipeline stages exchange shapes first
        variable_seq_lengths=parallel.packing,
        **recompute_settings(model),
    )


def cuda_graph_settings(model: ModelConfig) -> dict:
    """megatron-core's per-layer CUDA graphs (`cuda_graph_impl=local`) over
    `model.cuda_graph_scope` ({} for none; full: megatron's empty scope, whole layers). The
    local implementation needs no training-loop hook: megatron's schedule records the graphs
    in the first training forward-backward and replays them after (Transformer Engine's
    implementation wants megatron's training loop and fixed sample shapes before the first
    step)."""
    scopes = cuda_graph_scopes(model.cuda_graph_scope)
    if not scopes:
        return {}
    return dict(cuda_graph_impl="local", cuda_graph_scope=[] if scopes == ["full"] else scopes)


def recompute_settings(model: ModelConfig) -> dict:
    """Full activation recompute: every transformer layer keeps only its input and runs its
    forward again in the backward (megatron's full / uniform / 1 layer). The routing taps
    force each recomputed router to the experts the first forward used (`RouterTaps`)."""
    if model.recompute == "none":
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def build_gpt(model: ModelConfig, tcfg: TransformerConfig) -> GPTModel:
    """The local pipeline stage of the model (megatron's parallel state must be set up)."""
    use_te = resolve_layer_spec(model) == "te"
    if tcfg.cuda_graph_impl != "none":
        graph_safe_rng()
    block_spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=use_te, normalization="RMSNorm")
    if tcfg.cuda_graph_impl != "none" and tcfg.cuda_graph_scope:
        _partial_graphs_in_moe_layers(block_spec)
    if use_te:
        _share_checkpoint_names_with_the_local_spec(block_spec)
    else:  # TE's attention takes packed (THD) input itself; the local one needs ours
        core = MLADotProductAttention if model.multi_latent_attention else PackedDotProductAttention
        mla_te_linear.apply()
        for layer in block_spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core
    with unfused_linears.allowed(tcfg):
        gpt = _gpt_model(model, tcfg, block_spec)
    _reduce_expert_grads_over_expert_dp(gpt, tcfg)
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt


def _partial_graphs_in_moe_layers(block_spec: Any) -> None:
    """The MoE layers as megatron's MoETransformerLayer, which graphs the router (and the
    dispatch's preprocessing) and the combine in parts, the experts eager between them; the
    plain TransformerLayer would graph its whole forward under any scope. Without CUDA graphs
    the two compute alike, so only a partial scope swaps them."""
    for layer in block_spec.layer_specs:
        if layer.module is TransformerLayer and getattr(layer.submodules.mlp, "module", None) is MoELayer:
            layer.module = MoETransformerLayer


def _gpt_model(model: ModelConfig, tcfg: TransformerConfig, block_spec: Any) -> GPTModel:
    return GPTModel(
        config=tcfg,
        transformer_layer_spec=block_spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=model.rotary_percent,  # RoPE on the first part of each head only
        rotary_base=int(model.rotary_base) if float(model.rotary_base).is_integer() else model.rotary_base,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        pre_process=ps.is_pipeline_first_stage(),  # embedding only on the first stage
        post_process=ps.is_pipeline_last_stage(),  # final norm + output layer only on the last
    )


def release_cuda_graphs() -> None:
    """Drop every CUDA graph megatron's local implementation recorded in this process (its
    record is global: a later learner would otherwise replay an earlier one's graphs)."""
    from megatron.core.transformer import cuda_graphs

    if cuda_graphs._CudagraphGlobalRecord.cudagraph_record or cuda_graphs._CudagraphGlobalRecord.cudagraph_created:
        cuda_graphs.delete_cuda_graphs()


def _share_checkpoint_names_with_the_local_spec(block_spec: Any) -> None:
    """Save and load the TE spec's MoE pre-MLP norm under the local spec's name.

    megatron's local spec maps every layer's `pre_mlp_layernorm.` to the TE-fused name
    `mlp.linear_fc1.layer_norm_` in checkpoints, MoE layers included; its TE spec keeps the
    MoE layers' norm as a module of its own under `pre_mlp_layernorm.`. Without the same map a
    checkpoint made under one spec lacks that norm under the other (found on an H100)."""
    for layer in block_spec.layer_specs:
        sub = layer.submodules
        if getattr(sub, "pre_mlp_layernorm", IdentityOp) is not IdentityOp:
            sub.sharded_state_dict_keys_map = {**(sub.sharded_state_dict_keys_map or {}),
                                               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _reduce_expert_grads_over_expert_dp(gpt: GPTModel, tcfg: TransformerConfig) -> None:
    """Send every expert weight down megatron's expert-parallel path: gradient reduction
    over the expert-data-parallel group and a separate (expert) Adam, as megatron itself
    does only when EP > 1 (`allreduce=False`).

    Why always: with EP == 1 but expert-TP < TP (e.g. TP=2, ETP=1) each TP rank runs a full
    replica of every expert on its own sequence-parallel tokens, so an expert's gradient is
    split across TP ranks; megatron's EP == 1 path reduces it over the dense DP group only
    (which excludes TP) and silently loses part of it. The expert-DP group includes those
    ranks. When ETP == TP the expert-DP group is the DP group, so nothing changes
    numerically. And the optimizer then has the same structure (dense + expert) at every
    layout, which lets optimizer state saved at one layout load at another."""
    for name, param in gpt.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def wrap_ddp(gpt: GPTModel, tcfg: TransformerConfig, *, distributed_optimizer: bool = False) -> DistributedDataParallel:
    """megatron's DDP: contiguous grad buffers, fp32 grad reduction, averaging over DP. With
    `distributed_optimizer` the buffers are laid out (padded) for megatron's distributed
    optimizer, which must then be built with `use_distributed_optimizer=True` too."""
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=False,  # (it ends the process; `moe_rl.learner.finite` skips the update instead)
    )
    return DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=gpt)
