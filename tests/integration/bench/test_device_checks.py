"""The device checks of issue 45 in their CPU dry-run form: the same scripts, end to end,
so that a lent GPU's minutes go to measuring. Each writes only under its --out folder."""

from __future__ import annotations

import json
import re

import pytest


@pytest.mark.slow
def test_rl_step_check_dry_run_writes_its_table_and_the_mismatch_report(tmp_path):
    """Check 1 on CPU: a random model of the run's shape written as a Hugging Face directory,
    `moe_rl.train` under R3 for 2 steps, the per-step table (time breakdown, push GB/s, the
    used-route disagreement, exactly 0 under R3) and the mismatch report of the run's final
    checkpoint, bf16 and fp8 rows."""
    from bench.device.gpu_rl_step import main

    assert main(dry_run=True, out=str(tmp_path)) == 0
    result = json.loads((tmp_path / "results" / "gpu_cpu_rl_step.json").read_text())
    steps = result["steps"]
    assert [s["step"] for s in steps] == [1, 2] and result["dry_run"] is True
    for s in steps:
        assert s["used_disagree"] == 0.0  # R3: the learner used the sampler's experts
        assert s["push_gb"] > 0 and s["push_gbps"] > 0
        assert 0 < s["update_s"] < s["step_s"] and s["sample_s"] > 0
    assert "torch" in result["versions"] and "rl.replay=R3" in result["command"]
    table = (tmp_path / "results" / "gpu_cpu_rl_step.md").read_text()
    assert "| 2 |" in table and "push GB/s" in table and "Command: `-m moe_rl.train" in table
    report = json.loads((tmp_path / "mismatch" / "mismatch.json").read_text())
    assert list(report["settings"]) == ["vllm:bf16/learner:bf16", "vllm:fp8_emulated/learner:bf16"]
    assert (tmp_path / "mismatch" / "REPORT.md").is_file()


def test_rl_step_check_gpu_recipe_passes_the_checks_a_gpu_run_makes(tmp_path, monkeypatch):
    """The GPU run's overrides (30B layer shape, nccl, vLLM bf16 asleep during the update,
    R3, a token budget) load, and pass every check that does not read the weights, as on a
    machine with CUDA: a typo or a refused combination shows here, not on the GPU."""
    import torch

    from bench.device.gpu_rl_step import RECIPE, ROOT, recipe_overrides
    from moe_rl.config import load_config, validate_layout
    from moe_rl.preflight import check_learner_device, check_sampler, check_task_inputs

    cfg = load_config(ROOT / RECIPE, recipe_overrides(False, 2, 3, tmp_path, tmp_path / "init"))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (2, 2048, 128, 8, 768)
    assert (cfg.rl.replay, cfg.sampler.backend, cfg.sampler.precision, m.layer_spec) == ("R3", "vllm", "bf16", "local")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    validate_layout(cfg, 1)
    check_learner_device(cfg)
    check_sampler(cfg)
    check_task_inputs(cfg)


# ---------------------------------------------------------------------------- check 2: the learner's levers


