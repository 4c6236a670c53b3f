"""Rollout correction (importance weights and rejection at token, sequence and geometric
level, the veto, batch normalization), OPSM, and the rule that rejected tokens leave the
normalizers: `policy_loss` against an independent computation (moe_rl_testing/correction_reference.py)
in values and gradients; the learner's passes against the batch with the rejected tokens
taken out of its mask, at two micro-batch splits, scored and under the on-policy shortcut;
the recipe's refusals. (The same at data parallel 2: tests/integration/learner/test_learner_parallel.py; whole
runs: tests/integration/programs/rl/test_trainer.py.)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.objectives import PolicyBatch, policy_loss
from moe_rl.objectives.correction import CorrectionCounts
from moe_rl_testing.correction_reference import decide, reference_loss
from moe_rl_testing.learner_utils import default_learner, fixed_batch

OBJECTIVES = ["grpo", "dapo", "dr_grpo", "gspo"]
FORMS = {
    "tis": {"rollout_correction": "tis"},
    "mis": {"rollout_correction": "mis"},
    "icepop": {"rollout_correction": "icepop"},
    "token_is": {"is_level": "token"},
    "sequence_is": {"is_level": "sequence"},
    "geometric_is": {"is_level": "geometric", "tis_cap": 1.1},
    "token_is_token_rs": {"is_level": "token", "rs_level": "token", "rs_high": 1.6},
    "sequence_rs": {"rs_level": "sequence", "rs_high": 2.5},
    "geometric_rs_veto": {"is_level": "geometric", "rs_level": "geometric", "rs_high": 1.15, "rs_low": 0.9,
                          "veto_below": 0.55},
    "token_is_normalized": {"is_level": "token", "is_batch_normalize": True},
    "geometric_rs_veto_normalized": {"is_level": "geometric", "rs_level": "geometric", "rs_high": 1.2,
                                     "veto_below": 0.5, "is_batch_normalize": True},
    "opsm": {"rollout_correction": "none", "opsm_delta": 0.05},
    "opsm_zero_and_token_rs": {"rs_level": "token", "rs_high": 1.8, "opsm_delta": 0.0},
}


def _case(seed: int = 0, B: int = 8, T: int = 6):
    """A batch with varied lengths (row 3 empty), learner/sampler gaps of ~0.35 nats."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[3] = 0
    mask = torch.arange(T)[None, :] < lens[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.35 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    pad = lambda x: torch.where(mask, x, float("nan"))  # noqa: E731  (padding must never leak)
    return pad(logp), pad(old), pad(rollout), adv, mask


def _hparams(form: dict) -> tuple[dict, dict]:
    """(policy_loss keywords, the reference's keywords) for a form."""
    kw = dict(form)
    kw.setdefault("rollout_correction", "is_rs")
    ref = {k: v for k, v in kw.items() if k not in ("rollout_correction", "tis_cap", "is_batch_normalize", "opsm_delta")}
    mode = kw["rollout_correction"]
    if mode == "tis":
        ref = {"is_level": "token"}
    elif mode == "mis":
        ref = {"is_level": "token", "rs_level": "token", "rs_low": 0.5, "rs_high": 2.0}
    elif mode == "icepop":
        ref = {"rs_level": "token", "rs_low": 0.5, "rs_high": 2.0}
    ref["cap"] = kw.get("tis_cap", 2.0)
    return kw, ref


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_against_the_independent_computation(name, form):
    kw, ref_kw = _hparams(FORMS[form])
    if name == "gspo" and ref_kw.get("is_level") == "token":
        if kw["rollout_correction"] == "is_rs":  # (a token weight on one ratio per sequence is refused)
            logp, old, rollout, adv, mask = _case()
            with pytest.raises(ValueError, match="is_level=token on a sequence-level objective"):
                policy_loss(name, PolicyBatch(torch.where(mask, logp, 0.0), old, adv, mask,
                                              rollout_logprobs=rollout), **kw)
            return
        ref_kw["is_level"] = "geometric"  # (the presets weigh a sequence-level objective's sequences)
    for seed in range(3):
        logp, old, rollout, adv, mask = _case(seed)
        lp = torch.where(mask, logp, 0.0).requires_grad_(True)
        out = policy_loss(name, PolicyBatch(lp, old, adv, mask, rollout_logprobs=rollout), **kw)
        out.loss.backward()
        lp_ref = torch.where(mask, logp, 0.0).requires_grad_(True)
        expected = reference_loss(name, lp_ref, old, rollout, adv, mask, opsm_delta=kw.get("opsm_delta"),
                                  batch_normalize=kw.get("is_batch_normalize", False), **ref_kw)
        expected.backward()
        assert out.loss.item() == pytest.approx(expected.item(), abs=1e-12), (form, seed)
        torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-12, rtol=1e-10)
        kept, _, vetoed = decide(name, old, rollout, mask, **{k: v for k, v in ref_kw.items()})
        assert out.num_tokens.item() == sum(len(k) for k in kept)
        assert out.num_sequences.item() == sum(1 for k in kept if k)
        if out.counts is not None:
            assert out.counts.vetoed_sequences.item() == sum(vetoed)
            assert out.counts.kept_tokens.item() == sum(len(k) for k in kept)


