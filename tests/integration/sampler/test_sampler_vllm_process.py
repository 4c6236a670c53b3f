"""The vLLM sampler with its engine in a separate process (`in_process=False`).

The layout for large runs, where the engine cannot take the trainer's iterator: weight
sync goes through a temporary safetensors directory and the reload (with the CPU MoE
repack) runs inside the engine's worker process through the worker extension.
"""

from __future__ import annotations

import pytest

from moe_rl_testing.sampler_utils import (
    build_tiny_moe,
    max_abs_untied,
    perturbed,
    prompts,
    save_stream,
)

pytest.importorskip("vllm")

from moe_rl.sampler import VLLMEngineConfig, make_sampler
from moe_rl.sampler.hf_backend import HFSampler

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_separate_engine_process_generates_and_syncs(tmp_path):
    model_dir = build_tiny_moe(tmp_path / "hf")
    s = make_sampler(model_dir, VLLMEngineConfig(kv_cache_gib=0.0625, in_process=False, weight_sync_bucket_mib=1))
    try:
        assert s.weight_sync == "disk"
        s.update_weights(perturbed(model_dir))
        ref = HFSampler(save_stream(perturbed(model_dir), model_dir, tmp_path / "new"))
        r = s.generate(prompts(6), n=4, max_new_tokens=16, temperature=0.8, seed=5)
        P, R = [r.prompt_token_ids[i] for i in r.prompt_index], r.response_token_ids
        assert max_abs_untied(r.logprobs, ref.score(P, R, 0.8), P, R, ref.model) < 1e-4
    finally:
        s.close()
