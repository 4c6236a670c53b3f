"""Real Hugging Face MoE models in: the learner computes what transformers'
Glm4MoeForCausalLM (GLM-4.5 family) and Qwen3MoeForCausalLM compute, for every config.json
field that changes the math.

- The published config.json of GLM-4.5-Air and Qwen3-30B-A3B map to an exact ModelConfig
  (every field checked) without raising.
- Random-init transformers models with the features of those families (GQA 4:1, head_dim 64,
  16 experts top-4; GLM: dense first layer, shared expert, sigmoid router with a non-zero
  expert bias, partial rotary 0.5, q/k/v biases, routed scaling 2.5, an MTP layer in the
  files; Qwen3 with norm_topk_prob true and false) are saved with save_pretrained, loaded into a one-process fp32 learner through the
  HF import path (`load_hf_weights`, what run.init_checkpoint does), and score a batch with
  the same per-token logprobs as transformers (1e-5); the learner's HF stream gives back
  the saved tensors bit for bit, with a config.json that describes the same model.
- Controls: undoing any one GLM setting (partial rotary, routed scaling, q/k/v biases)
  moves the learner's logprobs off transformers' by more than 1e-3.
- The same directories at TP=2 and EP=2 (this file as the torchrun worker), and vLLM's
  scores of them (a subprocess), agree with transformers too.
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

from moe_rl.config import ModelConfig, load_config
from moe_rl.convert import HFCheckpoint, hf_config, model_config_from_hf
from moe_rl.plan.published import CONFIGS  # the published config.json files
from moe_rl_testing import ROOT, forked
from moe_rl_testing.hf_fixtures import hf_logprobs
from moe_rl_testing.learner_utils import fixed_batch

TOL = 1e-5  # fp32 learner vs transformers per-token logprobs

# ----------------------------------------------------------------- published config.json

# Every architecture field of ModelConfig, as each config.json implies it; the rest
# (training settings) must come from the base unchanged.
ARCH = {
    "Qwen3-30B-A3B": dict(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
        ffn_hidden_size=6144, num_dense_layers=0, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        moe_shared_expert_intermediate_size=0, moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True, untie_embeddings_and_output_weights=True,
        add_qkv_bias=False, rotary_percent=1.0, moe_router_topk_scaling_factor=1.0,
        moe_router_pre_softmax=False, params_dtype="bf16"),
    "GLM-4.5-Air": dict(
        num_layers=46, hidden_size=4096, num_attention_heads=96, num_query_groups=8, kv_channels=128,
        ffn_hidden_size=10944, num_dense_layers=1, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=1408, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, vocab_size=151552, max_position_embeddings=131072,
        rotary_base=1e6, norm_epsilon=1e-5, qk_layernorm=False, untie_embeddings_and_output_weights=True,
        add_qkv_bias=True, rotary_percent=0.5, moe_router_topk_scaling_factor=1.0,
        moe_router_pre_softmax=False, params_dtype="bf16"),
}
PUBLISHED = {name: CONFIGS[name] for name in ("Qwen3-30B-A3B", "GLM-4.5-Air")}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_map_exactly(name, caplog):
    base = ModelConfig(moe_aux_loss_coeff=0.01, init_method_std=0.01, layer_spec="local")
    with caplog.at_level(logging.WARNING):
        got = model_config_from_hf(json.loads(json.dumps(PUBLISHED[name])), base=base)
    want = dataclasses.replace(base, **ARCH[name])
    for f in dataclasses.fields(ModelConfig):
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert ("num_nextn_predict_layers=1" in caplog.text) is (name == "GLM-4.5-Air")
    notes: list[str] = []  # the planner's mode: the same model, MTP noted
    assert model_config_from_hf(PUBLISHED[name], base=base, notes=notes) == want
    assert [n for n in notes if "num_nextn_predict_layers" not in n] == []
    # GLM-4.5 (not Air) scales the routed weights by 2.5; the config written back keeps it
    if name == "GLM-4.5-Air":
        glm45 = model_config_from_hf({**CONFIGS["GLM-4.5-Air"], "routed_scaling_factor": 2.5}, base=base)
        assert glm45 == dataclasses.replace(want, moe_router_topk_scaling_factor=2.5)
        out = hf_config(glm45, torch.bfloat16, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        assert (out["routed_scaling_factor"], out["partial_rotary_factor"], out["attention_bias"]) == (2.5, 0.5, True)
        assert out["rope_parameters"]["partial_rotary_factor"] == 0.5 and out["num_nextn_predict_layers"] == 0
        assert model_config_from_hf(out, base=base) == glm45


# ----------------------------------------------------------------- random-init models

SMALL = dict(vocab_size=160, hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=4,
             max_position_embeddings=128, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
             norm_topk_prob=True, dtype="float32", bos_token_id=2, eos_token_id=3, pad_token_id=0)
HF_CONFIGS = {
    "glm4_moe": dict(SMALL, model_type="glm4_moe", n_routed_experts=16, n_shared_experts=1,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                     use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
                     num_nextn_predict_layers=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "qwen3_moe": dict(SMALL, model_type="qwen3_moe", num_experts=16, decoder_sparse_step=1, mlp_only_layers=[],
                      attention_bias=False, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
# norm_topk_prob=false: top-k of the softmax over all experts (megatron's pre-softmax)
HF_CONFIGS["qwen3_moe_unnormed"] = dict(HF_CONFIGS["qwen3_moe"], norm_topk_prob=False)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init (norms off 1, biases and expert biases non-zero), so every
    tensor and the expert bias's routing choice show in the logprobs."""
    g = torch.Generator().manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point() or "rotary_emb" in name:
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("norm.weight"):
            t.copy_(1 + 0.1 * noise)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(0.1 * noise)  # about the spread of the sigmoid scores: it changes the winners
        else:
            t.copy_(0.08 * noise)


