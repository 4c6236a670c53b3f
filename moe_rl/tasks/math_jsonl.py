r"""User math data: a JSONL file of {"prompt": ..., "answer": ...} scored by `math_verify`.

    {"prompt": "What is 17 * 3? Put the answer in \\boxed{}.", "answer": "51"}

`prompt` is used verbatim (any chat template is the data's business); `answer` may be a
string or a number, and may itself contain `\boxed{}` or GSM8K's `#### 51`. Other keys are
kept in `Problem.meta["fields"]`.

A malformed line (bad JSON or UTF-8, not an object, missing/empty/wrongly typed `prompt` or
`answer`) is logged as a warning with the file name and its 1-based line number, and
skipped; blank lines are ignored. A missing file, or one without a single valid line, is an
error naming the file, raised when the task is built (before any model exists).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_rl.tasks.base import Problem, Task, as_rng, check_count
from moe_rl.tasks.math_verify import math_reward, reference_answer

if TYPE_CHECKING:
    from moe_rl.config import TaskConfig

log = logging.getLogger(__name__)

# Per-line warnings stop here; the summary still counts every skipped line.
MAX_REPORTED_LINES = 20


class MalformedLineError(ValueError):
    """Why one JSONL line cannot be a problem."""


def parse_line(raw: bytes | str, line_no: int = 1) -> dict[str, Any] | None:
    """The record on one line, or None for a blank line; raises MalformedLineError otherwise."""
    if isinstance(raw, bytes):
        try:
            # The first line may start with a byte-order mark (files saved by Windows tools).
            raw = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise MalformedLineError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise MalformedLineError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise MalformedLineError(f"expected a JSON object, got {type(record).__name__}")
    prompt, answer = record.get("prompt"), record.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        raise MalformedLineError(f"'prompt' must be a non-empty string, got {_describe(prompt)}")
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise MalformedLineError(
            f"'answer' must be a non-empty string or a number, got {_describe(answer)}"
        )
    return {**record, "prompt": prompt, "answer": answer.strip()}


def _describe(value: object) -> str:
    if value is None:
        return "nothing"
    return f"{type(value).__name__} {value!r}"[:80]


def load_problems(path: str | os.PathLike) -> list[Problem]:
    """Every valid line of a JSONL file as a Problem; malformed lines are logged and skipped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"math_jsonl: data file {path} does not exist")
    problems: list[Problem] = []
    skipped = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                record = parse_line(raw, line_no)
            except MalformedLineError as e:
                skipped += 1
                if skipped <= MAX_REPORTED_LINES:
                    log.warning("%s:%d: %s; line skipped", path, line_no, e)
                continue
            if record is None:
                continue
            extra = {k: v for k, v in record.items() if k not in ("prompt", "answer")}
            meta = {"task": MathJsonlTask.name, "path": str(path), "line": line_no, "fields": extra}
            problems.append(Problem(record["prompt"], record["answer"], meta))
    if skipped:
        shown = "" if skipped <= MAX_REPORTED_LINES else f" (first {MAX_REPORTED_LINES} shown)"
        log.warning("%s: skipped %d malformed line(s)%s", path, skipped, shown)
    if not problems:
        raise ValueError(
            f"math_jsonl: {path} has no valid problems ({skipped} malformed line(s)); "
            'each line must be a JSON object with non-empty "prompt" and "answer"'
        )
    return problems


class MathJsonlTask(Task):
    r"""Problems from a JSONL file; reward 1 when the final answer matches numerically."""

    name = "math_jsonl"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.problems = load_problems(self.path)

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> MathJsonlTask:
        if not cfg.data_path:
            raise ValueError("task math_jsonl needs task.data_path (a JSONL file)")
        return cls(cfg.data_path)

    def __repr__(self) -> str:
        return f"MathJsonlTask({str(self.path)!r}, {len(self.problems)} problems)"

    def sample(self, n: int, seed: int | np.random.Generator) -> list[Problem]:
        """Without replacement while the file lasts: whole shuffled passes, then a partial one."""
        n, rng = check_count(n), as_rng(seed)
        order: list[int] = []
        while len(order) < n:
            order.extend(rng.permutation(len(self.problems)).tolist())
        return [self.problems[i] for i in order[:n]]

    def completion(self, problem: Problem) -> str:
        return f" \\boxed{{{reference_answer(problem.answer).strip()}}}"

    def reward(self, problem: Problem, response: str) -> float:
        return math_reward(response, problem.answer)
