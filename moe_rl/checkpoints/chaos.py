"""The chaos test's kill hook (tests/test_checkpoint_safety.py): named points of a save
where the test may have the process SIGKILL itself.

    kill_point("save.manifest")   # a no-op unless MOE_RL_TEST_KILL_AT names this point

With `MOE_RL_TEST_KILL_AT=<name>` (or `<name>#<n>`) in the environment, the process kills
itself the first (n-th) time it reaches point `name`. The count lives in the variable
itself (each earlier hit rewrites `#<n>` to `#<n-1>`), so the hook keeps no state of its
own. Points: save.begin, save.file (after each data file of a save), save.dcp, save.meta,
save.config, save.manifest (before the rename), save.renamed (before retention).
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "MOE_RL_TEST_KILL_AT"


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
