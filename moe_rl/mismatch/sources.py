"""Where a mismatch measurement gets its weights and prompts, checked before any engine
starts (no megatron, no vLLM here).

    ckpt = resolve_checkpoint("moe_rl/assets/tiny_base")    # megatron dir or HF dir
    prompts = read_prompt_file("prompts.jsonl")              # strict: first bad line raises

Prompt files use the dataset task's JSONL line format (one JSON object per line with a
non-empty string `prompt`; `answer` and other keys are allowed and ignored); a malformed
line raises a `MeasureError` naming the file and its 1-based line. A measurement quietly
taken on fewer prompts than the user listed is worse than none. Blank lines are skipped; a file with no
prompt at all is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moe_rl.config import Config, ConfigError, RunConfig, load_saved_config, validate
from moe_rl.mismatch.settings import MeasureError, ScoringLayout

SHIPPED_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "tiny_base"
# A learner checkpoint (moe_rl.learner.checkpoint / moe_rl.convert.dcp) holds these.
_MEGATRON_FILES = ("moe_rl.json", "metadata.json", ".metadata", "config.yaml")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory, its kind and the run config it implies."""

    path: Path
    kind: Literal["megatron", "hf"]
    cfg: Config
    """The checkpoint's config.yaml (megatron), or defaults with the model of config.json (HF)."""


def resolve_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Check that `path` is a learner checkpoint or a Qwen3-MoE Hugging Face directory."""
    p = Path(path)
    if not p.exists():
        raise MeasureError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        raise MeasureError(f"checkpoint {p} is not a directory")
    if (p / "config.json").is_file():
        from moe_rl.convert import ConvertError, HFCheckpoint

        try:
            with HFCheckpoint(p) as hf:
                model = hf.model_config()
        except (ConvertError, NotImplementedError, ValueError) as e:
            raise MeasureError(f"checkpoint {p}: {e}") from e
        cfg = Config(model=model, run=RunConfig(init_checkpoint=str(p.resolve())))
        return Checkpoint(p.resolve(), "hf", cfg)
    missing = [n for n in _MEGATRON_FILES if not (p / n).is_file()]
    if missing:
        raise MeasureError(
            f"checkpoint {p} is neither a learner checkpoint (lacks {', '.join(missing)}) nor a "
            "Hugging Face directory (no config.json)"
        )
    try:
        cfg = load_saved_config(p / "config.yaml")
    except ConfigError as e:
        raise MeasureError(f"checkpoint {p}: config.yaml: {e}") from e
    return Checkpoint(p.resolve(), "megatron", cfg)


def check_layout(cfg: Config, layout: ScoringLayout) -> None:
    """The learner layout against the model (expert / head counts) before anything runs."""
    run_cfg = dataclasses.replace(cfg, parallel=layout.parallel_config(cfg.parallel))
    try:
        validate(run_cfg, world_size=layout.nproc)
    except ConfigError as e:
        raise MeasureError(f"learner layout {layout.name}: {e}") from e


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """Prompt text and where it came from ("file.jsonl:3", "task reverse #5")."""

    text: str
    origin: str


def _line_error(path: Path, line_no: int, why: str) -> MeasureError:
    return MeasureError(f"{path}:{line_no}: {why}")


def _parse_prompt_line(raw: bytes, path: Path, line_no: int) -> str | None:
    """The prompt on one line, None for a blank line; MeasureError naming the line otherwise."""
    try:
        # The first line may start with a byte-order mark (files saved by Windows tools).
        text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise _line_error(path, line_no, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise _line_error(path, line_no, f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise _line_error(path, line_no, f"expected a JSON object with a \"prompt\", got {type(record).__name__}")
    if "prompt" not in record:
        keys = ", ".join(sorted(record)) or "none"
        raise _line_error(path, line_no, f"no \"prompt\" key (keys: {keys}); every line needs a non-empty \"prompt\" string")
    prompt = record["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _line_error(path, line_no, f"\"prompt\" must be a non-empty string, got {prompt!r:.60}")
    return prompt


def read_prompt_file(path: str | os.PathLike) -> list[Prompt]:
    """Every prompt of a JSONL file, in file order (strict: see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise MeasureError(f"prompt file {p} does not exist")
    if not p.is_file():
        raise MeasureError(f"prompt file {p} is not a file")
    prompts = []
    with open(p, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            text = _parse_prompt_line(raw, p, line_no)
            if text is not None:
                prompts.append(Prompt(text, f"{p}:{line_no}"))
    if not prompts:
        raise MeasureError(f"prompt file {p} is empty: no prompts (expected one JSON object with a \"prompt\" per line)")
    return prompts


def task_prompts(cfg: Config, task_name: str, n: int, seed: int) -> list[Prompt]:
    """`n` prompts drawn from a registered task (its other settings from the checkpoint's
    task section, e.g. the digit range of `reverse`)."""
    from moe_rl.tasks import TASKS, make_task

    if task_name not in TASKS:
        raise MeasureError(f"unknown task {task_name!r}; choose one of {', '.join(TASKS)} or pass --prompts FILE.jsonl")
    try:
        task = make_task(dataclasses.replace(cfg.task, name=task_name))
    except (ValueError, FileNotFoundError) as e:
        raise MeasureError(f"task {task_name}: {e}") from e
    return [Prompt(pr.prompt, f"task {task_name} #{i}") for i, pr in enumerate(task.sample(n, seed))]


def encode_prompts(prompts: list[Prompt], encoder, max_new_tokens: int, max_positions: int) -> list[list[int]]:
    """Token ids per prompt (`encoder`: a `moe_rl.tokenization.PromptEncoder`: the chat
    template when one applies); a prompt that encodes to nothing, or leaves no room for
    `max_new_tokens` within the model's positions, is an error naming its origin."""
    from moe_rl.tasks.base import Problem

    out = []
    for pr in prompts:
        ids = encoder.encode(Problem(pr.text, ""))
        if not ids:
            raise MeasureError(f"{pr.origin}: the prompt encodes to no tokens")
        if len(ids) + max_new_tokens > max_positions:
            raise MeasureError(
                f"{pr.origin}: prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"model's {max_positions} positions; shorten it or lower --max-new-tokens"
            )
        out.append(ids)
    return out
