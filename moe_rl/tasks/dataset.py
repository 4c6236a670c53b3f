r"""The `dataset` task: prompts and reference answers from a user's JSONL or Parquet file.

    {"prompt": "What is 17 * 3? Put the answer in \\boxed{}.", "answer": "51"}
    {"messages": [{"role": "user", "content": "Solve x + 2 = 5."}], "answer": 3,
     "metadata": {"source": "algebra"}}

Each row (one JSON object per line of a `.jsonl` file, blank lines ignored; or one row of a
`.parquet` file) holds either a prompt text under `task.prompt_key` or a chat list under
`task.messages_key` (`{"role", "content"}` items, roles system/user/assistant, at least one
user message), a reference answer under `task.answer_key` (a string, or a number, which
becomes its string) and optionally a mapping under `task.metadata_key`, handed to the
reward. The reward is `task.reward` (see `rewards.py`).

A bad row stops the build with a one-line `DatasetError` naming the file, the row (1-based
line for JSONL, 0-based row index for Parquet), the field and the fix: silently training
on part of a file is worse than failing before any model loads.

Scoring: with `task.reward_timeout_s` > 0 (the default, 60) the rewards run in this
process's reward worker (`reward_worker.py`), and a response whose reward takes longer is
cut and scores 0.0 (`Scores.timeouts`, logged as `reward/timeouts`); 0 scores here, with no
limit.

Order: `batch(step, n, seed)` walks the rows epoch by epoch (each epoch a fresh seeded
permutation, or file order with `task.shuffle=false`) as a pure function of the step, so a
resumed run sees exactly the rows the interrupted one would have.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_rl.tasks.answers import reference_answer
from moe_rl.tasks.base import Problem, Scores, Task, as_rng, check_count
from moe_rl.tasks.reward_worker import close_shared, shared_worker
from moe_rl.tasks.rewards import RewardFn, make_reward

if TYPE_CHECKING:
    from moe_rl.config import TaskConfig

SUFFIXES = (".jsonl", ".parquet")
ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """A data file or row that cannot become problems; one line with the fix."""


@dataclass(frozen=True)
class DatasetKeys:
    """Which fields of a row hold the prompt, the chat messages, the answer and the metadata."""

    prompt: str = "prompt"
    messages: str = "messages"
    answer: str = "answer"
    metadata: str = "metadata"

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> DatasetKeys:
        return cls(cfg.prompt_key, cfg.messages_key, cfg.answer_key, cfg.metadata_key)


# --- reading rows --------------------------------------------------------------------------


def read_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(row number, `file line N`/`file row N` for messages, raw record) for every row."""
    if path.suffix.lower() not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {path.suffix or '(no suffix)'!r}; "
                           f"use one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise DatasetError(f"{path}: no such file; check task.data_path")
    if path.suffix.lower() == ".parquet":
        yield from _parquet_rows(path)
    else:
        yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """One JSON value per non-blank line; bad UTF-8 or JSON is an error naming the line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path} line {line_no}"
            try:
                # Windows tools may start the file with a byte-order mark.
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                                   "save the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                yield line_no, where, json.loads(text)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                   "write one JSON object per line") from None


def _parquet_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """Every row of a Parquet file as a dict (structs become dicts, lists lists)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
        raise DatasetError(f"{path}: cannot read as Parquet ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]}); check the file") from None
    for i, record in enumerate(table.to_pylist()):
        yield i, f"{path} row {i}", record


# --- validating one row --------------------------------------------------------------------


