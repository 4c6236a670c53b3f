"""A checkpoint in `python -m moe_rl.plan` (moe_rl/plan/checkpoint.py): its size is one copy
of the weights and of the optimizer state, each rank writes only what megatron deduplicates
to it, and the save time follows the stated storage bandwidth (`--storage-gbps`).

Expected sizes are counted here by hand from ModelConfig's default shapes (parameters x
bytes per element), not from the planner's code. The plans come from
moe_rl_testing/workers/plan_worker.py in one subprocess (the meta-device build joins a fake process
group): a small bf16 model, seconds.
"""

import json

import pytest

from moe_rl.config import ModelConfig
from moe_rl_testing import ROOT
from moe_rl_testing.plan_jobs import run_plan_jobs

TINY = str(ROOT / "examples/tiny_rspo.yaml")
WEIGHT, OPTIMIZER = 2, 12  # bf16 weights; fp32 main copy + Adam's two fp32 moments
BASE = ["model.params_dtype=bf16"]


def hand_count() -> tuple[int, int]:
    """(dense, routed-expert) parameters of ModelConfig's defaults: embedding and untied
    output, per layer the input norm, GQA q/k/v and output projections, the per-head q/k
    norms, the pre-MLP norm, the router and E SwiGLU experts; the final norm."""
    m = ModelConfig()
    assert m.untie_embeddings_and_output_weights and m.qk_layernorm and m.num_dense_layers == 0
    h, q, kv = m.hidden_size, m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    per_layer = h + h * (q + 2 * kv) + q * h + 2 * m.kv_channels + h + m.num_experts * h
    dense = 2 * m.vocab_size * h + m.num_layers * per_layer + h
    experts = m.num_layers * m.num_experts * 3 * h * m.moe_ffn_hidden_size
    return dense, experts


def _jobs() -> list[dict]:
    one_per_node = {"gpus_per_node": 1}
    jobs = [
        {"name": "one", "recipe": None, "overrides": BASE, "gpus": 1},
        {"name": "one/distributed", "recipe": None, "overrides": [*BASE, "optimizer.distributed=true"], "gpus": 1},
        # EP2 on two one-GPU nodes: rank 0 is dense data-parallel rank 0, rank 1 is not
        {"name": "ep2", "recipe": None, "overrides": [*BASE, "parallel.expert_model_parallel_size=2"], "gpus": 2,
         "hardware": one_per_node},
        {"name": "ep2/sync", "recipe": None, "gpus": 2, "hardware": one_per_node,
         "overrides": [*BASE, "parallel.expert_model_parallel_size=2", "run.async_save=false"]},
    ]
    for gbps in (1, 4):  # the command line's flag; hashing fast, so the read-back is storage-bound
        jobs.append({"name": f"cli/storage{gbps}",
                     "argv": ["--config", TINY, "--json", "--storage-gbps", str(gbps), "--hash-gbps", "1000"]})
    jobs.append({"name": "cli/text", "argv": ["--config", TINY, "--no-suggest"]})
    return jobs


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict:
    return run_plan_jobs(_jobs(), tmp_path_factory.mktemp("checkpoint_plans"), timeout=300)


@pytest.mark.parametrize("name", ["one", "one/distributed"])
def test_checkpoint_size_is_parameters_times_bytes(plans, name):
    dense, experts = hand_count()
    p = plans[name]
    assert p["params_total"] == dense + experts
    c = p["checkpoint"]
    assert c["weights_bytes"] == (dense + experts) * WEIGHT
    assert c["optimizer_bytes"] == (dense + experts) * OPTIMIZER
    assert c["total_bytes"] == (dense + experts) * (WEIGHT + OPTIMIZER)
    # one rank on one node writes all of it
    assert c["rank_bytes"] == c["node_bytes"] == c["total_bytes"]


