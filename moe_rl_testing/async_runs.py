"""Asynchronous-rollout runs under torchrun (one learner rank, one engine rank) for
tests/integration/rollout/test_async.py and tests/integration/rollout/test_inflight.py: a run to the end, and a run stopped by a
SIGTERM to its engine rank once its first step is logged."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from moe_rl_testing import forked

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOE_RL_TEST_KILL_AT")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")


def command(recipe: Path, overrides: list[str], out: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
            "moe_rl.train", "--config", str(recipe), *overrides, f"run.output_dir={out}", f"run.name={name}"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(recipe: Path, overrides: list[str], out: Path, name: str) -> list[dict]:
    """Run to the end; its metrics rows."""
    proc = forked.run(command(recipe, overrides, out, name), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return rows(out / name)


def stopped_after_first_rows(recipe: Path, overrides: list[str], out: Path, name: str) -> tuple[int, int, str]:
    """Start a run, SIGTERM its engine rank (RANK 1) alone once a step is logged; the steps
    it kept, the launch's exit status (torchrun's) and its stderr."""
    err = out / f"{name}.stderr"
    proc = forked.popen(command(recipe, overrides, out, name), cwd=ROOT, env=env(), stderr=err)
    metrics, t0 = out / name / "metrics.jsonl", time.time()
    while proc.poll() is None and time.time() - t0 < 300 and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.05)
    if isinstance(proc, forked.Launch):
        proc.send_signal(signal.SIGTERM, rank=1)
    else:  # a real torchrun (MOE_RL_TEST_NO_ZYGOTE): its worker of RANK 1
        import psutil

        engine = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if "moe_rl.train" in p.cmdline() and p.environ().get("RANK") == "1"]
        assert len(engine) == 1
        engine[0].send_signal(signal.SIGTERM)
    returncode = proc.wait(timeout=300)
    return len(rows(out / name)), returncode, err.read_text()
