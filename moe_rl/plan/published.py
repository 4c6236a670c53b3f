"""The published config.json of the MoE models the planner's docs and tests are about (the
fields that shape the model, as on their Hugging Face pages), and their model cards' sizes.

    write_config_dir("Qwen3-30B-A3B", tmp)   # tmp/config.json: plan it with
                                             # run.init_checkpoint=tmp, no weights needed
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3_235B_A22B: dict[str, Any] = {
    **QWEN3_30B_A3B, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "max_window_layers": 94,
}
GLM_45_AIR: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "num_nextn_predict_layers": 1, "vocab_size": 151552, "max_position_embeddings": 131072,
    "rope_theta": 1000000, "rope_scaling": None, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": True, "torch_dtype": "bfloat16",
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
}
FP8_BLOCKS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16", "quantization_config": FP8_BLOCKS,
}
KIMI_K2: dict[str, Any] = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0, "max_position_embeddings": 131072,
    "rope_theta": 50000.0, "bos_token_id": 163584, "eos_token_id": 163585,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": QWEN3_30B_A3B, "Qwen3-235B-A22B": QWEN3_235B_A22B, "GLM-4.5-Air": GLM_45_AIR,
    "DeepSeek-V3": DEEPSEEK_V3, "Kimi-K2": KIMI_K2,
}
# Model cards, billions: (total, active, counted without embeddings?, unit of the last digit
# written; the cards round loosely, so a count within one unit agrees).
SIZES: dict[str, tuple[float, float, bool, float]] = {
    "Qwen3-30B-A3B": (30.5, 3.3, False, 0.1),
    "Qwen3-235B-A22B": (235, 22, False, 1),
    "GLM-4.5-Air": (106, 12, True, 1),
    "DeepSeek-V3": (671, 37, False, 1),  # the main model; the card's 685B adds the 14B MTP module
    "Kimi-K2": (1000, 32, False, 1),  # "1T total, 32B activated": 1.026 T / 32.9 B counted, not within a unit
}


def write_config_dir(name: str, path: str | Path, **changes: Any) -> Path:
    """A directory holding only `name`'s config.json (with `changes`), which is all the
    planner needs from a checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIGS[name], **changes}, indent=1))
    return path
