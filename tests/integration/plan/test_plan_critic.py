"""PPO's critic in `python -m moe_rl.plan` (`rl.advantage=gae`, moe_rl/plan/critic.py): its
model state per rank is the actor's without the frozen output layer's gradient and optimizer
state and with the value head's, its update adds its state to both phases, its time is the
actor's without the output layer's GEMM, and without gae the plan is the one it was.

Expected values are derived here from the model's shapes (vocab V, hidden H, TP, DP and the
bytes per element), not from the planner's code. The plans come from
moe_rl_testing/workers/plan_worker.py in one subprocess (the meta-device build joins a fake process
group): a small bf16 model, a few seconds.
"""

import math
import os
import sys

import pytest

from moe_rl_testing import ROOT, forked
from moe_rl_testing.plan_jobs import run_plan_jobs

V, H = 128, 64  # ModelConfig's default vocab_size and hidden_size (untied output layer)
PARAM, GRAD, ADAM, MAIN = 2, 4, 8, 4  # bf16 weights, fp32 gradients, Adam's fp32 moments, fp32 main copy
# two minibatches: the old-logprob pass runs (no on-policy shortcut), so the actor scores once
BASE = ["model.params_dtype=bf16", "rl.num_minibatches=2"]
LAYOUTS = {
    "one": ([], 1),
    "tp2": (["parallel.tensor_model_parallel_size=2", "optimizer.distributed=true"], 2),
    "pp2": (["parallel.pipeline_model_parallel_size=2", "optimizer.distributed=true"], 4),
}


def _jobs() -> list[dict]:
    jobs = [{"name": f"{adv}/{lay}", "recipe": None, "overrides": [*BASE, *ov, f"rl.advantage={adv}"], "gpus": n}
            for lay, (ov, n) in LAYOUTS.items() for adv in ("grpo", "gae")]
    jobs.append({"name": "gae/one/kl", "recipe": None, "gpus": 1,
                 "overrides": [*BASE, "rl.advantage=gae", "rl.kl_coef=0.1"]})
    # the critic's own passes: 2 epochs of 4 mini-batches (the actor: 1 of 2), against an
    # actor that itself takes 4 mini-batches; micro-batches of a whole mini-batch
    whole = [*BASE, "parallel.micro_batch_size=64"]
    jobs.append({"name": "gae/one/critic4x2", "recipe": None, "gpus": 1,
                 "overrides": [*whole, "rl.advantage=gae", "critic.num_minibatches=4", "critic.epochs=2"]})
    jobs.append({"name": "grpo/one/mb4", "recipe": None, "gpus": 1, "overrides": [*whole, "rl.num_minibatches=4"]})
    return jobs


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict:
    return run_plan_jobs(_jobs(), tmp_path_factory.mktemp("critic_plans"), timeout=300)


