"""Structural properties of every objective: on-policy equivalence to REINFORCE,
gspo_token == gspo, stop-gradients, micro-batch / data-parallel invariance, robustness
(property-based), and clear errors on illegal inputs."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_rl.objectives import (
    OBJECTIVES,
    CommonHParams,
    PolicyBatch,
    combine_metrics,
    make_common_hparams,
    make_hparams,
    policy_loss,
    register_objective,
)
from moe_rl.runtime.registry import UnknownNameError

NAMES = list(OBJECTIVES)
SEQ_LEVEL = [n for n in NAMES if OBJECTIVES[n].level == "sequence"]


def random_batch(
    B=8, T=7, *, seed=0, on_policy=False, dtype=torch.float32, lens=None, scale=0.3, **with_
) -> tuple[PolicyBatch, torch.Tensor]:
    """Random right-padded batch with empty rows; NaN garbage on padding."""
    g = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(0, T + 1, (B,), generator=g)
        lens[0], lens[-1] = 0, T  # at least one empty and one full row
    mask = torch.arange(T)[None, :] < torch.as_tensor(lens)[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp if on_policy else logp - scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    kwargs = {}
    if with_.get("router_shift", True):
        kwargs["router_shift"] = torch.where(
            mask, 0.05 + 0.95 * torch.rand(B, T, generator=g, dtype=torch.float64), nan
        ).to(dtype)
    if with_.get("ref", False):
        kwargs["ref_logprobs"] = torch.where(mask, logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64), nan).to(dtype)
    if with_.get("rollout", False):
        kwargs["rollout_logprobs"] = torch.where(mask, old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64), nan).to(dtype)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[1] = 0.0
    lp = torch.where(mask, logp, nan).to(dtype).requires_grad_(True)
    batch = PolicyBatch(lp, torch.where(mask, old, nan).to(dtype), adv.to(dtype), mask, **kwargs)
    return batch, lp


def grad_of(name, batch, lp, **hp):
    lp.grad = None
    out = policy_loss(name, batch, **hp)
    out.loss.backward()
    return out, lp.grad.clone()


# --------------------------------------------------------------------------- on-policy


def aggregation_weight(name: str, mask: torch.Tensor) -> torch.Tensor:
    """Per-token weight of each objective's aggregation, written out independently."""
    B, T = mask.shape
    mask = mask.double()
    n = mask.sum(1, keepdim=True)
    n_tok, n_seq = mask.sum().double(), (n > 0).sum().double()
    per_seq = mask / (n.clamp(min=1) * n_seq)  # (1/B') (1/n_i)
    return {
        "grpo": per_seq,
        "dr_grpo": mask / (B * T),  # (1/B) (1/L_max), L_max = T
        "dapo": mask / n_tok,
        "gspo": per_seq,  # s_i = 1, d s_i / d logp_it = 1/n_i, seq-mean 1/B'
        "gspo_token": per_seq,
        "gmpo": per_seq,
        "rspo": per_seq,
        "cispo": mask / n_tok,
        "sapo": per_seq,  # gate gradient 4 p (1 - p) rho = 1 at rho = 1
    }[name].double()


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_gradient_is_reinforce(name):
    batch, lp = random_batch(seed=1, on_policy=True, dtype=torch.float64)
    # RSPO's pre_clip placement clips log g for A < 0 when g < e^-0.4: keep gamma above it
    # so that the on-policy statement holds for both placements.
    batch = dataclasses.replace(
        batch, router_shift=0.7 + 0.3 * torch.rand(batch.logprobs.shape, dtype=torch.float64)
    )
    for hp in [{}] + ([{"gamma_placement": "pre_clip"}] if name == "rspo" else []):
        _, grad = grad_of(name, batch, lp, **hp)
        adv = batch.advantages[:, None]
        expected = -adv * aggregation_weight(name, batch.response_mask)
        if name == "rspo":  # up to S_i = exp(mean_t sgn(A_i) log g) (post) or exp(mean_t log g) (pre)
            log_g = torch.where(batch.response_mask, batch.router_shift.log(), 0.0)
            sgn = torch.sign(batch.advantages)[:, None] if not hp else 1.0
            n = batch.response_mask.sum(1, keepdim=True).clamp(min=1)
            expected = expected * torch.exp((sgn * log_g).sum(1, keepdim=True) / n)
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-10)


