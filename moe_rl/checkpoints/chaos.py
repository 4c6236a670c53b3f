"""The fault tests' hooks: named points of a save where the chaos test
(tests/test_checkpoint_safety.py) may have the process SIGKILL itself, and the optimizer
updates whose loss the non-finite test (tests/test_nonfinite.py) makes NaN.

    kill_point("save.manifest")   # a no-op unless MOE_RL_TEST_KILL_AT names this point

With `MOE_RL_TEST_KILL_AT=<name>` (or `<name>#<n>`) in the environment, the process kills
itself the first (n-th) time it reaches point `name`. The count lives in the variable
itself (each earlier hit rewrites `#<n>` to `#<n-1>`), so the hook keeps no state of its
own. Points: start (the run loop's start, before the run directory is touched), update
(mid-step: an optimizer update's gradients computed, before it is applied), step.logged
(a step's metrics written, before its save), save.begin, save.file (after each data file
of a save), save.dcp, save.meta, save.config, save.manifest (before the rename),
save.renamed (before retention).
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "MOE_RL_TEST_KILL_AT"
NAN_ENV = "MOE_RL_TEST_NAN_AT"


def kill_point(name: str) -> None:
    """SIGKILL this process here if the test hook asks for it (see the module doc)."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    point, _, nth = want.partition("#")
    if point != name:
        return
    left = int(nth or 1)
    if left <= 1:
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ[KILL_ENV] = f"{name}#{left - 1}"


def nan_update_due(update: int) -> bool:
    """Whether the test hook asks for a NaN loss in optimizer update `update` (1-based, the
    learner's count): `MOE_RL_TEST_NAN_AT=3,4` poisons updates 3 and 4. Unset: never."""
    want = os.environ.get(NAN_ENV)
    return bool(want) and str(update) in want.split(",")
