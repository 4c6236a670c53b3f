"""Issue 48: a Hugging Face recipe per program (examples/hf_{sft,dpo,rm,ppo}.yaml, beside
hf_rspo.yaml), none with a model section. Each is run as the README documents it, for 2 real
steps in this process (`in_process.run_main`), on one random-init Qwen3-MoE directory with
its own tokenizer and chat template (`hf_fixtures`); the documented chain included (DPO from
the SFT run's export, PPO's critic from the reward model's checkpoint). These commands run
here rather than as a --check in test_docs_commands.py (its RUN_FOR_REAL). Also: the
recipe-conflict error names the program's HF recipe, and a lower optimizer.lr than the
recipe's min_lr says to lower optimizer.min_lr with it.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

from moe_rl_testing import ROOT
from moe_rl_testing.doc_commands import DocCommand, doc_commands, replace_paths
from moe_rl_testing.hf_fixtures import make_hf_model_dir, write_math_jsonl
from moe_rl_testing.in_process import run_main
from tests.integration.test_cli_errors import one_line_error

RECIPES = {"sft": "examples/hf_sft.yaml", "dpo": "examples/hf_dpo.yaml", "rm": "examples/hf_rm.yaml",
           "ppo": "examples/hf_ppo.yaml"}
SMALL = {  # test sizes on top of the documented command: 2 steps, tiny batches and lengths
    "sft": ["sft.batch_size=4", "sft.eval_problems=4", "parallel.micro_batch_size=4"],
    "dpo": ["dpo.batch_size=2", "parallel.micro_batch_size=4"],
    "rm": ["rm.batch_size=2", "parallel.micro_batch_size=4"],
    "ppo": ["rl.prompts_per_step=4", "sampler.max_new_tokens=4", "sampler.backend=transformers",
            "critic.warmup_steps=1", "task.reward_timeout_s=0", "run.export_hf=false", "parallel.micro_batch_size=4"],
}
PREFS = [{"prompt": "What is 3 + 10?", "chosen": "The answer is \\boxed{13}.", "rejected": "The answer is \\boxed{14}."},
         {"messages": [{"role": "user", "content": "What is 4 + 12?"}],
          "chosen": [{"role": "assistant", "content": "\\boxed{16}"}], "rejected": "\\boxed{61}"},
         {"prompt": "Reverse the digits of 1234.", "chosen": "4321", "rejected": "4312"},
         {"prompt": "What is 5 + 14?", "chosen": "19", "rejected": "18"}]


def documented(recipe: str) -> DocCommand:
    """The README's one command of `recipe`."""
    found = [c for c in doc_commands(ROOT / "README.md", ROOT) if recipe in c.argv]
    assert len(found) == 1, f"README.md documents {len(found)} commands of {recipe}, expected 1"
    return found[0]


class _Runs(dict):
    """Run directories by program, each run on first use as documented (README.md), with
    the stand-ins for its paths and SMALL's sizes."""

    def __init__(self, out: Path, stand_ins: dict[str, str]) -> None:
        super().__init__()
        self.out, self.stand_ins = out, stand_ins

    def __missing__(self, program: str) -> Path:
        if program == "dpo":  # the documented chains: the SFT run's export, the reward model's checkpoint
            self.stand_ins["runs/hf_sft/hf"] = str(self["sft"] / "hf")
        if program == "ppo":
            self.stand_ins["runs/hf_rm/checkpoints/step_000050"] = str(self["rm"] / "checkpoints" / "step_000002")
        argv = replace_paths(documented(RECIPES[program]).argv, self.stand_ins)
        assert argv[:2] == ("python", "-m"), argv
        ran = run_main(importlib.import_module(argv[2]), [*argv[3:], *SMALL[program], "run.steps=2",
                                                          f"run.output_dir={self.out}", "logging.progress=false",
                                                          "logging.tensorboard=false"])
        assert ran.returncode == 0, ran.stderr[-3000:]
        self[program] = self.out / f"hf_{program}"
        return self[program]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_model_dir(tmp_path_factory.mktemp("hf_recipes") / "qwen3_moe")


@pytest.fixture(scope="module")
def runs(megatron_world, hf_dir, tmp_path_factory) -> _Runs:
    data = tmp_path_factory.mktemp("hf_recipes_data")
    prefs = data / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(r) + "\n" for r in PREFS))
    stand_ins = {"DIR": str(hf_dir), "train.jsonl": str(write_math_jsonl(data / "train.jsonl", n=8, messages=True)),
                 "prefs.jsonl": str(prefs)}
    return _Runs(tmp_path_factory.mktemp("hf_recipes_runs"), stand_ins)


def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").open())}


def _trained(rows: dict[int, dict]) -> None:
    """Steps 1 and 2 logged, each with a finite loss."""
    assert {1, 2} <= rows.keys() and max(rows) == 2, sorted(rows)
    assert all(math.isfinite(rows[s]["learner/loss"]) for s in (1, 2)), rows


