"""megatron <-> Hugging Face conversion of DeepSeek-style models (sigmoid router + expert
bias, shared expert) through the Glm4-MoE layout: layout dispatch, name/shape maps against
transformers' own Glm4MoeForCausalLM, config round trips and refusals, and parity with the
learner (transformers, vLLM) on a real checkpoint saved at EP=1 and EP=2.

The checkpoints come from one module fixture (moe_rl_testing/workers/convert_glm4_worker.py): a
1-process learner with random non-zero expert biases saves `c1`, converted to `hf1` and
back to `rt1`; a 2-process EP=2 learner loads c1 and saves `c_ep2`, streams its HF tensors
and loads `hf1` directly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_rl.config import ModelConfig
from moe_rl.convert import (
    ConvertError,
    DcpCheckpoint,
    HFCheckpoint,
    check_supported,
    from_hf,
    hf_config,
    layout_for,
    layout_for_hf,
    megatron_specs,
    megatron_tensors,
    megatron_to_hf,
    model_config_from_hf,
    to_hf,
)
from moe_rl.convert.glm4_moe import GLM4_MOE
from moe_rl.convert.megatron_keys import is_model_key
from moe_rl.convert.qwen3_moe import QWEN3_MOE
from moe_rl_testing import forked
from moe_rl_testing.dist_helpers import WORKERS, torchrun

TOL = 1e-5  # fp32 learner vs transformers per-token logprobs
DS = ModelConfig(params_dtype="fp32", num_dense_layers=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_shared_expert_intermediate_size=64)
# Glm4-MoE variants: what the model lacks is written as zeros / what is tied is written twice.
VARIANTS = {
    "deepseek": DS,
    "plain_sigmoid_tied": dataclasses.replace(
        DS, moe_router_enable_expert_bias=False, moe_shared_expert_intermediate_size=0, qk_layernorm=False,
        untie_embeddings_and_output_weights=False, num_dense_layers=0),
    "two_shared_top1": dataclasses.replace(DS, moe_shared_expert_intermediate_size=128, moe_router_topk=1),
}
IDS = dict(bos_token_id=2, eos_token_id=3, pad_token_id=0)


def _random_megatron(m: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in megatron_specs(m).items()}


def _write_hf(m: ModelConfig, path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Glm4-MoE directory of random weights, straight from the map (no checkpoint)."""
    path.mkdir()
    hf = {n: t.clone(memory_format=torch.contiguous_format)  # no shared storage (a tied head)
          for k, t in _random_megatron(m, seed).items() for n, t in to_hf(k, t, m)}
    save_file(hf, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(m, torch.float32, **IDS)))
    return hf


# --------------------------------------------------------------------------- pure maps


def test_layout_follows_the_router_and_shared_expert():
    assert layout_for(ModelConfig()) is QWEN3_MOE
    assert layout_for(DS) is GLM4_MOE
    assert layout_for(dataclasses.replace(ModelConfig(), moe_router_score_function="sigmoid")) is GLM4_MOE
    assert layout_for(dataclasses.replace(ModelConfig(), moe_shared_expert_intermediate_size=64)) is GLM4_MOE
    assert layout_for_hf({"model_type": "glm4_moe"}) is GLM4_MOE
    assert layout_for_hf({"architectures": ["Qwen3MoeForCausalLM"]}) is QWEN3_MOE
    with pytest.raises(ConvertError, match=r"model_type='mixtral'.*'glm4_moe' \(Glm4MoeForCausalLM\)"):
        layout_for_hf({"model_type": "mixtral"})  # (deepseek_v3 has its own layout: test_deepseek_v3.py)


