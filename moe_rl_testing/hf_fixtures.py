"""Hugging Face model directories as a new user brings them, made in the test: random-init
`Qwen3MoeForCausalLM` / `Glm4MoeForCausalLM` with shapes unlike the tiny model, and a
Qwen2-style byte-level BPE tokenizer trained here with `tokenizers` (ChatML template,
`<|im_start|>` / `<|im_end|>` / `<|endoftext|>`, two EOS ids in generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB = 384


def _corpus() -> list[str]:
    lines = []
    for a in range(200):
        b = (a * 37 + 11) % 1000
        lines += [f"What is {a} + {b}? Put the answer in \\boxed{{}}.", f"The answer is \\boxed{{{a + b}}}.",
                  f"Reverse the digits of {a * 7919 % 100000}.", "You are a helpful assistant."]
    return lines


def write_bpe_tokenizer(out: Path, vocab: int = VOCAB) -> dict[str, int]:
    """Train the byte-level BPE and save it with transformers (tokenizer.json +
    tokenizer_config.json with the ChatML template). Returns the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHATML)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return {s: tok.token_to_id(s) for s in SPECIALS}


def _common(vocab: int, ids: dict[str, int]) -> dict:
    return dict(vocab_size=vocab, hidden_size=128, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, intermediate_size=192, moe_intermediate_size=64,
                num_experts_per_tok=4, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def qwen3_moe_config(vocab: int, ids: dict[str, int]):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(vocab, ids), num_experts=16, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rope_theta=10000.0)


def glm4_moe_config(vocab: int, ids: dict[str, int]):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**_common(vocab, ids), n_routed_experts=16, n_shared_experts=1, first_k_dense_replace=1,
                         norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                         partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
                         num_nextn_predict_layers=0, rope_theta=10000.0)


def make_hf_model_dir(out: Path, arch: str = "qwen3_moe", seed: int = 0, vocab: int = 448) -> Path:
    """A random-init HF MoE directory with its own tokenizer (vocab padded past the
    tokenizer's, as real checkpoints are). Router weights are scaled up so routing is
    decisive (fp32 top-k ties would make parity tests flaky)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    ids = write_bpe_tokenizer(out)
    cfg = qwen3_moe_config(vocab, ids) if arch == "qwen3_moe" else glm4_moe_config(vocab, ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 0.02)
    model.save_pretrained(str(out))
    gen = GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    gen.save_pretrained(str(out))
    return out


def write_math_jsonl(path: Path, n: int = 24, messages: bool = False) -> Path:
    rows = []
    for i in range(n):
        a, b = 3 + i, 10 + 2 * i
        q = f"What is {a} + {b}? Put the answer in \\boxed{{}}."
        row = {"messages": [{"role": "user", "content": q}]} if messages else {"prompt": q}
        rows.append({**row, "answer": str(a + b)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf_logprobs(hf_dir: Path, batch) -> torch.Tensor:
    """transformers' fp32 per-token logprobs of the batch's responses [B, T]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = batch.tokens_BS
    with torch.no_grad():
        logp_BSV = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    out = torch.zeros(tokens.shape[0], batch.response_width)
    for b in range(tokens.shape[0]):
        p0, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        pos = torch.arange(p0, p0 + n)
        out[b, :n] = logp_BSV[b, pos - 1, tokens[b, pos]]
    return out