def _add_mtp_layer(path: Path, cfg: dict) -> int:
    """GLM-4.5's MTP layer as the published files store it (layer num_hidden_layers), which
    transformers' Glm4MoeForCausalLM does not build."""
    tensors = load_file(str(path / "model.safetensors"))
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    mtp = {f"model.layers.{L}.{n}": torch.randn(s) for n, s in [
        ("eh_proj.weight", (H, 2 * H)), ("enorm.weight", (H,)), ("hnorm.weight", (H,)),
        ("shared_head.norm.weight", (H,)), ("self_attn.q_proj.weight", (8 * 64, H))]}
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return len(mtp)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    import transformers

    out = {}
    for i, (name, cfg) in enumerate(HF_CONFIGS.items()):
        path = tmp_path_factory.mktemp(name)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        _randomize(model, seed=10 + i)
        model.save_pretrained(path)
        if name == "glm4_moe":
            _add_mtp_layer(path, cfg)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def layout(megatron_world):
    from moe_rl.learner import parallel_layout

    cfg = load_config(None, ["parallel.micro_batch_size=4"])
    with parallel_layout(cfg.parallel, seed=5) as lay:
        yield lay


def _learner_from_hf(hf_dir: Path, layout, overrides: tuple[str, ...] = ()):
    """A learner of the directory's model with its weights (the trainer's run.init_checkpoint
    path: config.json -> ModelConfig, then load_hf_weights); `overrides` set the layout."""
    from moe_rl.learner import Learner
    from moe_rl.learner.hf_import import load_hf_weights

    cfg = load_config(None, ["parallel.micro_batch_size=4", "model.layer_spec=local", *overrides])
    with HFCheckpoint(hf_dir) as hf:
        m = hf.model_config(base=cfg.model)
    learner = Learner(m, cfg.parallel, layout)
    load_hf_weights(learner, hf_dir)
    return learner


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_learner_logprobs_match_transformers(name, hf_dirs, layout, caplog):
    batch, _ = fixed_batch()
    with caplog.at_level(logging.WARNING):
        learner = _learner_from_hf(hf_dirs[name], layout)
    m = learner.model_cfg
    if name == "glm4_moe":
        assert (m.rotary_percent, m.moe_router_topk_scaling_factor, m.add_qkv_bias) == (0.5, 2.5, True)
        assert (m.num_layers, m.num_dense_layers, m.moe_shared_expert_intermediate_size) == (3, 1, 32)
        assert "num_nextn_predict_layers=1" in caplog.text  # the MTP layer's tensors were skipped
        assert any(n.endswith("linear_qkv.bias") for n, _ in learner.gpt.named_parameters())
    else:
        unnormed = name == "qwen3_moe_unnormed"
        assert (m.moe_router_score_function, m.moe_router_pre_softmax, m.num_experts) == ("softmax", unnormed, 16)
    assert (m.num_attention_heads, m.num_query_groups, m.kv_channels) == (8, 2, 64)
    got = learner.logprobs(batch)
    want = hf_logprobs(hf_dirs[name], batch)
    assert want[batch.response_mask()].std() > 0.1  # far from uniform: the weights matter
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_learner_stream_round_trips_the_files(name, hf_dirs, layout, tmp_path):
    """HF -> learner -> HF (the weight-sync / export map) gives back every saved tensor bit
    for bit (the MTP layer excepted), and a config.json describing the same model that
    transformers reads as the same architecture."""
    import transformers

    from moe_rl.learner.export import hf_named_tensors

    learner = _learner_from_hf(hf_dirs[name], layout)
    saved = load_file(str(hf_dirs[name] / "model.safetensors"))
    stream = dict(hf_named_tensors(learner))
    mtp = {n for n in saved if n.startswith(f"model.layers.{HF_CONFIGS[name]['num_hidden_layers']}.")}
    assert (len(mtp) > 0) is (name == "glm4_moe")
    assert set(stream) == set(saved) - mtp
    for n, t in stream.items():
        assert t.dtype == saved[n].dtype and torch.equal(t, saved[n]), n
    m = learner.model_cfg
    cfg = hf_config(m, torch.float32, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    assert model_config_from_hf(json.loads(json.dumps(cfg)), base=m) == m
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ref = transformers.AutoConfig.from_pretrained(hf_dirs[name])
    for field in ("attention_bias", "norm_topk_prob", "num_experts_per_tok", "head_dim", "num_key_value_heads"):
        assert getattr(theirs, field) == getattr(ref, field), field
    if name == "glm4_moe":
        assert theirs.routed_scaling_factor == 2.5 and theirs.num_nextn_predict_layers == 0
        assert theirs.rope_parameters["partial_rotary_factor"] == ref.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("change", [
    {"partial_rotary_factor": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    {"routed_scaling_factor": 1.0},
    {"attention_bias": False},
])
def test_each_glm_setting_changes_the_logprobs(change, hf_dirs, layout, tmp_path):
    """Controls for the parity above: a learner built with one of the GLM settings undone
    (the same files otherwise; without q/k/v biases they are left out) is measurably off."""
    src = hf_dirs["glm4_moe"]
    cfg = {**json.loads((src / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    if change.get("attention_bias") is False:
        tensors = {n: t for n, t in tensors.items() if not n.endswith("_proj.bias")}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    batch, _ = fixed_batch()
    got = _learner_from_hf(tmp_path, layout).logprobs(batch)
    assert (got - hf_logprobs(src, batch)).abs().max() > 1e-3


# ----------------------------------------------------------------- TP=2 / EP=2

PARALLEL = {"tp2": ("parallel.tensor_model_parallel_size=2",), "ep2": ("parallel.expert_model_parallel_size=2",)}


@pytest.fixture(scope="module")
def two_process(hf_dirs, tmp_path_factory) -> dict:
    """Every two-process layout's results from one torchrun launch (this file as its worker)."""
    from moe_rl_testing.dist_helpers import torchrun

    out = tmp_path_factory.mktemp("two_process") / "out.pt"
    torchrun(str(Path(__file__).resolve()), 2, "worker", ",".join(PARALLEL), str(out),
             *(f"{n}={hf_dirs[n]}" for n in HF_CONFIGS))
    return torch.load(out)


@pytest.mark.multiproc
@pytest.mark.parametrize("par", PARALLEL)
def test_two_process_layouts_match_transformers(par, hf_dirs, two_process):
    """The same directories loaded at TP=2 (q/k/v biases and heads split by query group)
    and EP=2 (global expert ids, expert biases) score as transformers does, and their HF
    stream gives back the saved tensors bit for bit."""
    batch, _ = fixed_batch()
    for name in HF_CONFIGS:
        assert two_process[par][name]["bad_stream"] == [], name
        assert (two_process[par][name]["logp"] - hf_logprobs(hf_dirs[name], batch)).abs().max() < TOL, name


def _worker(layouts: str, out: str, dirs: dict[str, Path]) -> None:
    """torchrun side of the `two_process` fixture: each of the comma-separated `layouts` in
    turn (rank 0 writes `out`)."""
    import torch.distributed as dist

    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.learner.parallel import init_distributed, parallel_layout

    rank, _ = init_distributed()
    batch, _ = fixed_batch()
    results: dict[str, dict] = {}
    for par in layouts.split(","):
        with parallel_layout(load_config(None, list(PARALLEL[par])).parallel, seed=5) as lay:
            for name, path in dirs.items():
                learner = _learner_from_hf(path, lay, PARALLEL[par])
                logp = learner.logprobs(batch)
                stream = dict(hf_named_tensors(learner))  # rank 0 gets the pairs
                saved = load_file(str(path / "model.safetensors"))
                bad = [n for n, t in stream.items() if not torch.equal(t, saved[n])]
                bad += [n for n in saved if n not in stream and ".layers.3." not in n]  # layer 3: GLM's MTP
                results.setdefault(par, {})[name] = {"logp": logp, "bad_stream": bad}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------- vLLM

VLLM_PROMPTS = [[5, 17, 33, 42], [9, 8, 7]]
VLLM_RESPONSES = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]]


@pytest.mark.vllm
def test_vllm_scores_as_transformers(hf_dirs, tmp_path):
    """vLLM (the sampler's backend, fp32) serves the same directories as transformers: GLM's
    partial rotary, q/k/v biases and routed scaling (its MTP layer skipped), Qwen3 with
    either norm_topk_prob. Runs in its own process (vLLM's engine)."""
    import sys

    pytest.importorskip("vllm")
    from moe_rl.batch import TokenBatch

    out = tmp_path / "vllm.json"
    proc = forked.run([sys.executable, __file__, "vllm", "-", str(out), *(f"{n}={hf_dirs[n]}" for n in HF_CONFIGS)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-6000:]
    scores = json.loads(out.read_text())
    batch = TokenBatch.from_lists(VLLM_PROMPTS, VLLM_RESPONSES)
    for name in HF_CONFIGS:
        ref = hf_logprobs(hf_dirs[name], batch)
        for b, got in enumerate(scores[name]):
            assert (ref[b, :len(got)] - torch.tensor(got)).abs().max() < 1e-4, name


def _vllm_worker(out: str, dirs: dict[str, Path]) -> None:
    """Subprocess side of test_vllm_scores_as_transformers."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from moe_rl.sampler import VLLMEngineConfig, make_sampler

    scores = {}
    for name, path in dirs.items():
        sampler = make_sampler(path, VLLMEngineConfig(precision="fp32", seed=0, max_model_len=64))
        scores[name] = sampler.score(VLLM_PROMPTS, VLLM_RESPONSES)
        sampler.close()
    Path(out).write_text(json.dumps(scores))


if __name__ == "__main__":
    import sys

    dirs = {a.split("=", 1)[0]: Path(a.split("=", 1)[1]) for a in sys.argv[4:]}
    if sys.argv[1] == "worker":
        _worker(sys.argv[2], sys.argv[3], dirs)
    elif sys.argv[1] == "vllm":
        _vllm_worker(sys.argv[3], dirs)
    else:
        raise SystemExit(f"usage: {sys.argv[0]} worker tp2,ep2 OUT NAME=HF_DIR... | vllm - OUT NAME=HF_DIR...")
