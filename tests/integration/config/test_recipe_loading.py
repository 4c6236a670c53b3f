"""How a recipe becomes a Config at every entry point: load -> the model from config.json ->
validate; one-line errors for a malformed or misplaced recipe; shipped assets found from any
working directory; `--check`; one error line per torchrun world, not per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.cli import parse
from moe_rl.config import ConfigError, load_config, load_recipe
from moe_rl.config.shipped import PACKAGE_DIR, shipped_path
from moe_rl_testing import ROOT

HF_RSPO = ROOT / "examples" / "hf_rspo.yaml"
TINY_RSPO = ROOT / "examples" / "tiny_rspo.yaml"
TINY_SFT = ROOT / "examples" / "tiny_sft.yaml"
TINY_BASE = PACKAGE_DIR / "assets" / "tiny_base"
BROKEN_YAML = "rl:\n  objective: rspo\n   group_size: 4\n"  # line 3: indented under a scalar


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "TORCHDYNAMO_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def cli(module: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600, env=child_env())


def only_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def qwen_12_experts(tmp_path_factory) -> Path:
    """A Qwen3-MoE Hugging Face directory (config.json) with 12 experts: 12 is divisible by
    EP=3 while the recipe's default model (8 experts) is not."""
    from moe_rl_testing.hf_fixtures import qwen3_moe_config

    out = tmp_path_factory.mktemp("qwen12")
    hf = qwen3_moe_config(448, {"<|im_end|>": 2, "<|endoftext|>": 0}).to_dict()
    hf["num_experts"] = 12
    (out / "config.json").write_text(json.dumps(hf))
    return out


def _rl() -> type:
    from moe_rl.programs.rl.learner_role import LearnerRole

    return LearnerRole


def test_train_checks_the_layout_against_the_checkpoints_model(qwen_12_experts, capsys):
    base = ["--config", str(HF_RSPO), f"run.init_checkpoint={qwen_12_experts}", "task.tokenizer=shipped"]
    _, cfg = parse([*base, "parallel.expert_model_parallel_size=3"], "train", "", _rl)
    assert (cfg.model.num_experts, cfg.parallel.expert_model_parallel_size) == (12, 3)
    with pytest.raises(SystemExit) as e:
        parse([*base, "parallel.expert_model_parallel_size=5"], "train", "", _rl)
    assert e.value.code == 2
    assert only_line(capsys.readouterr().err) == (
        "train: config error: model.num_experts=12 is not divisible by parallel.expert_model_parallel_size=5; "
        "pick an EP size that divides it")
    with pytest.raises(ConfigError, match=r"model\.num_experts=8 is not divisible"):  # no checkpoint: the recipe's
        load_config(HF_RSPO, ["parallel.expert_model_parallel_size=3"])


def test_plan_checks_the_layout_against_the_checkpoints_model(qwen_12_experts):
    args = ["--config", str(HF_RSPO), f"run.init_checkpoint={qwen_12_experts}", "--json", "--no-suggest"]
    ok = cli("moe_rl.plan", *args, "parallel.expert_model_parallel_size=3", "--gpus", "3")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "is not divisible" not in ok.stderr
    bad = cli("moe_rl.plan", *args, "parallel.expert_model_parallel_size=5", "--gpus", "5")
    assert bad.returncode == 2
    assert only_line(bad.stderr) == ("python -m moe_rl.plan: config error: model.num_experts=12 is not divisible "
                                     "by parallel.expert_model_parallel_size=5; pick an EP size that divides it")


def test_load_recipe_does_not_validate_but_load_config_does():
    cfg, given = load_recipe(None, ["parallel.expert_model_parallel_size=3"])
    assert cfg.parallel.expert_model_parallel_size == 3 and "parallel.expert_model_parallel_size" in given
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible"):
        load_config(None, ["parallel.expert_model_parallel_size=3"])


@pytest.mark.parametrize("module", ["moe_rl.train", "moe_rl.sft", "moe_rl.plan"])
def test_malformed_yaml_is_one_line_naming_file_line_and_column(tmp_path, module):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text(BROKEN_YAML)
    proc = cli(module, "--config", str(recipe))
    assert proc.returncode == 2
    assert only_line(proc.stderr) == (f"python -m {module}: config error: {recipe}:3:14: "
                                      "mapping values are not allowed here")


def test_a_malformed_config_yaml_read_back_on_resume_names_its_line(tmp_path):
    from moe_rl.loop.rundir import read_saved_config

    saved = tmp_path / "config.yaml"
    saved.write_text(BROKEN_YAML)
    with pytest.raises(ConfigError, match=rf"{saved}:3:14: mapping values are not allowed here"):
        read_saved_config(saved)


def test_other_unreadable_recipes_are_one_line(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError, match=r"bin\.yaml is not UTF-8 text"):
        load_config(tmp_path / "bin.yaml")
    with pytest.raises(ConfigError, match=r"override 'run.name=\[': the value is not valid YAML"):
        load_config(None, ["run.name=["])


