"""The advantage estimators, as registered by `moe_rl.advantages`: what the recipe layer
needs to know of each (the config package imports nothing of the estimators themselves).

    register_advantage_kind("gae", needs_critic=True)
    ADVANTAGE_KINDS["gae"].needs_critic        # -> True: the RL program runs PPO's critic

`import moe_rl` imports `moe_rl.advantages`, so every Config built anywhere sees the set.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.runtime.registry import Registry


@dataclass(frozen=True)
class AdvantageKind:
    """What the recipe layer knows of one advantage estimator."""

    name: str
    """Registry name (what rl.advantage holds)."""
    needs_critic: bool = False
    """The advantages come from a learned value model on the learner, one per response
    token, once the step is scored (PPO's GAE): the rollout computes none, the RL program
    runs the critic component, and only token-level objectives can take them."""


ADVANTAGE_KINDS: Registry[AdvantageKind] = Registry("advantage estimator")


def register_advantage_kind(name: str, *, needs_critic: bool = False) -> None:
    """Make `rl.advantage=<name>` a valid recipe value."""
    ADVANTAGE_KINDS.register(name, AdvantageKind(name, needs_critic))