def test_the_cases_exercise_rejection_and_the_veto():
    """The forms above reject tokens and sequences and veto on these batches (a test of the
    tests: a band nothing crosses would show nothing)."""
    logp, old, rollout, adv, mask = _case(0)
    for form, expect in [("token_is_token_rs", "kept_tokens"), ("sequence_rs", "rejected_sequences"),
                         ("geometric_rs_veto", "vetoed_sequences")]:
        kw, _ = _hparams(FORMS[form])
        counts = policy_loss("grpo", PolicyBatch(torch.where(mask, logp, 0.0), old, adv, mask,
                                                 rollout_logprobs=rollout), **kw).counts
        if expect == "kept_tokens":
            assert 0 < counts.kept_tokens < counts.tokens
        else:
            assert getattr(counts, expect) > 0, form


@pytest.mark.parametrize("name", OBJECTIVES)
def test_an_empty_response_and_a_fully_rejected_batch_give_zero(name):
    logp, old, rollout, adv, mask = _case(1)
    lp = torch.where(mask, logp, 0.0).requires_grad_(True)
    kw = {"rollout_correction": "is_rs", "rs_level": "geometric", "rs_high": 1.0 + 1e-9, "rs_low": 1.0 - 1e-9,
          "opsm_delta": 0.0}
    out = policy_loss(name, PolicyBatch(lp, old, adv, mask, rollout_logprobs=rollout), **kw)
    out.loss.backward()
    assert out.loss.item() == 0.0 and (lp.grad == 0).all() and out.num_tokens.item() == 0
    assert all(math.isfinite(v.item()) for k, v in out.metrics.items() if not k.endswith(("_max", "_min")))
    assert out.counts.fractions()["rollout_masked_frac"] == 1.0
    empty = torch.zeros(2, 4, dtype=torch.bool)
    z = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    out = policy_loss(name, PolicyBatch(z, z.detach(), torch.ones(2, dtype=torch.float64), empty,
                                        rollout_logprobs=z.detach()), rollout_correction="mis", opsm_delta=0.0)
    out.loss.backward()
    assert out.loss.item() == 0.0 and (z.grad == 0).all()
    assert out.counts.fractions() == {"rollout_masked_frac": 0.0, "rollout_rejected_seq_frac": 0.0,
                                      "rollout_vetoed_frac": 0.0, "opsm_masked_frac": 0.0}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_rejection_equals_the_batch_without_the_rejected_tokens(name):
    """Loss and gradient with rejection == those of the batch whose mask lacks the rejected
    tokens (the same weights, no rejection); summed over a micro-batch split with the
    whole batch's kept counts as normalizers, too."""
    logp, old, rollout, adv, mask = _case(2)
    form = ({"is_level": "geometric", "rs_level": "token", "rs_high": 1.6} if name == "gspo" else
            {"is_level": "token", "rs_level": "token", "rs_high": 1.6, "veto_below": 0.45})
    kw = {"rollout_correction": "is_rs", **form}
    lp = torch.where(mask, logp, 0.0).requires_grad_(True)
    out = policy_loss(name, PolicyBatch(lp, old, adv, mask, rollout_logprobs=rollout), **kw)
    out.loss.backward()
    kept_mask = torch.zeros_like(mask)
    kept, _, _ = decide(name, old, rollout, mask, **{k: v for k, v in form.items() if k != "is_level"})
    for i, row in enumerate(kept):
        kept_mask[i, row] = True
    assert kept_mask.sum() < mask.sum()
    without = {"rollout_correction": "is_rs", "is_level": form["is_level"]}
    lp2 = torch.where(mask, logp, 0.0).requires_grad_(True)
    ref = policy_loss(name, PolicyBatch(lp2, old, adv, kept_mask, rollout_logprobs=rollout), **without)
    ref.loss.backward()
    # (gspo: a rejected sequence's geometric weight is computed over its whole mask either way)
    assert out.loss.item() == pytest.approx(ref.loss.item(), abs=1e-12)
    torch.testing.assert_close(lp.grad, lp2.grad, atol=1e-12, rtol=1e-10)
    # two micro-batches with the whole batch's kept counts add up to the whole
    norms = {"token_normalizer": out.num_tokens, "seq_normalizer": out.num_sequences, "num_sequences_total": 8}
    lp3 = torch.where(mask, logp, 0.0).requires_grad_(True)
    total = sum(policy_loss(name, PolicyBatch(lp3[rows], old[rows], adv[rows], mask[rows],
                                              rollout_logprobs=rollout[rows]), **kw, **norms).loss
                for rows in (slice(0, 3), slice(3, 8)))
    total.backward()
    assert total.item() == pytest.approx(out.loss.item(), abs=1e-12)
    torch.testing.assert_close(lp3.grad, lp.grad, atol=1e-12, rtol=1e-10)