# --------------------------------------------------------------------------- gspo_token == gspo


@pytest.mark.parametrize("band", [{}, {"clip_low": 0.2, "clip_high": 0.2}, {"clip_low": 0.05, "clip_high": 0.05}])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_equals_gspo(band, seed):
    batch, lp = random_batch(seed=seed, scale=0.1)
    out_seq, grad_seq = grad_of("gspo", batch, lp, **band)
    out_tok, grad_tok = grad_of("gspo_token", batch, lp, **band)
    torch.testing.assert_close(out_tok.loss, out_seq.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_tok, grad_seq, atol=1e-7, rtol=1e-6)
    # and with the same advantages written per token
    batch_bt = PolicyBatch(
        lp, batch.old_logprobs, batch.advantages[:, None].expand_as(lp).clone(), batch.response_mask
    )
    out_bt, grad_bt = grad_of("gspo_token", batch_bt, lp, **band)
    torch.testing.assert_close(out_bt.loss, out_seq.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_bt, grad_seq, atol=1e-7, rtol=1e-6)


# --------------------------------------------------------------------------- stop-gradients


def test_stop_gradients():
    """gamma (RSPO), the CISPO weight's inputs, TIS/MIS inputs, old and ref logprobs get no
    gradient, and the advantages are constants."""
    batch, lp = random_batch(seed=3, ref=True, rollout=True)
    for t in (batch.old_logprobs, batch.rollout_logprobs, batch.ref_logprobs, batch.router_shift, batch.advantages):
        t.requires_grad_(True)
    for name in NAMES:
        for corr in ("tis", "mis", "icepop"):
            out = policy_loss(name, batch, rollout_correction=corr, kl_coef=0.1)
            out.loss.backward()
    assert lp.grad is not None
    for t in (batch.old_logprobs, batch.rollout_logprobs, batch.ref_logprobs, batch.router_shift, batch.advantages):
        assert t.grad is None


