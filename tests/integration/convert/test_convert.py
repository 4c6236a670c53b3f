"""megatron <-> Hugging Face conversion: name/shape maps, the streaming writer, parity with
the learner (transformers, vLLM), round trips, and bad input.

The checkpoints come from one module fixture, one 2-process launch
(moe_rl_testing/workers/convert_worker.py): its rank 0 first runs alone as a 1-process learner (one
dense layer, one optimizer step, a one-rank world of its own) that saves `c1`, converts it
to HF (`hf1`) and back through the CLI's main (`rt1`); then both processes save `c_tp2`
(tied embeddings), `c_ep2` and `c_pp2`, stream the live learner's HF tensors, and reload
c1's weights at each of those layouts from `rt1` and from `hf1`. (The CLI as a process, its
exit status and error line: test_not_a_checkpoint, and README's commands in
tests/integration/docs/test_docs_commands.py.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from moe_rl.config import ModelConfig
from moe_rl.convert import (
    ConvertError,
    DcpCheckpoint,
    HFCheckpoint,
    ShardedSafetensorsWriter,
    atomic_output_dir,
    check_supported,
    check_tensors,
    from_hf,
    hf_config,
    hf_specs,
    megatron_specs,
    megatron_to_hf,
    model_config_from_hf,
    to_hf,
)
from moe_rl.convert.qwen3_moe import hf_specs_all, is_model_key
from moe_rl.convert.safetensors_writer import INDEX_FILE, PlannedTensor
from moe_rl_testing import ROOT, forked
from moe_rl_testing.dist_helpers import WORKERS, torchrun

CLI = ROOT / "tools" / "convert_checkpoint.py"
TOL = 1e-5  # fp32 learner vs transformers per-token logprobs
LAYOUTS = ["tp2", "ep2", "pp2"]  # 2-process checkpoints (moe_rl_testing/workers/convert_worker.py)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, str(CLI), "--no-progress", *args],
                          capture_output=True, text=True, timeout=300)


def _random_megatron(m: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in megatron_specs(m).items()}


# --------------------------------------------------------------------------- pure maps


@pytest.mark.parametrize("heads,groups,dense,tied", [(4, 2, 1, False), (4, 4, 0, True), (8, 2, 2, False)])
def test_maps_are_inverse_and_match_specs(heads, groups, dense, tied):
    m = ModelConfig(num_attention_heads=heads, num_query_groups=groups, num_dense_layers=dense,
                    untie_embeddings_and_output_weights=not tied)
    mega = _random_megatron(m)
    hf = {}
    for key, t in mega.items():
        hf.update(to_hf(key, t, m))
    assert [(n, tuple(t.shape)) for n, t in hf.items()] == [(s.name, s.shape) for s in hf_specs_all(m)]
    assert ("lm_head.weight" in hf) is not tied
    assert sum(".mlp.gate_proj." in n for n in hf) == dense
    for key, t in mega.items():
        assert torch.equal(from_hf(key, hf.__getitem__, m), t), key


def test_qkv_rows_are_grouped_query_heads_then_k_then_v():
    """Row r of linear_qkv holds the value r: q_proj must take, per group, its query heads."""
    m = ModelConfig(num_attention_heads=4, num_query_groups=2, kv_channels=2, hidden_size=8, num_layers=1)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    rows = torch.arange(megatron_specs(m)[key][0], dtype=torch.float32)[:, None].expand(-1, 8)
    q, k, v = (t[:, 0].tolist() for _, t in to_hf(key, rows, m))
    # per group of (2 q heads + k + v) x 2 rows: group 0 = rows 0-7, group 1 = rows 8-15
    assert q == [0, 1, 2, 3, 8, 9, 10, 11] and k == [4, 5, 12, 13] and v == [6, 7, 14, 15]


def test_expert_fc1_is_gate_then_up_per_global_expert():
    m = ModelConfig(num_layers=1)
    key = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
    E, F2, H = megatron_specs(m)[key]
    w = torch.arange(E * F2, dtype=torch.float32).view(E, F2, 1).expand(E, F2, H)
    out = dict(to_hf(key, w, m))
    F = F2 // 2
    assert torch.equal(out["model.layers.0.mlp.experts.5.gate_proj.weight"], w[5, :F])
    assert torch.equal(out["model.layers.0.mlp.experts.5.up_proj.weight"], w[5, F:])
    assert out["model.layers.0.mlp.experts.5.up_proj.weight"].data_ptr() == w[5, F:].data_ptr()  # a view


def test_a_rank_fetches_only_the_hf_tensors_its_pieces_read():
    """Expert parallelism: the rank holding experts 4-7 of 8 reads those experts' gate/up
    tensors and no other, and its pieces equal the full import's; an index that spans every
    expert (a TP-like slice of all of them) fetches every tensor it reads."""
    from moe_rl.convert.layouts import layout_for

    m = ModelConfig(num_layers=1, num_experts=8)
    key = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
    E, F2, H = megatron_specs(m)[key]
    full = torch.randn(E, F2, H, generator=torch.Generator().manual_seed(0))
    hf = dict(to_hf(key, full, m))
    fetched: list[str] = []

    def fetch(name: str) -> torch.Tensor:
        fetched.append(name)
        return hf[name]

    layout = layout_for(m)
    wanted = [(e, slice(0, F2), slice(0, H)) for e in range(4, 8)]
    got = layout.from_hf(key, fetch, m, wanted)
    assert sorted(fetched) == sorted(f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"
                                     for e in range(4, 8) for p in ("gate", "up"))
    assert all(torch.equal(got[idx], full[idx]) for idx in wanted)
    fetched.clear()
    assert torch.equal(layout.from_hf(key, fetch, m), full) and len(fetched) == 2 * E
    fetched.clear()
    gates = (slice(0, E), slice(0, F2 // 2), slice(0, H))  # every expert's gate rows
    assert torch.equal(layout.from_hf(key, fetch, m, [gates])[gates], full[gates])
    assert {f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(E)} <= set(fetched)


@pytest.mark.parametrize("fields,named", [
    ({"moe_shared_expert_intermediate_size": 32}, "moe_shared_expert_intermediate_size"),  # softmax + shared
    ({"qk_layernorm": False}, "qk_layernorm"),  # softmax without QK-norm
    ({"add_qkv_bias": True}, "add_qkv_bias"),  # softmax: Qwen3-MoE would add an o_proj bias too
    ({"rotary_percent": 0.5}, "rotary_percent"),
    ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 1}, "moe_router_num_groups=4"),  # exported without
    ({"moe_router_score_function": "sigmoid", "moe_router_num_groups": 4, "moe_router_group_topk": 1},
     "moe_router_num_groups=4: the Glm4-MoE export writes n_group = topk_group = 1"),
    ({"moe_router_score_function": "sigmoid", "moe_shared_expert_intermediate_size": 48},
     "moe_shared_expert_intermediate_size=48 is not a multiple of model.moe_ffn_hidden_size"),
])
def test_unrepresentable_models_are_refused_by_name(fields, named):
    """(Sigmoid routers and shared experts convert to Glm4-MoE: tests/integration/convert/test_convert_glm4.py.)"""
    m = dataclasses.replace(ModelConfig(), **fields)
    with pytest.raises(NotImplementedError, match=f"model.{named}"):
        check_supported(m)
    with pytest.raises(NotImplementedError, match=f"model.{named}"):
        hf_config(m, torch.float32, bos_token_id=2, eos_token_id=3, pad_token_id=0)


def test_hf_config_round_trips_the_model_config():
    m = ModelConfig(num_dense_layers=2, untie_embeddings_and_output_weights=False, rotary_base=1e6,
                    norm_epsilon=1e-5, params_dtype="bf16")
    cfg = hf_config(m, torch.bfloat16, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    assert cfg["mlp_only_layers"] == [0, 1] and cfg["tie_word_embeddings"] and cfg["dtype"] == "bfloat16"
    assert model_config_from_hf(json.loads(json.dumps(cfg)), base=m) == m
    # a recipe's group routing does not survive an import of a model that has none
    grouped = dataclasses.replace(m, moe_router_num_groups=4, moe_router_group_topk=1)
    assert model_config_from_hf(json.loads(json.dumps(cfg)), base=grouped) == m
    # norm_topk_prob=false: top-k of the softmax over all experts, megatron's pre-softmax
    unnormed = model_config_from_hf({**cfg, "norm_topk_prob": False}, base=m)
    assert unnormed == dataclasses.replace(m, moe_router_pre_softmax=True)
    assert hf_config(unnormed, torch.bfloat16, bos_token_id=2, eos_token_id=3, pad_token_id=0)["norm_topk_prob"] is False
    for change, named in [({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
                          ({"attention_bias": True}, "attention_bias=true"),
                          ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
                          ({"num_experts_per_tok": 1}, "norm_topk_prob=true with num_experts_per_tok=1"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling has rope_type='yarn'")]:
        with pytest.raises(NotImplementedError, match=named):
            model_config_from_hf({**cfg, "rope_parameters": None, **change})
    with pytest.raises(NotImplementedError, match="mlp_only_layers"):
        model_config_from_hf({**cfg, "mlp_only_layers": [1]})
    with pytest.raises(ConvertError, match="model_type"):
        model_config_from_hf({**cfg, "model_type": "llama"})


def test_writer_streams_planned_shards(tmp_path):
    ts = {f"t{i}": torch.randn(100 + i, 3).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(7)}
    plan = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in ts.items()]
    with ShardedSafetensorsWriter(tmp_path, plan, max_shard_bytes=2500) as w:
        for n, t in ts.items():
            w.write(n, t)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    for n, t in ts.items():
        with safe_open(str(tmp_path / index["weight_map"][n]), "pt") as f:
            assert torch.equal(f.get_tensor(n), t)
    w = ShardedSafetensorsWriter(tmp_path / "x", plan, 2500)
    with pytest.raises(ConvertError, match="'t1' arrived where 't0' was planned"):
        w.write("t1", ts["t1"])
    with pytest.raises(ConvertError, match="'t0' has shape"):
        w.write("t0", ts["t0"][:5])
    with pytest.raises(ConvertError, match="'t0' was planned but never written"):
        w.close()


def test_raw_record_parser_accepts_only_plain_tensors(tmp_path):
    """The fast DCP reader trusts a torch.save record only when its bytes are the tensor."""
    from moe_rl.convert.dcp import _raw_tensor_offset

    base = torch.randn(4, 6, 8)
    cases = {"clone": (base[2:3].clone(), True), "bf16": (base.bfloat16()[:1].clone(), True),
             "view of a larger storage": (base[2:3], False), "transposed": (base[0].t(), False)}
    for name, (t, plain) in cases.items():
        path = tmp_path / "records"
        with open(path, "wb") as f:
            f.write(b"other records" * 3)
            start = f.tell()
            torch.save(t, f)
            length = f.tell() - start
        at = _raw_tensor_offset(path, start, length, t.dtype, tuple(t.shape))
        assert (at is not None) == plain, name
        if plain:
            raw = path.read_bytes()[at : at + t.numel() * t.element_size()]
            assert torch.equal(torch.frombuffer(bytearray(raw), dtype=t.dtype).view(t.shape), t), name
        assert _raw_tensor_offset(path, start, length, torch.float16, tuple(t.shape)) is None  # wrong dtype


def test_atomic_output_dir(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(dst) as tmp:
        (tmp / "a").write_text("partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(dst) as tmp:
        (tmp / "a").write_text("one")
    with pytest.raises(FileExistsError, match="--force"), atomic_output_dir(dst):
        pass
    with atomic_output_dir(dst, force=True) as tmp:
        (tmp / "b").write_text("two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (dst / "b").is_file()


# --------------------------------------------------------------------------- real checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("convert")
    torchrun("convert_worker.py", 2, "all", str(out))  # c1, hf1, rt1 (rank 0 alone), then the layouts
    for name in LAYOUTS:
        megatron_to_hf(out / f"c_{name}", out / f"hf_{name}", max_shard_bytes=200_000)
    return out


def _hf_logprobs(hf_dir: Path, r: dict) -> torch.Tensor:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens_BS, P, R = r["tokens_BS"], r["prompt_lens_B"], r["response_lens_B"]
    with torch.no_grad():
        logp_BSV = torch.log_softmax(model.eval()(tokens_BS).logits.float(), dim=-1)
    out = torch.zeros(tokens_BS.shape[0], r["response_width"])
    for b in range(tokens_BS.shape[0]):
        pos = torch.arange(int(P[b]), int(P[b] + R[b]))
        out[b, : len(pos)] = logp_BSV[b, pos - 1, tokens_BS[b, pos]]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["c1", *LAYOUTS])
def test_transformers_logprobs_match_learner(runs, name):
    if name == "c1":
        r = torch.load(runs / "save1.pt")
        hf_dir, logp = runs / "hf1", r["logp"]
    else:
        r = torch.load(runs / "layouts.pt")
        hf_dir, logp = runs / f"hf_{name}", r[name]["logp"]
    assert logp.abs().sum() > 0
    assert (_hf_logprobs(hf_dir, r) - logp).abs().max() < TOL


@pytest.mark.multiproc
def test_hf_directory_layout(runs):
    import transformers

    hf1, tp2 = runs / "hf1", runs / "hf_tp2"
    for d in (hf1, tp2):
        names = {p.name for p in d.iterdir()}
        assert {"config.json", "generation_config.json", INDEX_FILE, "tokenizer.json",
                "tokenizer_config.json"} <= names
    assert len(json.loads((tp2 / INDEX_FILE).read_text())["weight_map"]) == len(HFCheckpoint(tp2).names())
    assert len({p for p in tp2.glob("model-*-of-*.safetensors")}) > 1  # 200 kB shards
    cfg1 = transformers.AutoConfig.from_pretrained(hf1)
    assert (cfg1.mlp_only_layers, cfg1.tie_word_embeddings, cfg1.num_experts, cfg1.head_dim) == ([0], False, 8, 32)
    assert (cfg1.bos_token_id, cfg1.eos_token_id, cfg1.pad_token_id) == (2, 3, 0)
    assert transformers.AutoConfig.from_pretrained(tp2).tie_word_embeddings
    assert "lm_head.weight" not in HFCheckpoint(tp2).names()
    tok = transformers.AutoTokenizer.from_pretrained(hf1)
    from moe_rl.tasks.tokenizer import Tokenizer

    assert tok("rev 48213 =").input_ids == Tokenizer().encode("rev 48213 =")


@pytest.mark.multiproc
def test_round_trips_are_bit_exact(runs, tmp_path):
    a, b = DcpCheckpoint(runs / "c1"), DcpCheckpoint(runs / "rt1")
    keys = sorted(k for k in a.tensors if is_model_key(k))
    assert keys == sorted(k for k in b.tensors if is_model_key(k))
    for k in keys:
        x, y = a.read(k), b.read(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k
    # and HF -> megatron -> HF
    megatron_to_hf(runs / "rt1", tmp_path / "hf")
    with HFCheckpoint(runs / "hf1") as h1, HFCheckpoint(tmp_path / "hf") as h2:
        assert h1.names() == h2.names()
        assert all(torch.equal(h1.get(n), h2.get(n)) for n in h1.names())


@pytest.mark.multiproc
@pytest.mark.parametrize("name", LAYOUTS)
def test_hf_weights_load_at_other_layouts(runs, name):
    c1 = torch.load(runs / "save1.pt")["logp"]
    r = torch.load(runs / "layouts.pt")[name]
    assert (r["rt1_logp"] - c1).abs().max() < TOL  # converted checkpoint via load_checkpoint
    assert (r["hf1_logp"] - c1).abs().max() < TOL  # HF directory via load_hf_weights


@pytest.mark.multiproc
@pytest.mark.parametrize("name", LAYOUTS)
def test_live_stream_equals_converted_files(runs, name):
    stream = torch.load(runs / "layouts.pt")[name]["stream"]
    with HFCheckpoint(runs / f"hf_{name}") as hf:
        assert set(stream) == hf.names()
        for n, t in stream.items():
            assert torch.equal(hf.get(n), t), n


@pytest.mark.multiproc
def test_raw_reader_matches_dcp_loader(runs):
    """The fast chunk reader (raw bytes into place) against torch.distributed.checkpoint's
    own loader, for every tensor (optimizer state too), at every saved layout; and the
    file-to-file copy covers every tensor but q/k/v in the 1-process checkpoint."""
    from moe_rl.config import load_config
    from moe_rl.convert.hf_export import _stored_as_is

    for name in ["c1", *(f"c_{n}" for n in LAYOUTS)]:
        ckpt = DcpCheckpoint(runs / name)
        for key, info in ckpt.tensors.items():
            assert ckpt.raw_chunks(key) is not None, (name, key)
            ref = ckpt.read_with_dcp(key, torch.empty(info.shape, dtype=info.dtype))
            assert torch.equal(ckpt.read(key), ref), (name, key)
    ckpt = DcpCheckpoint(runs / "c1")
    m = load_config(runs / "c1" / "config.yaml").model
    relaid = [k for k in megatron_specs(m) if _stored_as_is(k, ckpt, k, m) is None]
    assert relaid == [f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in range(m.num_layers)]


@pytest.mark.multiproc
def test_bf16_output(runs, tmp_path):
    megatron_to_hf(runs / "c1", tmp_path / "bf16", dtype="bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with HFCheckpoint(runs / "hf1") as h32, HFCheckpoint(tmp_path / "bf16") as h16:
        for n in h32.names():
            assert torch.equal(h16.get(n), h32.get(n).to(torch.bfloat16)), n


@pytest.mark.multiproc
@pytest.mark.vllm
def test_vllm_loads_converted_directory(runs):
    pytest.importorskip("vllm")
    proc = forked.run([sys.executable, str(WORKERS / "convert_worker.py"), "vllm", str(runs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads((runs / "vllm.json").read_text())
    assert out["text"]  # the tokenizer files load too
    from moe_rl.batch import TokenBatch

    rows = out["rows"]
    batch = TokenBatch.from_lists([r["prompt"] for r in rows], [r["response"] for r in rows])
    r = {"tokens_BS": batch.tokens_BS, "prompt_lens_B": batch.prompt_lens_B,
         "response_lens_B": batch.response_lens_B, "response_width": batch.response_width}
    ref = _hf_logprobs(runs / "hf1", r)
    for b, row in enumerate(rows):
        assert len(row["response"]) == 6
        assert (ref[b, :6] - torch.tensor(row["logprobs"])).abs().max() < 1e-4


# --------------------------------------------------------------------------- bad input


@pytest.mark.multiproc
def test_not_a_checkpoint(runs, tmp_path):
    (tmp_path / "empty").mkdir()
    for src, msg in [(tmp_path / "empty", "not a megatron checkpoint"), (tmp_path / "nope", "does not exist"),
                     (runs / "hf1", "use --to megatron")]:
        with pytest.raises(ConvertError, match=msg):
            megatron_to_hf(src, tmp_path / "out")
    proc = _cli("--to", "hf", "--src", str(tmp_path / "empty"), "--dst", str(tmp_path / "out"))
    assert proc.returncode == 2 and "not a megatron checkpoint" in proc.stderr
    with pytest.raises(ConvertError, match="use --to hf"):
        HFCheckpoint(runs / "c1")
    assert not (tmp_path / "out").exists()


def _copy_with_config(src: Path, dst: Path, **model: object) -> Path:
    shutil.copytree(src, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["model"].update(model)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dst


@pytest.mark.multiproc
def test_config_that_does_not_match_the_weights(runs, tmp_path):
    cases = [
        ({"num_experts": 16}, r"'decoder\.layers\.1\.mlp\.router\.weight' has global shape \[8, 64\] but config\.yaml implies \[16, 64\]"),
        ({"num_layers": 5}, r"lacks tensor 'decoder\.layers\.4\."),
        ({"num_dense_layers": 0}, r"'decoder\.layers\.0\.mlp\.linear_fc1\.weight' is not part of the model"),
    ]
    for i, (model, msg) in enumerate(cases):
        bad = _copy_with_config(runs / "c1", tmp_path / f"bad{i}", **model)
        with pytest.raises(ConvertError, match=msg):
            megatron_to_hf(bad, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    # HF side: config.json against the safetensors, and a missing tensor
    hf = tmp_path / "hf"
    shutil.copytree(runs / "hf1", hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 32}))
    with HFCheckpoint(hf) as h, pytest.raises(ConvertError, match=r"'model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight' has shape \[64, 64\] but config\.json implies \[32, 64\]"):
        check_tensors(h, h.model_config())
    (hf / "config.json").write_text(json.dumps(cfg))
    index = json.loads((hf / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.2.self_attn.k_norm.weight"]
    (hf / INDEX_FILE).write_text(json.dumps(index))
    with HFCheckpoint(hf) as h, pytest.raises(ConvertError, match=r"'model\.layers\.2\.self_attn\.k_norm\.weight' is missing"):
        check_tensors(h, h.model_config())


@pytest.mark.multiproc
def test_interrupted_conversion_leaves_no_output(runs, tmp_path, monkeypatch):
    dst = tmp_path / "hf"
    calls = []

    def failing(method):
        def wrapped(self, name, *args):
            calls.append(name)
            if len(calls) == 30:  # some shards are already on disk by now
                raise OSError(28, "No space left on device")
            return method(self, name, *args)
        return wrapped

    def break_writer():
        calls.clear()
        for method in ("write", "copy_from_file"):  # tensors re-laid out / copied file to file
            monkeypatch.setattr(ShardedSafetensorsWriter, method, failing(getattr(ShardedSafetensorsWriter, method)))

    break_writer()
    with pytest.raises(OSError, match="No space left"):
        megatron_to_hf(runs / "c1", dst, max_shard_bytes=50_000)
    assert len(calls) == 30 and list(tmp_path.iterdir()) == []
    # with --force over an existing output, a failure leaves the old output untouched
    monkeypatch.undo()
    megatron_to_hf(runs / "c1", dst)
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    break_writer()
    with pytest.raises(OSError):
        megatron_to_hf(runs / "c1", dst, force=True)
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    with pytest.raises(FileExistsError, match="--force"):
        megatron_to_hf(runs / "c1", dst)
    with pytest.raises(ValueError, match="overlaps the source"):
        megatron_to_hf(runs / "c1", runs / "c1" / "hf", force=True)


def test_hf_specs_name_every_tensor_once():
    m = ModelConfig(num_dense_layers=1)
    names = [s.name for key in megatron_specs(m) for s in hf_specs(key, m)]
    # embed, norm, lm_head; 8 per layer for attention + norms; dense MLP 3; MoE: gate + 3 per expert
    assert len(names) == len(set(names)) == 3 + 4 * 8 + 3 + 3 * (1 + 8 * 3)
