"""`repeat`: write an operand K times over, the synthetic task with a long tail of answers.

    repeat    "rep 4821 x3 ="   -> " 482148214821"     the operand's digits, K times in a row

The format is the other digit tasks' (`synthetic.py`): with the shipped tokenizer a d-digit
operand with K copies is a prompt of d + 6 tokens (d + 7 when K has two digits: "r", "e",
"p", " ", the digits, " x", K's digits, " =") and an answer of d*K + 1 tokens (the space,
then one token per digit), then EOS. The operand is drawn as every digit task's is
(`task.min_digits`..`task.max_digits` digits, uniform, no leading zero); the reward is exact
match of the stripped response.

K, the number of copies, is what `task.length_profile` sets:

- `uniform`: K uniform in [1, 3], so with 3-5 digits the answers are 4-16 tokens long, as
  short and as even as the other digit tasks'.
- `long_tail`: K = 1 with probability 0.5, 2 with 0.3, and otherwise (0.2) log-uniform over
  [3, 50] (K = floor(exp(U(log 3, log 51))): P(K >= k) falls as log(51/k)), so most answers
  are short and a few are hundreds of tokens long: the shape of reasoning RL's response
  lengths, where the longest responses of a batch decide how long its rollout takes.

Measured over 100,000 problems of the long-tail recipe (`examples/tiny_long_tail.yaml`:
3-5 digits; `RepeatTask(3, 5, "long_tail").sample(100_000, seed=0)`), answer tokens (the
space and the digits, EOS excluded): 50% are at most 6 (one copy), 80.8% at most 12, 90% at
most 46, 95% at most 97, 99% at most 181; 4.9% are over 100; the mean is 18.5 and the
longest 251 (the bound: 1 + max_digits * 50). With the default 4-6 digits: 70.2% at most 12,
6.5% over 100, mean 22.9, longest 301. The prompts stay short (at most 13 tokens at 3-5
digits), so a long problem is long because of what the policy must write.

Copying is what a tiny transformer learns first; stopping after exactly K copies of a long
answer (counting to 50) comes later, which leaves RL something to learn on the long
problems while the short ones are mostly solved: the shipped base
(`moe_rl/assets/long_tail_base`, examples/long_tail_sft.yaml) gets 96% of the answers of at
most 12 tokens right at temperature 1 and none over 100, with responses about as long as
the answers (bench/results/long_tail_base.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from moe_rl.tasks.base import Problem
from moe_rl.tasks.synthetic import DigitTask

if TYPE_CHECKING:
    from typing_extensions import Self

    from moe_rl.config import TaskConfig

UNIFORM_MAX_COPIES = 3
"""`uniform`: K uniform in [1, this]."""
LONG_TAIL_SHORT = ((1, 0.5), (2, 0.3))
"""`long_tail`: (K, probability) of the short problems; the rest of the mass is the tail."""
LONG_TAIL_MAX_COPIES = 50
"""`long_tail`: the tail's K is log-uniform over [3, this]."""


class RepeatTask(DigitTask):
    """Write the operand's digits K times in a row; K's law is the length profile's."""

    name = "repeat"
    keyword = "rep"
    length_profiles = ("uniform", "long_tail")

    def __init__(self, min_digits: int = 4, max_digits: int = 6, length_profile: str = "uniform") -> None:
        super().__init__(min_digits, max_digits)
        if length_profile not in self.length_profiles:
            raise ValueError(f"task {self.name}: length_profile must be one of {list(self.length_profiles)}, "
                             f"got {length_profile!r}")
        self.length_profile = length_profile

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> Self:
        return cls(cfg.min_digits, cfg.max_digits, cfg.length_profile)

    def __repr__(self) -> str:
        return (f"RepeatTask(min_digits={self.min_digits}, max_digits={self.max_digits}, "
                f"length_profile={self.length_profile!r})")

    @property
    def max_copies(self) -> int:
        """The largest K this profile draws."""
        return UNIFORM_MAX_COPIES if self.length_profile == "uniform" else LONG_TAIL_MAX_COPIES

    def copies(self, rng: np.random.Generator) -> int:
        """K for one problem, drawn from `rng` by the length profile's law."""
        if self.length_profile == "uniform":
            return int(rng.integers(1, UNIFORM_MAX_COPIES + 1))
        u = float(rng.random())
        for k, p in LONG_TAIL_SHORT:
            if u < p:
                return k
            u -= p
        lo, hi = LONG_TAIL_SHORT[-1][0] + 1, LONG_TAIL_MAX_COPIES
        k = int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))
        return min(max(k, lo), hi)  # (guards the float edges)

    def make_problem(self, rng: np.random.Generator) -> Problem:
        x = self.number(rng)
        k = self.copies(rng)
        return self.problem(f"{x} x{k}", x * k, digits=len(x), copies=k)