def test_cispo_weight_is_stop_gradient():
    # With the weight detached, d/d logp of sg[w] A logp is w A exactly; if the weight carried
    # gradient there would be an extra w A logp term on every unclipped token.
    batch, lp = random_batch(seed=4, scale=0.5)
    _, grad = grad_of("cispo", batch, lp, clip_high=0.3, clip_low=0.3)
    mask = batch.response_mask
    rho = torch.exp(torch.where(mask, batch.logprobs.detach() - batch.old_logprobs, 0.0))
    w = rho.clamp(0.7, 1.3)
    expected = torch.where(mask, -w * batch.advantages[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(grad, expected, atol=1e-7, rtol=1e-6)


def test_rspo_gamma_enters_only_as_a_constant():
    batch, lp = random_batch(seed=5)
    _, grad = grad_of("rspo", batch, lp)
    shift = batch.router_shift.clone().requires_grad_(True)
    out = policy_loss("rspo", dataclasses.replace(batch, router_shift=shift))
    grad_lp, grad_shift = torch.autograd.grad(out.loss, [lp, shift], allow_unused=True)
    torch.testing.assert_close(grad_lp, grad)
    assert grad_shift is None


# --------------------------------------------------------------------------- micro-batch invariance


CORRECTIONS = [
    {},
    {"rollout_correction": "tis", "kl_coef": 0.05},
    {"rollout_correction": "icepop", "kl_coef": 0.05, "kl_estimator": "k2"},
]


@pytest.mark.parametrize("extra", CORRECTIONS, ids=["plain", "tis+kl", "icepop+kl"])
@pytest.mark.parametrize("name", NAMES)
def test_micro_batch_invariance(name, extra):
    B, T = 8, 7
    batch, lp = random_batch(B, T, seed=6, ref=True, rollout=True)
    mask = batch.response_mask
    norms = {
        "token_normalizer": mask.sum(),  # 0-d tensors (what an all-reduce hands back) ...
        "seq_normalizer": int((mask.sum(1) > 0).sum()),  # ... or plain numbers
        "num_sequences_total": B,
        "max_response_length": T,
    }
    whole, grad_whole = grad_of(name, batch, lp, **extra)
    for pieces in (2, 4):
        lp.grad = None
        total = 0.0
        outs = []
        for rows in torch.arange(B).chunk(pieces):
            i, j = int(rows[0]), int(rows[-1]) + 1
            part = PolicyBatch(
                lp[i:j],
                batch.old_logprobs[i:j],
                batch.advantages[i:j],
                mask[i:j],
                rollout_logprobs=batch.rollout_logprobs[i:j],
                ref_logprobs=batch.ref_logprobs[i:j],
                router_shift=batch.router_shift[i:j],
            )
            out = policy_loss(name, part, **norms, **extra)
            out.loss.backward()  # gradients accumulate as they would over micro-batches / ranks
            total = total + out.loss.detach()
            outs.append(out)
        torch.testing.assert_close(total, whole.loss.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(lp.grad, grad_whole, atol=1e-6, rtol=0)
        # Metrics combined by the naming convention equal the whole batch's.
        combined = combine_metrics(outs, OBJECTIVES[name].level)
        for key, value in whole.metrics.items():
            torch.testing.assert_close(combined[key], value.float(), atol=1e-5, rtol=1e-5, msg=key)


# --------------------------------------------------------------------------- robustness


@st.composite
def batches(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 7))
    lens = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    floats = st.floats(-50, 50, allow_nan=False, width=32)
    lr = torch.tensor(draw(st.lists(st.lists(floats, min_size=T, max_size=T), min_size=B, max_size=B)))
    adv = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 1e-3, -2.5, 7.0]), min_size=B, max_size=B)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return B, T, lens, lr, adv, dtype


IS_RS_FORMS = {
    "is_rs_token": {"rollout_correction": "is_rs", "is_level": "token", "rs_level": "token", "rs_high": 2.0,
                    "is_batch_normalize": True},
    "is_rs_seq": {"rollout_correction": "is_rs", "is_level": "sequence", "rs_level": "sequence", "rs_high": 100.0},
    "is_rs_geo_veto": {"rollout_correction": "is_rs", "is_level": "geometric", "rs_level": "geometric",
                       "rs_high": 1.5, "veto_below": 1e-3, "is_batch_normalize": True},
}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=batches(),
    name=st.sampled_from(NAMES),
    corr=st.sampled_from(["none", "tis", "mis", "icepop", *IS_RS_FORMS]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    per_token_adv=st.booleans(),
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    opsm=st.sampled_from([None, 0.0, 0.5]),
)
def test_robustness(data, name, corr, kl, per_token_adv, garbage, opsm):
    B, T, lens, lr, adv, dtype = data
    mask = torch.arange(T)[None, :] < torch.tensor(lens)[:, None]
    logp = -torch.rand(B, T) * 5
    fill = torch.tensor(garbage)
    lp = torch.where(mask, logp, fill).to(dtype).requires_grad_(True)
    old = torch.where(mask, logp - lr, fill).to(dtype)
    advantages = adv
    if per_token_adv and OBJECTIVES[name].level == "token" and opsm is None:
        advantages = torch.where(mask, adv[:, None] * torch.rand(B, T), fill)
    batch = PolicyBatch(
        lp,
        old,
        advantages.to(dtype),
        mask,
        rollout_logprobs=torch.where(mask, logp - lr.flip(1), fill).to(dtype),
        ref_logprobs=torch.where(mask, logp + lr.flip(0), fill).to(dtype),
        router_shift=torch.where(mask, torch.rand(B, T), fill).to(dtype),
    )
    hp = {"rollout_correction": corr, "opsm_delta": opsm}
    if corr in IS_RS_FORMS:
        hp = {**IS_RS_FORMS[corr], "opsm_delta": opsm}
        if OBJECTIVES[name].level == "sequence" and hp.get("is_level") == "token":
            hp["is_level"] = "geometric"
    if kl is not None:
        hp |= {"kl_coef": 0.1, "kl_estimator": kl}
    out = policy_loss(name, batch, **hp)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert lp.grad.dtype == dtype and torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()
    any_valid = bool(out.num_tokens > 0)  # (kept tokens: a correction may reject them all)
    for key, v in out.metrics.items():
        assert v.ndim == 0 and not v.requires_grad
        if any_valid or not key.endswith(("_max", "_min")):
            assert torch.isfinite(v), key
    if not any_valid:
        assert out.loss.item() == 0.0


