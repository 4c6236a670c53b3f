"""The RL loop end to end on CPU: one step per objective/replay mode, resume, bad recipes."""

import importlib
import json
import math
import shutil
import subprocess
import sys

import pytest

from moe_rl.config import load_config
from moe_rl_testing import ROOT
from moe_rl_testing.in_process import run_main

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "logging.progress=false",
         f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}", "optimizer.lr=1e-4"]


def run_trainer(tmp_path, *overrides):
    from moe_rl.programs.rl import train

    cfg = load_config(RECIPE, [*SMALL, f"run.output_dir={tmp_path}", *overrides])
    summary = train(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, summary, rows


def assert_finite(row, keys):
    for k in keys:
        assert k in row, f"metric {k} missing"
        assert math.isfinite(row[k]), f"metric {k} = {row[k]}"


CASES = {
    "grpo-vllm": ["rl.objective=grpo", "sampler.backend=vllm"],
    "gspo": ["rl.objective=gspo", "sampler.backend=transformers",
             "rl.rollout_correction=tis"],
    "rspo-R2": ["rl.objective=rspo", "rl.replay=R2", "sampler.backend=transformers", "rl.num_minibatches=2"],
    "rspo-R3": ["rl.objective=rspo", "rl.replay=R3", "sampler.backend=transformers", "rl.num_minibatches=2"],
}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_one_step_end_to_end(megatron_world, tmp_path, case):
    cfg, summary, rows = run_trainer(tmp_path, "run.steps=1", f"run.name={case}", "logging.rollouts_every=1",
                                     *CASES[case])
    row = rows[0]
    # the rollout dump carries the learner's log-probs the step's mismatch was measured on
    dumped = [json.loads(x) for x in (cfg.run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    d = [lp - sp for r in dumped for lp, sp in zip(r["learner_logprobs"], r["sampler_logprobs"], strict=True)]
    assert len(d) == sum(len(r["response_ids"]) for r in dumped) > 0
    assert sum(math.expm1(x) - x for x in d) / len(d) == pytest.approx(row["mismatch/k3"], rel=1e-6, abs=1e-15)
    assert summary["steps"] == 1 and summary["objective"] == cfg.rl.objective
    assert_finite(row, ["reward/mean", "policy/clip_frac", "policy/ratio_mean", "policy/approx_kl",
                        "learner/loss", "learner/grad_norm", "mismatch/k3", "mismatch/dp_mean",
                        "response/length_mean", "time/sample", "time/old_logprob", "time/update", "time/sync"])
    if cfg.rl.scores_in_update:  # on-policy shortcut: the router cannot have moved, nothing to measure
        assert "routing/flip_rate_mean" not in row and row["policy/updates"] == 1
    else:
        assert_finite(row, ["routing/flip_rate_mean", "routing/gamma_mean"])
    assert 0 <= row["reward/mean"] <= 1
    # fp32 sampler and learner hold the same weights: their logprobs agree
    assert row["mismatch/k3"] < 1e-6
    assert row["policy/updates"] == cfg.rl.num_minibatches
    assert (cfg.run_dir / "checkpoints" / "step_000001" / "moe_rl.json").is_file()
    assert list((cfg.run_dir / "tb").glob("events.out.tfevents.*"))
    if cfg.sampler.backend == "transformers":
        # the sampler's routing is returned; in fp32 it is the learner's routing
        assert row["routing/sampler_disagree_any"] < 0.02
    if case.startswith("rspo"):
        assert_finite(row, ["policy/router_shift_mean", "routing/gamma_p05"])
        assert 0 < row["routing/gamma_min"] <= row["routing/gamma_mean"] <= 1
        # two mini-batches: the second update sees a moved router
        assert row["routing/gamma_min"] < 1


@pytest.mark.slow
def test_resume_after_a_kill_repeats_the_uninterrupted_run(megatron_world, tmp_path):
    common = ["run.steps=3", "run.save_every=2", "sampler.backend=transformers", "rl.num_minibatches=2"]
    _, _, straight = run_trainer(tmp_path / "a", "run.name=a", *common)
    # the same run killed after step 2: its step-2 checkpoint and metrics up to step 2 survive
    run_b = tmp_path / "b" / "b"
    run_b.parent.mkdir()
    shutil.copytree(tmp_path / "a" / "a", run_b)
    shutil.rmtree(run_b / "checkpoints" / "step_000003")
    lines = (run_b / "metrics.jsonl").read_text().splitlines()[:2]
    (run_b / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _, summary, resumed = run_trainer(tmp_path / "b", "run.name=b", "run.resume=true", *common)
    assert [r["step"] for r in resumed] == [1, 2, 3] and summary["steps"] == 3
    for key in ["reward/mean", "learner/loss", "learner/grad_norm", "policy/clip_frac", "routing/gamma_mean"]:
        assert resumed[2][key] == pytest.approx(straight[2][key], rel=1e-6, abs=1e-9), key


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


IN_A_CHILD = "rl.objectiv=gspo"
"""The one bad recipe run by a real `python -m moe_rl.train` (the interpreter's exit status);
the others run its `main(argv)` in this process (`in_process.run_main`), the same code."""


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rl.objectiv=gspo", "unknown key rl.objectiv; did you mean rl.objective?"),
        ("parallel.expert_model_parallel_size=3", "num_experts=8 is not divisible by parallel.expert_model_parallel_size=3"),
        ("parallel.tensor_model_parallel_size=2", "world size 1 is not divisible by tensor x pipeline parallel"),
        ("rl.objective=ppo", "rl.objective='ppo' is unknown; valid: grpo"),
        ("rl.objective_args.rspo.clip_lo=0.1", "unknown key rl.objective_args.rspo.clip_lo for objective rspo"),
        ("run.init_checkpoint=/nonexistent/ckpt", "run.init_checkpoint=/nonexistent/ckpt does not exist"),
        ("rl.replay=R3", "rl.replay=R3 needs the sampler's routed experts"),
    ],
)
def test_bad_recipes_fail_before_any_work(tmp_path, override, message):
    args = [f"run.output_dir={tmp_path}", override]
    proc = run_cli(*args) if override == IN_A_CHILD else run_main(importlib.import_module("moe_rl.train"),
                                                                   ["--config", str(RECIPE), *args])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing was created


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["rspo", "grpo"])
def test_on_policy_shortcut_changes_nothing_but_the_time(megatron_world, tmp_path, objective, monkeypatch):
    """With one update per rollout the old-logprob pass is skipped (no scoring pass at all,
    counted): the update's own forward gives the old logprobs (gamma is exactly 1 for rspo).
    Every logged number but the timings equals the run that recomputes them. (The learner's
    behaviour, whatever samples: the transformers sampler, ~2 s a run less than a vLLM
    engine's start; the shortcut with vLLM runs in test_one_step_end_to_end[grpo-vllm] and
    the demo's pinned steps.)"""
    from moe_rl.learner.engine import Learner

    runs, scored = {}, []
    real_score = Learner.score

    def counted_score(self, *args, **kwargs):
        scored.append(1)
        return real_score(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "score", counted_score)
    for shortcut in (True, False):
        scored.clear()
        cfg, _, rows = run_trainer(tmp_path, f"run.name=s{shortcut}", "run.steps=2", f"rl.objective={objective}",
                                   "sampler.backend=transformers", f"rl.on_policy_shortcut={str(shortcut).lower()}")
        assert cfg.rl.scores_in_update is shortcut
        assert len(scored) == (0 if shortcut else 2), len(scored)  # (one scoring pass a step without it)
        runs[shortcut] = rows
    for fast, slow in zip(runs[True], runs[False]):
        same = {k for k in slow if not k.startswith(("time/", "sync/seconds", "sampler/sample_seconds", "perf/"))
                and not k.startswith("routing/") and k != "learner/tokens_per_s"}
        assert {k: fast[k] for k in same} == {k: slow[k] for k in same}
        # off the shortcut, rspo measures the router shift of an unmoved router: exactly 1
        if objective == "rspo":
            assert slow["routing/gamma_min"] == 1.0 and slow["routing/flip_rate_mean"] == 0.0


def test_r3_uses_the_samplers_routing_where_the_learners_router_differs(megatron_world, tmp_path):
    """bf16 sampler, fp32 learner: the learner's own router picks other experts than the
    sampler on some tokens; under R3 the routing the pass used is the sampler's on all."""
    _, _, rows = run_trainer(tmp_path, "run.steps=2", "run.name=r3_bf16", "rl.objective=grpo", "rl.replay=R3",
                             "sampler.backend=transformers", "sampler.precision=bf16", "rl.prompts_per_step=8")
    assert all(r["routing/sampler_used_disagree_any"] == 0 for r in rows)
    assert max(r["routing/sampler_disagree_any"] for r in rows) > 0, [r["routing/sampler_disagree_any"] for r in rows]


@pytest.mark.slow
def test_packing_changes_nothing_but_the_time(megatron_world, tmp_path):
    """Packed micro-batches against the padded reference over 3 steps of off-policy RSPO with
    R2 (4 mini-batch updates a step): the same rewards (the engines receive the same weights
    to float precision), grad norm to 1e-5 relative and loss to 1e-6; only the padding differs."""
    runs = {}
    for packing in (True, False):
        _, _, rows = run_trainer(tmp_path, f"run.name=p{packing}", "run.steps=3", "rl.objective=rspo",
                                 "rl.replay=R2", "rl.num_minibatches=4", "sampler.backend=transformers",
                                 f"parallel.packing={str(packing).lower()}", "parallel.micro_batch_size=4")
        runs[packing] = rows
    for packed, padded in zip(runs[True], runs[False]):
        assert packed["reward/mean"] == padded["reward/mean"]
        for key in ("learner/grad_norm", "routing/gamma_mean"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-5), key
        # the loss sums signed per-token terms of size ~1: compared at the terms' scale, as the
        # placement tests do (its relative error grows with the cancellation)
        assert packed["learner/loss"] == pytest.approx(padded["learner/loss"], abs=1e-6)
        assert packed["learner/pad_frac"] < padded["learner/pad_frac"]
        assert packed["learner/microbatches"] == padded["learner/microbatches"]
        assert packed["learner/tokens_per_s"] > 0


@pytest.mark.slow
def test_offloading_the_learner_during_rollout_changes_nothing_but_the_time(megatron_world, tmp_path):
    runs = {}
    for offload in (True, False):
        _, _, rows = run_trainer(tmp_path, f"run.name=o{offload}", "run.steps=2", "rl.num_minibatches=2",
                                 "sampler.backend=transformers", f"optimizer.offload_during_rollout={str(offload).lower()}")
        runs[offload] = rows
    for on, off in zip(runs[True], runs[False]):
        for key in ("reward/mean", "learner/loss", "learner/grad_norm", "mismatch/k3"):
            assert on[key] == off[key], key
    assert runs[True][1]["learner/offloaded_gib"] > 0 and "learner/offloaded_gib" not in runs[False][1]


@pytest.mark.slow
def test_a_run_with_rejection_and_opsm_and_a_bypass_run(megatron_world, tmp_path, monkeypatch):
    """Two 2-step off-policy GRPO runs (2 mini-batches a step, a bf16 sampler for a real gap):
    geometric rejection + veto + normalized token weights + OPSM, whose normalized weights
    average 1 over what is kept; and bypass (rl.old_logprobs=sampler), which never calls the
    learner's scoring pass and measures the gap against the update's first log-probs
    (the correction itself: tests/unit/objectives/test_rollout_correction.py)."""
    from moe_rl.learner.engine import Learner

    scored = []
    real_score = Learner.score
    monkeypatch.setattr(Learner, "score", lambda self, *a, **k: scored.append(1) or real_score(self, *a, **k))
    common = ["rl.objective=grpo", "rl.num_minibatches=2", "sampler.backend=transformers", "sampler.precision=bf16",
              "run.steps=2"]
    runs = {
        "corrected": ["rl.rollout_correction=is_rs", "rl.rollout_correction_args.is_level=token",
                      "rl.rollout_correction_args.is_batch_normalize=true",
                      "rl.rollout_correction_args.rs_level=geometric", "rl.rollout_correction_args.rs_high=1.002",
                      "rl.rollout_correction_args.veto_below=0.2", "rl.opsm_delta=0.0"],
        "bypass": ["rl.old_logprobs=sampler", "rl.opsm_delta=0.0"],
    }
    rows = {}
    for name, extra in runs.items():
        scored.clear()
        _, _, rows[name] = run_trainer(tmp_path, f"run.name={name}", *common, *extra)
        assert len(scored) == (0 if name == "bypass" else 2), (name, len(scored))
    for row in rows["corrected"]:
        assert 0 < row["policy/rollout_masked_frac"] < 1 and row["policy/rollout_rejected_seq_frac"] > 0
        # normalized to mean 1 over the step's kept tokens; the step's value is the mean of its two
        # mini-batches' means (each over its own kept tokens), so 1 only to the split's balance
        assert row["policy/rollout_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert 0 <= row["policy/opsm_masked_frac"] <= 1 and "policy/rollout_vetoed_frac" in row
        assert row["mismatch/k3"] > 0 and 0 < row["mismatch/ess_token"] <= 1 and math.isfinite(row["mismatch/chi2_seq"])
    for row in rows["bypass"]:
        assert row["policy/rollout_masked_frac"] == 0  # (no correction: OPSM's tallies alone)
        assert row["policy/updates"] == 2 and math.isfinite(row["learner/grad_norm"])
        assert row["mismatch/k3"] > 0  # the bf16 sampler against the learner's first update log-probs
