"""Synthetic digit tasks a ~1M-parameter MoE learns on a CPU in minutes.

Every task uses one fixed format: the prompt is `"<keyword> <operands> ="` and the
completion is a space followed by the answer, then EOS:

    reverse   "rev 48213 ="     -> " 31284"     digits in reverse order (zeros kept)
    sort      "sort 48213 ="    -> " 12348"     digits in ascending order
    add       "add 4821+139 ="  -> " 4960"      the sum, in decimal

With the shipped tokenizer every digit is one token and the keywords and " =" are one token
each, so a d-digit reverse/sort prompt is d + 3 tokens and its answer d + 1 (+ EOS); an add
prompt with operands of a and b digits is a + b + 4. The leading space keeps token
boundaries stable: `encode(prompt) + encode(completion) == encode(prompt + completion)`.

A k-digit operand is uniform over k-digit numbers (no leading zero; k = 1 allows 0), with k
uniform in [min_digits, max_digits]. The reward is exact match of the stripped response.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from moe_rl.tasks.base import Problem, Task, as_rng, check_count, clean_response

if TYPE_CHECKING:
    from typing_extensions import Self

    from moe_rl.config import TaskConfig

# int64 holds every 18-digit number; longer operands would not fit a token budget anyway.
MAX_DIGITS = 18


class DigitTask(Task):
    """Shared machinery: operand sampling, the prompt/completion format, exact-match reward."""

    keyword: ClassVar[str]

    def __init__(self, min_digits: int = 4, max_digits: int = 6) -> None:
        if not 1 <= min_digits <= max_digits <= MAX_DIGITS:
            raise ValueError(
                f"task {self.name}: need 1 <= min_digits <= max_digits <= {MAX_DIGITS}, "
                f"got min_digits={min_digits}, max_digits={max_digits}"
            )
        self.min_digits = min_digits
        self.max_digits = max_digits

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> Self:
        return cls(cfg.min_digits, cfg.max_digits)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_digits={self.min_digits}, max_digits={self.max_digits})"

    def sample(self, n: int, seed: int | np.random.Generator) -> list[Problem]:
        rng = as_rng(seed)
        return [self.make_problem(rng) for _ in range(check_count(n))]

    def completion(self, problem: Problem) -> str:
        return f" {problem.answer}"

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if clean_response(response) == problem.answer else 0.0

    def number(self, rng: np.random.Generator) -> str:
        """A random operand with a random number of digits in [min_digits, max_digits]."""
        k = int(rng.integers(self.min_digits, self.max_digits + 1))
        low = 0 if k == 1 else 10 ** (k - 1)
        return str(int(rng.integers(low, 10**k)))

    def problem(self, operands: str, answer: str, **meta: object) -> Problem:
        return Problem(
            prompt=f"{self.keyword} {operands} =",
            answer=answer,
            meta={"task": self.name, **meta},
        )

    @abstractmethod
    def make_problem(self, rng: np.random.Generator) -> Problem:
        """One problem drawn from `rng`."""


class ReverseTask(DigitTask):
    """Write the operand's digits in reverse order."""

    name = "reverse"
    keyword = "rev"

    def make_problem(self, rng: np.random.Generator) -> Problem:
        x = self.number(rng)
        return self.problem(x, x[::-1], digits=len(x))


class SortTask(DigitTask):
    """Write the operand's digits in ascending order."""

    name = "sort"
    keyword = "sort"

    def make_problem(self, rng: np.random.Generator) -> Problem:
        x = self.number(rng)
        return self.problem(x, "".join(sorted(x)), digits=len(x))


class AddTask(DigitTask):
    """Add two operands; set min/max_digits to 1-3 for the "small numbers" version."""

    name = "add"
    keyword = "add"

    def make_problem(self, rng: np.random.Generator) -> Problem:
        a, b = self.number(rng), self.number(rng)
        return self.problem(f"{a}+{b}", str(int(a) + int(b)), digits=max(len(a), len(b)))
