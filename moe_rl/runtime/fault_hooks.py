"""The engine-fault test's hook: the generate calls at which an engine fails on purpose
(tests/test_engine_faults.py), so that the recovery path runs the code a real failure would.

    engine_fail_point()    # first thing in every Sampler.generate; a no-op unless the variable is set

With `MOE_RL_TEST_ENGINE_FAIL_AT=2,5` in the environment, this process's 2nd and 5th
`generate` calls raise a RuntimeError, as an out-of-memory error or a crashed worker would.
Like `moe_rl.checkpoints.chaos.kill_point`, the hook keeps its count in the variable itself
(each call rewrites it to the calls left before each failure: `2,5` -> `1,4` -> `3`), so it
holds no state of its own and every process of a torchrun world counts its own calls.
"""

from __future__ import annotations

import os

ENGINE_FAIL_ENV = "MOE_RL_TEST_ENGINE_FAIL_AT"


class InjectedEngineError(RuntimeError):
    """The failure the hook raises (a RuntimeError, as the backends' own failures are)."""


def engine_fail_point() -> None:
    """Raise `InjectedEngineError` if the test hook asks for a failure at this call."""
    want = os.environ.get(ENGINE_FAIL_ENV)
    if not want:
        return
    left = [int(n) for n in want.split(",") if n.strip()]
    os.environ[ENGINE_FAIL_ENV] = ",".join(str(n - 1) for n in left if n > 1)
    if 1 in left:
        raise InjectedEngineError(f"injected engine failure ({ENGINE_FAIL_ENV})")