def test_each_rank_writes_only_its_deduplicated_part(plans):
    """EP2, replicated optimizer: the dense weights (replicated over the two data-parallel
    ranks) are written once, by rank 0; each rank writes its half of the experts; the
    optimizer state goes with the weights it belongs to."""
    dense, experts = hand_count()
    c = plans["ep2"]["checkpoint"]
    assert c["total_bytes"] == (dense + experts) * (WEIGHT + OPTIMIZER)
    assert c["rank_bytes"] == c["node_bytes"] == (dense + experts // 2) * (WEIGHT + OPTIMIZER)
    hw = plans["ep2"]["hardware"]
    assert c["host_copy_s"] == pytest.approx(c["rank_bytes"] / (hw["host_copy_gbps"] * 1e9))
    assert c["write_s"] == pytest.approx(c["node_bytes"] / (hw["storage_gbps"] * 1e9))


def test_save_time_scales_with_storage_gbps(plans):
    runs = {}
    for gbps in (1, 4):
        r = plans[f"cli/storage{gbps}"]
        assert r["returncode"] == 0, r["stderr"][-3000:]
        runs[gbps] = json.loads(r["stdout"])
    slow, fast = runs[1]["checkpoint"], runs[4]["checkpoint"]
    assert runs[1]["hardware"]["storage_gbps"] == 1 and runs[4]["hardware"]["storage_gbps"] == 4
    assert slow["total_bytes"] == fast["total_bytes"] > 0
    assert slow["host_copy_s"] == fast["host_copy_s"]  # the host copy does not touch storage
    assert slow["write_s"] == pytest.approx(4 * fast["write_s"])
    assert slow["write_s"] == pytest.approx(slow["node_bytes"] / 1e9)
    assert slow["verify_s"] == pytest.approx(4 * fast["verify_s"])  # read back at the storage bandwidth
    for c in (slow, fast):
        assert c["save_s"] == pytest.approx(c["host_copy_s"] + c["write_s"] + c["verify_s"])
    assert slow["save_s"] - slow["host_copy_s"] == pytest.approx(4 * (fast["save_s"] - fast["host_copy_s"]))


def test_grace_is_a_step_and_the_stops_saves(plans):
    """Background saves: the steps wait for the host copy only; the stop finishes a save in
    flight, then saves the stopped step synchronously. Without: a whole save each."""
    a, s = plans["ep2"]["checkpoint"], plans["ep2/sync"]["checkpoint"]
    assert a["blocking_s"] == pytest.approx(a["host_copy_s"])
    assert s["blocking_s"] == pytest.approx(s["save_s"]) and s["in_flight_s"] == 0
    assert a["in_flight_s"] == pytest.approx(max(0.0, a["write_s"] + a["verify_s"] - a["step_s"]))
    for c in (a, s):
        assert c["stop_grace_needed_s"] == pytest.approx(c["in_flight_s"] + c["save_s"])
        assert c["kill_grace_needed_s"] == pytest.approx(c["step_s"] + c["stop_grace_needed_s"])
        assert c["stop_grace_ok"] == (c["stop_grace_s"] >= c["stop_grace_needed_s"])
        assert c["recommended_stop_grace_s"] >= c["stop_grace_needed_s"]
        assert c["recommended_kill_grace_s"] >= c["step_s"] + c["recommended_stop_grace_s"]


def test_the_text_report_has_a_checkpoint_section(plans):
    r = plans["cli/text"]
    assert r["returncode"] == 0, r["stderr"][-3000:]
    section = r["stdout"].split("\ncheckpoint (", 1)[1].splitlines()
    assert section[1].startswith("  size: ") and "per node" in section[1] and "per rank" in section[1]
    assert section[2].startswith("  save at 2 GB/s per node: ")
    assert section[3].startswith("  the steps wait ") and "run.async_save=true" in section[3]
    assert section[4].startswith("  grace: ") and "run.stop_grace_s=20: " in section[5]


def test_the_grace_lines_say_what_to_set():
    from moe_rl.plan.checkpoint import CheckpointPlan
    from moe_rl.plan.report import _grace_lines

    c = CheckpointPlan(weights_bytes=60, optimizer_bytes=360, rank_bytes=30, node_bytes=210, host_copy_s=3.0,
                       write_s=100.0, verify_s=100.0, step_s=150.0, async_save=True, stop_grace_s=20.0)
    lines = _grace_lines(c)  # in flight 100 + 100 - 150 = 50 s, then a save of 203 s
    assert "then 253 s to finish a save in flight and save the stopped step" in lines[0]
    assert "run.stop_grace_s=20: too short: set run.stop_grace_s=260" in lines[1]
    assert "--shutdown-timeout 410" in lines[2]