@pytest.mark.parametrize("variant", VARIANTS)
def test_maps_are_inverse(variant):
    m = VARIANTS[variant]
    mega = _random_megatron(m)
    hf = {}
    for key, t in mega.items():
        hf.update(to_hf(key, t, m))
    assert list(hf) == [s.name for s in GLM4_MOE.hf_specs_all(m)]
    biases = [n for n in hf if n.endswith("e_score_correction_bias")]
    assert len(biases) == m.num_layers - m.num_dense_layers
    if not m.moe_router_enable_expert_bias:
        assert not any(hf[n].any() for n in biases)
    if not m.moe_shared_expert_intermediate_size:
        shared = [n for n in hf if ".shared_experts." in n]
        assert len(shared) == 3 * len(biases) and not any(hf[n].any() for n in shared)
    head = mega.get("output_layer.weight", mega["embedding.word_embeddings.weight"])  # tied: written too
    assert torch.equal(hf["lm_head.weight"], head)
    for key, t in mega.items():
        assert torch.equal(from_hf(key, hf.__getitem__, m), t), key
    # a cast leaves the expert bias float32 (megatron keeps it so; rounding it moves routing)
    hf16 = {n: t for k, t in mega.items() for n, t in to_hf(k, t, m, dtype=torch.bfloat16)}
    assert {n for n, t in hf16.items() if t.dtype == torch.float32} == set(biases)


def test_shared_expert_and_bias_keys():
    m = DS
    mega = _random_megatron(m)
    p = "decoder.layers.1.mlp."
    out = dict(to_hf(p + "shared_experts.linear_fc1.weight", mega[p + "shared_experts.linear_fc1.weight"], m))
    assert torch.equal(out["model.layers.1.mlp.shared_experts.gate_proj.weight"], mega[p + "shared_experts.linear_fc1.weight"][:64])
    assert torch.equal(out["model.layers.1.mlp.shared_experts.up_proj.weight"], mega[p + "shared_experts.linear_fc1.weight"][64:])
    (name, bias), = to_hf(p + "router.expert_bias", mega[p + "router.expert_bias"], m)
    assert name == "model.layers.1.mlp.gate.e_score_correction_bias" and torch.equal(bias, mega[p + "router.expert_bias"])