def test_opsm_masks_whole_negative_sequences_by_their_mean():
    """Tokens each inside any band, the mean beyond delta: the sequence goes whole; the same
    gap on a positive advantage never does; the masked sequence stays in the normalizers."""
    T = 4
    mask = torch.ones(3, T, dtype=torch.bool)
    logp = torch.full((3, T), -1.0, dtype=torch.float64)
    # rollout - logp per token: 0.09, 0.11, 0.10, 0.10 (mean 0.1 > delta 0.08; each small)
    rollout = logp + torch.tensor([0.09, 0.11, 0.10, 0.10], dtype=torch.float64)
    old = logp.clone()
    adv = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    rollout[2] = logp[2] + 0.05  # mean 0.05 <= delta: kept
    lp = logp.clone().requires_grad_(True)
    out = policy_loss("grpo", PolicyBatch(lp, old, adv, mask, rollout_logprobs=rollout), opsm_delta=0.08)
    out.loss.backward()
    assert out.counts.opsm_sequences.item() == 1
    assert (lp.grad[0] == 0).all() and (lp.grad[1] != 0).all() and (lp.grad[2] != 0).all()
    # on-policy grpo: the gradient of a kept sequence is -A / (n_i B') with B' = 3 (the masked one counts)
    torch.testing.assert_close(lp.grad[1], torch.full((T,), -1.0 / (T * 3), dtype=torch.float64))
    assert out.num_sequences.item() == 3
    with pytest.raises(ValueError, match=r"opsm_delta masks whole sequences .* \[B\]"):
        policy_loss("grpo", PolicyBatch(lp, old, adv[:, None].expand(3, T).clone(), mask,
                                        rollout_logprobs=rollout), opsm_delta=0.0)


def test_counts_add_up_and_name_their_fields():
    a = CorrectionCounts(torch.arange(9, dtype=torch.float64))
    b = a + a
    assert b.kept_tokens.item() == 4 and b.opsm_sequences.item() == 16
    assert CorrectionCounts.zeros().fractions()["rollout_masked_frac"] == 0.0


# --------------------------------------------------------------------------- the recipe


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rl.rollout_correction=is_rs"], "is_rs with is_level, rs_level and veto_below all unset does nothing"),
        (["rl.rollout_correction=is_rs", "rl.rollout_correction_args.rs_level=token"],
         "rs_level=token needs rs_high"),
        (["rl.rollout_correction=tis", "rl.rollout_correction_args.veto_below=0.1"],
         "veto_below is read only by rollout_correction=is_rs"),
        (["rl.objective=gspo", "rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=token"],
         "rl.objective=gspo is sequence-level"),
        (["rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=token",
          "rl.rollout_correction_args.rs_high=3"], "rs_high and rs_low are read only with rs_level"),
        (["rl.old_logprobs=sampler", "rl.replay=R2", "rl.objective=grpo"], "which rl.replay=R2"),
        (["rl.old_logprobs=sampler", "rl.objective=rspo"], "which rl.objective=rspo"),
        (["rl.old_logprobs=sampler", "rl.objective=grpo", "rl.rollout_correction=tis"],
         "d = old - rollout would be 0"),
        (["rl.advantage=gae", "rl.objective=grpo", "rl.opsm_delta=0.1"], "leave rl.opsm_delta unset"),
    ],
)
def test_recipes_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_top_p_below_one_is_refused_for_rl_training():
    from moe_rl.preflight import check_sampler

    cfg = load_config(None, ["sampler.top_p=0.9"])  # (evaluation and the mismatch tool still take it)
    with pytest.raises(ConfigError, match=r"sampler\.top_p=0\.9 .* biased"):
        check_sampler(cfg)


# --------------------------------------------------------------------------- the learner's passes


@pytest.fixture(scope="module")
def learner(megatron_world):
    with default_learner(5) as learner:
        yield learner


