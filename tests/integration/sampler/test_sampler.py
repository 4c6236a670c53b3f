"""Sampler pieces that need no vLLM: Rollouts, precision transform, transformers backend."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from moe_rl.convert.safetensors_writer import buckets, write_safetensors_buckets
from moe_rl.sampler import HFEngineConfig, Rollouts, Sampler, make_sampler
from moe_rl.sampler.base import sample_seeds
from moe_rl.sampler.hf_backend import HFSampler, top_p_filter
from moe_rl.sampler.precision import (
    FP8_MAX,
    fp8_round_trip,
    is_quantized,
    precision_dtype,
    transform_weight,
)
from moe_rl.sampler.weights import iter_checkpoint
from moe_rl_testing.sampler_utils import (
    TINY,
    build_tiny_moe,
    eos_of,
    max_abs_untied,
    perturbed,
    prompts,
    save_stream,
)


def _max_abs(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s))


def _prompts_of(r: Rollouts) -> list[list[int]]:
    return [r.prompt_token_ids[i] for i in r.prompt_index]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return make_sampler(tiny_dir, HFEngineConfig(batch_size=16))


# --------------------------------------------------------------------------- Rollouts


def test_rollouts_to_padded():
    r = Rollouts(
        prompt_token_ids=[[1, 2], [3]],
        prompt_index=[0, 0, 1],
        response_token_ids=[[5, 6, 7], [8], [9, 10]],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6]],
        finish_reasons=["length", "stop", "stop"],
    )
    p = r.to_padded(pad_token_id=-1)
    assert p["response_ids_BT"].tolist() == [[5, 6, 7], [8, -1, -1], [9, 10, -1]]
    assert p["mask_BT"].tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert p["lengths_B"].tolist() == [3, 1, 2]
    torch.testing.assert_close(p["logprobs_BT"][1], torch.tensor([-0.4, 0.0, 0.0]))
    with pytest.raises(ValueError, match="one logprob per token"):
        Rollouts([[1]], [0], [[2, 3]], [[-1.0]], ["stop"])


def test_sample_seeds_are_distinct_and_reproducible():
    s = sample_seeds(7, num_prompts=3, n=4)
    assert s == sample_seeds(7, 3, 4) and len(set(s)) == 12
    assert s[1] == s[0] + 1  # vLLM's child-seed rule: request seed + sample index
    assert not set(s) & set(sample_seeds(8, 3, 4))


# --------------------------------------------------------------------------- precision


def test_which_tensors_fp8_rounds():
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.1.mlp.experts.0.down_proj.weight",
        "model.layers.1.mlp.shared_expert.up_proj.weight",
    ]:
        assert is_quantized(name), name
    for name in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.mlp.gate.weight",  # the router
        "model.layers.1.mlp.shared_expert_gate.weight",
    ]:
        assert not is_quantized(name), name


def test_fp8_round_trip_is_a_per_tensor_e4m3_grid():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 0.3
    q = fp8_round_trip(w)
    scale = w.abs().max() / FP8_MAX
    grid = q / scale
    # every value sits on the float8_e4m3fn grid, and the largest maps to 448 exactly
    torch.testing.assert_close(grid, grid.to(torch.float8_e4m3fn).to(torch.float32), rtol=0, atol=1e-4)
    assert torch.isclose(q.abs().max(), w.abs().max())
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values
    normal = grid.abs() >= 2**-6
    assert ((q - w).abs()[normal] <= w.abs()[normal] * 2**-4 + 1e-7).all()
    assert 0 < (q - w).abs().max() < 0.1 * w.abs().max()
    assert torch.equal(fp8_round_trip(torch.zeros(3)), torch.zeros(3))


def test_transform_weight_dtypes():
    w = torch.randn(8, 8)
    assert transform_weight("lm_head.weight", w, "fp32").dtype == torch.float32
    assert transform_weight("lm_head.weight", w, "bf16").dtype == torch.bfloat16
    torch.testing.assert_close(transform_weight("lm_head.weight", w, "fp8_emulated"), w.to(torch.bfloat16), rtol=0, atol=0)
    q = transform_weight("model.layers.0.self_attn.q_proj.weight", w, "fp8_emulated")
    assert q.dtype == torch.bfloat16 and not torch.equal(q, w.to(torch.bfloat16))
    assert precision_dtype("fp8_emulated") == torch.bfloat16
    with pytest.raises(ValueError, match="fp32"):
        precision_dtype("fp16")


# --------------------------------------------------------------------------- weights


def test_buckets_and_disk_round_trip(tiny_dir, tmp_path):
    tensors = list(iter_checkpoint(tiny_dir))
    groups = list(buckets(tensors, bucket_bytes=200_000))
    assert len(groups) > 1 and [n for g in groups for n, _ in g] == [n for n, _ in tensors]
    names = write_safetensors_buckets(tensors, tmp_path / "b", bucket_bytes=200_000)
    assert len(list((tmp_path / "b").glob("*.safetensors"))) == len(groups)
    back = dict(iter_checkpoint(tmp_path / "b"))
    assert names == [n for n, _ in tensors] and all(torch.equal(back[n], t) for n, t in tensors)


# --------------------------------------------------------------------------- transformers backend


def test_hf_sampler_is_a_sampler(hf):
    assert isinstance(hf, Sampler) and hf.returns_routed_experts
    with pytest.raises(TypeError, match="needs a VLLMEngineConfig or HFEngineConfig, got dict"):
        make_sampler("x", {"backend": "sglang"})


def test_hf_generate_layout_and_determinism(hf, tiny_dir):
    ps = prompts(3)
    r = hf.generate(ps, n=4, max_new_tokens=16, temperature=1.0, seed=5)
    assert len(r) == 12 and r.prompt_index == [0] * 4 + [1] * 4 + [2] * 4
    assert r.prompt_token_ids == ps
    eos = eos_of(tiny_dir)
    for ids, lps, fin in zip(r.response_token_ids, r.logprobs, r.finish_reasons):
        assert 1 <= len(ids) <= 16 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
        assert (fin == "stop") == (ids[-1] == eos) and eos not in ids[:-1]
        assert fin == "stop" or len(ids) == 16
    assert {"stop", "length"} <= set(r.finish_reasons)  # the tiny model does both
    again = hf.generate(ps, n=4, max_new_tokens=16, temperature=1.0, seed=5)
    assert again.response_token_ids == r.response_token_ids and again.logprobs == r.logprobs
    other = hf.generate(ps, n=4, max_new_tokens=16, temperature=1.0, seed=6)
    assert other.response_token_ids != r.response_token_ids
    # a row's sample does not depend on what it is batched with
    small = HFSampler(tiny_dir, HFEngineConfig(batch_size=3))
    assert small.generate(ps, n=4, max_new_tokens=16, seed=5).response_token_ids == r.response_token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_sample_logprobs_are_teacher_forced_logprobs(hf, temperature):
    r = hf.generate(prompts(4), n=4, max_new_tokens=16, temperature=temperature, seed=1)
    P, R = _prompts_of(r), r.response_token_ids
    scored = hf.score(P, R, temperature=temperature)
    # (batched, left-padded, cached decoding vs one unpadded forward)
    assert max_abs_untied(r.logprobs, scored, P, R, hf.model) < 1e-4
    if temperature != 1.0:  # the temperature really is in the logprobs
        assert _max_abs(r.logprobs, hf.score(_prompts_of(r), r.response_token_ids, 1.0)) > 1e-2


def test_hf_top_p(hf):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    kept = top_p_filter(logits, 0.8).isfinite()
    p = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, 0.03: the 0.8 nucleus is the top two
    assert kept.tolist() == [[True, True, False, False]] and p[:2].sum() >= 0.8
    r = hf.generate(prompts(2), n=8, max_new_tokens=8, top_p=0.5, seed=0)
    full = hf.score(_prompts_of(r), r.response_token_ids)
    # truncated-and-renormalised logprobs are never below the full-distribution ones
    assert all(a >= b - 1e-5 for x, y in zip(r.logprobs, full) for a, b in zip(x, y))


def _reference_routing(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """Top-k ids recomputed from each router's input on an unpadded, cache-free forward."""
    ids_by_layer = {}

    def hook(layer_id):
        def fn(module, inputs, output):
            x = inputs[0].reshape(-1, module.weight.shape[1])
            probs = torch.softmax(torch.nn.functional.linear(x, module.weight).float(), dim=-1)
            ids_by_layer[layer_id] = torch.topk(probs, TINY["num_experts_per_tok"], dim=-1).indices

        return fn

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        seq = prompt + response[:-1]  # the last sampled token is never fed
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([ids_by_layer[i] for i in range(len(ids_by_layer))], dim=1).numpy()


