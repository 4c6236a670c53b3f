"""Verifiable-reward tasks: seeded prompt generators with verifiers, and the task registry.

    task = make_task(cfg.task)                        # TaskConfig -> Task
    problems = task.sample(16, seed=step)             # same seed, same problems
    r = task.reward(problems[0], " 31284")            # in [0, 1]
    pairs = sft_examples(task, 512, seed=0)           # (prompt, completion) for a warm start

Tasks: `reverse`, `sort`, `add` (synthetic, see `synthetic.py` for the formats), `repeat`
(the same format, with a long tail of answer lengths under `task.length_profile=long_tail`;
see `repeat.py`), `dataset` (a user's JSONL/Parquet file, `task.data_path`, rewards from
`rewards.py`; see `dataset.py`; `math_jsonl` is its older name), `calculator` (chat: long
sums with an `add` tool; see `calculator.py`). The shipped tokenizer is in
`tokenizer.py` (import it from there; it is not re-exported so `python -m
moe_rl.tasks.tokenizer` runs cleanly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from moe_rl.config.errors import ConfigError
from moe_rl.runtime.registry import Registry
from moe_rl.tasks.base import Problem, Task, sft_examples
from moe_rl.tasks.calculator import CalculatorTask
from moe_rl.tasks.dataset import DatasetTask
from moe_rl.tasks.repeat import RepeatTask
from moe_rl.tasks.synthetic import AddTask, ReverseTask, SortTask

if TYPE_CHECKING:
    from moe_rl.config import TaskConfig

TaskFactory = Callable[["TaskConfig"], Task]

TASKS: Registry[TaskFactory] = Registry("task")
"""Task name -> factory taking a TaskConfig. Add-only; an unknown name is a ValueError."""


def register_task(name: str, factory: TaskFactory) -> TaskFactory:
    """Add a task under `name`; a name can be registered only once."""
    return TASKS.register(name, factory)


def make_task(cfg: TaskConfig) -> Task:
    """Build the task `cfg.name` from a TaskConfig (or anything with the same attributes).
    A `task.length_profile` the task does not honour (`Task.length_profiles`) is a one-line
    ConfigError naming the tasks that do."""
    task = TASKS[cfg.name](cfg)
    profile = getattr(cfg, "length_profile", "uniform")
    if profile not in getattr(task, "length_profiles", ("uniform",)):
        able = " or ".join(f"task.name={n}" for n in tasks_with_profile(profile))
        raise ConfigError(f"task.length_profile={profile}: task {cfg.name} cannot draw it (its answers have the "
                          f"one length range of its settings); use {able + ' or ' if able else ''}"
                          "task.length_profile=uniform")
    return task


def tasks_with_profile(profile: str) -> list[str]:
    """The registered tasks whose class (a factory that is a Task class's `from_config`)
    honours `task.length_profile=profile`."""
    owners = {name: getattr(factory, "__self__", None) for name, factory in TASKS.items()}
    return [name for name, cls in owners.items() if profile in getattr(cls, "length_profiles", ())]


for _task in (ReverseTask, SortTask, AddTask, RepeatTask, CalculatorTask):
    register_task(_task.name, _task.from_config)
register_task("math_jsonl", DatasetTask.from_config)  # the older name (same format, now strict)
register_task(DatasetTask.name, TASKS["math_jsonl"])

__all__ = [
    "TASKS",
    "AddTask",
    "CalculatorTask",
    "DatasetTask",
    "Problem",
    "RepeatTask",
    "ReverseTask",
    "SortTask",
    "Task",
    "TaskFactory",
    "make_task",
    "register_task",
    "sft_examples",
]
