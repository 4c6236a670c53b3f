"""Hand-derived cases for every objective: loss value, gradient w.r.t. logprobs against the
closed form, and metrics. The expected numbers are written out here, with the arithmetic in
comments; nothing below calls the code under test to produce an expected value.

The case (B=3, T=5), ratios rho = exp(logprobs - old_logprobs) chosen directly:

    seq 0  n=5  A=+1.0  rho = [1.1, 1.3, 0.9, 0.7, 1.6]
    seq 1  n=3  A=-0.5  rho = [0.6, 1.25, 0.95] + 2 padded positions
    seq 2  n=0  A=+2.0  (empty response: must contribute exactly nothing)

Padded positions hold NaN logprobs and +inf old_logprobs: they must never leak.
B' = 2 non-empty sequences, N = 8 valid tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.objectives import OBJECTIVES, PolicyBatch, policy_loss

NAN, INF = float("nan"), float("inf")
RHO = [[1.1, 1.3, 0.9, 0.7, 1.6], [0.6, 1.25, 0.95], []]
LOGP = [[-1.0, -2.0, -0.5, -1.5, -0.3], [-0.8, -1.2, -2.5], []]
ADV = [1.0, -0.5, 2.0]
T = 5
DTYPES = [(torch.float64, 1e-10), (torch.float32, 2e-6)]


def pad(rows: list[list[float]], fill: float) -> list[list[float]]:
    """Rows of valid values -> a [3, T] nested list, `fill` everywhere else."""
    rows = rows + [[]] * (3 - len(rows))
    return [r + [fill] * (T - len(r)) for r in rows]


def make_case(dtype, *, adv=None, **extra_rows) -> tuple[PolicyBatch, torch.Tensor]:
    """The batch above; `extra_rows` (router_shift, ref_delta, rollout_delta) are per-token
    lists on valid positions, NaN-padded."""
    logp = torch.tensor(pad(LOGP, NAN), dtype=torch.float64)
    log_rho = torch.tensor(pad([[math.log(x) for x in r] for r in RHO], 0.0), dtype=torch.float64)
    mask = torch.tensor([[True] * len(r) + [False] * (T - len(r)) for r in RHO])
    old = torch.where(mask, logp - log_rho, INF)
    kwargs = {}
    if "router_shift" in extra_rows:
        kwargs["router_shift"] = torch.tensor(pad(extra_rows["router_shift"], NAN), dtype=dtype)
    if "ref_delta" in extra_rows:  # ref - logprobs
        kwargs["ref_logprobs"] = (logp + torch.tensor(pad(extra_rows["ref_delta"], NAN), dtype=torch.float64)).to(dtype)
    if "rollout_delta" in extra_rows:  # d = old - rollout
        kwargs["rollout_logprobs"] = (old - torch.tensor(pad(extra_rows["rollout_delta"], NAN), dtype=torch.float64)).to(dtype)
    lp = logp.to(dtype).requires_grad_(True)
    adv_t = torch.tensor(ADV if adv is None else adv, dtype=dtype)
    return PolicyBatch(lp, old.to(dtype), adv_t, mask, **kwargs), lp


def run(name, batch, lp, **hp):
    out = policy_loss(name, batch, **hp)
    out.loss.backward()
    return out, lp.grad


def check(out, grad, loss, grad_rows, tol):
    """Compare the loss and the gradient (given on valid positions; padding must be 0)."""
    assert out.loss.item() == pytest.approx(loss, abs=tol, rel=tol)
    expected = torch.tensor(pad(grad_rows, 0.0), dtype=torch.float64)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), expected, atol=tol, rtol=tol)


def k3(rho: float) -> float:
    """k3 of old vs current for one token: exp(-lr) + lr - 1 = 1/rho + ln(rho) - 1."""
    return 1 / rho + math.log(rho) - 1


# Token-level approx_kl: mean over the 8 valid tokens; sequence-level: mean over the two
# sequences of their per-sequence token means.
K3_ROW0 = sum(k3(r) for r in RHO[0])
K3_ROW1 = sum(k3(r) for r in RHO[1])
APPROX_KL_TOKEN = (K3_ROW0 + K3_ROW1) / 8
APPROX_KL_SEQ = (K3_ROW0 / 5 + K3_ROW1 / 3) / 2


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --------------------------------------------------------------------------- grpo / dr_grpo / dapo


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_grpo(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("grpo", batch, lp)
    # Band [0.8, 1.2]. seq 0 (A=+1): u = min(rho, clip(rho)) = [1.1, 1.2*, 0.9, 0.7, 1.2*]
    #   (* clipped above; 0.7 < 0.8 is NOT clipped for A > 0), sum 5.1, mean 1.02.
    # seq 1 (A=-0.5): 0.6 < 0.8 clipped -> -0.5*0.8 = -0.4; -0.625; -0.475; sum -1.5, mean -0.5.
    # objective = (1.02 - 0.5) / 2 = 0.26.
    # grad = -(1/B')(1/n_i) A_i rho [unclipped]: seq 0: -(1/10) rho; seq 1: +(1/12) rho.
    check(
        out,
        grad,
        -0.26,
        [[-0.11, 0.0, -0.09, -0.07, 0.0], [0.0, 1.25 / 12, 0.95 / 12], []],
        tol,
    )
    m = out.metrics
    assert m["clip_frac"].item() == pytest.approx(3 / 8, abs=tol)  # 1.3, 1.6 and 0.6
    assert m["ratio_mean"].item() == pytest.approx(8.4 / 8, abs=tol)  # sum of the 8 ratios = 8.4
    assert m["ratio_max"].item() == pytest.approx(1.6, abs=tol)
    assert m["ratio_min"].item() == pytest.approx(0.6, abs=tol)
    assert m["approx_kl"].item() == pytest.approx(APPROX_KL_TOKEN, abs=tol)
    assert out.num_tokens.item() == 8 and out.num_sequences.item() == 2
    assert all(v.ndim == 0 and not v.requires_grad for v in m.values())


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_dr_grpo(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("dr_grpo", batch, lp)
    # Same u as grpo; token sums 5.1 and -1.5 over B * L_max = 3 * 5 = 15 (B counts the empty
    # sequence, L_max defaults to T): (5.1 - 1.5) / 15 = 0.24. grad = -A rho [unclipped] / 15.
    check(
        out,
        grad,
        -0.24,
        [[-1.1 / 15, 0.0, -0.9 / 15, -0.7 / 15, 0.0], [0.0, 0.625 / 15, 0.475 / 15], []],
        tol,
    )
    assert out.metrics["clip_frac"].item() == pytest.approx(3 / 8, abs=tol)


def test_dr_grpo_explicit_constants():
    batch, lp = make_case(torch.float64)
    out, grad = run("dr_grpo", batch, lp, num_sequences_total=6, max_response_length=10)
    # (5.1 - 1.5) / (6 * 10) = 0.06; grad = -A rho [unclipped] / 60.
    check(
        out,
        grad,
        -0.06,
        [[-1.1 / 60, 0.0, -0.9 / 60, -0.7 / 60, 0.0], [0.0, 0.625 / 60, 0.475 / 60], []],
        1e-10,
    )


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_dapo(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("dapo", batch, lp)
    # Band [0.8, 1.28]. seq 0: [1.1, 1.28*, 0.9, 0.7, 1.28*] sum 5.26; seq 1 as grpo, -1.5.
    # token-mean over N = 8: (5.26 - 1.5) / 8 = 0.47. grad = -A rho [unclipped] / 8.
    check(
        out,
        grad,
        -0.47,
        [[-1.1 / 8, 0.0, -0.9 / 8, -0.7 / 8, 0.0], [0.0, 0.625 / 8, 0.475 / 8], []],
        tol,
    )
    assert out.metrics["clip_frac"].item() == pytest.approx(3 / 8, abs=tol)  # 1.3 > 1.28 too


# --------------------------------------------------------------------------- gspo / gspo_token

# s_i = geometric mean of the token ratios.
S0 = (1.1 * 1.3 * 0.9 * 0.7 * 1.6) ** (1 / 5)  # 1.44144^(1/5) ~ 1.07587
S1 = (0.6 * 1.25 * 0.95) ** (1 / 3)  # 0.7125^(1/3) ~ 0.89314


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_gspo_default_band_clips_both(name, dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run(name, batch, lp)
    # Band [1 - 3e-4, 1 + 4e-4]. seq 0: s0 ~ 1.0759 > 1.0004 with A > 0 -> clipped, u0 = 1.0004.
    # seq 1: s1 ~ 0.8931 < 0.9997 with A < 0 -> clipped, u1 = -0.5 * 0.9997 = -0.49985.
    # objective = (1.0004 - 0.49985) / 2 = 0.250275; every gradient is zero.
    check(out, grad, -0.250275, [[0.0] * 5, [0.0] * 3, []], tol)
    assert out.metrics["clip_frac"].item() == pytest.approx(1.0, abs=tol)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_gspo_wide_band(name, dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run(name, batch, lp, clip_low=0.2, clip_high=0.2)
    # Both s_i inside [0.8, 1.2]: objective = (s0 * 1 + s1 * (-0.5)) / 2.
    # d s_i / d logp_it = s_i / n_i, so grad = -(1/B') A_i s_i / n_i:
    #   seq 0: -(1/2)(1/5) s0 = -s0/10 on each token; seq 1: -(1/2)(-0.5)(1/3) s1 = s1/12.
    check(out, grad, -(S0 - 0.5 * S1) / 2, [[-S0 / 10] * 5, [S1 / 12] * 3, []], tol)
    m = out.metrics
    assert m["clip_frac"].item() == pytest.approx(0.0, abs=tol)
    assert m["ratio_max"].item() == pytest.approx(S0, abs=tol)
    assert m["ratio_min"].item() == pytest.approx(S1, abs=tol)
    if name == "gspo":  # sequence-level: means over the 2 non-empty sequences
        assert m["ratio_mean"].item() == pytest.approx((S0 + S1) / 2, abs=tol)
        assert m["approx_kl"].item() == pytest.approx(APPROX_KL_SEQ, abs=tol)
        assert m["clip_frac"].item() == 0.0
    else:  # token-level: each token reports its sequence's s_i; means over 8 tokens
        assert m["ratio_mean"].item() == pytest.approx((5 * S0 + 3 * S1) / 8, abs=tol)
        assert m["approx_kl"].item() == pytest.approx(APPROX_KL_TOKEN, abs=tol)


def test_gspo_token_per_token_advantages():
    adv_rows = [[1.0, 2.0, -1.0, 0.0, 0.5], [-0.5, 1.5, -2.0]]
    batch, lp = make_case(torch.float64, adv=pad(adv_rows, NAN))
    out, grad = run("gspo_token", batch, lp, clip_low=0.2, clip_high=0.2)
    # u_it = s_i A_it (s_i in band). seq 0: s0 * (1 + 2 - 1 + 0 + 0.5) / 5 = s0 * 2.5 / 5;
    # seq 1: s1 * (-0.5 + 1.5 - 2) / 3 = -s1 / 3. objective = (s0/2 - s1/3) / 2.
    # grad_it = -(1/B')(1/n_i) s_i A_it (the gradient flows through token t only).
    check(
        out,
        grad,
        -(S0 / 2 - S1 / 3) / 2,
        [[-S0 * a / 10 for a in adv_rows[0]], [-S1 * a / 6 for a in adv_rows[1]], []],
        1e-10,
    )


# --------------------------------------------------------------------------- gmpo / rspo

# GMPO, d = 0.4: seq 0 (A>0) clips ln 1.6 = 0.47 to 0.4; seq 1 (A<0) clips ln 0.6 = -0.51 to -0.4.
GM_S0 = (1.1 * 1.3 * 0.9 * 0.7 * math.exp(0.4)) ** (1 / 5)
GM_S1 = (math.exp(-0.4) * 1.25 * 0.95) ** (1 / 3)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_gmpo(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("gmpo", batch, lp)
    # u_i = S_i A_i; objective = (S0 - 0.5 S1) / 2. d S_i / d logp_it = S_i / n_i on unclipped
    # tokens: grad = -(1/2) A_i S_i / n_i -> seq 0: -S0/10 (0 on token 4), seq 1: S1/12 (0 on token 0).
    check(
        out,
        grad,
        -(GM_S0 - 0.5 * GM_S1) / 2,
        [[-GM_S0 / 10] * 4 + [0.0], [0.0, GM_S1 / 12, GM_S1 / 12], []],
        tol,
    )
    m = out.metrics
    # clip_frac: mean over sequences of the clipped-token fraction: (1/5 + 1/3) / 2.
    assert m["clip_frac"].item() == pytest.approx((1 / 5 + 1 / 3) / 2, abs=tol)
    # ratio_*: the unclipped geometric means s_i (same as GSPO's).
    assert m["ratio_mean"].item() == pytest.approx((S0 + S1) / 2, abs=tol)
    assert m["ratio_max"].item() == pytest.approx(S0, abs=tol)
    assert m["ratio_min"].item() == pytest.approx(S1, abs=tol)
    assert m["approx_kl"].item() == pytest.approx(APPROX_KL_SEQ, abs=tol)


GAMMA = [[1.0, 0.8, 0.5, 0.05, 0.9], [0.7, 1.0, 0.6]]  # 0.05 is floored to g_min = 0.1


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rspo_post_clip(dtype, tol):
    batch, lp = make_case(dtype, router_shift=GAMMA)
    out, grad = run("rspo", batch, lp)
    # log S_i = mean_t (c_it + sgn(A_i) log g_it), c as in GMPO.
    # seq 0 (A>0): S0 = (1.1*1.3*0.9*0.7*e^0.4 * 1*0.8*0.5*0.1*0.9)^(1/5)
    # seq 1 (A<0): S1 = (e^-0.4*1.25*0.95 / (0.7*1.0*0.6))^(1/3)
    s0 = (1.1 * 1.3 * 0.9 * 0.7 * math.exp(0.4) * (1.0 * 0.8 * 0.5 * 0.1 * 0.9)) ** (1 / 5)
    s1 = (math.exp(-0.4) * 1.25 * 0.95 / (0.7 * 1.0 * 0.6)) ** (1 / 3)
    # gamma is a constant: grad = -(1/2) A_i S_i / n_i on unclipped tokens, as in GMPO.
    check(
        out, grad, -(s0 - 0.5 * s1) / 2, [[-s0 / 10] * 4 + [0.0], [0.0, s1 / 12, s1 / 12], []], tol
    )
    m = out.metrics
    assert m["clip_frac"].item() == pytest.approx((1 / 5 + 1 / 3) / 2, abs=tol)
    # router_shift metrics read the input (before the floor): per-sequence token means
    # 3.25/5 = 0.65 and 2.3/3, averaged over the 2 sequences; min 0.05.
    assert m["router_shift_mean"].item() == pytest.approx((0.65 + 2.3 / 3) / 2, abs=tol)
    assert m["router_shift_min"].item() == pytest.approx(0.05, abs=tol)
    # A drifted router makes the objective smaller than GMPO's for both signs of A.
    assert s0 < GM_S0 and -0.5 * s1 < -0.5 * GM_S1


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rspo_pre_clip(dtype, tol):
    batch, lp = make_case(dtype, router_shift=GAMMA)
    out, grad = run("rspo", batch, lp, gamma_placement="pre_clip")
    # The clip acts on rho * g. seq 0 (A>0): rho*g = [1.1, 1.04, 0.45, 0.07, 1.44], all log
    # values <= 0.4 (ln 1.44 = 0.365): nothing clipped, S0 = (1.1*1.04*0.45*0.07*1.44)^(1/5).
    # seq 1 (A<0): rho*g = [0.42, 1.25, 0.57]: ln 0.42 and ln 0.57 < -0.4 are clipped to -0.4,
    # S1 = (e^-0.4 * 1.25 * e^-0.4)^(1/3).
    s0 = (1.1 * 1.04 * 0.45 * 0.07 * 1.44) ** (1 / 5)
    s1 = (math.exp(-0.4) * 1.25 * math.exp(-0.4)) ** (1 / 3)
    check(out, grad, -(s0 - 0.5 * s1) / 2, [[-s0 / 10] * 5, [0.0, s1 / 12, 0.0], []], tol)
    assert out.metrics["clip_frac"].item() == pytest.approx((0 + 2 / 3) / 2, abs=tol)


# --------------------------------------------------------------------------- cispo / sapo


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_cispo(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("cispo", batch, lp)
    # Cap 1 + 4 = 5: no ratio reaches it, weight = rho. u = sg[rho] A logp, token-mean over 8.
    # seq 0: 1.1*-1 + 1.3*-2 + 0.9*-0.5 + 0.7*-1.5 + 1.6*-0.3 = -5.68
    # seq 1: -0.5 * (0.6*-0.8 + 1.25*-1.2 + 0.95*-2.5) = -0.5 * -4.355 = 2.1775
    # objective = (-5.68 + 2.1775) / 8 = -0.4378125. grad = -w A / 8 (the weight is constant).
    check(
        out,
        grad,
        0.4378125,
        [[-r / 8 for r in RHO[0]], [0.5 * r / 8 for r in RHO[1]], []],
        tol,
    )
    assert out.metrics["clip_frac"].item() == 0.0


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_cispo_two_sided(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("cispo", batch, lp, clip_low=0.2, clip_high=0.25)
    # w = clip(rho, 0.8, 1.25): seq 0 [1.1, 1.25, 0.9, 0.8, 1.25], seq 1 [0.8, 1.25, 0.95].
    # seq 0: -1.1 - 2.5 - 0.45 - 1.2 - 0.375 = -5.625
    # seq 1: -0.5 * (0.8*-0.8 + 1.25*-1.2 + 0.95*-2.5) = -0.5 * -4.515 = 2.2575
    # objective = (-5.625 + 2.2575) / 8 = -0.4209375; clipped tokens still get gradient -w A / 8.
    w0, w1 = [1.1, 1.25, 0.9, 0.8, 1.25], [0.8, 1.25, 0.95]
    check(out, grad, 0.4209375, [[-w / 8 for w in w0], [0.5 * w / 8 for w in w1], []], tol)
    # clipped: 1.3, 0.7, 1.6 in seq 0 and 0.6 in seq 1 -> 4 / 8.
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5, abs=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_sapo(dtype, tol):
    batch, lp = make_case(dtype)
    out, grad = run("sapo", batch, lp)
    # u = (4/tau) sigmoid(tau (rho - 1)) A, tau = 1 for seq 0 (A>0), 1.05 for seq 1 (A<0).
    # objective = (1/2) [ (1/5) sum_0 4 sig(rho-1) + (1/3) sum_1 (4/1.05) sig(1.05 (rho-1)) (-0.5) ]
    u0 = sum(4 * sigmoid(r - 1) for r in RHO[0]) / 5
    u1 = sum(4 / 1.05 * sigmoid(1.05 * (r - 1)) * -0.5 for r in RHO[1]) / 3
    # d u / d logp = 4 p (1 - p) rho A, p = sigmoid(tau (rho - 1)); times -(1/2)(1/n_i).
    g0 = [-4 * sigmoid(r - 1) * (1 - sigmoid(r - 1)) * r / 10 for r in RHO[0]]
    g1 = [
        4 * sigmoid(1.05 * (r - 1)) * (1 - sigmoid(1.05 * (r - 1))) * r * 0.5 / 6 for r in RHO[1]
    ]
    check(out, grad, -(u0 + u1) / 2, [g0, g1, []], tol)
    # The gate 4 p (1 - p) stays above 0.5 for these ratios (lowest: rho = 1.6, ~0.92).
    assert out.metrics["clip_frac"].item() == 0.0


def test_sapo_soft_clip_frac():
    # One token with rho = 3, A = 1: gate 4 sig(2)(1 - sig(2)) = 4 * 0.8808 * 0.1192 = 0.42 < 0.5.
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-math.log(3.0), 0.0]], dtype=torch.float64)
    batch = PolicyBatch(lp, old, torch.tensor([1.0], dtype=torch.float64), torch.tensor([[True, True]]))
    out = policy_loss("sapo", batch)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)  # 1 of the 2 tokens


# --------------------------------------------------------------------------- KL and corrections

DELTA = [[0.1, -0.2, 0.0, 0.3, -0.1], [0.2, 0.0, -0.3]]  # ref - logprobs per token


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty(estimator):
    batch, lp = make_case(torch.float64, ref_delta=DELTA)
    out, grad = run("grpo", batch, lp, kl_coef=0.1, kl_estimator=estimator)
    # k1 = -delta, k2 = delta^2 / 2, k3 = e^delta - delta - 1; d k / d logp: 1, -delta, 1 - e^delta.
    k = {"k1": lambda d: -d, "k2": lambda d: d * d / 2, "k3": lambda d: math.exp(d) - d - 1}[estimator]
    dk = {"k1": lambda d: 1.0, "k2": lambda d: -d, "k3": lambda d: 1 - math.exp(d)}[estimator]
    # grpo aggregation (1/B')(1/n_i): penalty = 0.1 * (mean_0 k + mean_1 k) / 2.
    kl = (sum(k(d) for d in DELTA[0]) / 5 + sum(k(d) for d in DELTA[1]) / 3) / 2
    grpo_grad = [[-0.11, 0.0, -0.09, -0.07, 0.0], [0.0, 1.25 / 12, 0.95 / 12]]
    expected = [
        [g + 0.1 * dk(d) / 10 for g, d in zip(grpo_grad[0], DELTA[0])],
        [g + 0.1 * dk(d) / 6 for g, d in zip(grpo_grad[1], DELTA[1])],
        [],
    ]
    check(out, grad, -0.26 + 0.1 * kl, expected, 1e-10)
    # The kl_ref metric of a token-level objective is a token mean over the 8 tokens.
    kl_token_mean = (sum(k(d) for d in DELTA[0]) + sum(k(d) for d in DELTA[1])) / 8
    assert out.metrics["kl_ref"].item() == pytest.approx(kl_token_mean, abs=1e-12)


def test_kl_metric_without_penalty_has_no_gradient_effect():
    batch, lp = make_case(torch.float64, ref_delta=DELTA)
    out, grad = run("grpo", batch, lp)  # kl_coef = 0: kl_ref is only reported
    check(out, grad, -0.26, [[-0.11, 0.0, -0.09, -0.07, 0.0], [0.0, 1.25 / 12, 0.95 / 12], []], 1e-10)
    assert "kl_ref" in out.metrics


D = [[0.0, math.log(1.5), math.log(3.0), math.log(0.6), 0.0], [math.log(2.5), 0.0, math.log(0.8)]]
# exp(d) = [1, 1.5, 3, 0.6, 1] and [2.5, 1, 0.8]


def test_tis_token_level():
    batch, lp = make_case(torch.float64, rollout_delta=D)
    out, grad = run("grpo", batch, lp, rollout_correction="tis")
    # weight min(e^d, 2) = [1, 1.5, 2, 0.6, 1], [2, 1, 0.8], times grpo's u:
    # seq 0: 1.1*1 + 1.2*1.5 + 0.9*2 + 0.7*0.6 + 1.2*1 = 6.32 -> /5 = 1.264
    # seq 1: -0.4*2 - 0.625*1 - 0.475*0.8 = -1.805 -> /3
    # objective = (1.264 - 1.805/3) / 2; grad = grpo's closed form times the weight.
    check(
        out,
        grad,
        -(1.264 - 1.805 / 3) / 2,
        [[-0.11, 0.0, -0.09 * 2, -0.07 * 0.6, 0.0], [0.0, 1.25 / 12, 0.95 / 12 * 0.8], []],
        1e-10,
    )
    assert out.metrics["rollout_weight_mean"].item() == pytest.approx(9.9 / 8)  # sum of weights 9.9
    assert out.counts.fractions()["rollout_masked_frac"] == 0.0


def test_tis_sequence_level():
    batch, lp = make_case(torch.float64, rollout_delta=D)
    out, grad = run("gmpo", batch, lp, rollout_correction="tis")
    # per sequence min(exp(mean_t d), 2): seq 0 (1.5*3*0.6)^(1/5) = 2.7^(1/5), seq 1 (2.5*0.8)^(1/3) = 2^(1/3).
    c0, c1 = 2.7 ** (1 / 5), 2.0 ** (1 / 3)
    check(
        out,
        grad,
        -(c0 * GM_S0 - 0.5 * c1 * GM_S1) / 2,
        [[-c0 * GM_S0 / 10] * 4 + [0.0], [0.0, c1 * GM_S1 / 12, c1 * GM_S1 / 12], []],
        1e-10,
    )
    assert out.metrics["rollout_weight_mean"].item() == pytest.approx((c0 + c1) / 2)


@pytest.mark.parametrize("mode", ["mis", "icepop"])
def test_mis_icepop_token_level(mode):
    batch, lp = make_case(torch.float64, rollout_delta=D)
    out, grad = run("dapo", batch, lp, rollout_correction=mode)
    # Band [0.5, 2]: e^d = 3 (seq 0, token 2) and 2.5 (seq 1, token 0) are rejected: they
    # leave the token count too, N = 8 - 2 = 6.
    # mis keeps weight min(e^d, 2) on the rest: [1, 1.5, 0, 0.6, 1], [0, 1, 0.8]; icepop 1.
    c = {"mis": [[1, 1.5, 0, 0.6, 1], [0, 1, 0.8]], "icepop": [[1, 1, 0, 1, 1], [0, 1, 1]]}[mode]
    u = [[1.1, 1.28, 0.9, 0.7, 1.28], [-0.4, -0.625, -0.475]]  # dapo's u (test_dapo)
    objective = (sum(a * b for a, b in zip(c[0], u[0])) + sum(a * b for a, b in zip(c[1], u[1]))) / 6
    # mis: (1.1 + 1.92 + 0 + 0.42 + 1.28 - 0 - 0.625 - 0.38) / 6 = 3.715 / 6
    # icepop: (1.1 + 1.28 + 0 + 0.7 + 1.28 - 0 - 0.625 - 0.475) / 6 = 3.26 / 6
    assert objective == pytest.approx({"mis": 3.715 / 6, "icepop": 3.26 / 6}[mode])
    dapo_grad = [[-1.1 / 6, 0.0, -0.9 / 6, -0.7 / 6, 0.0], [0.0, 0.625 / 6, 0.475 / 6]]
    expected = [[g * w for g, w in zip(dapo_grad[i], c[i])] for i in range(2)] + [[]]
    check(out, grad, -objective, expected, 1e-10)
    assert out.counts.fractions()["rollout_masked_frac"] == pytest.approx(2 / 8)
    assert out.num_tokens.item() == 6


def test_mis_keeps_the_truncated_weight():
    batch, lp = make_case(torch.float64, rollout_delta=D)
    out, grad = run("dapo", batch, lp, rollout_correction="mis", mis_high=3.5, tis_cap=1.2)
    # Band [0.5, 3.5] keeps every token; weight min(e^d, 1.2) = [1, 1.2, 1.2, 0.6, 1], [1.2, 1, 0.8].
    # 1.1 + 1.28*1.2 + 0.9*1.2 + 0.7*0.6 + 1.28 - 0.4*1.2 - 0.625 - 0.475*0.8
    # = 1.1 + 1.536 + 1.08 + 0.42 + 1.28 - 0.48 - 0.625 - 0.38 = 3.931, over N = 8.
    c = [[1, 1.2, 1.2, 0.6, 1], [1.2, 1, 0.8]]
    dapo_grad = [[-1.1 / 8, 0.0, -0.9 / 8, -0.7 / 8, 0.0], [0.0, 0.625 / 8, 0.475 / 8]]
    expected = [[g * w for g, w in zip(dapo_grad[i], c[i])] for i in range(2)] + [[]]
    check(out, grad, -3.931 / 8, expected, 1e-10)
    assert out.counts.fractions()["rollout_masked_frac"] == 0.0


def test_mis_sequence_level_drops_sequences():
    batch, lp = make_case(torch.float64, rollout_delta=D)
    out, grad = run("gmpo", batch, lp, rollout_correction="mis", mis_low=0.7, mis_high=3.5)
    # Band [0.7, 3.5]: seq 0 has e^d = 0.6 -> rejected whole, and it leaves B' (2 -> 1);
    # seq 1 kept with weight exp(mean d) = 2^(1/3).
    c1 = 2.0 ** (1 / 3)
    check(out, grad, -(-0.5 * c1 * GM_S1), [[0.0] * 5, [0.0, c1 * GM_S1 / 6, c1 * GM_S1 / 6], []], 1e-10)
    assert out.counts.fractions()["rollout_masked_frac"] == pytest.approx(5 / 8)
    assert out.counts.fractions()["rollout_rejected_seq_frac"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "cispo", "sapo", "gspo", "gmpo", "rspo"])
def test_ratio_and_kl_metrics(name):
    batch, _ = make_case(torch.float64, router_shift=GAMMA)
    m = policy_loss(name, batch).metrics
    if name in ("gspo", "gmpo", "rspo"):
        # sequence-level: the unclipped s_i of the two non-empty sequences
        expected = {"ratio_mean": (S0 + S1) / 2, "ratio_max": S0, "ratio_min": S1, "approx_kl": APPROX_KL_SEQ}
    else:
        # token-level: the 8 token ratios, which sum to 8.4
        expected = {"ratio_mean": 8.4 / 8, "ratio_max": 1.6, "ratio_min": 0.6, "approx_kl": APPROX_KL_TOKEN}
    for key, value in expected.items():
        assert m[key].item() == pytest.approx(value, abs=1e-12), key
    assert m["router_shift_min"].item() == pytest.approx(0.05)  # reported for any objective


# --------------------------------------------------------------------------- coverage


def test_every_objective_has_a_hand_case():
    tested = {"grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "gmpo", "rspo", "cispo", "sapo"}
    assert set(OBJECTIVES) == tested
