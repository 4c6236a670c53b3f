r"""Reward functions of the `dataset` task, chosen by `task.reward` (see `make_reward`).

    reward = make_reward("math")                  # math-verify: final answer == reference
    reward = make_reward("my_rewards:score")      # a user function, imported now
    r = reward(problem, response_text)            # a float

`math` scores 1.0 when the response's final answer equals the reference answer according
to the `math-verify` library (symbolic and numeric comparison with sympy), else 0.0. The
reference may be a bare answer (`51`, `\frac{1}{2}`, `(1, 2]`), contain `\boxed{...}`, or
GSM8K's `#### 51`. From the response it takes the last `\boxed{}`, else a "final answer
is"/"answer:" phrase, else the last LaTeX or plain expression. Measured against the older
hand-written verifier (now `bench/archive/handwritten_math_verifier.py`) by `bench/archive/math_verify_compare.py`. It never raises:
garbage scores 0.0, and so does a response holding a number too big to build (a numeric
power tower such as 9^{9^{9}}, a 7-digit exponent, a 6-digit factorial), which would
otherwise stall sympy for minutes.

Timeouts: the dataset task scores in a reward worker process (`reward_worker.py`) that cuts
any reward, math or user, running past `task.reward_timeout_s` (default 60 s): the worker
is killed and restarted, the response scores 0.0, counts in `reward/timeouts` and one
warning names the reward, the row and the limit. Inside it, math-verify also limits each
parse/compare with `signal.alarm` (MATH_TIMEOUT_S), which only works in the main thread,
where the worker scores. In any other thread (`task.reward_timeout_s=0` scores in the
caller's process, maybe off its main thread) the alarm is switched off (the library would
raise otherwise), and only the response's last MAX_RESPONSE_CHARS characters are read,
which bounds the regex work; the huge-number guard above removes the known sympy stalls,
which hold the GIL (so a watchdog thread could not even run), but an unknown slow path
would be unbounded there.

A user reward is `module.path:function`, imported when the reward is made (so a typo fails
before any model loads), and called once per response as

    def score(prompt: str, response: str, answer: str, metadata: Mapping) -> float: ...

with `prompt` the prompt text (the last user message for chat rows), `response` the decoded
completion (after EOS/pad markers are cut), `answer` the reference as a string and
`metadata` the row's metadata mapping (empty when the row has none). It must return a real
number (an int or float, not a bool, not NaN or infinite). An import failure, a missing or
non-callable attribute, an exception inside the function or a bad return value is a
one-line `RewardError` naming the spec and the data row (raised in the trainer from the
worker's report). One that runs longer than `task.reward_timeout_s` is cut as above. It
runs in the worker, a separate process: it must be importable there (the worker has the
trainer's `sys.path`) and state it keeps between calls starts afresh after a cut.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import numpy as np

from moe_rl.tasks.answers import last_boxed, reference_answer
from moe_rl.tasks.base import Problem, clean_response
from moe_rl.tasks.user_code import UserCodeError, load_object

RewardFn = Callable[[Problem, str], float]
"""A reward: (problem, decoded response) -> float."""

MATH_TIMEOUT_S = 3
"""Seconds math-verify may spend on one parse or one comparison (main thread only)."""
MAX_RESPONSE_CHARS = 8192
"""The final answer sits at the end; reading only the tail bounds the extraction cost."""

# A plain number with an exponent (3e5, 1.5E-3), not part of a word or a LaTeX command.
_SCIENTIFIC = re.compile(r"(?<![\w.\\])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_SCIENTIFIC_LATEX = r"\1\\times 10^{\2}"

# Numbers sympy would spend minutes building while holding the GIL (so no thread can stop
# it): power towers with a numeric base (9^{9^{9}}), 7+ digit exponents, 6+ digit factorials.
_HUGE_NUMBER = re.compile(r"\d\s*\^\s*[{(]?\s*\d+\s*\^|\^\s*[{(]?\s*\d{7,}|\d(?:,?\d){5,}\s*!")


class RewardError(ValueError):
    """A user reward function (or its spec) that cannot score a row; one line, with the fix."""


def make_reward(spec: str) -> RewardFn:
    """The reward named by `task.reward`: `math` or `module.path:function`."""
    spec = spec.strip() if isinstance(spec, str) else spec
    if spec == "math":
        return math_reward
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise RewardError(f"task.reward={spec!r} is neither 'math' nor 'module.path:function'; "
                          "set task.reward=math or e.g. task.reward=my_rewards:score")
    return UserReward(spec)


# --- math: math-verify ---------------------------------------------------------------------


def math_reward(problem: Problem, response: str) -> float:
    """1.0 when the response's final answer equals `problem.answer` (math-verify), else 0.0."""
    return math_verify_score(response, problem.answer)