def _model_of(run: Path, hf_dir: Path) -> None:
    """The run's model is config.json's (the recipe has no model section)."""
    import yaml

    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    hf = json.loads((hf_dir / "config.json").read_text())
    assert (model["num_experts"], model["num_layers"], model["vocab_size"], model["max_position_embeddings"]) == \
           (hf["num_local_experts"], hf["num_hidden_layers"], hf["vocab_size"], hf["max_position_embeddings"])


def _exported(out: Path, src: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name


@pytest.mark.parametrize("program", RECIPES)
def test_recipe_has_no_model_section(program):
    import yaml

    assert "model" not in yaml.safe_load((ROOT / RECIPES[program]).read_text())


def test_hf_sft_chat_templated_and_exported(runs, hf_dir):
    """SFT's prompts are the chat template's ids, as RL's and DPO's are; the run ends with
    <run>/hf, the source's files kept."""
    from moe_rl.cli import load_resolved
    from moe_rl.preflight import load_prompt_encoder
    from moe_rl.programs.sft import encode_problems
    from moe_rl.tasks import make_task

    run = runs["sft"]
    rows = _rows(run)
    _trained(rows)
    assert "eval/expected_reward" in rows[0]
    _model_of(run, hf_dir)
    _exported(run / "hf", hf_dir)
    cfg = load_resolved(ROOT / RECIPES["sft"], [f"run.init_checkpoint={hf_dir}",
                                                f"task.data_path={runs.stand_ins['train.jsonl']}"])
    tok, encoder = load_prompt_encoder(cfg)
    task = make_task(cfg.task)
    problem = task.problems[0]
    batch = encode_problems([problem], task, encoder, 1)
    prompt = tok.hf.apply_chat_template([dict(m) for m in problem.messages], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    p, n = int(batch.prompt_lens_B[0]), int(batch.response_lens_B[0])
    assert batch.tokens_BS[0, :p].tolist() == prompt
    assert batch.tokens_BS[0, p:p + n].tolist() == tok.encode(task.completion(problem), eos=True)


def test_hf_dpo_from_the_sft_export(runs):
    run = runs["dpo"]
    rows = _rows(run)
    _trained(rows)
    assert all("rewards/accuracies" in rows[s] for s in (1, 2))
    _exported(run / "hf", runs["sft"] / "hf")


def test_hf_rm(runs, hf_dir):
    run = runs["rm"]
    _trained(_rows(run))
    _model_of(run, hf_dir)
    assert (run / "checkpoints" / "step_000002").is_dir()


def test_hf_ppo_with_the_reward_models_critic(runs, hf_dir):
    """critic.warmup_steps=1: step 1 trains the critic alone, step 2 both."""
    run = runs["ppo"]
    rows = _rows(run)
    assert sorted(rows) == [1, 2]
    assert [rows[s]["policy/updates"] > 0 for s in (1, 2)] == [False, True]
    assert all(rows[s]["critic/updates"] > 0 and math.isfinite(rows[s]["critic/value_loss"]) for s in (1, 2))
    _model_of(run, hf_dir)


@pytest.mark.parametrize(("module", "recipe", "hf_recipe"), [
    ("moe_rl.sft", "tiny_sft", "hf_sft"), ("moe_rl.dpo", "tiny_dpo", "hf_dpo"),
    ("moe_rl.reward_model", "tiny_rm", "hf_rm"), ("moe_rl.train", "tiny_ppo", "hf_ppo"),
    ("moe_rl.train", "tiny_rspo", "hf_rspo")])
def test_model_conflict_names_the_programs_hf_recipe(hf_dir, module, recipe, hf_recipe):
    ran = run_main(importlib.import_module(module), ["--config", f"examples/{recipe}.yaml",
                                                     f"run.init_checkpoint={hf_dir}", "--check"])
    one_line_error(ran, f"python -m {module}", "the recipe disagrees with", "model.max_position_embeddings=64",
                   "remove these keys", f"start from examples/{hf_recipe}.yaml")


def test_a_conflict_from_the_command_line_suggests_no_other_recipe(hf_dir):
    ran = run_main(importlib.import_module("moe_rl.dpo"), ["--config", RECIPES["dpo"], f"run.init_checkpoint={hf_dir}",
                                                           "model.num_experts=8", "--check"])
    one_line_error(ran, "python -m moe_rl.dpo", "model.num_experts=8 (config.json gives 16)", "remove these keys")
    assert "start from" not in ran.stderr


def test_lr_below_the_recipes_min_lr_says_to_lower_min_lr():
    ran = run_main(importlib.import_module("moe_rl.dpo"), ["--config", "examples/tiny_dpo.yaml", "optimizer.lr=1e-7",
                                                           "--check"])
    one_line_error(ran, "python -m moe_rl.dpo", "optimizer.min_lr=5e-05 is above optimizer.lr=1e-07",
                   "lower optimizer.min_lr with it")
