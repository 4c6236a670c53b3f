"""Checks of a whole recipe that need no process group: each section's own `validate`, then
the rules that span sections (`cross_section`), and the layout against the world size
(which needs torchrun's WORLD_SIZE)."""

from __future__ import annotations

import dataclasses

from moe_rl.config.cross_section import (
    CROSS_SECTION_CHECKS,
    check_finite,
    learner_world_size,
    validate_layout,
    validate_minibatches,
)
from moe_rl.config.sections import Config

__all__ = ["learner_world_size", "validate", "validate_layout", "validate_minibatches"]


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need no process group. With `world_size`, the layout is checked too."""
    check_finite(cfg)
    for f in dataclasses.fields(cfg):  # (every section has its own `validate`: tests/unit/config/test_config.py)
        getattr(cfg, f.name).validate()
    for check in CROSS_SECTION_CHECKS:
        check(cfg)
    if world_size is not None:
        validate_layout(cfg, world_size)
