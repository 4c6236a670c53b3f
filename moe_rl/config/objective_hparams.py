"""The objectives' hyperparameter types, as registered by `moe_rl.objectives`.

The config package imports nothing of the objectives: each objective, when its module is
imported, registers here what a recipe needs of it (its hyperparameter dataclass, a
one-line summary for `--help-config`, whether it needs the router shift). `import moe_rl`
imports `moe_rl.objectives`, so every Config built anywhere sees the whole set.

    register_objective_hparams("rspo", RSPOHParams, summary="...", needs_router_shift=True)
    OBJECTIVE_HPARAMS["rspo"].hparams      # -> RSPOHParams
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_rl.runtime.registry import Registry


@dataclass(frozen=True)
class ObjectiveHParams:
    """What the recipe layer knows of one objective."""

    name: str
    """Registry name (what rl.objective holds)."""
    hparams: type
    """Frozen dataclass of the objective's own hyperparameters (rl.objective_args.<name>)."""
    summary: str
    """The one thing the objective fixes, in a sentence (a --help-config heading)."""
    needs_router_shift: bool = False
    """True when the objective reads the router shift (the learner must record routing)."""
    sequence_level: bool = False
    """True for objectives with one ratio per sequence (their corrections act per sequence)."""


OBJECTIVE_HPARAMS: Registry[ObjectiveHParams] = Registry("objective")


def register_objective_hparams(name: str, hparams: type, *, summary: str, needs_router_shift: bool = False,
                               sequence_level: bool = False) -> None:
    """Make `rl.objective=<name>` and `rl.objective_args.<name>.*` valid recipe keys."""
    if not (dataclasses.is_dataclass(hparams) and hparams.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{name}: hparams must be a frozen dataclass type, got {hparams!r}")
    OBJECTIVE_HPARAMS.register(name, ObjectiveHParams(name, hparams, summary, needs_router_shift,
                                                               sequence_level))
