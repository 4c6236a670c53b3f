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
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": QWEN3_30B_A3B, "Qwen3-235B-A22B": QWEN3_235B_A22B, "GLM-4.5-Air": GLM_45_AIR,
}
# Model cards, billions: (total, active, counted without embeddings?, unit of the last digit
# written; the cards round loosely, so a count within one unit agrees).
SIZES: dict[str, tuple[float, float, bool, float]] = {
    "Qwen3-30B-A3B": (30.5, 3.3, False, 0.1),
    "Qwen3-235B-A22B": (235, 22, False, 1),
    "GLM-4.5-Air": (106, 12, True, 1),
}


def write_config_dir(name: str, path: str | Path, **changes: Any) -> Path:
    """A directory holding only `name`'s config.json (with `changes`), which is all the
    planner needs from a checkpoint."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIGS[name], **changes}, indent=1))
    return path
