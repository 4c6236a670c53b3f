"""Multi-turn tool episodes in real runs (issue #49): the shipped tool base on the calculator
task under torchrun with one learner rank and one engine rank (separate placement, the
engines a step ahead: one-step-off, and in-flight updates with partial rollouts), the transformers sampler
recording routes: R3 replays every position of whole episodes exactly (the loud used =
replayed check), episodes call the tool and take several turns. And a transformers-made
Qwen3-MoE directory whose chat template offers tools runs the tool task through the
documented Hugging Face recipe."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moe_rl_testing import ROOT
from moe_rl_testing.async_runs import train

RECIPE = ROOT / "examples" / "tiny_tools.yaml"
TOOL_TOKENIZER = ROOT / "moe_rl" / "assets" / "tool_tokenizer"


SCHEDULES = {
    "one-step-off": ["rl.max_staleness=1"],
    "inflight-partial": ["rl.max_staleness=2", "rl.inflight_weight_updates=true", "rl.partial_rollouts=true",
                         "rl.inflight_segment_tokens=16"],
}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_r3_replays_whole_episodes_exactly_with_a_separate_engine_running_ahead(tmp_path, schedule):
    rows = train(RECIPE, ["sampler.backend=transformers", "sampler.placement=separate", "sampler.engine_ranks=1",
                          *SCHEDULES[schedule], "rl.rollout_correction=tis", "rl.replay=R3",
                          "rl.prompts_per_step=4", "rl.group_size=4", "run.steps=3", "run.save_every=0",
                          "logging.progress=false", "logging.tensorboard=false"], tmp_path, "r3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["routing/sampler_used_disagree_any"] == 0 for r in rows)
    assert max(r["rollout/turns_mean"] for r in rows) > 1.0
    assert max(r["rollout/tool_calls_mean"] for r in rows) > 0.0
    assert all(0.0 <= r["rollout/truncated_frac"] <= 1.0 and r["rollout/tool_parse_errors"] >= 0 for r in rows)


def tool_hf_dir(out: Path) -> Path:
    """A random-init Qwen3-MoE over the tool tokenizer's 512 ids, with the tokenizer and its
    tool-calling chat template in the directory (as a Hugging Face checkpoint ships them)."""
    import torch
    import transformers

    from moe_rl_testing.hf_fixtures import qwen3_moe_config

    ids = json.loads((TOOL_TOKENIZER / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in ids}
    cfg = qwen3_moe_config(512, ids)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TOOL_TOKENIZER / name, out / name)
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_a_hugging_face_directory_with_a_tool_template_runs_the_tool_task(megatron_world, tmp_path):
    """examples/hf_rspo.yaml (vLLM) with the directory's own tokenizer: the prompts show the
    `add` tool through its chat template, episodes run (`rollout/turns_mean`), 2 steps."""
    import moe_rl.train
    from moe_rl_testing.in_process import run_main

    hf = tool_hf_dir(tmp_path / "hf")
    ran = run_main(moe_rl.train, ["--config", str(ROOT / "examples" / "hf_rspo.yaml"), f"run.init_checkpoint={hf}",
                                  "task.name=calculator", "task.tokenizer=auto", "rl.max_turns=3",
                                  "rl.max_turn_tokens=12", "sampler.max_new_tokens=48", "rl.num_minibatches=1",
                                  "run.steps=2", f"run.output_dir={tmp_path}", "run.name=hf_tools",
                                  "logging.rollouts_every=1", "logging.progress=false", "logging.tensorboard=false",
                                  "run.export_hf=false"])
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "hf_tools" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/turns_mean"] >= 1 for r in rows)
    dumps = sorted((tmp_path / "hf_tools" / "rollouts").glob("step_*.jsonl"))
    assert dumps, "no rollout dump"
    row = json.loads(dumps[0].read_text().splitlines()[0])
    from moe_rl.tokenization import load_tokenizer

    prompt = load_tokenizer(str(hf)).hf.decode(row["prompt_ids"])
    assert '"name": "add"' in prompt and "<tools>" in prompt  # the tool's schema, through the template