LEARNER_FORMS = {
    "token_is_token_rs": ["rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=token",
                          "rl.rollout_correction_args.rs_level=token", "rl.rollout_correction_args.rs_high=1.5"],
    "geometric_rs_veto_normalized": [
        "rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=geometric",
        "rl.rollout_correction_args.rs_level=geometric", "rl.rollout_correction_args.rs_high=1.12",
        "rl.rollout_correction_args.veto_below=0.5", "rl.rollout_correction_args.is_batch_normalize=true"],
}
REFERENCE_FORMS = {  # (the same weights without rejection)
    "token_is_token_rs": ["rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=token"],
    "geometric_rs_veto_normalized": ["rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=geometric",
                                     "rl.rollout_correction_args.is_batch_normalize=true"],
}


def _grads(learner):
    return torch.cat([p.main_grad.flatten().clone() for p in learner.model.parameters() if p.requires_grad])


def _pass(learner, cfg, batch, on_policy, mbs):
    from moe_rl.programs.rl.policy_loss import PolicyLossFn

    learner.parallel_cfg = dataclasses.replace(learner.parallel_cfg, micro_batch_size=mbs)
    loss_fn = PolicyLossFn(cfg.rl, cfg.sampler.max_new_tokens, on_policy=on_policy)
    loss_fn.prepare(batch, [batch.row_ids_B], lambda t: t)
    metrics, _, _, sums = learner._gradients(batch, loss_fn, None, 1.0)
    return metrics["loss"], _grads(learner), sums


@pytest.mark.parametrize("objective", ["grpo", "dapo", "gspo"])
@pytest.mark.parametrize("form", list(LEARNER_FORMS))
def test_the_learners_passes_equal_the_batch_without_the_rejected_tokens(learner, objective, form):
    """Scored (the step's counts before the pass) and on-policy (the counts from the pass's
    own forward, the gradient rescaled once), at 1 and 3 micro-batches: loss and gradient
    equal the pass over the batch whose rejected tokens are observations (out of the mask)."""
    from moe_rl.objectives.correction import correction_form, decide_correction
    from moe_rl.step_batch import StepBatch

    if objective == "gspo" and form == "token_is_token_rs":
        form_args = [*LEARNER_FORMS[form][:1], "rl.rollout_correction_args.is_level=geometric",
                     *LEARNER_FORMS[form][2:]]
        ref_args = [REFERENCE_FORMS[form][0], "rl.rollout_correction_args.is_level=geometric"]
    else:
        form_args, ref_args = LEARNER_FORMS[form], REFERENCE_FORMS[form]
    cfg = load_config(None, [f"rl.objective={objective}", *form_args])
    cfg_ref = load_config(None, [f"rl.objective={objective}", *ref_args])
    tokens, adv_B = fixed_batch()
    mask = tokens.response_mask()
    whole = StepBatch.whole(tokens, adv_B=adv_B)
    logp0 = learner.score(whole).logp_BT
    g = torch.Generator().manual_seed(11)
    sampler = torch.where(mask, logp0 + 0.3 * torch.randn(logp0.shape, generator=g), 0.0)
    decided = decide_correction(correction_form(cfg.rl.rollout_correction, cfg.rl.rollout_correction_args,
                                                objective == "gspo"), logp0, sampler, mask)
    rejected = mask & ~decided.kept_BT
    assert 0 < int(rejected.sum()) < int(mask.sum())
    ref_tokens = dataclasses.replace(tokens, observed_BT=rejected)  # (fed and attended to, not trained)
    results = {}
    for on_policy in (False, True):
        for mbs in (12, 5):
            batch = StepBatch.whole(tokens, adv_B=adv_B, sampler_logp_BT=sampler)
            ref = StepBatch.whole(ref_tokens, adv_B=adv_B, sampler_logp_BT=sampler)
            if not on_policy:
                batch, ref = batch.scored(logp0, None), ref.scored(logp0 * ~rejected, None)
            got = _pass(learner, cfg, batch, on_policy, mbs)
            want = _pass(learner, cfg_ref, ref, on_policy, mbs)
            assert got[0] == pytest.approx(want[0], rel=1e-6, abs=1e-9), (on_policy, mbs)
            scale = float(want[1].abs().max())
            assert float((got[1] - want[1]).abs().max()) <= 1e-6 * scale, (on_policy, mbs)
            results[on_policy, mbs] = got
            assert got[2]["kept_tokens"] == mask.sum() - rejected.sum()
    base = results[False, 12][1]
    for key, (_, grads, _) in results.items():
        assert float((grads - base).abs().max()) <= 1e-6 * float(base.abs().max()), key