def test_a_directory_is_named_as_such_with_its_recipes(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "examples")
    message = str(e.value)
    assert message.startswith(f"recipe {ROOT / 'examples'} is a directory, not a YAML file; recipes in it: ")
    assert str(TINY_RSPO) in message and str(ROOT / "examples" / "gpu") not in message
    with pytest.raises(ConfigError, match=r"is a directory, not a YAML file; it holds no \.yaml recipe"):
        load_config(tmp_path)


def test_shipped_assets_resolve_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY_RSPO)  # run.init_checkpoint: moe_rl/assets/tiny_base
    assert cfg.run.init_checkpoint == str(TINY_BASE) and (TINY_BASE / "manifest.json").is_file()
    # the user's own paths stay relative to the working directory, existing or not
    assert load_config(TINY_RSPO, ["task.data_path=data/train.jsonl"]).task.data_path == "data/train.jsonl"
    assert shipped_path("moe_rl/assets/no_such_thing") == "moe_rl/assets/no_such_thing"
    # a user directory called moe_rl/ wins over the package
    (tmp_path / "moe_rl" / "assets" / "tiny_base").mkdir(parents=True)
    assert load_config(TINY_RSPO).run.init_checkpoint == "moe_rl/assets/tiny_base"


def test_every_recipe_names_only_shipped_or_absolute_paths():
    """No shipped recipe depends on being run from the repository root."""
    from moe_rl.config.shipped import SHIPPED_PATH_FIELDS

    for recipe in sorted((ROOT / "examples").rglob("*.yaml")):
        cfg, _ = load_recipe(recipe)
        for section, key in SHIPPED_PATH_FIELDS:
            value = getattr(getattr(cfg, section), key)
            relative = value and not Path(value).is_absolute() and value not in ("auto", "shipped", "none")
            assert not relative or value.startswith("moe_rl/"), f"{recipe.name}: {section}.{key}={value}"


def test_check_prints_one_line_from_any_directory(tmp_path):
    ok = cli("moe_rl.train", "--check", "--nproc", "2", "--config", str(TINY_RSPO),
             "parallel.expert_model_parallel_size=2", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert only_line(ok.stdout) == (f"recipe OK: rspo, 2 ranks (TP1 PP1 EP2 DP2), model 4 layers x 8 experts (top-2) "
                                    f"from {TINY_BASE}, 200 steps -> runs/tiny_rspo")
    bad = cli("moe_rl.train", "--check", "--nproc", "3", "--config", str(TINY_RSPO),
              "parallel.expert_model_parallel_size=2", cwd=tmp_path)
    assert bad.returncode == 2 and not bad.stdout
    assert "learner world size 3 is not divisible by expert-tensor x expert x pipeline parallel" in only_line(
        bad.stderr)


def test_sft_check(tmp_path):
    ok = cli("moe_rl.sft", "--check", "--config", str(TINY_SFT), f"sft.output={tmp_path}/base", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert only_line(ok.stdout).startswith("recipe OK: sft, 1 rank (TP1 PP1 EP1 DP1), model 4 layers x 8 experts")


@pytest.mark.multiproc
def test_torchrun_prints_a_config_error_once(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text(BROKEN_YAML)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "moe_rl.train", "--config", str(recipe)],
                          capture_output=True, text=True, timeout=600, env=child_env(), cwd=tmp_path)
    assert proc.returncode != 0
    line = f"python -m moe_rl.train: config error: {recipe}:3:14: mapping values are not allowed here"
    assert (proc.stdout + proc.stderr).count(line) == 1, proc.stderr[-3000:]


@pytest.mark.parametrize("script", ["launch_deepseek_v3.sh", "launch_qwen3_30b_a3b.sh"])
def test_launch_scripts_check_before_torchrun(tmp_path, script):
    """A typo'd override stops the launch script with the one --check line; torchrun (a stub
    here that records being started) never runs."""
    marker = tmp_path / "torchrun_started"
    (tmp_path / "torchrun").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (tmp_path / "torchrun").chmod(0o755)
    env = {**child_env(), "PATH": f"{tmp_path}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / "gpu" / script), "run.save_evry=10"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 2 and not marker.exists()
    assert only_line(proc.stderr) == ("python -m moe_rl.train: config error: unknown key run.save_evry; "
                                      "did you mean run.save_every?")


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "examples" / "gpu").glob("*.yaml")))
def test_gpu_recipes_ask_only_what_the_learner_builds_on_a_gpu(recipe, monkeypatch):
    """What the preflight checks of the learner on a CUDA machine holds for every shipped GPU
    recipe (glm45_air.yaml once asked for model.recompute=full, which the learner refuses)."""
    import torch

    from moe_rl.preflight import check_learner_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_learner_device(load_recipe(ROOT / "examples" / "gpu" / recipe)[0])
