"""A model trained beside the actor within each RL step (PPO's critic is one): the RL
program runs every component the recipe asks for through this interface, knowing none of
them by name.

    components = step_components(cfg, layout)      # (learner_role) [] for the GRPO family; PPO: [CriticStage]
    batch, metrics = component.advantages(batch, gather)   # once the step is scored
    metrics |= component.update(batch, minibatches)        # after the actor's updates
    save_checkpoint(actor, path, recipe=to_dict(cfg), components=models_of(components))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from moe_rl.step_batch import StepBatch

if TYPE_CHECKING:
    from moe_rl.learner.engine import Learner


class StepComponent:
    """One trained model of the RL step besides the actor, with its part of the step."""

    actor_warmup_steps: int = 0
    """The run's first steps train this component alone (the actor waits)."""
    missing_hint: str = ""
    """Why a checkpoint may lack this component, for the error a resume from it gives."""
    passes: tuple[int, int] = (1, 1)
    """(epochs, mini-batches per epoch) of its updates in a step."""

    def models(self) -> dict[str, Learner]:
        """Its trained models by checkpoint name (saved and loaded beside the actor, offloaded
        with it)."""
        raise NotImplementedError

    def start(self, init: str, trust: bool) -> None:
        """A fresh run: its starting weights (from its own setting or the actor's `init`)."""

    def advantages(self, batch: StepBatch, gather: Callable[[Any], list[Any]]) -> tuple[StepBatch, dict[str, float]]:
        """The scored batch with this component's advantages (and what its update needs);
        `gather`: every data-parallel rank's object. Collective."""
        return batch, {}

    def update(self, batch: StepBatch, minibatches: list[torch.Tensor]) -> dict[str, float]:
        """Its optimizer steps on the step's mini-batches (global row ids of each)."""
        return {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint's metadata keeps of it besides its models."""
        return {}

    def restore(self, meta: dict[str, Any]) -> None:
        """Resume `state` from a checkpoint's metadata."""


def models_of(components: list[StepComponent]) -> dict[str, Learner]:
    """Every component's trained models by checkpoint name."""
    return {name: model for c in components for name, model in c.models().items()}