def test_hf_routed_experts_in_vllm_layout(hf):
    ps = prompts(3, length=7)
    r = hf.generate(ps, n=3, max_new_tokens=12, seed=2)
    assert r.routed_experts is not None and len(r.routed_experts) == len(r)
    for i, (ids, routed) in enumerate(zip(r.response_token_ids, r.routed_experts)):
        prompt = r.prompt_token_ids[r.prompt_index[i]]
        L, K = TINY["num_hidden_layers"], TINY["num_experts_per_tok"]
        assert routed.shape == (len(prompt) + len(ids) - 1, L, K) and routed.dtype == np.uint8
        assert (np.sort(routed, axis=-1)[..., 1:] != np.sort(routed, axis=-1)[..., :-1]).all()  # K distinct
        np.testing.assert_array_equal(routed, _reference_routing(hf.model, prompt, ids))


@pytest.fixture
def fresh_hf(tiny_dir):
    return HFSampler(tiny_dir)


def test_hf_update_weights_matches_reloaded_model(fresh_hf, tiny_dir, tmp_path):
    ps = prompts(3)
    r = fresh_hf.generate(ps, n=4, max_new_tokens=12, seed=3)
    before = fresh_hf.score(_prompts_of(r), r.response_token_ids)
    fresh_hf.update_weights(perturbed(tiny_dir))
    new_dir = save_stream(perturbed(tiny_dir), tiny_dir, tmp_path / "new")
    ref = HFSampler(new_dir)
    after = fresh_hf.score(_prompts_of(r), r.response_token_ids)
    assert _max_abs(before, after) > 0.1
    assert _max_abs(after, ref.score(_prompts_of(r), r.response_token_ids)) < 1e-5
    with pytest.raises(KeyError, match="matches no parameter"):
        fresh_hf.update_weights([("model.layers.0.mlp.nonsense.weight", torch.zeros(1))])


@pytest.mark.parametrize("precision", ["bf16", "fp8_emulated"])
def test_hf_reduced_precisions(tiny_dir, hf, precision):
    s = HFSampler(tiny_dir, HFEngineConfig(precision=precision))
    assert s.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    experts = s.model.model.layers[1].mlp.experts
    ckpt = dict(iter_checkpoint(tiny_dir))
    up = ckpt["model.layers.1.mlp.experts.3.up_proj.weight"]
    want = transform_weight("model.layers.1.mlp.experts.3.up_proj.weight", up, precision)
    torch.testing.assert_close(experts.gate_up_proj[3, up.shape[0] :], want, rtol=0, atol=0)
    router = s.model.model.layers[1].mlp.gate.weight
    torch.testing.assert_close(router, ckpt["model.layers.1.mlp.gate.weight"].to(torch.bfloat16), rtol=0, atol=0)
    r = s.generate(prompts(4), n=4, max_new_tokens=12, seed=0)
    ref = hf.score(_prompts_of(r), r.response_token_ids)
    gap = statistics.fmean(abs(a - b) for x, y in zip(r.logprobs, ref) for a, b in zip(x, y))
    assert 1e-4 < gap < 0.5  # a real, modest mismatch with the fp32 model