def test_zeros_and_tied_head_are_checked_on_import():
    m = VARIANTS["plain_sigmoid_tied"]
    hf = {n: t for k, t in _random_megatron(m).items() for n, t in to_hf(k, t, m)}
    bad = dict(hf, **{"model.layers.1.mlp.gate.e_score_correction_bias": torch.full((8,), 0.1)})
    with pytest.raises(ConvertError, match=r"e_score_correction_bias' is not all zeros.*moe_router_enable_expert_bias=false"):
        from_hf("decoder.layers.1.mlp.router.weight", bad.__getitem__, m)
    bad = dict(hf, **{"model.layers.2.mlp.shared_experts.down_proj.weight": torch.ones(64, 64)})
    with pytest.raises(ConvertError, match="moe_shared_expert_intermediate_size=0"):
        from_hf("decoder.layers.2.mlp.router.weight", bad.__getitem__, m)
    bad = dict(hf, **{"lm_head.weight": hf["lm_head.weight"] + 1})
    with pytest.raises(ConvertError, match=r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'"):
        from_hf("embedding.word_embeddings.weight", bad.__getitem__, m)


@pytest.mark.parametrize("variant", ["deepseek", "plain_sigmoid_tied"])
def test_names_and_shapes_are_transformers_own(variant, tmp_path):
    """Our names/shapes against what transformers' Glm4MoeForCausalLM saves, and our
    directory loads into it with nothing missing, unexpected or mismatched."""
    import transformers

    m = VARIANTS[variant]
    cfg = transformers.AutoConfig.for_model(**hf_config(m, torch.float32, **IDS))
    assert type(cfg).__name__ == "Glm4MoeConfig" and cfg.rope_parameters["partial_rotary_factor"] == 1.0
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "theirs")
    with safe_open(str(tmp_path / "theirs" / "model.safetensors"), "pt") as f:
        theirs = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    ours = {s.name: s.shape for s in GLM4_MOE.hf_specs_all(m)}
    if not m.untie_embeddings_and_output_weights:
        assert "lm_head.weight" not in theirs  # transformers drops a tied head; vLLM needs it
        ours.pop("lm_head.weight")
    assert ours == theirs
    _write_hf(m, tmp_path / "ours")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # and back: both directories describe the same model; transformers' random weights
    # are the model's only when it has every tensor (else its random bias / shared expert
    # are refused, not dropped)
    for d in ("ours", "theirs"):
        with HFCheckpoint(tmp_path / d) as h:
            assert h.model_config(base=m) == m
            if d == "ours" or variant == "deepseek":
                assert len(dict(megatron_tensors(h, m))) == len(megatron_specs(m))
            else:
                with pytest.raises(ConvertError, match="is not all zeros"):
                    dict(megatron_tensors(h, m))


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_config_round_trips_the_model_config(variant):
    m = VARIANTS[variant]
    cfg = json.loads(json.dumps(hf_config(m, torch.float32, **IDS)))
    assert (cfg["model_type"], cfg["architectures"], cfg["partial_rotary_factor"]) == ("glm4_moe", ["Glm4MoeForCausalLM"], 1.0)
    assert cfg["norm_topk_prob"] is (m.moe_router_topk > 1)
    assert cfg["n_shared_experts"] == max(m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size, 1)
    assert model_config_from_hf(cfg, base=m) == m
    # without a base, HF's always-present bias and shared expert are taken as on
    fresh = model_config_from_hf(cfg)
    assert fresh.moe_router_enable_expert_bias and fresh.moe_shared_expert_intermediate_size >= m.moe_ffn_hidden_size
    # mapped: partial rotary (top level or in rope_parameters; absent is Glm4-MoE's 0.5),
    # routed scaling, and MTP layers (left out)
    plain_rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    mapped = [({"partial_rotary_factor": 0.5, "rope_parameters": plain_rope}, "rotary_percent", 0.5),
              ({"rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": 0.25}}, "rotary_percent", 0.25),
              ({"partial_rotary_factor": None, "rope_parameters": plain_rope}, "rotary_percent", 0.5),
              ({"routed_scaling_factor": 2.5}, "moe_router_topk_scaling_factor", 2.5),
              ({"num_nextn_predict_layers": 1}, "num_layers", m.num_layers)]
    for change, field, want in mapped:
        assert getattr(model_config_from_hf({**cfg, **change}, base=m), field) == want, change
    refused = [({"n_group": 8, "topk_group": 4}, "group-limited routing"),
               ({"norm_topk_prob": not cfg["norm_topk_prob"]}, "norm_topk_prob"),
               ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters has rope_type='yarn'"),
               ({"n_shared_experts": 0}, "n_shared_experts=0")]
    for change, msg in refused:
        with pytest.raises(NotImplementedError, match=msg):
            model_config_from_hf({**cfg, **change})
    with pytest.raises(ConvertError, match=r"partial_rotary_factor=1.5: must be in \(0, 1\]"):
        model_config_from_hf({**cfg, "partial_rotary_factor": 1.5, "rope_parameters": plain_rope})


def test_softmax_router_with_shared_expert_is_refused():
    m = dataclasses.replace(DS, moe_router_score_function="softmax", moe_router_enable_expert_bias=False)
    with pytest.raises(NotImplementedError, match=r"softmax.*moe_shared_expert_intermediate_size=64.*Glm4-MoE routes by sigmoid"):
        check_supported(m)
    check_supported(dataclasses.replace(DS, qk_layernorm=False))  # Glm4-MoE can leave QK-norm out


# --------------------------------------------------------------------------- real checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("convert_glm4")
    torchrun("convert_glm4_worker.py", 1, "save1", str(out))  # c1 -> hf1 -> rt1
    torchrun("convert_glm4_worker.py", 2, "ep2", str(out))
    megatron_to_hf(out / "c_ep2", out / "hf_ep2", max_shard_bytes=200_000)
    return out


