"""`python -m moe_rl.plan`: exact per-rank parameter counts from megatron's meta-device
build, memory checked against the real learner, the published model sizes, the GPU
recipes fitting, and one-line errors for bad recipes.

The planner runs in subprocesses (moe_rl_testing/workers/plan_worker.py, which also runs the CLI's
command lines by its main, and one CLI process): its build joins a fake process group, which
a pytest process that already holds a real one cannot.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, ModelConfig, load_config, validate_layout
from moe_rl.plan.published import CONFIGS as PUBLISHED_CONFIGS
from moe_rl.plan.published import SIZES as PUBLISHED_SIZES
from moe_rl_testing import ROOT
from moe_rl_testing.dist_helpers import torchrun
from moe_rl_testing.plan_jobs import run_plan_jobs, worker_env

HAS_QKV_BIAS = "add_qkv_bias" in ModelConfig.__dataclass_fields__

# Random-init shapes unlike the tiny model: one dense first layer, GQA 2:1, untied output.
QWEN_SMALL = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
    "mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": True, "vocab_size": 160,
    "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False, "torch_dtype": "float32",
}
# GLM-4.5-Air's features at small size: dense first layer, shared expert, sigmoid router with
# expert bias, no QK-norm, partial rotary and an MTP layer (neither changes the learner's
# parameters: the planner notes them). attention_bias as GLM has it once ModelConfig can build it.
GLM_SMALL = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 96, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "num_nextn_predict_layers": 1, "vocab_size": 160, "max_position_embeddings": 128, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": HAS_QKV_BIAS,
    "torch_dtype": "float32",
}
# The published config.json files; GLM-4.5-Air's q/k/v biases only once the learner can
# build them (ModelConfig.add_qkv_bias), otherwise planned and counted without them.
GLM45_AIR = {**PUBLISHED_CONFIGS["GLM-4.5-Air"], "attention_bias": HAS_QKV_BIAS}
CONFIGS = {"qwen_small": QWEN_SMALL, "glm_small": GLM_SMALL, "qwen3_30b_a3b": PUBLISHED_CONFIGS["Qwen3-30B-A3B"],
           "qwen3_235b_a22b": PUBLISHED_CONFIGS["Qwen3-235B-A22B"], "glm45_air": GLM45_AIR}

SMALL = ("qwen_small", "glm_small")
REAL = ("qwen3_30b_a3b", "qwen3_235b_a22b", "glm45_air")
LAYOUTS = {"one": ([], 1), "tp2": (["parallel.tensor_model_parallel_size=2"], 2),
           "ep2": (["parallel.expert_model_parallel_size=2"], 2),
           "pp2": (["parallel.pipeline_model_parallel_size=2"], 2)}
CARD = {"qwen3_30b_a3b": "Qwen3-30B-A3B", "qwen3_235b_a22b": "Qwen3-235B-A22B", "glm45_air": "GLM-4.5-Air"}
# The real shapes at a 16-GPU layout the recipe's family uses (TP2 x EP8 x PP2).
REAL_LAYOUT = ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=8",
               "parallel.pipeline_model_parallel_size=2", "parallel.micro_batch_size=1", "sampler.max_new_tokens=1024"]
TINY = str(ROOT / "examples/tiny_rspo.yaml")
LORA30B = ["parallel.pipeline_model_parallel_size=1", "model.lora.rank=8"]
RECIPES = {"qwen3_30b_a3b": ("examples/gpu/qwen3_30b_a3b.yaml", 16), "deepseek_v3": ("examples/gpu/deepseek_v3.yaml", 256),
           "glm45_air": ("examples/gpu/glm45_air.yaml", 64)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_configs")
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}  # not supported
    for name, cfg in {**CONFIGS, "mixtral": mixtral}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
    return {name: root / name for name in [*CONFIGS, "mixtral"]}


def _jobs(dirs) -> list[dict]:
    jobs = [{"name": f"{m}/{lay}", "recipe": None, "overrides": [f"run.init_checkpoint={dirs[m]}", *ov], "gpus": n}
            for m in SMALL for lay, (ov, n) in LAYOUTS.items()]
    jobs += [{"name": m, "recipe": TINY, "overrides": [f"run.init_checkpoint={dirs[m]}", *REAL_LAYOUT], "gpus": 16}
             for m in REAL]
    jobs.append({"name": "tiny", "recipe": TINY, "overrides": [], "gpus": 1})
    jobs.append({"name": "separate", "recipe": TINY, "gpus": 3,
                 "overrides": ["sampler.placement=separate", "sampler.engine_ranks=1"]})
    jobs += [{"name": f"recipe/{r}", "recipe": str(ROOT / path), "overrides": [], "gpus": n, "suggest": True}
             for r, (path, n) in RECIPES.items()]
    # GLM-4.5-Air at TP2 without recompute: the update does not fit (its recipe uses TP4)
    jobs.append({"name": "glm_tp2", "recipe": str(ROOT / RECIPES["glm45_air"][0]), "gpus": 64, "suggest": True,
                 "overrides": ["parallel.tensor_model_parallel_size=2"]})
    # does not fit: activations of 128 x 64-token fp32 micro-batches in a 0.3 GiB GPU beside vLLM
    jobs.append({"name": "unfit", "recipe": TINY, "overrides": ["model.params_dtype=fp32", "sampler.precision=fp32"],
                 "gpus": 1, "suggest": True,
                 "hardware": {"gpu_memory_gib": 0.3, "reserve_gib": 0.0, "vllm_workspace_gib": 0.0}})
    # `python -m moe_rl.plan ARGS` command lines, by the CLI's main in the same worker
    jobs += [{"name": f"cli/bad/{case}", "argv": _bad_argv(case)} for case in BAD]
    jobs.append({"name": "cli/mixtral", "argv": ["--config", TINY, f"run.init_checkpoint={dirs['mixtral']}"]})
    jobs.append({"name": "cli/json", "argv": ["--config", TINY, "--json"]})
    # LoRA's saving on the 30B recipe on one node, and full fine-tuning planned apart at 8/16/32 GPUs
    # (the meta builds are cached in the worker: the CLI's re-plans reuse them)
    recipe30 = str(ROOT / RECIPES["qwen3_30b_a3b"][0])
    jobs += [{"name": f"lora30b/full{n}", "recipe": recipe30, "overrides": LORA30B[:1], "gpus": n} for n in (8, 16, 32)]
    jobs.append({"name": "cli/lora30b", "argv": ["--config", recipe30, "--gpus", "8", *LORA30B, "--no-suggest"]})
    return jobs


@pytest.fixture(scope="module")
def planned(model_dirs, tmp_path_factory):
    return run_plan_jobs(_jobs(model_dirs), tmp_path_factory.mktemp("planned"), errors_allowed=True, timeout=600)


def _plan(planned, name) -> dict:
    p = planned[name]
    assert "error" not in p, p.get("error")
    return p


def hf_counts(config_dir: Path) -> tuple[int, int]:
    """(total, active) parameters of transformers' model of config.json, built on the meta
    device; active leaves out the E - K routed experts a token skips in every MoE layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    E = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    K = cfg.num_experts_per_tok
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, total - routed // E * (E - K)


