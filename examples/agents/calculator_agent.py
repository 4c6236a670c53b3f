"""The calculator task as an agent is written: a plain `openai` client loop with an `add`
tool (nothing from moe_rl imported). Trained by examples/tiny_agent.yaml
(`task.agent: examples.agents.calculator_agent:solve`); tried outside a run with
`python -m moe_rl.serve --checkpoint DIR` and `python examples/agents/calculator_agent.py URL`.

It does what the run's tool environment does for the calculator task: the question as the
user message, the model's `add` calls run and answered with their results, the first reply
without a call is the answer, scored by the task's verifier.
"""

from __future__ import annotations

import json
import sys

TOOLS = [{"type": "function", "function": {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "description": "The first number."},
                                  "b": {"type": "integer", "description": "The second number."}},
                   "required": ["a", "b"]},
    "return": {"type": "integer", "description": "The sum a + b."}}}]
"""The `add` tool's schema (what transformers' get_json_schema makes of the task's `add`)."""

MAX_CALLS = 8


def add(a: int, b: int) -> int:
    return a + b


def run_call(name: str, arguments: str) -> str:
    """One tool call's result as text, or its error (the model reads it and may retry)."""
    if name != "add":
        return f"error: no tool named {name!r} (tools: add)"
    try:
        result = add(**json.loads(arguments))
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"
    return result if isinstance(result, str) else json.dumps(result)


async def solve(problem, client, task) -> float:
    """One episode: ask, run the calls, score the answer (the task's verifier)."""
    messages = [{"role": "user", "content": problem.prompt}]
    answer = ""
    for _ in range(MAX_CALLS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        if choice.finish_reason == "length" and not response.usage.completion_tokens:
            break  # (the episode's budget is used up: the last answer stands)
        answer = choice.message.content or ""
        if not choice.message.tool_calls:
            break
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_call(call.function.name, call.function.arguments)})
    return task.reward(problem, answer)


if __name__ == "__main__":  # against a served checkpoint: python examples/agents/calculator_agent.py URL
    import asyncio
    from types import SimpleNamespace

    import openai

    class Exact:
        def reward(self, problem, answer: str) -> float:
            return float(answer.strip() == problem.answer)

    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
    problem = SimpleNamespace(prompt="What is 482131 + 90377?", answer="572508")
    client = openai.AsyncOpenAI(base_url=url, api_key="none")
    print("reward", asyncio.run(solve(problem, client, Exact())))