def row_problem(record: Any, where: str, keys: DatasetKeys, meta: dict[str, Any]) -> Problem:
    """The Problem of one row; anything malformed is a DatasetError naming `where` and the field."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}; "
                           "write one object per row")
    prompt, messages = _prompt_or_messages(record, where, keys)
    answer = _answer(record, where, keys)
    metadata = _metadata(record, where, keys)
    return Problem(prompt=prompt, answer=answer, meta={**meta, "metadata": metadata},
                   messages=messages)


def _present(record: dict[str, Any], key: str) -> bool:
    """A key counts only with a value: Parquet gives a null where a row lacks a column."""
    return record.get(key) is not None


def _keys_hint(record: dict[str, Any]) -> str:
    names = ", ".join(str(k) for k in record if record[k] is not None)
    return names[:200] or "(none)"


def _prompt_or_messages(record: dict[str, Any], where: str,
                        keys: DatasetKeys) -> tuple[str, tuple[dict[str, str], ...] | None]:
    """(prompt text, None) for a prompt row; (last user message, messages) for a chat row."""
    has_prompt, has_messages = _present(record, keys.prompt), _present(record, keys.messages)
    if has_prompt and has_messages:
        raise DatasetError(f"{where}: has both {keys.prompt!r} and {keys.messages!r}; keep one "
                           "of them in each row")
    if not has_prompt and not has_messages:
        raise DatasetError(f"{where}: no {keys.prompt!r} (or {keys.messages!r}) key; the row has "
                           f"keys: {_keys_hint(record)}; set task.prompt_key")
    if has_prompt:
        prompt = record[keys.prompt]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(f"{where}: {keys.prompt!r} must be a non-empty string, got "
                               f"{_describe(prompt)}; fix the row")
        return prompt, None
    messages = _messages(record[keys.messages], where, keys.messages)
    return [m["content"] for m in messages if m["role"] == "user"][-1], messages


def _messages(value: Any, where: str, key: str) -> tuple[dict[str, str], ...]:
    """A validated chat: a non-empty list of {role, content} with at least one user turn."""
    if not isinstance(value, list | tuple) or not value:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of "
                           f'{{"role", "content"}} objects, got {_describe(value)}; fix the row')
    out = []
    for i, item in enumerate(value):
        field = f"{key}[{i}]"
        if not isinstance(item, Mapping):
            raise DatasetError(f"{where}: {field} must be an object with 'role' and 'content', "
                               f"got {_describe(item)}; fix the row")
        role, content = item.get("role"), item.get("content")
        if role not in ROLES:
            raise DatasetError(f"{where}: {field} has role {_describe(role)}; use one of "
                               f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DatasetError(f"{where}: {field} 'content' must be a string, got "
                               f"{_describe(content)}; fix the row")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise DatasetError(f"{where}: {key!r} has no 'user' message; add the question as a "
                           "user message")
    return tuple(out)


def _answer(record: dict[str, Any], where: str, keys: DatasetKeys) -> str:
    """The reference as a stripped string; numbers become their text, bools are rejected."""
    if keys.answer not in record:
        raise DatasetError(f"{where}: no {keys.answer!r} key; the row has keys: "
                           f"{_keys_hint(record)}; set task.answer_key")
    answer = record[keys.answer]
    if isinstance(answer, int | float) and not isinstance(answer, bool) and math.isfinite(answer):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DatasetError(f"{where}: {keys.answer!r} must be a non-empty string or a finite "
                           f"number, got {_describe(answer)}; fix the row")
    return answer.strip()


def _metadata(record: dict[str, Any], where: str, keys: DatasetKeys) -> dict[str, Any]:
    """The optional metadata mapping (empty when absent or null)."""
    metadata = record.get(keys.metadata)
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise DatasetError(f"{where}: {keys.metadata!r} must be an object (a mapping), got "
                           f"{_describe(metadata)}; wrap it, e.g. {{\"value\": ...}}, or drop it")
    return dict(metadata)


def _describe(value: object) -> str:
    if value is None:
        return "nothing"
    return " ".join(f"{type(value).__name__} {value!r}".split())[:80]


def load_problems(path: str | os.PathLike, keys: DatasetKeys = DatasetKeys()) -> list[Problem]:
    """Every row of a data file as a Problem, in file order; the first bad row is an error."""
    path = Path(path)
    problems = []
    for number, where, record in read_rows(path):
        meta = {"task": DatasetTask.name, "path": str(path), "line": number, "where": where}
        problems.append(row_problem(record, where, keys, meta))
    if not problems:
        raise DatasetError(f"{path}: no rows; add at least one row with {keys.prompt!r} (or "
                           f"{keys.messages!r}) and {keys.answer!r}")
    return problems


def _index(name: str, value: int) -> int:
    """A step or seed: numpy's seed sequences take non-negative ints only."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


