"""What every task is: a seeded prompt generator plus a verifier that scores a response.

A task never sees tokens. It hands out `Problem`s (prompt text and reference answer) and
scores response *text* with a reward in [0, 1]; tokenization lives in `tokenizer.py`, so a
task works unchanged with the shipped tiny tokenizer or a real model's own.

Convention shared by all tasks: the policy's completion is appended to the prompt verbatim,
so `prompt + completion(problem)` is the text an ideal policy produces, followed by EOS.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

# What a decoded response may carry after the answer when special tokens are not skipped.
_TRAILING_SPECIALS = ("</s>", "<pad>")


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    `meta` carries task-specific details for logging (operand length, source line) and
    `messages` a chat conversation ([{"role", "content"}, ...]) when the data gave one
    instead of a prompt text (`prompt` is then its last user message, for logs); both are
    excluded from the hash so problems can be used as dict keys.
    """

    prompt: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    messages: tuple[Mapping[str, str], ...] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class Scores:
    """A batch's rewards, and how many of them were cut at `task.reward_timeout_s` (scored 0.0)."""

    values: list[float]
    timeouts: int = 0


def as_rng(seed: int | np.random.Generator) -> np.random.Generator:
    """An int seeds a fresh generator (reproducible); a Generator is used (and advanced) as is."""
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int or a numpy Generator, got {type(seed).__name__}")
    return np.random.default_rng(int(seed))


def clean_response(response: object) -> str:
    """The answer part of a decoded response: text before any EOS/pad marker, stripped.

    Anything that is not a string (a sampler bug, None) becomes "" and so scores 0.
    """
    if not isinstance(response, str):
        return ""
    for marker in _TRAILING_SPECIALS:
        response = response.split(marker, 1)[0]
    return response.strip()


class Task(ABC):
    """A verifiable-reward task. Subclasses are deterministic given the seed."""

    name: ClassVar[str]
    length_profiles: ClassVar[tuple[str, ...]] = ("uniform",)
    """The `task.length_profile` values the task honours (`make_task` refuses the others):
    `uniform`, its one range of answers, unless it can also draw a long tail of them."""

    @abstractmethod
    def sample(self, n: int, seed: int | np.random.Generator) -> list[Problem]:
        """`n` problems drawn with `seed` (same seed, same problems)."""

    def batch(self, step: int, n: int, seed: int) -> list[Problem]:
        """The `n` problems of batch `step` (0-based: training step step + 1), a pure function
        of (step, seed) so a resumed run sees the same ones; file-backed tasks override it to
        walk epochs. Drawn as the rollout's other draws are, from (seed, training step, 0)."""
        return self.sample(n, np.random.default_rng([seed, step + 1, 0]))

    @abstractmethod
    def reward(self, problem: Problem, response: str) -> float:
        """Score of a decoded response in [0, 1]; never raises on garbage."""

    @abstractmethod
    def completion(self, problem: Problem) -> str:
        """The ideal response text (without EOS), in the task's fixed answer format."""

    def rewards(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[float]:
        """`reward` over aligned lists (one response per problem, repeat problems for groups)."""
        return self.score(problems, responses).values

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> Scores:
        """`rewards` with the number of responses whose reward was cut for taking too long
        (the rollout's `reward/timeouts`); in this process, where nothing is cut, by default."""
        if len(problems) != len(responses):
            raise ValueError(f"{len(problems)} problems but {len(responses)} responses")
        return Scores([self.reward(p, r) for p, r in zip(problems, responses)])

    def close(self) -> None:
        """Release what scoring holds (the dataset task's reward process); nothing by default."""
        return None


def check_count(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"number of problems must be a non-negative int, got {n!r}")
    return int(n)


def sft_examples(task: Task, n: int, seed: int | np.random.Generator) -> list[tuple[str, str]]:
    """(prompt, completion) text pairs for a supervised warm start.

    The completion excludes EOS: the caller appends the tokenizer's EOS id (see
    `Tokenizer.encode_example`), which is what teaches the policy to stop.
    """
    return [(p.prompt, task.completion(p)) for p in task.sample(n, seed)]
