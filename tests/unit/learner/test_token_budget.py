"""Token-budget micro-batches: sequences binned by length into micro-batches of at most
`parallel.max_tokens_per_microbatch` tokens, and every objective's loss and gradient the
same however the rows fall into micro-batches (the objectives' normalisers are global)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.config import ConfigError, load_config
from moe_rl.learner.microbatch import bins_needed, token_budget_bins
from moe_rl.objectives import OBJECTIVES
from moe_rl_testing.learner_utils import default_learner, fixed_batch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(8, 64), st.integers(0, 3))
def test_bins_hold_every_row_once_within_the_budget(cost, budget, extra):
    n = bins_needed(cost, budget) + extra
    bins = token_budget_bins(cost, budget, n)
    assert bins is not None and len(bins) == n
    assert sorted(r for b in bins for r in b) == list(range(len(cost)))
    for b in bins:
        assert sum(cost[r] for r in b) <= budget or len(b) == 1  # an over-long sequence sits alone


def test_bins_are_balanced_longest_first():
    bins = token_budget_bins([10, 9, 8, 7, 3, 3], budget=20, n_bins=2)
    loads = sorted(sum([10, 9, 8, 7, 3, 3][r] for r in b) for b in bins)
    assert loads == [20, 20]
    assert token_budget_bins([15, 15, 15], budget=20, n_bins=2) is None  # needs a third bin


def test_a_token_budget_needs_packing():
    with pytest.raises(ConfigError, match=r"needs parallel\.packing=true"):
        load_config(None, ["parallel.max_tokens_per_microbatch=64", "parallel.packing=false"])


SPLITS = {"mbs12": ("micro_batch_size", 12), "mbs5": ("micro_batch_size", 5),
          "budget24": ("max_tokens_per_microbatch", 24), "budget48": ("max_tokens_per_microbatch", 48)}


def _parallel(cfg, field, value):
    """`cfg`'s parallel section with micro-batches of 12 rows, no token budget, and `field` = `value`."""
    parallel = dataclasses.replace(cfg.parallel, micro_batch_size=12, max_tokens_per_microbatch=0)
    return dataclasses.replace(parallel, **{field: value})


@pytest.fixture(scope="module")
def learner(megatron_world):
    with default_learner(4) as learner:
        yield learner


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_loss_and_gradient_do_not_depend_on_the_split(learner, objective):
    from moe_rl.programs.rl.policy_loss import PolicyLossFn
    from moe_rl.step_batch import StepBatch

    cfg = load_config(None, [f"rl.objective={objective}", "rl.rollout_correction=tis", "rl.kl_coef=0.05"])
    tokens, adv_B = fixed_batch()
    g = torch.Generator().manual_seed(2)
    mask = tokens.response_mask()
    batch = StepBatch.whole(tokens, adv_B=adv_B)
    plan = learner.routing_plan("none", batch, capture=True)
    learner.parallel_cfg = _parallel(cfg, "micro_batch_size", 12)
    score = learner.score(batch, plan)
    noisy = lambda: (score.logp_BT + 0.05 * torch.randn(score.logp_BT.shape, generator=g)) * mask  # noqa: E731
    batch = dataclasses.replace(batch.scored(noisy(), score.record), sampler_logp_BT=noisy(), ref_logp_BT=noisy())
    plan = learner.routing_plan("none", batch)
    results = {}
    for name, (field, value) in SPLITS.items():
        learner.parallel_cfg = _parallel(cfg, field, value)
        metrics, _, _, _ = learner._gradients(batch, PolicyLossFn(cfg.rl, cfg.sampler.max_new_tokens), plan, 1.0)
        grads = torch.cat([p.main_grad.flatten().clone() for p in learner.model.parameters() if p.requires_grad])
        results[name] = (metrics["loss"], grads, learner._num_microbatches)
    loss0, grads0, _ = results["mbs12"]
    assert results["mbs5"][2] == 3 and results["mbs12"][2] == 1 and results["budget24"][2] > results["budget48"][2] > 1
    for name, (loss, grads, _) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-6, abs=1e-9), name
        assert float((grads - grads0).abs().max()) <= 1e-6 * float(grads0.abs().max()), name