# --- the task ------------------------------------------------------------------------------


class DatasetTask(Task):
    """Problems from a JSONL/Parquet file, scored by `task.reward`, walked epoch by epoch."""

    name = "dataset"

    def __init__(self, path: str | os.PathLike, *, keys: DatasetKeys = DatasetKeys(),
                 reward: str = "math", shuffle: bool = True, reward_timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.keys = keys
        self.shuffle = bool(shuffle)
        self.problems = load_problems(self.path, keys)
        self.reward_spec = reward
        self.reward_fn: RewardFn = make_reward(reward)  # (imported here too: a typo fails before any model loads)
        self.reward_timeout_s = float(reward_timeout_s)
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (seed, epoch) -> row order

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> DatasetTask:
        if not cfg.data_path:
            raise DatasetError("task dataset needs task.data_path (a .jsonl or .parquet file); "
                               "set task.data_path")
        return cls(cfg.data_path, keys=DatasetKeys.from_config(cfg), reward=cfg.reward,
                   shuffle=cfg.shuffle, reward_timeout_s=cfg.reward_timeout_s)

    def __repr__(self) -> str:
        return (f"DatasetTask({str(self.path)!r}, {len(self.problems)} problems, "
                f"reward={self.reward_spec!r}, shuffle={self.shuffle})")

    def sample(self, n: int, seed: int | np.random.Generator) -> list[Problem]:
        """A seeded draw (whole shuffled passes, then a partial one); training uses `batch`."""
        n, rng = check_count(n), as_rng(seed)
        order: list[int] = []
        while len(order) < n:
            order.extend(rng.permutation(len(self.problems)).tolist())
        return [self.problems[i] for i in order[:n]]

    def batch(self, step: int, n: int, seed: int) -> list[Problem]:
        """Rows [step*n, (step+1)*n) of perm_0 + perm_1 + ...: every row once per epoch."""
        step, n, seed = _index("step", step), check_count(n), _index("seed", seed)
        rows = len(self.problems)
        out = []
        for position in range(step * n, (step + 1) * n):
            epoch, i = divmod(position, rows)
            out.append(self.problems[int(self._order(seed, epoch)[i])])
        return out

    def epoch_of(self, step: int, n: int) -> float:
        """Epochs completed before `step` (fractional): 1.5 means halfway through the second."""
        return _index("step", step) * check_count(n) / len(self.problems)

    def _order(self, seed: int, epoch: int) -> np.ndarray:
        """Row order of one epoch, drawn from default_rng([seed, epoch]); the last two are kept."""
        key = (seed, epoch)
        if key not in self._orders:
            rows = len(self.problems)
            order = (np.random.default_rng([seed, epoch]).permutation(rows) if self.shuffle
                     else np.arange(rows))
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return self._orders[key]

    def completion(self, problem: Problem) -> str:
        return f" \\boxed{{{reference_answer(problem.answer).strip()}}}"

    def reward(self, problem: Problem, response: str) -> float:
        return self.score([problem], [response]).values[0]

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> Scores:
        """Rewards in the reward worker, each cut at `reward_timeout_s` (0: here, no limit)."""
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        if self.reward_timeout_s <= 0:
            return Scores([self.reward_fn(p, r) for p, r in zip(problems, responses)])
        values, cut = shared_worker().score(self.reward_spec, problems, responses, self.reward_timeout_s)
        return Scores(values, cut)

    def close(self) -> None:
        """Stop the reward worker (shared by this process's tasks; the next score restarts it)."""
        close_shared()