@pytest.mark.slow
def test_learner_levers_dry_run_records_every_row(tmp_path):
    """Check 2 on CPU: every lever row in order; what runs on CPU (the baseline, the token
    budget, manual GC) ran with an exact on-policy ratio, what needs the TE spec on a GPU is
    skipped with the refusal naming its field (not failed), nothing was carried past a
    skipped lever, and Python's automatic GC is back on afterwards."""
    import gc

    from bench.device.gpu_learner_levers import SECTION, levers, main

    assert main(dry_run=True, out=str(tmp_path)) == 0
    assert gc.isenabled()
    rows = json.loads((tmp_path / "results" / "gpu_cpu_learner_levers.json").read_text())["rows"]
    names = [lv.name for lv in levers(128, 50)]
    assert [r["row"] for r in rows] == names
    for i in (0, 1, 4):  # the baseline, the token budget, manual GC
        assert rows[i]["status"] == "ran", rows[i]
    refused = {2: "model.moe_permute_fusion=true", 3: "model.gradient_accumulation_fusion=true",
               5: "model.cuda_graph_scope=moe_router,moe_preprocess", 6: "Transformer Engine",
               7: "model.moe_expert_capacity_factor=1.0", 8: "model.cuda_graph_scope=full", 9: "model.fp8=hybrid"}
    for i, field in refused.items():
        assert rows[i]["status"] == "skipped" and field in rows[i]["reason"], rows[i]
    for r in (r for r in rows if r["status"] == "ran"):
        assert r["step_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None  # (no peak on CPU)
        assert r["on_policy_max_abs_dlogp"] <= 1e-6 and not r["on_policy_error"]
        assert not any("fusion" in o or "cuda_graph" in o for o in r["overrides"])  # (skipped: not carried)
    budget = ["parallel.max_tokens_per_microbatch=128"] if rows[1]["kept"] else []  # (kept: not slower)
    assert rows[4]["overrides"] == [*budget, "parallel.manual_gc_interval=50"]
    assert rows[0]["kept"] and rows[0]["gain"] is None
    learner_md = (tmp_path / "results" / "gpu_cpu_learner.md").read_text()
    assert SECTION in learner_md and "| baseline: 1 sequence per micro-batch | ran |" in learner_md


def test_the_flop_count_is_megatrons_formula_by_hand():
    """`moe_rl.plan.flops.train_flops` (what both GPU benchmarks and a run's perf/mfu_learner
    count) at the default tiny shape (h 64, 4 heads / 2 groups of 32, 8 experts top-2 of 64,
    vocab 128, 4 layers), counted by hand, forward per token and layer: QKV 2*64*8*32 =
    32768, projection 2*4*32*64 = 16384, router 2*64*8 = 1024, experts 2*3*64*64*2 = 49152
    (99328 in all), x 4 layers + head 2*64*128 = 16384: 413696; causal attention per s-token
    sequence 4 layers * 2 * (2*4*32 * s/2) * s. Training 3x. At the 30B shape it is the
    benchmark's former count (6 x active parameters + attention) plus the head."""
    from moe_rl.config import ModelConfig
    from moe_rl.plan.flops import train_flops

    m = ModelConfig()
    assert train_flops(m, [16]) == 3 * (16 * 413696 + 4 * 2 * 2048 * 16) == 20_643_840
    assert train_flops(m, [16, 8]) == 3 * (24 * 413696 + 262144 + 65536) == 30_769_152
    big = ModelConfig(num_layers=4, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
                      num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, vocab_size=32768)
    active = 4 * (2048 * 40 * 128 + 32 * 128 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768)
    former = 6 * active + 6 * 4 * 2048 * 32 * 128  # (per token at S = 2048)
    assert train_flops(big, [2048] * 2) == 2 * 2048 * (former + 6 * 2048 * 32768)


NO_TAPS = "rl.capture_routing=false"  # (a graphed router needs the routing taps off)
GPU_ONLY = [("model.moe_permute_fusion=true", "set it to false"),
            ("model.gradient_accumulation_fusion=true", "set it to false"),
            ("model.cuda_graph_scope=moe_router", "set it to none"),
            ("model.moe_expert_capacity_factor=1.0", "set it to 0.0")]


@pytest.mark.parametrize("override, fix", GPU_ONLY)
def test_gpu_only_levers_are_refused_on_cpu_naming_the_field(override, fix, monkeypatch):
    """Each GPU-only lever: the preflight refuses it without a GPU (and with the local spec
    on one), the learner's spec check refuses it off the TE spec; one line naming the key."""
    import torch

    from moe_rl.config import ConfigError, load_config
    from moe_rl.learner.model import resolve_layer_spec
    from moe_rl.preflight import check_learner_device

    cfg = load_config("examples/tiny_grpo.yaml", [override, NO_TAPS])
    for cuda, spec in ((False, "auto"), (True, "local")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        with pytest.raises(ConfigError, match=f"^{re.escape(override)} needs the Transformer Engine layer spec on a "
                                              f"GPU, and .*: {fix}$"):
            check_learner_device(load_config("examples/tiny_grpo.yaml", [override, NO_TAPS, f"model.layer_spec={spec}"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=f"^{re.escape(override)} needs the Transformer Engine layer spec"):
        resolve_layer_spec(cfg.model)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe_pad_expert_input_to_capacity=true"], "needs model.moe_expert_capacity_factor > 0"),
    (["model.moe_expert_capacity_factor=-1"], "model.moe_expert_capacity_factor must be >= 0"),
    (["model.moe_expert_capacity_factor=1.0", "rl.replay=R2"], "drops tokens the replayed routing"),
    (["model.cuda_graph_scope=attn"], "expected none or a comma-separated subset of full, moe_router"),
    (["model.cuda_graph_scope=moe_preprocess", NO_TAPS], "moe_preprocess needs moe_router"),
    (["model.cuda_graph_scope=full", NO_TAPS], "full needs model.moe_pad_expert_input_to_capacity=true"),
    (["model.cuda_graph_scope=full,moe_router", NO_TAPS], "full (whole layers) takes no other scope"),
    (["model.cuda_graph_scope=moe_router", "model.recompute=full", NO_TAPS], "cannot take model.recompute=full"),
    (["model.cuda_graph_scope=moe_router"], "set rl.capture_routing=false"),
    (["model.cuda_graph_scope=moe_router", NO_TAPS, "rl.replay=R2"], "set rl.capture_routing=false"),
    (["parallel.manual_gc_interval=-2"], "parallel.manual_gc_interval must be >= 0"),
])
def test_lever_settings_are_checked_against_each_other(overrides, message):
    from moe_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("examples/tiny_grpo.yaml", overrides)
    load_config("examples/tiny_grpo.yaml", ["model.cuda_graph_scope=moe_router,moe_preprocess", NO_TAPS,
                                            "parallel.manual_gc_interval=10"])
    load_config("examples/tiny_grpo.yaml", ["model.cuda_graph_scope=full", NO_TAPS, "model.moe_expert_capacity_factor=1",
                                            "model.moe_pad_expert_input_to_capacity=true"])


def test_manual_gc_collects_every_n_updates_with_the_collector_off():
    import gc

    from moe_rl.runtime import manual_gc

    assert gc.isenabled() and not manual_gc.tick(0) and gc.isenabled()
    try:
        assert [manual_gc.tick(3) for _ in range(7)] == [True, False, False, True, False, False, True]
        assert not gc.isenabled() and manual_gc.active()
    finally:
        manual_gc.restore()
    assert gc.isenabled() and not manual_gc.active()


def test_partial_cuda_graphs_build_the_moe_layers_as_megatrons_moe_layer(megatron_world):
    """A partial scope (router, preprocessing) needs megatron's MoETransformerLayer, which
    graphs those parts only (the plain layer would graph its whole forward); dense layers and
    the whole-layer scope keep the plain layer. The spec is built on CPU (no graph recorded)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.model import (
        _partial_graphs_in_moe_layers,
        cuda_graph_settings,
        transformer_config,
    )

    m = ModelConfig(num_dense_layers=1, cuda_graph_scope="moe_router,moe_preprocess")
    assert cuda_graph_settings(m) == {"cuda_graph_impl": "local", "cuda_graph_scope": ["moe_router", "moe_preprocess"]}
    assert cuda_graph_settings(ModelConfig(cuda_graph_scope="full"))["cuda_graph_scope"] == []
    assert cuda_graph_settings(ModelConfig()) == {}
    with parallel_layout(ParallelConfig()):
        spec = get_gpt_decoder_block_spec(transformer_config(ModelConfig(num_dense_layers=1), ParallelConfig()),
                                          use_transformer_engine=False, normalization="RMSNorm")
    _partial_graphs_in_moe_layers(spec)
    assert [s.module for s in spec.layer_specs] == [TransformerLayer] + [MoETransformerLayer] * 3