def _hf_logprobs(hf_dir: Path, r: dict, zero_bias: bool = False) -> torch.Tensor:
    """transformers' fp32 per-token logprobs of the batch's responses."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    if zero_bias:
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
    tokens_BS, P, R = r["tokens_BS"], r["prompt_lens_B"], r["response_lens_B"]
    with torch.no_grad():
        logp_BSV = torch.log_softmax(model.eval()(tokens_BS).logits.float(), dim=-1)
    out = torch.zeros(tokens_BS.shape[0], r["response_width"])
    for b in range(tokens_BS.shape[0]):
        pos = torch.arange(int(P[b]), int(P[b] + R[b]))
        out[b, : len(pos)] = logp_BSV[b, pos - 1, tokens_BS[b, pos]]
    return out


@pytest.mark.multiproc
def test_transformers_logprobs_match_learner(runs):
    r, ep2 = torch.load(runs / "save1.pt"), torch.load(runs / "ep2.pt")
    ref = _hf_logprobs(runs / "hf1", r)
    assert r["logp"].abs().sum() > 0
    assert (ref - r["logp"]).abs().max() < TOL
    assert (ref - ep2["logp"]).abs().max() < TOL  # c1 loaded at EP=2
    assert (ref - ep2["hf1_logp"]).abs().max() < TOL  # hf1 loaded at EP=2 (load_hf_weights)
    # the expert bias decides routing here: without it the model is measurably different
    assert (_hf_logprobs(runs / "hf1", r, zero_bias=True) - ref).abs().max() > 1e-3


@pytest.mark.multiproc
def test_round_trip_and_ep2_checkpoint_are_bit_exact(runs, tmp_path):
    a, b = DcpCheckpoint(runs / "c1"), DcpCheckpoint(runs / "rt1")
    keys = sorted(k for k in a.tensors if is_model_key(k))
    assert keys == sorted(k for k in b.tensors if is_model_key(k))
    assert "decoder.layers.1.mlp.router.expert_bias" in keys and a.tensors[keys[0]].dtype == torch.float32
    for k in keys:
        x, y = a.read(k), b.read(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k
    assert a.read("decoder.layers.3.mlp.router.expert_bias").abs().min() > 0
    stream = torch.load(runs / "ep2.pt")["stream"]
    megatron_to_hf(runs / "rt1", tmp_path / "hf_rt1")
    with HFCheckpoint(runs / "hf1") as h1:
        for other in (runs / "hf_ep2", tmp_path / "hf_rt1"):  # saved at EP=2; HF -> megatron -> HF
            with HFCheckpoint(other) as h2:
                assert h1.names() == h2.names()
                assert all(torch.equal(h1.get(n), h2.get(n)) for n in h1.names())
        assert set(stream) == h1.names()  # the live EP=2 learner's stream, too
        assert all(torch.equal(h1.get(n), t) for n, t in stream.items())
        assert h1.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


@pytest.mark.multiproc
def test_bf16_output_keeps_the_expert_bias_fp32(runs, tmp_path):
    megatron_to_hf(runs / "c1", tmp_path / "bf16", dtype="bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with HFCheckpoint(runs / "hf1") as h32, HFCheckpoint(tmp_path / "bf16") as h16:
        for n in h32.names():
            want = h32.get(n) if n.endswith("e_score_correction_bias") else h32.get(n).to(torch.bfloat16)
            assert h16.get(n).dtype == want.dtype and torch.equal(h16.get(n), want), n


@pytest.mark.multiproc
@pytest.mark.vllm
def test_vllm_serves_the_converted_directory(runs):
    """vLLM's Glm4MoeForCausalLM (through the sampler package) against transformers, before
    and after weight syncs."""
    pytest.importorskip("vllm")
    proc = forked.run([sys.executable, str(WORKERS / "convert_glm4_worker.py"), "vllm", str(runs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = json.loads((runs / "vllm.json").read_text())["rows"]
    from moe_rl.batch import TokenBatch

    batch = TokenBatch.from_lists([r["prompt"] for r in rows], [r["response"] for r in rows])
    r = {"tokens_BS": batch.tokens_BS, "prompt_lens_B": batch.prompt_lens_B,
         "response_lens_B": batch.response_lens_B, "response_width": batch.response_width}
    ref, unbiased = _hf_logprobs(runs / "hf1", r), _hf_logprobs(runs / "hf1", r, zero_bias=True)
    for b, row in enumerate(rows):
        assert len(row["response"]) == 6
        for got in ("logprobs", "synced"):
            assert (ref[b, :6] - torch.tensor(row[got])).abs().max() < 1e-4, got
        assert (unbiased[b, :6] - torch.tensor(row["unbiased"])).abs().max() < 1e-4