# --------------------------------------------------------------------------- counts


@pytest.mark.parametrize("name", SMALL + REAL)
def test_total_and_active_equal_transformers(planned, model_dirs, name):
    p = _plan(planned, name if name in REAL else f"{name}/one")
    total, active = hf_counts(model_dirs[name])
    assert (p["params_total"], p["params_active"]) == (total, active)
    assert p["params_by_kind"]["other"] == 0
    assert p["model_source"] == str(model_dirs[name] / "config.json")


def test_glm_notes_say_what_the_learner_leaves_out(planned):
    notes = " ".join(_plan(planned, "glm_small/one")["notes"])
    # partial rotary is honoured (model.rotary_percent); only the MTP layers are left out
    assert "num_nextn_predict_layers=1" in notes and "partial_rotary_factor" not in notes


@pytest.mark.parametrize("name", REAL)
def test_real_shapes_match_published_sizes(planned, name):
    """Within one unit of the card's last digit: cards round loosely (Qwen3-30B-A3B's 3.35 B
    active is written "3.3B", GLM-4.5-Air's 105.6 B without embeddings "106B")."""
    p = _plan(planned, name)
    total_b, active_b, without_emb, unit = PUBLISHED_SIZES[CARD[name]]
    suffix = "_without_embeddings" if without_emb else ""
    total, active = p["params_total" + suffix] / 1e9, p["params_active" + suffix] / 1e9
    print(f"{name}: {total:.2f} B total, {active:.2f} B active{' (without embeddings)' if without_emb else ''}")
    assert abs(total - total_b) < unit and abs(active - active_b) < unit