def test_empty_batch_and_all_padding():
    for B, T in [(0, 4), (3, 0), (2, 3)]:
        lp = torch.full((B, T), float("nan"), requires_grad=True)
        batch = PolicyBatch(
            lp,
            torch.zeros(B, T),
            torch.ones(B),
            torch.zeros(B, T, dtype=torch.bool),
            router_shift=torch.ones(B, T),
        )
        for name in NAMES:
            out = policy_loss(name, batch)
            out.loss.backward()
            assert out.loss.item() == 0.0 and out.metrics["ratio_max"].item() == -math.inf
            assert out.num_tokens.item() == 0 and out.num_sequences.item() == 0
            assert torch.isfinite(lp.grad).all() if lp.grad is not None else True


# --------------------------------------------------------------------------- illegal inputs


def test_shape_and_dtype_errors_name_the_field():
    B, T = 2, 3
    ok = dict(
        logprobs=torch.zeros(B, T),
        old_logprobs=torch.zeros(B, T),
        advantages=torch.zeros(B),
        response_mask=torch.ones(B, T, dtype=torch.bool),
    )
    bad = {
        "logprobs": torch.zeros(B * T),
        "old_logprobs": torch.zeros(B, T + 1),
        "advantages": torch.zeros(B + 1),
        "response_mask": torch.ones(B, T),  # float, not bool
        "rollout_logprobs": torch.zeros(B, 1),
        "ref_logprobs": torch.zeros(T, B),
        "router_shift": torch.zeros(B, T, dtype=torch.int64),
    }
    for field, value in bad.items():
        with pytest.raises(ValueError, match=f"PolicyBatch.{field}"):
            PolicyBatch(**(ok | {field: value}))


def test_missing_inputs_are_errors():
    batch, _ = random_batch(router_shift=False)
    with pytest.raises(ValueError, match="router_shift"):
        policy_loss("rspo", batch)  # never GMPO in disguise
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss("grpo", batch, kl_coef=0.1)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss("dapo", batch, rollout_correction="tis")
    per_token = PolicyBatch(
        batch.logprobs,
        batch.old_logprobs,
        torch.zeros_like(batch.logprobs),
        batch.response_mask,
        router_shift=torch.ones_like(batch.logprobs),
    )
    for name in SEQ_LEVEL:
        with pytest.raises(ValueError, match=r"advantages of shape \[B\]"):
            policy_loss(name, per_token)


