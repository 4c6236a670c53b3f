"""Issue 16: a Hugging Face MoE directory with its own tokenizer, chat template and a dataset,
RL-trained and exported, as a new user brings them (random-init transformers models and a
byte-level BPE tokenizer trained in the test: `hf_fixtures`).

Fast tests (no engines): tokenizer resolution with no silent fallback, prompt ids equal to
`apply_chat_template`, the model section derived from config.json, one-line errors for bad
inputs with nothing written. Engine tests: the RL recipe for 3 steps with vLLM and with the
transformers sampler (R3), the export reloaded in transformers and measured against the
learner by the mismatch tool with vLLM and transformers (fp32: agreement to rounding).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.cli import resolve_recipe
from moe_rl.config import ConfigError, TaskConfig, load_recipe
from moe_rl.tasks.base import Problem
from moe_rl.tokenization import (
    HFTokenizer,
    PromptEncoder,
    TokenizerError,
    check_fits_model,
    load_tokenizer,
)
from moe_rl_testing import ROOT, forked
from moe_rl_testing.hf_fixtures import (
    CHATML,
    make_hf_model_dir,
    write_bpe_tokenizer,
    write_math_jsonl,
)
from moe_rl_testing.in_process import load_tool, run_main
from tests.integration.test_cli_errors import child_env, one_line_error

RECIPE = ROOT / "examples" / "hf_rspo.yaml"
TINY_BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
SYSTEM = "You are a helpful assistant."
ARCHS = ("qwen3_moe", "glm4_moe")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_hf_model_dir(root / arch, arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def qwen_dir(hf_dirs) -> Path:
    return hf_dirs["qwen3_moe"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {"prompt": write_math_jsonl(root / "train.jsonl"), "messages": write_math_jsonl(root / "chat.jsonl",
                                                                                         messages=True)}


def _ids(encoding) -> list[int]:
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


# --------------------------------------------------------------------------- tokenizer


def test_auto_uses_the_checkpoints_tokenizer_and_every_eos(qwen_dir):
    tok = load_tokenizer("auto", qwen_dir)
    assert isinstance(tok, HFTokenizer)
    hf = tok.hf
    gen = json.loads((qwen_dir / "generation_config.json").read_text())
    assert tok.eos_ids == [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]
    assert gen["eos_token_id"] == tok.eos_ids  # both declared ids, the tokenizer's first
    assert tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.vocab_size == len(hf) == 384 and tok.chat_template == CHATML
    text = "What is 12 + 30? The answer is \\boxed{42}."
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([*tok.encode(text), tok.eos_id, 400]) == text  # specials and ids past the vocab dropped


@pytest.mark.parametrize("system", ["", SYSTEM])
def test_prompt_ids_are_apply_chat_template(qwen_dir, system):
    tok = load_tokenizer("auto", qwen_dir)
    enc = PromptEncoder.from_config(TaskConfig(system_prompt=system), tok)
    q = "What is 7 + 5? Put the answer in \\boxed{}."
    head = [{"role": "system", "content": system}] if system else []
    want = _ids(tok.hf.apply_chat_template([*head, {"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True))
    assert enc.encode(Problem(q, "12")) == want
    chat = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": q})
    want = _ids(tok.hf.apply_chat_template([*head, *map(dict, chat)], add_generation_prompt=True, tokenize=True))
    assert enc.encode(Problem(q, "12", messages=chat)) == want
    assert tok.decode(want).endswith("assistant\n")


def test_chat_template_none_and_file(qwen_dir, tmp_path):
    tok = load_tokenizer("auto", qwen_dir)
    plain = PromptEncoder.from_config(TaskConfig(chat_template="none"), tok)
    assert plain.encode(Problem("What is 1 + 1?", "2")) == tok.hf("What is 1 + 1?")["input_ids"]
    with pytest.raises(TokenizerError, match="chat template"):
        plain.encode(Problem("q", "a", messages=({"role": "user", "content": "q"},)))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    own = PromptEncoder.from_config(TaskConfig(chat_template=str(template)), tok)
    assert tok.decode(own.encode(Problem("hi", "x"))) == "[user] hi\n[assistant]"
    with pytest.raises(TokenizerError, match="no such file"):
        PromptEncoder.from_config(TaskConfig(chat_template=str(tmp_path / "missing.jinja")), tok)


def test_shipped_tokenizer_only_for_the_projects_models(qwen_dir, tmp_path):
    from moe_rl.tokenization import resolve_spec

    assert resolve_spec("auto", TINY_BASE) == "shipped"  # recorded in its config.yaml
    assert resolve_spec("auto", None) == "shipped"  # a model built from the recipe
    with pytest.raises(TokenizerError, match="has its own tokenizer"):
        resolve_spec("shipped", qwen_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(qwen_dir / name, bare / name)
    with pytest.raises(TokenizerError, match=r"has no tokenizer files \(.*\); set task\.tokenizer="):
        resolve_spec("auto", bare)


def test_tokenizer_must_fit_the_embedding(qwen_dir, tmp_path):
    write_bpe_tokenizer(tmp_path / "big", vocab=500)
    big = load_tokenizer(str(tmp_path / "big"), qwen_dir)
    with pytest.raises(TokenizerError, match=r"500 tokens but model\.vocab_size=448"):
        check_fits_model(big, 448)
    odd = load_tokenizer("auto", qwen_dir)
    odd.eos_ids = [*odd.eos_ids, 9999]  # a special id the embedding does not have
    with pytest.raises(TokenizerError, match=r"eos id 9999 is outside model\.vocab_size=448"):
        check_fits_model(odd, 448)


# --------------------------------------------------------------------------- model from config.json


def test_model_section_from_config_json(qwen_dir):
    cfg = resolve_recipe(*load_recipe(RECIPE, [f"run.init_checkpoint={qwen_dir}"]))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels) == (3, 128, 8, 2, 64)
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (16, 4, 64, 192)
    assert (m.vocab_size, m.max_position_embeddings, m.untie_embeddings_and_output_weights) == (448, 256, True)
    assert m.params_dtype == "fp32" and cfg.task.tokenizer == str(qwen_dir.resolve())
    same = resolve_recipe(*load_recipe(RECIPE, [f"run.init_checkpoint={qwen_dir}", "model.num_experts=16",
                                                "model.params_dtype=bf16"]))
    assert same.model == dataclasses.replace(m, params_dtype="bf16")  # agreeing keys, an overridden dtype
    with pytest.raises(ConfigError, match=r"model.num_experts=8 \(config.json gives 16\).*remove these keys"):
        resolve_recipe(*load_recipe(RECIPE, [f"run.init_checkpoint={qwen_dir}", "model.num_experts=8"]))


def test_unsupported_architecture_is_named(qwen_dir, tmp_path):
    llama = tmp_path / "llama"
    shutil.copytree(qwen_dir, llama)
    cfg = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"model_type='llama'.*supported: 'qwen3_moe' \(Qwen3MoeForCausalLM\)"):
        resolve_recipe(*load_recipe(RECIPE, [f"run.init_checkpoint={llama}"]))


# --------------------------------------------------------------------------- bad inputs (CLI)


def _train_argv(out: Path, *args: str) -> list[str]:
    return ["--config", str(RECIPE), f"run.output_dir={out}", "run.steps=3", "sampler.backend=transformers",
            "logging.progress=false", *args]


def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_rl.train", *_train_argv(out, *args)]
    return forked.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, env=child_env())


def _nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), list(out.rglob("*"))


def test_bad_inputs_are_one_line_and_write_nothing(qwen_dir, data, tmp_path):
    prog = "python -m moe_rl.train"
    shapes = tmp_path / "shapes"
    shutil.copytree(qwen_dir, shapes)
    cfg = json.loads((shapes / "config.json").read_text())
    (shapes / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 96}))
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text(data["prompt"].read_text().splitlines()[0] + "\n" + json.dumps({"question": "?", "answer": "1"}) + "\n")
    module = tmp_path / "my_rewards.py"
    module.write_text("def score(prompt, response, answer, metadata):\n    return 1 / 0\n")
    write_bpe_tokenizer(tmp_path / "big", vocab=500)
    llama = tmp_path / "llama"
    shutil.copytree(qwen_dir, llama)
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    cases = [
        ([f"run.init_checkpoint={llama}", f"task.data_path={data['prompt']}"],
         ["model_type='llama'", "supported: 'qwen3_moe' (Qwen3MoeForCausalLM)"]),
        ([f"run.init_checkpoint={shapes}", f"task.data_path={data['prompt']}"],
         [str(shapes), "has shape", "config.json implies"]),
        ([f"run.init_checkpoint={qwen_dir}", f"task.data_path={bad_rows}"], [str(bad_rows), "line 2", "prompt"]),
        ([f"run.init_checkpoint={qwen_dir}", f"task.data_path={data['prompt']}", "task.reward=my_rewards:score"],
         ["my_rewards:score", "ZeroDivisionError"]),
        ([f"run.init_checkpoint={qwen_dir}", f"task.data_path={data['prompt']}", f"task.tokenizer={tmp_path / 'big'}"],
         ["500 tokens", "model.vocab_size=448"]),
    ]
    for i, (args, needles) in enumerate(cases):
        out = tmp_path / f"out{i}"
        argv = ["--config", str(RECIPE), f"run.output_dir={out}", "logging.progress=false", *args]
        if "task.reward=my_rewards:score" in args:  # the user's module on PYTHONPATH, in a real interpreter
            proc = forked.run([sys.executable, "-m", "moe_rl.train", *argv], capture_output=True, text=True,
                                  cwd=ROOT, timeout=600, env=child_env(PYTHONPATH=str(tmp_path)))
        else:  # the same main(argv) in this process (`in_process.run_main`)
            proc = run_main(importlib.import_module("moe_rl.train"), argv)
        one_line_error(proc, prog, *needles)
        _nothing_written(out)


# --------------------------------------------------------------------------- engines


def _rollout_prompt_ids(run_dir: Path) -> list[list[int]]:
    rows = [json.loads(line) for f in sorted((run_dir / "rollouts").glob("step_*.jsonl")) for line in f.open()]
    return [r["prompt_ids"] for r in rows]


class _Runs(dict):
    """Run directories by architecture, each trained on first use: 3 RSPO steps with the
    vLLM sampler on a chat dataset, evaluated at the end."""

    def __init__(self, hf_dirs: dict[str, Path], data: dict[str, Path], factory) -> None:
        super().__init__()
        self.hf_dirs, self.data, self.factory = hf_dirs, data, factory

    def __missing__(self, arch: str) -> Path:
        out = self.factory.mktemp(f"run_{arch}")
        proc = _train(out, f"run.init_checkpoint={self.hf_dirs[arch]}", f"task.data_path={self.data['messages']}",
                      "sampler.backend=vllm", "logging.rollouts_every=1", f"task.eval_data_path={self.data['prompt']}",
                      "run.eval_every=3", "run.eval_max_problems=4")
        assert proc.returncode == 0, proc.stderr[-3000:]
        self[arch] = out / "hf_rspo"
        return self[arch]


@pytest.fixture(scope="module")
def trained(hf_dirs, data, tmp_path_factory) -> _Runs:
    pytest.importorskip("vllm")
    return _Runs(hf_dirs, data, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("arch", ARCHS)
def test_rl_recipe_with_vllm_sees_chat_ids_and_evaluates(arch, hf_dirs, data, trained):
    """The prompts the sampler and the learner saw are the chat-templated ids of the rows."""
    tok = load_tokenizer("auto", hf_dirs[arch])
    rows = [json.loads(line) for line in data["messages"].open()]
    templated = {tuple(_ids(tok.hf.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)))
                 for r in rows}
    seen = _rollout_prompt_ids(trained[arch])
    assert len(seen) == 3 * 4 * 4 and all(tuple(ids) in templated for ids in seen)
    metrics = [json.loads(line) for line in (trained[arch] / "metrics.jsonl").open()]
    assert len(metrics) == 3 and metrics[-1]["eval/problems"] == 4
    assert 0 <= metrics[-1]["eval/greedy_acc"] <= metrics[-1]["eval/pass@4"] + 1 and "eval/pass@1" in metrics[-1]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("arch", ARCHS)
def test_export_keeps_the_checkpoints_files_and_reloads(arch, hf_dirs, trained, tmp_path):
    """The trainer's export and tools/convert_checkpoint.py --to hf: the source's config.json,
    generation config and tokenizer files byte for byte; transformers loads it."""
    src, out = hf_dirs[arch], trained[arch] / "hf"
    _check_export(src, out)
    final = sorted((trained[arch] / "checkpoints").glob("step_*"))[-1]
    tool = run_main(load_tool("tools/convert_checkpoint.py"),
                    ["--no-progress", "--to", "hf", "--src", str(final), "--dst", str(tmp_path / "hf")])
    assert tool.returncode == 0, tool.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(p.name for p in out.iterdir())
    for f in out.iterdir():
        assert (tmp_path / "hf" / f.name).read_bytes() == f.read_bytes(), f.name


def _check_export(src: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == json.loads((src / "config.json").read_text())["architectures"][0]
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == CHATML


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_rl_recipe_with_transformers_sampler_and_r3(arch, hf_dirs, data, tmp_path, megatron_world):
    """(In this process: `moe_rl.train`'s main, as its command line runs it.)"""
    argv = _train_argv(tmp_path, f"run.init_checkpoint={hf_dirs[arch]}", f"task.data_path={data['prompt']}",
                       "rl.replay=R3", "run.export_hf=false", "sampler.max_new_tokens=16")
    proc = run_main(importlib.import_module("moe_rl.train"), argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "hf_rspo" / "metrics.jsonl").open()]
    assert len(metrics) == 3
    # R3 replays the sampler's routing: the learner's routing disagrees with it nowhere
    assert all(m["routing/sampler_used_disagree_any"] == 0 for m in metrics), metrics


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("arch", ARCHS)
def test_mismatch_tool_and_eval_on_the_trained_checkpoint(arch, trained, data, tmp_path):
    """The exported checkpoint through tools/measure_mismatch.py (its tokenizer and chat
    template, prompts from a JSONL): vLLM and transformers in fp32 agree with the fp32
    learner to rounding; and `python -m moe_rl.eval` on it alone."""
    from moe_rl.mismatch.run import MeasureConfig, measure, prepare
    from moe_rl.mismatch.settings import Setting

    ckpt = trained[arch] / "hf"
    mc = MeasureConfig(checkpoint=str(ckpt), settings=(Setting("vllm", "fp32"), Setting("transformers", "fp32")),
                       prompts_file=str(data["prompt"]), num_prompts=6, samples_per_prompt=2, max_new_tokens=16,
                       progress=False)
    prep = prepare(mc)
    tok = load_tokenizer("auto", ckpt)
    first = json.loads(data["prompt"].open().readline())["prompt"]
    assert prep.prompt_ids[0] == _ids(tok.hf.apply_chat_template([{"role": "user", "content": first}],
                                                                 add_generation_prompt=True, tokenize=True))
    results, _ = measure(mc, prep)
    for name, r in results.items():
        s = r.summary()
        assert s["mismatch/num_tokens"] > 50, name
        assert s["mismatch/dp_max"] < 1e-5, (name, s["mismatch/dp_max"])
        assert float(r.tokens.valid("log_ratio").abs().max()) < 1e-4, name
    out = tmp_path / "eval.json"
    proc = run_main(importlib.import_module("moe_rl.eval"),
                    ["--checkpoint", str(ckpt), "--data", str(data["prompt"]), "--k", "2", "--max-problems", "3",
                     "--out", str(out), "sampler.backend=transformers", "sampler.max_new_tokens=8"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["eval/problems"] == 3 and {"eval/greedy_acc", "eval/pass@1", "eval/pass@2"} <= result.keys()