@pytest.mark.parametrize("name", REAL)
def test_real_shapes_have_one_entry_per_stage(planned, name):
    """TP2 x EP8 x PP2 at 16 GPUs: two distinct ranks, the stages, each a shard of the model."""
    p = _plan(planned, name)
    assert [r["pp_rank"] for r in p["ranks"]] == [0, 1]
    assert p["ranks"][0]["stage_ranks"] == list(range(8)) and p["ranks"][1]["stage_ranks"] == list(range(8, 16))
    assert all(0 < r["params"] < p["params_total"] / 8 for r in p["ranks"])


@pytest.fixture(scope="module")
def learned(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("learned")
    models = {m: [f"run.init_checkpoint={model_dirs[m]}"] for m in SMALL}
    specs = {"one": {"models": models, "layouts": {"one": []}, "tiny": TINY},
             "two": {"models": models, "layouts": {k: ov for k, (ov, n) in LAYOUTS.items() if n == 2}}}
    (out / "specs.json").write_text(json.dumps(specs))
    # one launch: "one" measured by its rank 0 alone (a one-process run), then "two" by both
    torchrun("plan_learner.py", 2, str(out / "specs.json"), str(out), timeout=600)
    results: dict[str, list[dict]] = {}
    for f in sorted(out.glob("*.*.json")):
        for key, value in json.loads(f.read_text()).items():
            results.setdefault(key, []).append(value)
    return results


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", SMALL)
def test_per_rank_params_equal_the_learner(planned, learned, model, layout):
    plan = _plan(planned, f"{model}/{layout}")
    ranks = learned[f"{model}/{layout}"]
    assert len(ranks) == LAYOUTS[layout][1]
    for measured in ranks:
        (entry,) = [r for r in plan["ranks"] if measured["rank"] in r["stage_ranks"]]
        assert entry["pp_rank"] == measured["pp_rank"]
        assert entry["params"] == measured["params"], f"rank {measured['rank']}"
        assert entry["memory_bytes"]["params"] == measured["param_bytes"]
        assert entry["memory_bytes"]["grads"] == measured["grad_bytes"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_tiny_memory_equals_the_learner(planned, learned):
    """Bytes of parameters, megatron's gradient buffers and Adam's moments after a step."""
    (measured,) = learned["tiny"]
    (rank,) = _plan(planned, "tiny")["ranks"]
    mem = rank["memory_bytes"]
    assert (mem["params"], mem["grads"], mem["optimizer_states"]) == (
        measured["param_bytes"], measured["grad_bytes"], measured["adam_bytes"])
    assert rank["params"] == measured["params"]


# --------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_recipes_fit_on_their_gpus(planned, recipe):
    p = _plan(planned, f"recipe/{recipe}")
    print(f"{recipe}: rollout {p['phases']['rollout']['peak_bytes'] / 2**30:.1f} GiB, "
          f"update {p['phases']['update']['peak_bytes'] / 2**30:.1f} GiB")
    assert p["fits"] and p["phases"]["rollout"]["fits"] and p["phases"]["update"]["fits"]
    assert p["sampler"]["starts"]


def test_unfit_plan_suggests_changes_that_fit(planned):
    p = _plan(planned, "unfit")
    assert not p["fits"] and p["suggestions"]
    limit = 0.3 * 2**30
    for s in p["suggestions"]:
        assert s["changes"] and s["fits"]
        assert max(s["rollout_peak_bytes"], s["update_peak_bytes"]) <= limit


def test_recompute_is_suggested_beside_a_wider_layout_with_its_cost(planned):
    """GLM-4.5-Air at TP2: its update does not fit. Full recompute alone fits it, and so does
    the wider TP the recipe uses; both are suggested, recompute first (GROUPS order), each
    with its own plan: recompute's is smaller in memory but slower (one more forward)."""
    p = _plan(planned, "glm_tp2")
    assert not p["fits"]
    recompute, tp4 = p["suggestions"]
    assert (recompute["changes"], tp4["changes"]) == (["model.recompute=full"], ["parallel.tensor_model_parallel_size=4"])
    assert recompute["fits"] and tp4["fits"]
    assert recompute["update_peak_bytes"] < p["phases"]["update"]["peak_bytes"]
    assert recompute["step_s"] > p["times_s"]["total"]


def test_separate_placement_puts_the_engine_on_its_own_gpus(planned):
    learner, engine = _plan(planned, "separate")["ranks"]
    assert (learner["role"], learner["stage_ranks"], engine["role"], engine["stage_ranks"]) == (
        "learner", [0, 1], "engine", [2])
    assert learner["memory_bytes"]["sampler_budget"] == 0 and engine["memory_bytes"]["sampler_budget"] > 0
    assert engine["params"] == 0 and engine["memory_bytes"]["optimizer_states"] == 0


def test_recompute_and_distribution_shrink_memory(planned):
    rank = _plan(planned, "qwen3_30b_a3b")["ranks"][0]
    alt = rank["alternatives_bytes"]
    assert alt["activations_full_recompute"] < alt["activations_no_recompute"]
    assert alt["optimizer_distributed"] < alt["optimizer_replicated"]


# --------------------------------------------------------------------------- the CLI


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # (a fresh interpreter: what it prints while starting is part of what the test checks)
    return subprocess.run([sys.executable, "-m", "moe_rl.plan", *args], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=timeout)


def _config_error(overrides: list[str], world: int | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        cfg = load_config(TINY, overrides)
        if world is not None:
            validate_layout(cfg, world)
    return str(e.value)


BAD = {
    "heads": (["parallel.tensor_model_parallel_size=3"], None),
    "experts": (["parallel.expert_model_parallel_size=3"], None),
    "layers": (["parallel.pipeline_model_parallel_size=3"], None),
    "world": (["parallel.tensor_model_parallel_size=2"], 3),
}


def _bad_argv(case: str) -> list[str]:
    overrides, world = BAD[case]
    return ["--config", TINY, *overrides, *(["--gpus", str(world)] if world else [])]


def _assert_one_line_config_error(case: str, returncode: int, stdout: str, stderr: str) -> None:
    overrides, world = BAD[case]
    assert returncode == 2 and stdout == ""
    assert stderr.strip() == f"python -m moe_rl.plan: config error: {_config_error(overrides, world)}"
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("case", list(BAD))
def test_bad_layout_is_the_trainers_one_line_error(planned, case):
    """The CLI's main on each bad layout (in the plan worker: moe_rl_testing/workers/plan_worker.py)."""
    r = planned[f"cli/bad/{case}"]
    _assert_one_line_config_error(case, r["returncode"], r["stdout"], r["stderr"])


def test_bad_layout_is_one_line_from_the_process():
    """The same as a command line: the whole stderr of the process (interpreter start-up,
    imports, exit) is the one line, and its exit status is 2."""
    proc = cli(*_bad_argv("world"))
    _assert_one_line_config_error("world", proc.returncode, proc.stdout, proc.stderr)


def test_unsupported_architecture_lists_the_supported(planned):
    r = planned["cli/mixtral"]
    assert r["returncode"] == 2 and "Traceback" not in r["stderr"]
    (line,) = r["stderr"].strip().splitlines()
    assert "mixtral" in line and "Qwen3MoeForCausalLM" in line and "Glm4MoeForCausalLM" in line
    assert "DeepseekV3ForCausalLM" in line


def test_json_output_parses_with_the_keys(planned):
    r = planned["cli/json"]
    assert r["returncode"] == 0, r["stderr"][-3000:]
    p = json.loads(r["stdout"])
    assert isinstance(p["params_total"], int) and isinstance(p["params_active"], int)
    assert isinstance(p["fits"], bool) and p["fits"]
    assert p["params_active"] < p["params_total"]
    (rank,) = p["ranks"]
    kinds = rank["memory_bytes"]
    assert {"params", "grads", "optimizer_states", "activations", "kv_cache", "sampler_weights"} <= set(kinds)
    assert all(isinstance(v, int) and v >= 0 for v in kinds.values())
    assert all(v is None or math.isfinite(v) for v in p["times_s"].values())


def test_lora_report_states_the_saving_and_the_gpus_each_needs(planned):
    """The 30B recipe at TP2 x EP8 on 8 GPUs with LoRA rank 8: the report's saving line
    against full fine-tuning planned apart (same layout at 8, 16, 32 GPUs): its update peak,
    the difference, and the smallest of those worlds at which each fits."""
    import re

    r = planned["cli/lora30b"]
    assert r["returncode"] == 0, r["stderr"][-3000:]
    m = re.search(r"LoRA rank 8 \(attention, experts\) against full fine-tuning: removes the gradients and optimizer "
                  r"states of the frozen base weights \(30.53 B parameters\), ([\d.]+) GiB per GPU; update phase "
                  r"([\d.]+) GiB against ([\d.]+) GiB per GPU \(([\d.]+) GiB per GPU saved\)\n  GPUs needed at "
                  r"79.2 GiB each \(this layout, more data parallelism; tried 8, 16, 32, 64\): LoRA (\d+), full "
                  r"fine-tuning (\d+)$", r["stdout"].strip(), re.M)
    assert m, r["stdout"][-1500:]
    removed, lora, full, saved = map(float, m.groups()[:4])
    full_at = {n: _plan(planned, f"lora30b/full{n}") for n in (8, 16, 32)}
    gib = 2**30
    assert full == round(full_at[8]["phases"]["update"]["peak_bytes"] / gib, 1) == 110.4  # docs/lora.md's table
    assert lora == 52.0 and abs(saved - (full - lora)) <= 0.05 + 1e-9
    rank = full_at[8]["ranks"][0]["memory_bytes"]
    assert abs(removed - ((rank["grads"] + rank["optimizer_states"]) / gib - 0.61)) <= 0.06  # LoRA keeps 0.16 + 0.45
    assert not full_at[8]["fits"] and not full_at[16]["fits"] and full_at[32]["fits"]
    assert m.groups()[4:] == ("8", "32")
    assert "lora_saving" not in json.loads(planned["cli/json"]["stdout"])  # (no LoRA, no saving)


@pytest.mark.parametrize(("recipe", "card"), [("qwen3_30b_a3b", "Qwen3-30B-A3B"), ("glm45_air", "GLM-4.5-Air")])
def test_gpu_recipes_restate_the_real_config_json(tmp_path, recipe, card):
    """The recipes' model sections are what the real checkpoints' config.json give: pointed
    at a directory holding that config.json, no key conflicts and the model is unchanged."""
    from moe_rl.config import load_recipe
    from moe_rl.plan.published import write_config_dir
    from moe_rl.recipe_source import model_from_checkpoint

    directory = write_config_dir(card, tmp_path / card)
    cfg, given = load_recipe(ROOT / RECIPES[recipe][0])
    assert model_from_checkpoint(cfg.model, directory, given) == cfg.model


def test_token_budget_and_chunk_size_set_the_update_memory():
    """A token budget decides how many longest sequences share a micro-batch; the chunked
    head holds two [chunk, V/TP] fp32 blocks instead of the micro-batch's logits."""
    from moe_rl.plan.activations import logits_bytes
    from moe_rl.plan.workload import PlannedLayout, workload

    m = ModelConfig(vocab_size=151936, hidden_size=2048)
    full = logits_bytes(m, micro_batch=1, seq_len=9216, response_tokens=8192, tp=2)
    chunked = logits_bytes(m, micro_batch=1, seq_len=9216, response_tokens=8192, tp=2, chunk_tokens=2048)
    assert chunked == 2 * 2048 * (151936 // 2) * 4 + 2 * 8192 * 2048 * 2  # bf16 hidden states on GPU
    assert chunked < full / 5
    cfg = load_config(None, ["rl.prompts_per_step=64", "rl.group_size=8", "sampler.max_new_tokens=96",
                             "parallel.max_tokens_per_microbatch=512"])
    layout = PlannedLayout(world=1, learners=1, tp=1, pp=1, ep=1, etp=1, dp=1, expert_dp=1)
    work = workload(cfg.rl, cfg.sampler, cfg.parallel, layout, prompt_tokens=32)
    assert work.seq_len == 128 and work.micro_batch == 4 and work.micro_batches == 128


def test_the_table_shows_the_fastest_plan_that_fits_recompute_or_not(monkeypatch):
    """Over layouts, offload and recompute, the fastest plan that fits; nothing else decides."""
    from types import SimpleNamespace

    import moe_rl.plan.table as table
    from moe_rl.plan.hardware import Hardware
    from moe_rl.plan.planner import ModelSource

    def plan(total: float, recompute: bool):
        return SimpleNamespace(times={"total": total}, switches=SimpleNamespace(recompute=recompute))

    fits = {(2, 0.0, False): None, (2, 0.0, True): plan(300.0, True), (2, 1.0, False): plan(500.0, False),
            (2, 1.0, True): plan(350.0, True), (4, 0.0, False): plan(450.0, False)}
    source = ModelSource(load_config(None, []), "recipe", ())
    monkeypatch.setattr(table, "layouts", lambda model, gpus, per_node: iter([(2, 8, 1), (4, 8, 1)]))
    monkeypatch.setattr(table, "_fitted", lambda src, hw, tokens, sw: fits.get(
        (src.cfg.parallel.tensor_model_parallel_size, sw.offload_fraction, sw.recompute)))
    assert table.best_plan(source, Hardware(gpus=8), 1024) is fits[2, 0.0, True]
    fits[4, 1.0, False] = plan(250.0, False)
    assert table.best_plan(source, Hardware(gpus=8), 1024) is fits[4, 1.0, False]


def test_full_recompute_keeps_layer_inputs_the_routed_ids_and_one_layer():
    """Full recompute on a stage of 6 layers (2 dense, 4 MoE) at PP2 stage 0 (2 micro-batches
    in flight), TP2: each layer's bf16 input, each MoE layer's K one-byte expert ids (what the
    routing taps keep to force the recomputed router), and the largest layer's activations."""
    from moe_rl.plan.activations import layer_bytes, stage_activation_bytes

    m = ModelConfig(num_layers=6, hidden_size=256, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                    num_experts=64, moe_router_topk=4, moe_ffn_hidden_size=128, params_dtype="bf16")
    tokens, tp = 4096, 2
    got = stage_activation_bytes(m, tokens=tokens, tp=tp, pp=2, stage=0, layers=6, moe_layers=4, micro_batches=8,
                                 recompute=True)
    inputs = 2 * 6 * tokens * 2 * 256 // tp
    ids = 2 * 4 * tokens * 4 * 1 // tp
    assert got == inputs + ids + max(layer_bytes(m, tokens, tp, True), layer_bytes(m, tokens, tp, False))
    more_experts = stage_activation_bytes(ModelConfig(**{**vars(m), "num_experts": 512}), tokens=tokens, tp=tp, pp=2,
                                          stage=0, layers=6, moe_layers=4, micro_batches=8, recompute=True)
    assert more_experts - layer_bytes(ModelConfig(**{**vars(m), "num_experts": 512}), tokens, tp, True) == \
        inputs + 2 * ids  # int16 ids beyond 256 experts


@pytest.mark.parametrize("experts", [8, 256, 257, 32768])
def test_the_planner_counts_expert_ids_at_the_learners_width(experts):
    from moe_rl.plan.activations import expert_id_bytes
    from moe_rl.routing.record import ids_dtype

    assert expert_id_bytes(experts) == ids_dtype(experts).itemsize
