"""The fault tests' hooks: where a test makes this process fail on purpose, so that the
recovery path runs the code a real fault would. Every hook is a no-op unless its variable
is set, and keeps its count in the variable itself (each hit rewrites it), so it holds no
state of its own and every process of a torchrun world counts its own hits.

    kill_point("save.manifest")   # MOE_RL_TEST_KILL_AT=<point>[#<n>][@<rank>]: SIGKILL here
    nan_update_due(update)        # MOE_RL_TEST_NAN_AT=3,4: a NaN loss in those optimizer updates
    engine_fail_point()           # MOE_RL_TEST_ENGINE_FAIL_AT=2,5: those generate calls raise
                                  # MOE_RL_TEST_ENGINE_HANG_AT=2: that generate call never returns

Kill points (tests/integration/checkpoints/test_checkpoint_safety.py, tests/integration/rollout/test_engine_faults.py): the process
kills itself the first (n-th) time it reaches point `name` (only on global rank `rank` when
`@<rank>` is given). Points: start (the run loop's start, before the run directory is
touched), update (mid-step: an optimizer update's gradients computed, before it is
applied), step.logged (a step's metrics written, before its save), generate (an engine's
generate call), save.begin, save.file (after each data file of a save), save.dcp,
save.meta, save.config, save.manifest (before the rename), save.renamed (before retention).

NaN updates (tests/integration/loop/test_nonfinite.py): the learner's updates (1-based, its own count) whose
loss is multiplied by NaN. Engine failures (tests/integration/rollout/test_engine_faults.py): this process's
`Sampler.generate` calls that raise a RuntimeError, as an out-of-memory error or a crashed
worker would (`2,5` -> `1,4` -> `3` as calls pass). Engine hangs (tests/integration/rollout/test_engine_faults.py):
the generate calls that block forever instead, as a deadlocked engine would
(`sampler.generate_timeout_s` must end them).
"""

from __future__ import annotations

import os
import signal
import time

KILL_ENV = "MOE_RL_TEST_KILL_AT"
NAN_ENV = "MOE_RL_TEST_NAN_AT"
ENGINE_FAIL_ENV = "MOE_RL_TEST_ENGINE_FAIL_AT"
ENGINE_HANG_ENV = "MOE_RL_TEST_ENGINE_HANG_AT"


def kill_point(name: str) -> None:
    """SIGKILL this process here if the test hook asks for it (see the module doc)."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    want, _, rank = want.partition("@")
    point, _, nth = want.partition("#")
    if point != name or (rank and rank != os.environ.get("RANK", "0")):
        return
    left = int(nth or 1)
    if left <= 1:
        os.kill(os.getpid(), signal.SIGKILL)
    os.environ[KILL_ENV] = f"{name}#{left - 1}" + (f"@{rank}" if rank else "")


def nan_update_due(update: int) -> bool:
    """Whether the test hook asks for a NaN loss in optimizer update `update` (1-based, the
    learner's count). Unset: never."""
    want = os.environ.get(NAN_ENV)
    return bool(want) and str(update) in want.split(",")


class InjectedEngineError(RuntimeError):
    """The failure the hook raises (a RuntimeError, as the backends' own failures are)."""


def _due(env: str) -> bool:
    """This call is one the hook `env` names (its count moves on by one either way)."""
    want = os.environ.get(env)
    if not want:
        return False
    left = [int(n) for n in want.split(",") if n.strip()]
    os.environ[env] = ",".join(str(n - 1) for n in left if n > 1)
    return 1 in left


def engine_fail_point() -> None:
    """Raise `InjectedEngineError` if the test hook asks for a failure at this call, or block
    forever if the hang hook asks for a hang."""
    if _due(ENGINE_FAIL_ENV):
        raise InjectedEngineError(f"injected engine failure ({ENGINE_FAIL_ENV})")
    if _due(ENGINE_HANG_ENV):
        while True:  # (a deadlocked engine: only the watchdog ends this)
            time.sleep(3600)
