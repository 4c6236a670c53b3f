"""Launch multi-process test workers with torchrun (gloo on CPU), as users launch the learner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parent / "workers"


def torchrun(worker: str, nproc: int, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run tests/workers/<worker> under torchrun with `nproc` processes; raise with the
    workers' output if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS.parent.parent), str(WORKERS.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKERS / worker), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode})\n--- stdout\n{proc.stdout[-6000:]}\n"
            f"--- stderr\n{proc.stderr[-12000:]}"
        )
    return proc