def math_verify_score(response: object, reference: str) -> float:
    """1.0 / 0.0 for a response against a reference answer; any failure scores 0.0."""
    from math_verify import verify

    text = _prepare_response(clean_response(response)[-MAX_RESPONSE_CHARS:])
    if not text or not isinstance(reference, str) or _HUGE_NUMBER.search(text):
        return 0.0
    timeout_s = _timeout_s()
    try:
        gold = _parse_gold(reference, timeout_s)
        if not gold:
            return 0.0
        predicted = _parse_response(text, timeout_s)
        if not predicted:
            return 0.0
        return 1.0 if verify(list(gold), predicted, timeout_seconds=timeout_s) else 0.0
    except Exception:  # a library bug must not stop training; the response scores 0
        return 0.0


def _prepare_response(text: str) -> str:
    r"""Rewrite what math-verify misreads: several boxes, `3e5`, a final period.

    It joins boxes separated by words like "or" into one answer (`\boxed{518} or
    \boxed{757}` reads as 518,757 = 518757), so the text is cut to start at the last
    complete box; `4e4` is read as 4*e*4 (Euler's e), so plain-number exponents become
    `4\times 10^{4}`; and `15/36.` reads as 15/36.0, which fails the exact comparison.
    """
    start = text.rfind("\\boxed")
    if start > 0 and last_boxed(text[start:]) is not None:
        text = text[start:]
    text = _SCIENTIFIC.sub(_SCIENTIFIC_LATEX, text)
    return text.rstrip().rstrip(".")


def _timeout_s() -> int | None:
    """math-verify's timeout uses SIGALRM, which only the main thread may set."""
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def _parse_gold(reference: str, timeout_s: int | None) -> tuple[Any, ...]:
    r"""Parsed reference: its `\boxed{}`/`####` part, tried as `$...$` LaTeX, then raw.

    Cached because every rollout group scores many responses against one reference.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = _SCIENTIFIC.sub(_SCIENTIFIC_LATEX, reference_answer(reference).strip())
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    for candidate in (f"${text}$", text):
        parsed = parse(candidate, extraction_config=config, parsing_timeout=timeout_s)
        if parsed:
            return tuple(parsed)
    return ()


def _parse_response(text: str, timeout_s: int | None) -> list[Any]:
    r"""The response's final answer: the last `\boxed{}` first, then answer phrases/LaTeX/expr."""
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    normalization = NormalizationConfig(basic_latex=True, units=True, malformed_operators=True,
                                        nits=True, boxed="last", equations=False)
    config = [LatexExtractionConfig(boxed_match_priority=0, normalization_config=normalization),
              ExprExtractionConfig()]
    return parse(text, extraction_config=config, parsing_timeout=timeout_s)


# --- user functions ------------------------------------------------------------------------


class UserReward:
    """A `module.path:function` reward; the function is resolved once, at construction."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = _import_function(spec)

    def __repr__(self) -> str:
        return f"UserReward({self.spec!r})"

    def __call__(self, problem: Problem, response: str) -> float:
        """Call the user function; any failure or bad value becomes a one-line RewardError."""
        meta = problem.meta or {}
        metadata = meta.get("metadata") or {}
        try:
            value = self.fn(problem.prompt, clean_response(response), problem.answer, metadata)
        except Exception as e:
            raise RewardError(f"task.reward={self.spec} raised {_one_line(repr(e))} on "
                              f"{row_of(problem)}; fix the function (or that row)") from e
        return self._checked(value, problem)

    def _checked(self, value: object, problem: Problem) -> float:
        """A real, non-NaN number as float; bools and strings are mistakes, not scores."""
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise RewardError(f"task.reward={self.spec} returned {_one_line(repr(value))[:60]} "
                              f"({type(value).__name__}) on {row_of(problem)}; "
                              "it must return a float")
        number = float(value)
        if not math.isfinite(number):  # NaN or inf would poison every advantage of the group
            raise RewardError(f"task.reward={self.spec} returned {'NaN' if math.isnan(number) else number} "
                              f"on {row_of(problem)}; it must return a finite number")
        return number


def _import_function(spec: str) -> Callable[[str, str, str, Mapping[str, Any]], float]:
    """The callable at `module.path:function`; any failure is a one-line RewardError."""
    try:
        return load_object(spec, "task.reward")
    except UserCodeError as e:
        raise RewardError(str(e)) from e


def row_of(problem: Problem) -> str:
    """Where a problem came from, for messages: `data.jsonl line 3`, or `a problem`."""
    meta = problem.meta or {}
    if "where" in meta:
        return str(meta["where"])
    if "path" in meta and "line" in meta:
        return f"{meta['path']} line {meta['line']}"
    return f"the problem {problem.prompt[:40]!r}"


def _one_line(text: str) -> str:
    return " ".join(text.split())
