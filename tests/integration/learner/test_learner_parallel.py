"""The learner at TP=2, EP=2 (alltoall), PP=2 and TP=2 x EP=2 against one process.

Each layout loads the same checkpoint, scores the same batch, takes the same optimizer
step, and its full parameters are gathered and compared with the 1-process run. A
checkpoint saved at EP=2 is loaded at 1 process; resuming at EP=2 after a save gives the
same next step as not stopping.
"""

import math

import pytest
import torch

from moe_rl_testing.dist_helpers import torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LAYOUTS = ["tp2", "ep2", "pp2", "tp2ep2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    torchrun("learner_layouts.py", 4, str(out))  # (the one-process reference and check on rank 0)
    load = lambda name: torch.load(out / f"{name}.pt")  # noqa: E731
    return load("reference"), load("layouts"), load("check")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_match_one_process(runs, layout):
    ref, lay, _ = runs
    assert (lay[layout]["logp"] - ref["logp"]).abs().max() <= 1e-5
    # the empty response (row 5) scores nothing
    assert lay[layout]["logp"][5].abs().max() == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_episodes_logprobs_match_one_process(runs, layout):
    """Multi-turn episodes (observation tokens between the policy's turns, issue #49): the
    policy's tokens score as at one process, the observations score nothing."""
    from moe_rl_testing.learner_utils import episode_batch

    ref, lay, _ = runs
    batch = episode_batch()[0]
    assert (lay[layout]["logp_episode"] - ref["logp_episode"]).abs().max() <= 1e-5
    assert lay[layout]["logp_episode"][batch.observed_BT].abs().max() == 0
    policy = batch.response_mask()
    assert (lay[layout]["logp_episode"][policy] - ref["logp"][policy]).abs().max() <= 1e-5  # (same ids, same logits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_optimizer_step_matches_one_process(runs, layout):
    ref, lay, _ = runs
    params = lay[layout]["params"]
    assert set(params) == set(ref["params"])
    worst = max((params[k] - ref["params"][k]).abs().max().item() for k in params)
    assert worst <= 1e-5, f"{layout}: parameters differ by {worst}"
    assert lay[layout]["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], abs=1e-6)
    assert lay[layout]["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert (lay[layout]["logp_after"] - ref["logp_after"]).abs().max() <= 1e-5
    # the step really moved the weights
    assert (ref["logp_after"] - ref["logp"]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["dapo-token_is_token_rs/scored", "dapo-token_is_token_rs/on_policy",
                                  "grpo-geometric_rs_veto/scored", "grpo-geometric_rs_veto/on_policy",
                                  "gspo-opsm/scored", "gspo-opsm/on_policy"])
def test_rollout_corrections_at_data_parallel_2_match_one_process(runs, case):
    """Token IS + token rejection (dapo: the kept-token count crosses ranks), geometric
    rejection + veto + batch normalization (grpo: B' and the weights' mean), OPSM (gspo): the
    same loss, gradient norm and tallies at TP2 (data parallel 2) as at one process, scored
    and under the on-policy shortcut (counted after the pass, the gradient rescaled)."""
    ref, lay, _ = runs
    (loss0, norm0, sums0), (loss, norm, sums) = ref["corrections"][case], lay["tp2"]["corrections"][case]
    assert loss == pytest.approx(loss0, abs=1e-6) and norm == pytest.approx(norm0, rel=1e-5)
    assert sums == pytest.approx(sums0, rel=1e-6, abs=1e-9)  # (counts exact; the weights' sum to fp32 rounding)
    kind = case.split("/")[0]
    if kind != "gspo-opsm":
        assert 0 < sums["kept_tokens"] < sums["tokens"], sums  # (the case does reject)
    else:
        assert sums["opsm_sequences"] > 0, sums
    if kind == "grpo-geometric_rs_veto":
        assert sums["vetoed_sequences"] > 0, sums
    # scored and on-policy passes agree: same weights, the rejection decided from the same log-probs
    other = case.replace("scored", "on_policy") if "scored" in case else case.replace("on_policy", "scored")
    assert loss == pytest.approx(lay["tp2"]["corrections"][other][0], abs=1e-6)


def test_a_nan_update_at_tp2_is_skipped_on_every_rank_without_a_trace(runs):
    """Its step then matches the reference's, which took none (test_one_optimizer_step_...)."""
    _, lay, _ = runs
    nan = lay["tp2"]["nan"]
    assert nan["update_skipped"] == 1.0 and nan["skipped_in_a_row_max"] == 1.0 and math.isnan(nan["grad_norm"])
    assert lay["tp2"]["metrics"]["update_skipped"] == 0.0 and lay["tp2"]["metrics"]["skipped_in_a_row_max"] == 0.0


def test_checkpoint_saved_at_ep2_loads_at_one_process(runs):
    _, lay, check = runs
    assert (check["logp"] - lay["ep2"]["logp_after"]).abs().max() <= 1e-5


def test_resume_gives_the_same_next_step(runs):
    _, lay, _ = runs
    timing = "tokens_per_s"  # (a rate: the only number allowed to differ)
    assert {k: v for k, v in lay["ep2"]["next_resumed"].items() if k != timing} == \
        {k: v for k, v in lay["ep2"]["next"].items() if k != timing}
