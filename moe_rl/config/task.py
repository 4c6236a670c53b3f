"""The `task` section: where prompts and rewards come from, how prompts become token ids,
and (for agents) how an agent program is run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_rl.config.errors import ConfigError, require_all


@dataclass(frozen=True)
class TaskConfig:
    """Where prompts and rewards come from, and how prompts become token ids."""

    name: str = "reverse"
    """Task name from moe_rl.tasks.TASKS: the synthetic reverse/sort/add/repeat, `calculator`
    (long additions with an `add` tool: multi-turn, rl.max_turns > 1), `dataset` (a JSONL or
    Parquet file of prompts, `data_path`; `math_jsonl` is its older name)."""
    data_path: str = ""
    """The training prompts of file-backed tasks (.jsonl or .parquet), relative to the working
    directory. A path starting with moe_rl/ that does not exist there names a file shipped
    inside the installed package (`moe_rl.config.shipped`)."""
    eval_data_path: str = ""
    """Held-out prompts in the same format, scored every `run.eval_every` steps (paths as in
    data_path)."""
    prompt_key: str = "prompt"
    """Dataset: the column holding the prompt text (a row has it or `messages_key`)."""
    messages_key: str = "messages"
    """Dataset: the column holding a chat `[{role, content}, ...]` list instead of a prompt."""
    answer_key: str = "answer"
    """Dataset: the column holding the reference answer (a string or a number)."""
    metadata_key: str = "metadata"
    """Dataset: an optional column (a mapping) handed to the reward function as is."""
    reward: str = "math"
    """Dataset: `math` (math-verify: the response's final answer equals the reference) or a
    user function `module.path:function` called as f(prompt, response, answer, metadata) -> float."""
    shuffle: bool = True
    """Dataset: visit rows in an order shuffled per epoch from run.seed (false: file order)."""
    min_digits: int = 4
    """Synthetic tasks: shortest operand."""
    max_digits: int = 6
    """Synthetic tasks: longest operand."""
    length_profile: Literal["uniform", "long_tail"] = "uniform"
    """How long the correct answers are. uniform: every problem from the task's one range
    (the digit tasks' operands, a file's rows as they are). long_tail: mostly short answers
    and sometimes long ones, up to a few hundred tokens, as reasoning RL's response lengths
    are (the workload of asynchronous rollout, examples/tiny_long_tail.yaml): only `repeat`
    draws it (moe_rl/tasks/repeat.py gives the distribution); the other tasks refuse it."""
    tokenizer: str = "auto"
    """auto: the tokenizer of run.init_checkpoint (a Hugging Face directory's own files; a
    moe_rl checkpoint's recorded one; the shipped SentencePiece model for the project's own
    models). shipped: the project's 128-piece model. Or a path: a Hugging Face tokenizer
    directory / tokenizer.json, or a SentencePiece .model file (paths as in data_path)."""
    chat_template: str = "auto"
    """auto: the tokenizer's chat template when it has one, else the prompt as plain text.
    none: plain text. Or a .jinja file (paths as in data_path). Prompts become ids as
    apply_chat_template(messages, add_generation_prompt=True) makes them."""
    system_prompt: str = ""
    """A system message put before every prompt when a chat template is applied."""
    environment: str = ""
    """Multi-turn episodes (rl.max_turns > 1): a user's environment class `module.path:Class`
    (a subclass of moe_rl.tasks.environment.Environment). "": the tool environment, which
    runs the task's own tools and task.tools and scores the last turn with the verifier."""
    tools: tuple[str, ...] = ()
    """Multi-turn: further tools offered to the model, as `module.path:function` (plain
    functions with type hints and a Google-style docstring: their JSON schemas go through the
    chat template)."""
    tool_parser: str = "auto"
    """How the model writes tool calls: hermes (Qwen2.5 / Qwen3 `<tool_call>{json}</tool_call>`,
    the shipped tool base), glm45 (GLM-4.5 `<arg_key>` / `<arg_value>`), or auto (read off
    the chat template)."""
    agent: str = ""
    """Multi-turn episodes through an agent program (docs/tools.md): `module.path:function`,
    an `async def f(problem, client, task)` (client: an `openai.AsyncOpenAI` bound to its
    episode) or a plain function (run in a worker thread, given an `openai.OpenAI`), which
    calls the run's OpenAI-compatible gateway as often as it likes and returns the reward (or
    a dict with `reward`). "": the environment (task.environment) runs the episodes."""
    agent_timeout_s: float = 300.0
    """task.agent: seconds one agent episode may take; past it an async agent is cancelled and
    a plain one abandoned, the episode dropped from the step (rollout/agent_timeouts)."""
    max_agent_failures_frac: float = 0.5
    """task.agent: the run stops when more than this fraction of a step's episodes time out or
    raise (each dropped and counted: rollout/agent_timeouts, rollout/agent_errors)."""
    reward_timeout_s: float = 60.0
    """Dataset: seconds one response's reward (math-verify or a user function) may take; one
    that runs longer is cut, scores 0.0 and is counted in reward/timeouts. Rewards run in a
    worker process that is killed and restarted on a timeout (0: in this process, no limit)."""


    def validate(self) -> None:
        """The section's own rules: digit ranges, the reward's time limit, the text settings
        (reward spec, chat template, environment and tools, column names)."""
        t = self
        require_all({
            "task.reward_timeout_s": (t.reward_timeout_s >= 0,
                                      f">= 0 seconds (0: no limit, rewards in this process), got {t.reward_timeout_s}"),
            "task.min_digits": (t.min_digits >= 1, f">= 1, got {t.min_digits}"),
            "task.max_digits": (t.max_digits >= t.min_digits, f">= task.min_digits={t.min_digits}, got {t.max_digits}"),
        })
        if t.reward != "math" and (t.reward.count(":") != 1 or not all(t.reward.split(":"))):
            raise ConfigError(f"task.reward={t.reward!r}: expected 'math' or a function 'module.path:function'")
        if t.chat_template not in ("auto", "none") and not t.chat_template.endswith(".jinja"):
            raise ConfigError(f"task.chat_template={t.chat_template!r}: expected auto, none or a .jinja file")
        frac = t.max_agent_failures_frac
        require_all({"task.agent_timeout_s": (t.agent_timeout_s > 0, f"> 0 seconds, got {t.agent_timeout_s}"),
                     "task.max_agent_failures_frac": (0 <= frac <= 1, f"in [0, 1], got {frac}")})
        if t.agent and t.environment:
            raise ConfigError(f"task.agent={t.agent} and task.environment={t.environment}: an episode runs either an "
                              "agent program or an environment; set one of them to \"\"")
        for name, spec in [("task.environment", t.environment), ("task.agent", t.agent)] + [("task.tools", x) for x in t.tools]:
            if spec and (spec.count(":") != 1 or not all(spec.split(":"))):
                raise ConfigError(f"{name}={spec!r}: expected 'module.path:name'")
        for key in ("prompt_key", "messages_key", "answer_key", "metadata_key"):
            if not getattr(t, key):
                raise ConfigError(f"task.{key} must not be empty")
