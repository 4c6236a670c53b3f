"""The calculator task: add two numbers too long for a tiny model to add, with an `add` tool.

    task = CalculatorTask(5, 7)
    p = task.sample(1, seed=0)[0]       # e.g. p.prompt "What is 482131 + 90377?", p.answer "572508"
    task.reward(p, "572508")            # 1.0: the final answer is the exact decimal sum
    tool_conversation(p, use_tool=True)  # user, assistant tool call, tool result, answer

A chat task: `Problem.prompt` is the user message, and the response scored is the text of the
final assistant message. A policy that adds in its head has to carry through 5-7 digits; one
that calls `add` (rendered by the shipped tool tokenizer's chat template as a `<tool_call>`)
gets the sum back in a `<tool_response>` and only has to copy it. That gap is what makes the
task a test of tool use: the reward cannot tell the two apart, so a rising reward on long
operands means the policy learned to call the tool.

Operands: a k-digit operand is uniform over k-digit numbers (no leading zero; k = 1 allows 0),
k uniform in [min_digits, max_digits], drawn independently for A and B.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from moe_rl.tasks.base import Problem
from moe_rl.tasks.synthetic import DigitTask

if TYPE_CHECKING:

    pass

# What a decoded final message may end with when special tokens are not skipped: the chat
# template's end of turn and the end of text (both are EOS ids of the tool tokenizer).
_TRAILING_MARKERS = ("<|im_end|>", "<|endoftext|>")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum a + b.
    """
    # A plain function with a Google-style docstring: transformers.utils.get_json_schema
    # turns it into the JSON schema the chat template lists under `# Tools`, and an
    # environment can call it with the parsed arguments.
    return a + b


def final_answer(response: object) -> str:
    """The answer a response gives: its stripped text with trailing end markers removed.

    Only *trailing* markers go (not everything after the first one, as `clean_response`
    does): text after an end of turn is not part of the answer, so "123<|im_end|>x" is no
    answer. Anything that is not a string (a sampler bug, None) becomes "" and scores 0.
    """
    if not isinstance(response, str):
        return ""
    text = response.strip()
    while text.endswith(_TRAILING_MARKERS):
        marker = next(m for m in _TRAILING_MARKERS if text.endswith(m))
        text = text[: -len(marker)].rstrip()
    return text


class CalculatorTask(DigitTask):
    """`What is A + B?`, answered with the exact decimal sum; the `add` tool is allowed. The
    operands are drawn as the digit tasks draw theirs (`DigitTask.number`); the prompt is a
    question and the answer the final assistant message."""

    name = "calculator"
    keyword = "add"

    def __init__(self, min_digits: int = 5, max_digits: int = 7) -> None:
        super().__init__(min_digits, max_digits)

    @property
    def tools(self) -> list[Callable[..., Any]]:
        """The functions a policy may call (a fresh list: callers may extend it)."""
        return [add]

    def make_problem(self, rng: np.random.Generator) -> Problem:
        """One problem drawn from `rng` (A first, then B)."""
        a, b = int(self.number(rng)), int(self.number(rng))
        return Problem(
            prompt=f"What is {a} + {b}?",
            answer=str(a + b),
            meta={"task": self.name, "a": a, "b": b, "digits": max(len(str(a)), len(str(b)))},
        )

    def completion(self, problem: Problem) -> str:
        """The direct answer: the sum alone (the final assistant message's content)."""
        return problem.answer

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if final_answer(response) == problem.answer else 0.0

    SFT_TOOL_FRAC: ClassVar[float] = 0.25
    """The share of supervised conversations that call `add`; the others answer the sum
    directly. A base taught this mix calls the tool in about a quarter of its episodes and
    fails most direct sums of 5-7 digits, so RL has a reward gap to close by choosing the
    tool (`make tool-demo`)."""

    def sft_conversation(self, problem: Problem, rng: np.random.Generator | None) -> list[dict[str, Any]]:
        """A supervised conversation (`moe_rl.programs.sft`): with the tool with probability
        `SFT_TOOL_FRAC` under `rng`, else the direct answer; `rng=None` (the held-out set,
        whose expected reward is then that of always calling the tool): with the tool."""
        use_tool = rng is None or bool(rng.random() < self.SFT_TOOL_FRAC)
        return tool_conversation(problem, use_tool)


def tool_conversation(problem: Problem, use_tool: bool, answer: str | None = None) -> list[dict[str, Any]]:
    """An SFT conversation for `problem` in transformers' chat message format.

    use_tool: the user message, an assistant message calling `add(a=A, b=B)` (empty
    content), the tool's result, and an assistant message stating it. Otherwise the user
    message and one assistant message whose content is `answer` (default the true sum): the
    caller decides what a model answering without the tool says (a wrong sum, to teach
    that guessing long sums fails, or the right one). `answer` applies only without the tool,
    since a tool episode's final message copies the tool's result (giving it there is an error).
    """
    if use_tool and answer is not None:
        raise ValueError("tool_conversation: `answer` is for the direct form; a tool episode answers with the tool's result")
    a, b = int(problem.meta["a"]), int(problem.meta["b"])
    user = {"role": "user", "content": problem.prompt}
    if not use_tool:
        return [user, {"role": "assistant", "content": problem.answer if answer is None else answer}]
    call = {"type": "function", "function": {"name": add.__name__, "arguments": {"a": a, "b": b}}}
    result = str(add(a, b))
    return [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]
