"""Multi-turn episodes: what an environment is, and the one that runs tools.

    env = make_environment(cfg.task, task)(problem)   # one per episode (G per problem)
    messages = env.start()                             # the opening conversation
    obs = env.step(turn)                               # after every assistant turn
    reward = env.reward()                              # once the episode is over

An environment never sees tokens: the rollout (`moe_rl.rollout.episodes`) templates what it
says into ids once and appends them to the episode as ids, and hands it each assistant turn
decoded and parsed (`AssistantTurn`). It offers tools as plain Python functions with type
hints and a Google-style docstring (`Args:`), from which `transformers.utils.get_json_schema`
makes the JSON schema the chat template shows the model.

The episode's reward is `reward()` (the final reward, e.g. the verifier on the last answer)
plus the sum of every `Observation.reward` (per-turn rewards, 0 unless an environment gives
them); the advantage is one per episode (outcome). A user's environment is named
`task.environment: module.path:Class` (a subclass of `Environment` taking the problem and the
task); without one, `ToolEnvironment` runs the task's tools (`Task.tools`) and those named by
`task.tools`.

Environments must be deterministic given the turns they were shown: a resumed run rebuilds
the episodes that were running at the stop by replaying their turns (`replay`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moe_rl.tasks.base import Problem, Task
from moe_rl.tasks.user_code import UserCodeError, load_object
from moe_rl.tokenization.tool_calls import ToolCall


@dataclass(frozen=True)
class AssistantTurn:
    """One assistant turn as the environment sees it."""

    content: str
    """The turn's text outside its tool calls (decoded, special tokens dropped)."""
    calls: tuple[ToolCall, ...] = ()
    """The tool calls it made, in order."""
    error: str | None = None
    """One line on its first malformed call (None: every call parsed)."""


@dataclass(frozen=True)
class Observation:
    """What the environment answers a turn with."""

    messages: tuple[dict[str, Any], ...] = ()
    """Chat messages appended to the episode (role "tool" for a tool's result, "user" for a
    user's reply); the chat template renders them."""
    reward: float = 0.0
    """This turn's reward (added to the final reward)."""
    done: bool = False
    """The episode is over (its messages, if any, are not appended)."""


class Environment(ABC):
    """One episode's world. Subclass it and name it `task.environment: module.path:Class`."""

    def __init__(self, problem: Problem, task: Task) -> None:
        self.problem = problem
        self.task = task

    @property
    def tools(self) -> Sequence[Callable[..., Any]]:
        """The tools the model is offered (plain functions; their schemas go through the chat
        template). None by default."""
        return ()

    def start(self) -> list[dict[str, Any]]:
        """The opening conversation: the problem's messages, or its prompt as a user message."""
        if self.problem.messages:
            return [dict(m) for m in self.problem.messages]
        return [{"role": "user", "content": self.problem.prompt}]

    @abstractmethod
    def step(self, turn: AssistantTurn) -> Observation:
        """The environment's answer to an assistant turn."""

    @abstractmethod
    def reward(self) -> float:
        """The episode's final reward, once it is over (finished or cut at a limit)."""


class ToolEnvironment(Environment):
    """Runs the tools the model calls and answers with their results; the first turn without a
    call is the answer, which the task's verifier scores. A malformed call, an unknown tool or
    a tool that raises is answered with an error message in the tool's place."""

    def __init__(self, problem: Problem, task: Task, tools: Sequence[Callable[..., Any]] = ()) -> None:
        super().__init__(problem, task)
        self.reward_timeouts = 0
        """Rewards of this episode cut at task.reward_timeout_s (0 or 1)."""
        self._tools = list(tools)
        self._by_name = {f.__name__: f for f in self._tools}
        self.answer = ""
        """The last turn's content (what `reward` scores)."""

    @property
    def tools(self) -> Sequence[Callable[..., Any]]:
        return self._tools

    def step(self, turn: AssistantTurn) -> Observation:
        self.answer = turn.content
        if turn.error is not None:
            return Observation(({"role": "tool", "content": f"error: {turn.error}"},))
        if not turn.calls:
            return Observation(done=True)
        return Observation(tuple({"role": "tool", "content": self.run(call)} for call in turn.calls))

    def run(self, call: ToolCall) -> str:
        """One call's result as text (JSON for structured results), or its error."""
        tool = self._by_name.get(call.name)
        if tool is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self._by_name) or 'none'})"
        try:
            result = tool(**call.arguments)
        except Exception as e:  # (the model's arguments are the usual cause: it reads the error and may retry)
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result)

    def reward(self) -> float:
        """The task's verifier on the answer, through `Task.score`: under task.reward_timeout_s
        a hanging reward is cut (0.0) and counted in `reward_timeouts`, as in single-turn runs."""
        scores = self.task.score([self.problem], [self.answer])
        self.reward_timeouts = scores.timeouts
        return float(scores.values[0])


EnvironmentFactory = Callable[[Problem], Environment]


def make_environment(task_cfg: Any, task: Task) -> EnvironmentFactory:
    """The environment each episode of `task` runs in: `task.environment` (a user's class), or
    a `ToolEnvironment` with the task's own tools and `task.tools`."""
    extra = [load_object(spec, "task.tools") for spec in task_cfg.tools]
    tools = [*getattr(task, "tools", ()), *extra]
    if task_cfg.environment:
        cls = load_object(task_cfg.environment, "task.environment")
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise UserCodeError(f"task.environment={task_cfg.environment} is not a subclass of "
                             "moe_rl.tasks.environment.Environment")
        return lambda problem: cls(problem, task)
    return lambda problem: ToolEnvironment(problem, task, tools)


def replay(env: Environment, turns: Sequence[AssistantTurn]) -> list[Observation]:
    """Show a fresh environment the turns an episode had (a resume): its observations again."""
    env.start()
    return [env.step(t) for t in turns]
