"""vLLM sampler precisions bf16 and fp8_emulated against the transformers backend.

Reduced precision cannot match to 1e-4 across two implementations (and on this tiny,
sharply-routed model one flipped expert moves a logprob by ~1), so these compare mean
absolute gaps: fp8 weight rounding must move logprobs much more than the two engines'
bf16 arithmetic differs. One engine at a time (vLLM keeps global state per process).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from moe_rl_testing.sampler_utils import build_tiny_moe, perturbed, prompts, save_stream

pytest.importorskip("vllm")

from moe_rl.sampler import HFEngineConfig, VLLMEngineConfig, make_sampler
from moe_rl.sampler.hf_backend import HFSampler

pytestmark = pytest.mark.vllm


def _mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    return statistics.fmean(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny_prec") / "hf")


def _gaps(sampler, model_dir) -> tuple[float, float]:
    """(vLLM vs transformers at the sampler's precision, transformers at it vs fp32)."""
    r = sampler.generate(prompts(8), n=4, max_new_tokens=16, seed=1)
    P = [r.prompt_token_ids[i] for i in r.prompt_index]
    same = HFSampler(model_dir, HFEngineConfig(precision=sampler.precision)).score(P, r.response_token_ids)
    fp32 = HFSampler(model_dir).score(P, r.response_token_ids)
    return _mean_abs(r.logprobs, same), _mean_abs(same, fp32)


def test_bf16(tiny_dir):
    s = make_sampler(tiny_dir, VLLMEngineConfig(precision="bf16", kv_cache_gib=0.0625))
    try:
        assert s.llm.llm_engine.model_config.dtype == torch.bfloat16
        vs_hf, hf_vs_fp32 = _gaps(s, tiny_dir)
        assert vs_hf < 0.15 and 1e-4 < hf_vs_fp32 < 0.15
    finally:
        s.close()


def test_fp8_emulated_including_weight_sync(tiny_dir, tmp_path):
    s = make_sampler(tiny_dir, VLLMEngineConfig(precision="fp8_emulated", kv_cache_gib=0.0625))
    try:
        assert s.llm.llm_engine.model_config.dtype == torch.bfloat16
        vs_hf, fp8_effect = _gaps(s, tiny_dir)
        assert vs_hf < 0.25 * fp8_effect  # both engines round the same weights the same way
        # update_weights applies the same rounding to the learner's stream
        s.update_weights(perturbed(tiny_dir))
        vs_hf, fp8_effect = _gaps(s, save_stream(perturbed(tiny_dir), tiny_dir, tmp_path / "new"))
        assert vs_hf < 0.25 * fp8_effect
    finally:
        s.close()