def test_names_and_hyperparameters_are_checked():
    batch, _ = random_batch()
    with pytest.raises(ValueError, match="valid names: grpo, dr_grpo, dapo, gspo"):
        policy_loss("nope", batch)
    with pytest.raises(UnknownNameError):
        OBJECTIVES["nope"]
    assert "nope" not in OBJECTIVES and OBJECTIVES.get("nope") is None
    with pytest.raises(ValueError, match=r"'clip_lo'.*valid: clip_low, clip_high.*shared: tis_cap, mis_low, mis_high, is_level"):
        policy_loss("grpo", batch, clip_lo=0.1)
    with pytest.raises(ValueError, match="'tau' for objective 'sapo'; valid: tau_pos, tau_neg"):
        make_hparams("sapo", tau=1.0)
    with pytest.raises(ValueError, match="'tis_c'"):
        make_common_hparams(tis_c=3.0)
    assert make_hparams("dapo").clip_high == 0.28
    assert make_hparams("rspo", gamma_placement="pre_clip").gamma_placement == "pre_clip"
    bad_values = [
        ("grpo", {"clip_low": 1.5}),
        ("gspo", {"clip_high": -1.0}),
        ("rspo", {"gamma_min": 0.0}),
        ("rspo", {"gamma_placement": "inside"}),
        ("sapo", {"tau_neg": 0.0}),
        ("cispo", {"clip_low": 1.0}),
        ("grpo", {"rollout_correction": "is"}),
        ("grpo", {"kl_estimator": "k4"}),
        ("grpo", {"mis_low": 2.0, "mis_high": 1.0}),
        ("grpo", {"token_normalizer": -1}),
        ("dr_grpo", {"max_response_length": 0}),
    ]
    for name, hp in bad_values:
        with pytest.raises(ValueError, match=next(iter(hp))):
            policy_loss(name, batch, **hp)


def test_registry_refuses_duplicates():
    spec = OBJECTIVES["grpo"]
    with pytest.raises(ValueError, match="already registered"):
        register_objective(
            "grpo", hparams=spec.hparams, aggregation=spec.aggregation, paper="", fixes=""
        )(spec.fn)


def test_specs_and_docstrings():
    """Each objective names its paper and what it fixes; every hyperparameter has a docstring
    (the attribute-docstring style RLConfig validation and --help-config read)."""
    from moe_rl.config import field_docs

    for name, spec in OBJECTIVES.items():
        assert spec.name == name and spec.level in ("token", "sequence")
        assert "arXiv:" in spec.paper and spec.fixes
        arxiv = re.search(r"arXiv:\d{4}\.\d{5}", spec.paper).group()
        assert arxiv in spec.fn.__doc__ and "Fixes" in spec.fn.__doc__, name
        assert spec.needs_router_shift == (name == "rspo")
        docs = field_docs(spec.hparams)
        for f in spec.hparams.__dataclass_fields__:
            assert docs.get(f), f"{name}.{f} has no docstring"
    docs = field_docs(CommonHParams)
    assert all(docs.get(f) for f in CommonHParams.__dataclass_fields__)
    assert set(SEQ_LEVEL) == {"gspo", "gmpo", "rspo"}


@pytest.mark.parametrize("name", NAMES)
def test_bf16_inputs_compute_in_fp32(name):
    """bf16 inputs are upcast before any arithmetic: the loss equals the fp32 loss on the same
    (bf16-representable) values, and the gradient is that fp32 gradient rounded to bf16."""
    batch16, lp16 = random_batch(seed=7, dtype=torch.bfloat16, ref=True, rollout=True)
    lp32 = lp16.detach().float().requires_grad_(True)
    batch32 = PolicyBatch(
        lp32,
        *(t.float() for t in (batch16.old_logprobs, batch16.advantages)),
        batch16.response_mask,
        *(t.float() for t in (batch16.rollout_logprobs, batch16.ref_logprobs, batch16.router_shift)),
    )
    hp = {"rollout_correction": "tis", "kl_coef": 0.1}
    out16, grad16 = grad_of(name, batch16, lp16, **hp)
    out32, grad32 = grad_of(name, batch32, lp32, **hp)
    assert out16.loss.dtype == torch.float32 and grad16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.loss, out32.loss, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(grad16, grad32.to(torch.bfloat16), atol=0, rtol=0)
    for key, value in out32.metrics.items():
        torch.testing.assert_close(out16.metrics[key], value, msg=key)
