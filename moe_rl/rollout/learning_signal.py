"""Says so when a step has no learning signal: every group's rewards are equal, so every
advantage is 0 and the gradient is exactly 0, yet the run would otherwise report success.
Only group advantages have this failure: with a learned critic (`rl.advantage: gae`) every
row's advantage is its returns minus the critic's values, whatever its group's rewards."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

REPEAT_EVERY = 10
"""While it lasts, the warning is repeated every this many steps."""


class LearningSignalWatch:
    """Warns the first step whose groups all have equal rewards, then every REPEAT_EVERY
    steps while that lasts; a step with signal resets it. Silent with a critic's advantages
    (`group_advantages=False`)."""

    def __init__(self, dynamic_sampling: bool, group_advantages: bool = True) -> None:
        self.dynamic_sampling = dynamic_sampling
        self.group_advantages = group_advantages
        """False with a critic's advantages (GAE): equal group rewards then say nothing."""
        self.silent_steps = 0
        """Consecutive steps without signal so far."""

    def observe(self, step: int, zero_variance_frac: float) -> None:
        if zero_variance_frac < 1.0 or not self.group_advantages:
            self.silent_steps = 0
            return
        if self.silent_steps % REPEAT_EVERY == 0:
            fixes = ("an easier dataset, or more samples per prompt (rl.group_size)" if self.dynamic_sampling else
                     "dynamic sampling (rl.dynamic_sampling=true), an easier dataset, or more samples per prompt "
                     "(rl.group_size)")
            log.warning("step %d: no learning signal: every group's rewards are equal (%d step(s) in a row), so "
                        "every advantage and the gradient are 0; try %s", step, self.silent_steps + 1, fixes)
        self.silent_steps += 1
