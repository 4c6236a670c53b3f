"""Chunked vocab-parallel log-probs and entropy equal the full-logits computation (values and
gradients), never hold more than one chunk of logits, and never return a positive log-prob."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.config import ConfigError, load_config
from moe_rl.learner.chunked_logprobs import chunked_token_logprobs
from moe_rl_testing.dist_helpers import torchrun
from moe_rl_testing.logprob_reference import full_token_logprobs, logprob_case, values_and_grads

N, H, V = 10, 6, 23


def _assert_close(got: dict, want: dict, tol: float) -> None:
    """max |chunked - full| <= tol * max(1, max |full|), for every value and gradient (relative
    to the tensor's scale: fp32 log-probs of -25 carry an ulp of 2e-6)."""
    for key in ("logp", "entropy", "grad_h", "grad_w"):
        err = (got[key].double() - want[key].double()).abs().max().item()
        bound = tol * max(1.0, want[key].abs().max().item())
        assert err <= bound, f"{key}: max |chunked - full| = {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("chunk", [1, 3, 7, N, N + 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_logits_values_and_gradients_fp64(chunk, temperature):
    case = logprob_case(N, H, V, seed=chunk)
    want = values_and_grads(full_token_logprobs, case, temperature=temperature)
    got = values_and_grads(partial(chunked_token_logprobs, chunk_tokens=chunk), case, temperature=temperature)
    _assert_close(got, want, tol=1e-12)
    assert want["grad_w"].abs().max() > 0.1  # the comparison is not between zeros


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_fp32_is_within_1e_6_of_the_exact_full_logits(chunk):
    case = logprob_case(40, 16, 101, seed=3, dtype=torch.float32)
    exact = {k: v.double() if v.is_floating_point() else v for k, v in case.items()}
    want = values_and_grads(full_token_logprobs, exact, temperature=0.9)
    got = values_and_grads(partial(chunked_token_logprobs, chunk_tokens=chunk), case, temperature=0.9)
    assert got["logp"].dtype == torch.float32 and got["grad_w"].dtype == torch.float32
    _assert_close(got, want, tol=1e-6)


def test_gradcheck_float64_both_outputs():
    case = logprob_case(5, 3, 7, seed=11)
    h = case["hidden_NH"].requires_grad_(True)
    w = case["weight_VH"].requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_token_logprobs(h, w, case["targets_N"], temperature=1.3, chunk_tokens=2),
        (h, w), eps=1e-6, atol=1e-8,
    )


def test_only_the_log_prob_needs_a_gradient():
    case = logprob_case(N, H, V, seed=5)
    case["g_entropy_N"] = torch.zeros(N, dtype=torch.float64)
    want = values_and_grads(full_token_logprobs, case)
    h = case["hidden_NH"].clone().requires_grad_(True)
    w = case["weight_VH"].clone().requires_grad_(True)
    logp_N, entropy_N = chunked_token_logprobs(h, w, case["targets_N"], chunk_tokens=4, with_entropy=False)
    assert entropy_N is None
    grad_h, grad_w = torch.autograd.grad(logp_N, (h, w), case["g_logp_N"])
    _assert_close({"logp": logp_N, "entropy": want["entropy"], "grad_h": grad_h, "grad_w": grad_w}, want, tol=1e-12)


def test_bf16_inputs_compute_in_fp32_and_return_grads_in_bf16():
    case = logprob_case(N, H, V, seed=7, dtype=torch.bfloat16)
    got = values_and_grads(partial(chunked_token_logprobs, chunk_tokens=3), case)
    as_fp32 = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
    want = values_and_grads(partial(chunked_token_logprobs, chunk_tokens=3), as_fp32)
    assert got["logp"].dtype == torch.float32 and got["entropy"].dtype == torch.float32
    assert got["grad_h"].dtype == torch.bfloat16 and got["grad_w"].dtype == torch.bfloat16
    assert torch.equal(got["logp"], want["logp"]) and torch.equal(got["entropy"], want["entropy"])
    assert torch.equal(got["grad_w"], want["grad_w"].bfloat16())


def test_no_tokens_gives_empty_outputs_and_zero_gradients():
    case = logprob_case(0, H, V, seed=0)
    got = values_and_grads(partial(chunked_token_logprobs, chunk_tokens=4), case)
    assert got["logp"].shape == (0,) and got["entropy"].shape == (0,)
    assert got["grad_h"].shape == (0, H) and torch.equal(got["grad_w"], torch.zeros(V, H, dtype=torch.float64))


