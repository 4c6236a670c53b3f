"""Shared by the planner tests: plan a list of jobs in moe_rl_testing/workers/plan_worker.py, one
subprocess for them all (its meta-device build joins a fake process group, which a test
process must not)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from moe_rl_testing import ROOT, forked

WORKERS = Path(__file__).resolve().parent / "workers"


def worker_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_plan_jobs(jobs: list[dict], out: Path, *, errors_allowed: bool = False, timeout: float = 900) -> dict:
    """{job name: its plan (or {"error": ...})} of each job (plan_worker.py's job format);
    unless `errors_allowed`, a job that failed fails the test, naming it."""
    (out / "jobs.json").write_text(json.dumps(jobs))
    proc = forked.run([sys.executable, str(WORKERS / "plan_worker.py"), str(out / "jobs.json"),
                           str(out / "plans.json")], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    plans = json.loads((out / "plans.json").read_text())
    if not errors_allowed:
        for name, plan in plans.items():
            assert "error" not in plan, f"{name}: {plan['error']}"
    return plans