def _state(rank: dict, prefix: str = "") -> tuple[int, int, int]:
    mem = rank["memory_bytes"]
    return mem[f"{prefix}params"], mem[f"{prefix}grads"], mem[f"{prefix}optimizer_states"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_critic_state_is_the_actors_less_the_frozen_output_layer(plans, layout):
    """Per rank: + the [H] value head on the last stage (bf16 weight, fp32 gradient, Adam and
    main copy); - the V/tp x H output layer's gradient and optimizer state (the distributed
    optimizer's shard of it: ceil(elements / dp)); the output layer's weight stays."""
    plan = plans[f"gae/{layout}"]
    lay = plan["layout"]
    last = lay["pp"] - 1
    for rank in plan["ranks"]:
        on_last = rank["pp_rank"] == last
        frozen = V // lay["tp"] * H if on_last else 0
        head = H if on_last else 0
        owned = -(-frozen // lay["dp"]) if plan["switches"]["distributed_optimizer"] else frozen
        params, grads, optimizer = _state(rank)
        assert _state(rank, "critic_") == (
            params + head * PARAM,
            grads - frozen * GRAD + head * GRAD,
            optimizer - owned * (ADAM + MAIN) + head * (ADAM + MAIN),
        ), f"{layout} stage {rank['pp_rank']}"
    assert {r["pp_rank"] for r in plan["ranks"]} == set(range(lay["pp"]))


def test_the_layouts_split_the_output_layer_as_expected(plans):
    """The cases above are the intended ones: dp 2 under PP2 x 4 GPUs, tp 2 halving V."""
    assert (plans["gae/pp2"]["layout"]["dp"], plans["gae/pp2"]["layout"]["pp"]) == (2, 2)
    assert (plans["gae/tp2"]["layout"]["tp"], plans["gae/tp2"]["layout"]["dp"]) == (2, 1)
    one = plans["gae/one"]["ranks"][0]
    assert one["memory_bytes"]["critic_grads"] == one["memory_bytes"]["grads"] - (V * H - H) * GRAD


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_critic_activations_are_the_actors_plus_the_value_head(plans, layout):
    """Same layers and micro-batches; on the last stage the head's input (a sequence-parallel
    shard of the final hidden states, bf16) and one fp32 value per token."""
    plan = plans[f"gae/{layout}"]
    lay, work = plan["layout"], plan["workload"]
    tokens = work["micro_batch"] * work["seq_len"]
    for rank in plan["ranks"]:
        mem = rank["memory_bytes"]
        head = tokens * H * PARAM // lay["tp"] + 4 * tokens if rank["pp_rank"] == lay["pp"] - 1 else 0
        assert mem["critic_activations"] == mem["activations"] + head


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gae_peaks_exceed_grpo_by_the_critic(plans, layout):
    """Both phases carry the critic's state; the update also its fp8 caches (none here) and
    whatever its pass needs beyond the actor's activations + logits (they run in turn)."""
    gae, grpo = plans[f"gae/{layout}"], plans[f"grpo/{layout}"]
    for with_critic, without in zip(gae["ranks"], grpo["ranks"]):
        mem = with_critic["memory_bytes"]
        state = sum(_state(with_critic, "critic_"))
        beyond = max(0, mem["critic_activations"] - mem["activations"] - mem["logits"])
        assert with_critic["rollout_peak_bytes"] - without["rollout_peak_bytes"] == state
        assert with_critic["update_peak_bytes"] - without["update_peak_bytes"] == state + mem["critic_fp8_extra"] + beyond
    least = min(sum(_state(r, "critic_")) for r in gae["ranks"])
    assert least > 0
    for phase in ("rollout", "update"):
        assert gae["phases"][phase]["peak_bytes"] >= grpo["phases"][phase]["peak_bytes"] + least


def test_reference_model_is_counted_beside_the_critic(plans):
    kl, plain = plans["gae/one/kl"]["ranks"][0], plans["gae/one"]["ranks"][0]
    assert kl["memory_bytes"]["reference_model"] == kl["memory_bytes"]["params"] > 0
    assert kl["update_peak_bytes"] - plain["update_peak_bytes"] == kl["memory_bytes"]["params"]
    assert plans["gae/one/kl"]["workload"]["scoring_passes"] == 2


def test_critic_time_is_the_actors_without_the_output_layer(plans):
    """One value forward over the batch, and the update at the actor's cost in forwards; each
    forward cheaper than the actor's by the output layer's GEMM: 2 V H FLOPs per token."""
    gae, grpo = plans["gae/one"], plans["grpo/one"]
    t, hw, work = gae["times_s"], gae["hardware"], gae["workload"]
    assert work["scoring_passes"] == 1
    tokens = work["sequences"] * work["seq_len"]
    output_gemm = tokens * 2 * V * H / (hw["bf16_tflops"] * 1e12 * hw["mfu"])  # one GPU
    assert t["scoring"] - t["critic_scoring"] == pytest.approx(output_gemm, rel=1e-9)
    factor = t["update_compute"] / t["scoring"]
    assert factor == pytest.approx(3.0)  # fwd + 2x bwd, one epoch, no pipeline bubble
    assert t["critic_update_compute"] == pytest.approx(factor * t["critic_scoring"], rel=1e-12)
    critic = {k: v for k, v in t.items() if k.startswith("critic_")}
    assert set(critic) == {"critic_scoring", "critic_update_compute", "critic_comms", "critic_optimizer"}
    assert t["total"] - grpo["times_s"]["total"] == pytest.approx(sum(critic.values()), rel=1e-9)
    assert 0 < critic["critic_optimizer"] < t["optimizer"]  # Adam over fewer elements


def test_the_critic_is_planned_at_its_own_minibatches_and_epochs(plans):
    """critic.num_minibatches=4 and critic.epochs=2 (the actor: one pass of 2): the critic's
    activations are those of an actor update over a quarter of the batch (plus the head), its
    update compute is 2 passes (fwd + 2x bwd each) of its value forward, its Adam steps 8 where
    the default critic takes 2; the actor's own numbers do not move."""
    plan, default, quarter = plans["gae/one/critic4x2"], plans["gae/one"], plans["grpo/one/mb4"]
    mem, q = plan["ranks"][0]["memory_bytes"], quarter["ranks"][0]["memory_bytes"]
    assert (plan["workload"]["micro_batch"], quarter["workload"]["micro_batch"]) == (64, 32)
    shapes = {k: plan["critic_workload"][k] for k in ("micro_batch", "micro_batches", "updates", "epochs")}
    assert shapes == {"micro_batch": 32, "micro_batches": 1, "updates": 8, "epochs": 2}
    assert plans["grpo/one"]["critic_workload"] is None
    tokens = 32 * quarter["workload"]["seq_len"]
    assert mem["critic_activations"] == q["activations"] + tokens * H * PARAM + 4 * tokens
    assert mem["activations"] > q["activations"]  # the actor's micro-batches stay whole mini-batches
    t, t0 = plan["times_s"], default["times_s"]
    assert t["critic_update_compute"] == pytest.approx(2 * 3.0 * t["critic_scoring"], rel=1e-12)
    assert t["critic_scoring"] == pytest.approx(t0["critic_scoring"], rel=1e-12)
    assert t["critic_optimizer"] == pytest.approx(4 * t0["critic_optimizer"], rel=1e-12)
    assert t["update_compute"] == t0["update_compute"] and t["optimizer"] == t0["optimizer"]


def test_critic_traffic_is_the_actors_passes(plans):
    """Under PP2 the critic's value pass and updates move what the actor's score pass and
    updates move (same pass count here), its gradients counted as the actor's: the slowest
    rank's TP + EP + PP + DP seconds."""
    plan = plans["gae/pp2"]
    per_rank = [sum(x["seconds"] for x in r["traffic"] if x["family"] in ("tp", "ep", "pp", "dp"))
                for r in plan["ranks"]]
    assert plan["times_s"]["pp"] > 0
    assert plan["times_s"]["critic_comms"] == pytest.approx(max(per_rank), rel=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_without_gae_the_plan_has_no_critic(plans, layout):
    """grpo: no critic kind, part or flag, and the phases are the actor's sums as before."""
    grpo, gae = plans[f"grpo/{layout}"], plans[f"gae/{layout}"]
    assert grpo["critic"] is False and gae["critic"] is True
    assert not any(k.startswith("critic") for k in grpo["times_s"])
    for rank, same in zip(grpo["ranks"], gae["ranks"]):
        mem = rank["memory_bytes"]
        assert not any(k.startswith("critic") for k in mem)
        assert mem == {k: v for k, v in same["memory_bytes"].items() if not k.startswith("critic")}
        static = mem["params"] + mem["grads"] + mem["optimizer_states"] + mem["reference_model"] + mem["reserve"]
        assert rank["rollout_peak_bytes"] == static + mem["sampler_budget"]
        sampler = 0 if grpo["switches"]["sleep"] else mem["sampler_budget"]
        assert rank["update_peak_bytes"] == static + mem["fp8_extra"] + mem["activations"] + mem["logits"] + sampler
    shared = {k: v for k, v in gae["times_s"].items() if not k.startswith("critic") and k != "total"}
    assert shared == {k: v for k, v in grpo["times_s"].items() if k != "total"}
    assert math.isclose(grpo["times_s"]["total"], sum(shared.values()), rel_tol=1e-12)


def test_report_shows_the_critic_lines():
    proc = forked.run([sys.executable, "-m", "moe_rl.plan", "--config", "examples/tiny_rspo.yaml",
                           "rl.advantage=gae", "--no-suggest"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for row in ("critic_params", "critic_grads", "critic_optimizer_states", "critic_activations",
                "critic_scoring", "critic_update_compute", "critic_comms"):
        assert any(line.strip().startswith(row + " ") for line in lines), row
    assert any(line.startswith("critic (rl.advantage=gae)") for line in lines)
