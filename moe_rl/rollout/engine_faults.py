"""An engine that fails mid-generation: what its failure is called, and the run's restart budget.

    fault = EngineFault(rank, describe_error(e))          # one engine rank's failed generate call
    budget = RestartBudget(cfg.sampler.max_restarts)
    budget.spend(faults, "generating step 7")       # raises EngineFailedError once none is left

An exception inside `Sampler.generate` (out of memory, a bad request, a crashed worker) is
agreed over the engine ranks (`RolloutCollector`), so that they all take the same way on:
while the budget lasts the engines are rebuilt from the starting weights and the call is
retried with the same seeds; an engine that had received weights since then raises
`EnginesRebuilt` first, and whoever holds the newest weights brings them again (the learner
pushes them, or the next scheduled push arrives). With no restart left the run stops with
`EngineFailedError`, one line naming the engine rank, the step and the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moe_rl.runtime.failures import RunFaultError, describe_error
from moe_rl.sampler.base import Generates


@dataclass(frozen=True)
class EngineFault:
    """One engine rank's failed generate call."""

    rank: int
    """The global rank whose engine failed."""
    cause: str
    """The exception, as one line (`moe_rl.runtime.failures.describe_error`)."""


class EngineFailedError(RunFaultError):
    """An engine failed with no restart left: the run stops before training on the step, so
    the last checkpoint stays the latest."""


class EnginesRebuilt(Exception):  # noqa: N818 (a signal to the caller, not an error)
    """The engines were rebuilt from the starting weights after a failure and lack the newest:
    the caller brings them (the learner pushes again, or the engine takes the next push) and
    then retries the rollout."""


@dataclass(frozen=True)
class EngineNote:
    """What an engine rank delivers instead of a batch when the learners must act: push the
    weights again (`rebuilt`), or stop with `line`."""

    rebuilt: bool
    line: str = ""

    def error(self) -> Exception:
        """The exception every rank raises on receiving this note."""
        return EnginesRebuilt() if self.rebuilt else EngineFailedError(self.line, everywhere=True)

    @staticmethod
    def of(e: EnginesRebuilt | EngineFailedError) -> EngineNote:
        return EngineNote(isinstance(e, EnginesRebuilt), "" if isinstance(e, EnginesRebuilt) else str(e))


class GenerateError(Exception):
    """A `Sampler.generate` call that raised (`GenerateOnly`), told apart from what the
    caller itself raises around it (a reward function's error is not the engine's)."""


class GenerateOnly:
    """A sampler's `generate`, its failures raised as `GenerateError` (for callers that
    run more than the engine: the evaluation scores its responses too)."""

    def __init__(self, sampler: Generates) -> None:
        self._sampler = sampler

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._sampler.generate(*args, **kwargs)
        except Exception as e:
            raise GenerateError(describe_error(e)) from e


_OOM = ("out of memory", "outofmemory", "cuda error: out of memory")


def failure_line(faults: Sequence[EngineFault], doing: str, max_restarts: int) -> str:
    """The one line a run ends with: the first failed engine rank, what it was doing, its
    cause, what becomes of the step and what to do."""
    first, others = faults[0], sorted({f.rank for f in faults} - {faults[0].rank})
    also = f" (and engine rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    if any(m in first.cause.lower() for m in _OOM):
        fix = "give the engines memory (sampler.gpu_memory_utilization, rl.prompts_per_step, sampler.max_new_tokens)"
    else:
        fix = "fix the cause"
    if max_restarts:
        fix += f" (the engines were already rebuilt {max_restarts} time(s): sampler.max_restarts={max_restarts})"
    else:
        fix += ", or set sampler.max_restarts > 0 to rebuild a failed engine and retry"
    return (f"engine rank {first.rank}{also} failed while {doing}: {first.cause}; the run stops without saving the "
            f"step in progress, the last checkpoint stays the latest (run.resume=true continues from it): {fix}")


class RestartBudget:
    """`sampler.max_restarts` over this process's run (a resume starts a full budget again:
    the operator who resumes has seen the line)."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.used = 0
        """Restarts so far (rollout/engine_restarts)."""

    def spend(self, faults: Sequence[EngineFault], doing: str) -> None:
        """Count one restart for `faults` (the engines' failures of one call, agreed), or
        raise `EngineFailedError` naming the first when the budget is spent."""
        if self.used >= self.max_restarts:
            raise EngineFailedError(failure_line(faults, doing, self.max_restarts))
        self.used += 1