class _LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("fn,bound", [(partial(chunked_token_logprobs, chunk_tokens=8), 8 * 50), (full_token_logprobs, 64 * 50)])
def test_forward_and_backward_never_hold_more_than_one_chunk_of_logits(fn, bound):
    # N*V = 3200 full logits; a chunk is 8*V = 400; inputs and grads are at most V*H = 200.
    case = logprob_case(64, 4, 50, seed=2)
    with _LargestOutput() as seen:
        values_and_grads(fn, case)
    assert seen.largest == bound


def test_only_inputs_and_per_token_scalars_are_saved_for_backward():
    case = logprob_case(64, 4, 50, seed=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        values_and_grads(partial(chunked_token_logprobs, chunk_tokens=8), case)
    assert sorted(saved) == sorted([(64,), (64,), (64,), (64, 4), (50, 4)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e4]),
       chunk=st.integers(1, 9), temperature=st.sampled_from([0.3, 1.0, 2.0]))
def test_log_probs_are_never_positive_and_entropy_is_within_0_and_log_v(seed, scale, chunk, temperature):
    case = logprob_case(9, 5, 31, seed=seed, dtype=torch.float32, scale=scale)
    logp_N, entropy_N = chunked_token_logprobs(case["hidden_NH"], case["weight_VH"], case["targets_N"],
                                               temperature=temperature, chunk_tokens=chunk)
    assert torch.isfinite(logp_N).all() and torch.isfinite(entropy_N).all()
    assert (logp_N <= 0).all(), logp_N.max()
    assert (entropy_N >= 0).all() and (entropy_N <= math.log(31) * (1 + 1e-6)).all(), entropy_N


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"chunk_tokens": 0}, "chunk_tokens must be >= 1"),
    ({"vocab_start": 5}, "held by 0 vocabulary shards"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    case = logprob_case(N, H, V, seed=1)
    case["targets_N"][0] = 2  # below vocab_start=5: held by no shard
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(case["hidden_NH"], case["weight_VH"], case["targets_N"], **kwargs)


def test_target_beyond_the_vocabulary_is_refused():
    case = logprob_case(N, H, V, seed=1)
    case["targets_N"][3] = V
    with pytest.raises(ValueError, match=f"target id {V} \\(token 3\\) is held by 0"):
        chunked_token_logprobs(case["hidden_NH"], case["weight_VH"], case["targets_N"])


@pytest.mark.multiproc
def test_tensor_parallel_2_equals_the_single_process_full_logits(tmp_path):
    out = tmp_path / "tp2.json"
    torchrun("chunked_logprobs_worker.py", 2, str(out), timeout=300)
    errors = json.loads(out.read_text())
    assert len(errors) == 2 * 3  # 2 ranks x 3 cases
    for e in errors:
        assert e["logp"] <= 1e-6 and e["entropy"] <= 1e-6, e
        assert e["grad_h"] <= 1e-6 and e["grad_w"] <= 1e-6, e
        assert e["owned_targets"] > 0  # each rank reads some targets' logits


def test_the_chunk_size_key_defaults_on_and_refuses_negative_values():
    assert load_config(None).parallel.logprob_chunk_tokens == 1024
    assert load_config(None, ["parallel.logprob_chunk_tokens=0"]).parallel.logprob_chunk_tokens == 0
    with pytest.raises(ConfigError, match=r"parallel.logprob_chunk_tokens must be >= 0 \(0: full logits\), got -1"):
        load_config(None, ["parallel.logprob_chunk_tokens=-1"])


def test_the_logit_gradient_splits_into_two_bf16_halves_within_2_to_the_minus_16():
    """hi = t rounded to bf16, lo = (t - hi) rounded: |t - hi - lo| <= 2^-9 |t - hi| <= 2^-17 |t|
    per element (each bf16 rounding is within half an ulp, 2^-9 relative)."""
    from moe_rl.learner.chunked_logprobs import _halves

    t = torch.randn(5, 37, generator=torch.Generator().manual_seed(3)) * torch.logspace(-6, 2, 37)
    want = t.clone()
    halves = _halves(t, torch.bfloat16)
    assert halves.shape == (10, 37) and halves.dtype == torch.bfloat16
    err = (want - halves[:5].float() - halves[5:].float()).abs()
    assert bool((err <= 2.0**-17 * want.abs()).all()), float((err / want.abs()).max())
    assert bool(((want - halves[:5].float()).abs() > err).any())  # lo carries what hi loses
