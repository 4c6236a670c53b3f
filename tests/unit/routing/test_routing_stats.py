"""Router shift (RSPO gamma) and routing statistics against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from moe_rl.routing import (
    per_layer,
    router_shift,
    router_shift_from_partial,
    router_shift_partial,
    routing_stats,
    topk_disagreement,
    topk_set_changed,
)


def _old_logp(L: int = 2, N: int = 2, K: int = 2) -> torch.Tensor:
    # log routing probs of the old top-k; values only need to be distinct and finite
    return torch.log(torch.linspace(0.05, 0.6, L * N * K)).reshape(L, N, K)


# --------------------------------------------------------------------------- router_shift


def test_gamma_is_one_when_router_unchanged():
    old = _old_logp(3, 5, 2)
    torch.testing.assert_close(router_shift(old, old.clone(), 0.1), torch.ones(5))


def test_gamma_hand_value_after_perturbation():
    old = _old_logp()  # L=2, N=2, K=2
    delta = torch.zeros(2, 2, 2)
    # token 1: |delta log r| = 0.2, 0.4 (layer 0), 0.0, 0.2 (layer 1); signs do not matter
    delta[0, 1] = torch.tensor([0.2, -0.4])
    delta[1, 1] = torch.tensor([0.0, -0.2])
    # mean over L*K = (0.2 + 0.4 + 0.0 + 0.2) / 4 = 0.2  ->  gamma = exp(-0.2) = 0.818731
    gamma = router_shift(old, old + delta, gamma_min=0.1)
    torch.testing.assert_close(gamma, torch.tensor([1.0, math.exp(-0.2)]))
    assert abs(gamma[1].item() - 0.818731) < 1e-6


def test_gamma_floor_at_gamma_min():
    old = _old_logp()
    new = old.clone()
    new[:, 0] -= 5.0  # mean |delta| = 5 -> exp(-5) = 0.0067 < 0.1
    gamma = router_shift(old, new, gamma_min=0.1)
    torch.testing.assert_close(gamma, torch.tensor([0.1, 1.0]))
    # gamma_min = 0 leaves the raw value
    torch.testing.assert_close(router_shift(old, new, 0.0)[0], torch.tensor(math.exp(-5.0)))


def test_gamma_is_detached():
    old = _old_logp().requires_grad_(True)
    new = (old.detach() + 0.1).requires_grad_(True)
    gamma = router_shift(old, new, 0.1)
    assert not gamma.requires_grad and gamma.grad_fn is None


def test_partial_sums_over_pipeline_stages_equal_full_formula():
    torch.manual_seed(0)
    L, N, K = 5, 7, 3
    old = torch.log_softmax(torch.randn(L, N, 8), -1)[..., :K]
    new = old + 0.3 * torch.randn(L, N, K)
    # stage 0 owns layers 0-1, stage 1 layers 2-4; an all-reduce would sum the partials
    partial = router_shift_partial(old[:2], new[:2]) + router_shift_partial(old[2:], new[2:])
    full = router_shift(old, new, 0.05)
    torch.testing.assert_close(router_shift_from_partial(partial, L, K, 0.05), full)
    # and the full formula itself, written out
    ref = torch.exp(-(new - old).abs().mean(dim=(0, 2))).clamp_min(0.05)
    torch.testing.assert_close(full, ref)


def test_gamma_bf16_inputs_give_float32():
    old = _old_logp().bfloat16()
    assert router_shift(old, old, 0.1).dtype == torch.float32


@pytest.mark.parametrize(
    ("old_shape", "new_shape", "arg"),
    [((2, 3), (2, 3), "old_logp_LNK"), ((2, 3, 2), (2, 3, 1), "new_logp_LNK")],
)
def test_gamma_shape_errors_name_the_argument(old_shape, new_shape, arg):
    with pytest.raises(ValueError, match=arg):
        router_shift(torch.zeros(old_shape), torch.zeros(new_shape), 0.1)


def test_gamma_rejects_bad_gamma_min_and_counts():
    old = _old_logp()
    with pytest.raises(ValueError, match="gamma_min"):
        router_shift(old, old, 1.5)
    with pytest.raises(ValueError, match="num_layers"):
        router_shift_from_partial(torch.zeros(3), 0, 2, 0.1)
    with pytest.raises(ValueError, match="sum_abs_N"):
        router_shift_from_partial(torch.zeros(3, 1), 1, 2, 0.1)


# --------------------------------------------------------------------------- top-k sets


def test_flip_is_order_independent():
    ids = torch.tensor([[[3, 1], [0, 5]], [[2, 7], [4, 6]]], dtype=torch.uint8)  # [N=2,L=2,K=2]
    permuted = ids.flip(-1)
    assert not topk_set_changed(ids, permuted).any()
    changed = permuted.clone()
    changed[1, 0] = torch.tensor([7, 3], dtype=torch.uint8)  # {2,7} -> {3,7}: a flip
    expected = torch.tensor([[False, False], [True, False]])
    assert torch.equal(topk_set_changed(ids, changed), expected)


def test_set_comparison_is_exact_even_with_duplicates():
    a = torch.tensor([[[1, 1]]])
    b = torch.tensor([[[1, 2]]])
    assert topk_set_changed(a, b).all() and topk_set_changed(b, a).all()


def test_disagreement_per_layer_and_any_layer_with_mask():
    # N=4 tokens, L=3 layers, K=2; int16 vs uint8 ids compare by value
    a = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int16).expand(4, 3, 2).clone()
    b = a.to(torch.uint8).clone()
    b[0, 0] = torch.tensor([0, 7])  # token 0 differs in layer 0
    b[0, 2] = torch.tensor([5, 6])  # ... and in layer 2
    b[1, 2] = torch.tensor([5, 4])  # token 1: layer 2 only permuted -> no difference
    b[2, 1] = torch.tensor([3, 6])  # token 2 differs in layer 1
    b[3, 0] = torch.tensor([7, 6])  # token 3 differs in layer 0 but is masked out
    valid = torch.tensor([True, True, True, False])
    per_layer_L, any_ = topk_disagreement(a, b, valid)
    # 3 valid tokens: layer 0 {t0} = 1/3, layer 1 {t2} = 1/3, layer 2 {t0} = 1/3; any {t0, t2} = 2/3
    torch.testing.assert_close(per_layer_L, torch.tensor([1 / 3, 1 / 3, 1 / 3]))
    torch.testing.assert_close(any_, torch.tensor(2 / 3))
    # without the mask token 3 counts: layer 0 {t0, t3} = 2/4, any = 3/4
    per_layer_L, any_ = topk_disagreement(a, b)
    torch.testing.assert_close(per_layer_L, torch.tensor([0.5, 0.25, 0.25]))
    torch.testing.assert_close(any_, torch.tensor(0.75))


def test_topk_errors_name_the_argument():
    a = torch.zeros(2, 3, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ids_b_NLK"):
        topk_set_changed(a, torch.zeros(2, 3, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="ids_a_NLK"):
        topk_set_changed(a.float(), a)
    with pytest.raises(ValueError, match="valid_N"):
        topk_disagreement(a, a, torch.ones(2))  # not bool


# --------------------------------------------------------------------------- routing_stats


def _shifted_logp(x_N: torch.Tensor):
    """old/new [N, L=2, K=2] whose per-token mean |delta| is x_n: layer 0 moves 0.5 x_n,
    layer 1 moves 1.5 x_n (one expert up, one down)."""
    N = x_N.shape[0]
    old = torch.log(torch.tensor([0.3, 0.2])).expand(N, 2, 2).clone()
    scale_L = torch.tensor([0.5, 1.5])
    sign_K = torch.tensor([1.0, -1.0])
    new = old + x_N[:, None, None] * scale_L[None, :, None] * sign_K[None, None, :]
    return old, new


def test_routing_stats_hand_values():
    x = torch.tensor([0.0, 0.5, 1.0, 2.0])
    valid = torch.tensor([True, True, True, False])  # token 3 (x = 2) is padding
    old, new = _shifted_logp(x)
    new[3] = float("nan")  # garbage in a masked row must not leak
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.uint8).expand(4, 2, 2).clone()
    new_ids = ids.clone()
    new_ids[1, 1] = torch.tensor([3, 4])  # token 1 flips in layer 1
    sampler_ids = ids.flip(-1).clone()  # same sets, other order
    sampler_ids[2, 0] = torch.tensor([5, 6])  # token 2 disagrees in layer 0
    s = routing_stats(
        old,
        new,
        old_ids_NLK=ids,
        new_ids_NLK=new_ids,
        sampler_ids_NLK=sampler_ids,
        valid_N=valid,
        gamma_min=0.4,
    )
    # gamma = exp(-x) on valid tokens = [1, 0.606531, 0.367879]
    g = [1.0, math.exp(-0.5), math.exp(-1.0)]
    assert s["routing/num_tokens"].item() == 3
    assert abs(s["routing/gamma_mean"].item() - sum(g) / 3) < 1e-6  # 0.658137
    assert abs(s["routing/gamma_min"].item() - g[2]) < 1e-6
    # p05, linear interpolation: sorted [0.367879, 0.606531, 1], pos = 0.05 * 2 = 0.1
    # -> 0.367879 + 0.1 * (0.606531 - 0.367879) = 0.391744
    assert abs(s["routing/gamma_p05"].item() - 0.391744) < 1e-6
    assert abs(s["routing/frac_gamma_below_0.5"].item() - 1 / 3) < 1e-6
    assert abs(s["routing/frac_gamma_floored"].item() - 1 / 3) < 1e-6  # 0.3679 < 0.4
    # dlogr: layer 0 = 0.5 * mean(0, 0.5, 1) = 0.25; layer 1 = 1.5 * 0.5 = 0.75
    assert abs(s["routing/dlogr_layer0"].item() - 0.25) < 1e-6
    assert abs(s["routing/dlogr_layer1"].item() - 0.75) < 1e-6
    assert abs(s["routing/dlogr_mean"].item() - 0.5) < 1e-6
    # flips: layer 0 none, layer 1 {t1} = 1/3; any = 1/3
    assert s["routing/flip_rate_layer0"].item() == 0
    assert abs(s["routing/flip_rate_layer1"].item() - 1 / 3) < 1e-6
    assert abs(s["routing/flip_rate_mean"].item() - 1 / 6) < 1e-6
    assert abs(s["routing/flip_any"].item() - 1 / 3) < 1e-6
    # sampler vs learner (old ids): layer 0 {t2} = 1/3, layer 1 none (order only); any 1/3
    assert abs(s["routing/sampler_disagree_layer0"].item() - 1 / 3) < 1e-6
    assert s["routing/sampler_disagree_layer1"].item() == 0
    assert abs(s["routing/sampler_disagree_any"].item() - 1 / 3) < 1e-6
    assert all(v.dim() == 0 and torch.isfinite(v) for v in s.values())
    torch.testing.assert_close(per_layer(s, "dlogr"), torch.tensor([0.25, 0.75]))


def test_routing_stats_gamma_matches_router_shift():
    torch.manual_seed(1)
    old = torch.log_softmax(torch.randn(50, 3, 8), -1)[..., :2]  # [N, L, K]
    new = old + 0.2 * torch.randn(50, 3, 2)
    s = routing_stats(old, new)
    gamma = router_shift(old.transpose(0, 1), new.transpose(0, 1), 0.0)
    torch.testing.assert_close(s["routing/gamma_mean"], gamma.mean())
    torch.testing.assert_close(s["routing/gamma_min"], gamma.min())
    torch.testing.assert_close(s["routing/gamma_p05"], torch.quantile(gamma, 0.05))


@pytest.mark.parametrize("N", [0, 4])
def test_routing_stats_no_valid_token_is_defined_and_finite(N):
    old, new = _shifted_logp(torch.ones(N))
    ids = torch.zeros(N, 2, 2, dtype=torch.uint8)
    s = routing_stats(
        old,
        new,
        old_ids_NLK=ids,
        new_ids_NLK=ids + 1,
        sampler_ids_NLK=ids + 2,
        valid_N=torch.zeros(N, dtype=torch.bool),
        gamma_min=0.1,
    )
    assert all(torch.isfinite(v) for v in s.values())
    assert s["routing/num_tokens"].item() == 0
    for key in ("gamma_mean", "gamma_min", "gamma_p05"):
        assert s[f"routing/{key}"].item() == 1.0  # "no shift observed"
    for key in ("frac_gamma_below_0.5", "dlogr_layer0", "flip_rate_mean", "sampler_disagree_any"):
        assert s[f"routing/{key}"].item() == 0.0


def test_routing_stats_input_errors():
    old, new = _shifted_logp(torch.ones(3))
    with pytest.raises(ValueError, match="together"):
        routing_stats(old, None)
    with pytest.raises(ValueError, match="old_ids_NLK"):
        routing_stats(
            old,
            new,
            old_ids_NLK=torch.zeros(4, 2, 2, dtype=torch.uint8),
            new_ids_NLK=torch.zeros(4, 2, 2, dtype=torch.uint8),
        )
    with pytest.raises(ValueError, match="new_logp_NLK"):
        routing_stats(old, new[:, :, :1])


# --------------------------------------------------------------------------- heat map


def test_heatmap_image_is_hwc_uint8():
    from moe_rl.routing.heatmap import heatmap_image

    hist = torch.rand(12, 6)
    hist[3, 2] = float("nan")  # unmeasured cell: drawn blank, no error
    img = heatmap_image(
        hist,
        title="top-k flip rate",
        stat_label="flip rate",
        steps=range(0, 120, 10),
        size_in=(4, 3),
        dpi=50,
    )
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape == (150, 200, 3)
    assert img.std() > 0  # something was drawn
    with pytest.raises(ValueError, match="history_SL"):
        heatmap_image(torch.rand(5))
    with pytest.raises(ValueError, match="steps"):
        heatmap_image(torch.rand(3, 2), steps=[0, 1])
