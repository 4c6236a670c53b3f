"""The SLURM launch (examples/gpu/slurm/): each recipe's sbatch script, run with stand-in
`srun`, `scontrol`, `python` and `torchrun` executables first on PATH (each appends its argv
to one file) inside a faked allocation of 1 and 4 nodes, builds the rendezvous from the
allocation, runs the recipe's --check once for the whole world before anything starts, and
launches one torchrun per node with its own log file. Bash only: milliseconds a case."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from moe_rl_testing import ROOT

SLURM = ROOT / "examples" / "gpu" / "slurm"
RECIPES = ["qwen3_30b_a3b", "glm45_air", "deepseek_v3"]
STUBS = {
    "srun": 'while [[ $# -gt 0 && $1 == --* ]]; do shift; done\nexec "$@"',  # (then runs its command)
    "torchrun": "",
    "python": 'exit "${PYTHON_STATUS:-0}"',
    "scontrol": '[[ "$1 $2" == "show hostnames" ]] || exit 1\nprintf "%s\\n" $HOSTS',
}


def _stubs(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, body in STUBS.items():
        stub = bin_dir / name
        stub.write_text(f'#!/usr/bin/env bash\nprintf "%s" {name} >> "$CALLS"; printf " %q" "$@" >> "$CALLS"; '
                        f'echo >> "$CALLS"\n{body}\n')
        stub.chmod(0o755)


def _sbatch(tmp_path: Path, recipe: str, slurm_env: dict[str, str], *args: str,
            status: int = 0) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run `recipe`'s sbatch script as the batch step of a faked allocation (from another
    directory: it finds the repository from SLURM_SUBMIT_DIR); returns it and the calls."""
    _stubs(tmp_path / "bin")
    calls = tmp_path / "calls.txt"
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "GPUS_PER_NODE", "RDZV_PORT", "LOG_DIR", "PYTHON", "SHUTDOWN_TIMEOUT", "RESUME", "MOE_RL_ROOT")}
    env = {**keep, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls),
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "4242", "SLURM_CPUS_ON_NODE": "96",
           "LOG_DIR": str(tmp_path / "logs"), "PYTHON_STATUS": str(status), **slurm_env}
    ran = subprocess.run(["bash", str(SLURM / f"{recipe}.sbatch"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=30)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return ran, [shlex.split(line) for line in lines]


def _signal_seconds(recipe: str) -> int:
    found = re.findall(r"^#SBATCH --signal=TERM@(\d+)$", (SLURM / f"{recipe}.sbatch").read_text(), re.M)
    assert len(found) == 1, f"{recipe}.sbatch: one #SBATCH --signal=TERM@<seconds> line"
    return int(found[0])


ALLOCATIONS = {  # nodes -> (the SLURM variables, GPUs per node, the hosts scontrol expands)
    1: ({"SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu01", "SLURM_GPUS_PER_NODE": "h100:4"}, 4, "gpu01"),
    4: ({"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_GPUS_ON_NODE": "8",
         "SLURM_GPUS_PER_NODE": "h100:8"}, 8, "gpu07 gpu08 gpu09 gpu10"),
}


@pytest.mark.parametrize("nodes", sorted(ALLOCATIONS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_sbatch_checks_once_then_launches_one_torchrun_per_node(tmp_path, recipe, nodes):
    slurm_env, gpus, hosts = ALLOCATIONS[nodes]
    ran, calls = _sbatch(tmp_path, recipe, {**slurm_env, "HOSTS": hosts}, "optimizer.lr=1e-6")
    assert ran.returncode == 0, ran.stderr
    config = f"examples/gpu/{recipe}.yaml"
    train = ["-m", "moe_rl.train", "--config", config, "run.resume=true", "optimizer.lr=1e-6"]
    assert [c[0] for c in calls[:2]] == ["scontrol", "python"], calls  # (the check before any launch)
    assert calls[1] == ["python", "-m", "moe_rl.train", "--check", "--nproc", str(nodes * gpus), *train[2:]]
    torchrun = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts.split()[0]}:29500", "--rdzv-id", "4242",
                "--shutdown-timeout", str(_signal_seconds(recipe)), *train]
    logs = tmp_path / "logs"
    assert calls[2:] == [["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
                          "--cpus-per-task=96", "--kill-on-bad-exit=1", f"--output={logs}/%x-%j-%N.log", *torchrun],
                         torchrun]
    assert logs.is_dir()  # (srun writes each node's log there: <job name>-<job id>-<node>.log)


def test_a_failed_check_launches_nothing(tmp_path):
    slurm_env, _, hosts = ALLOCATIONS[4]
    ran, calls = _sbatch(tmp_path, "qwen3_30b_a3b", {**slurm_env, "HOSTS": hosts}, status=2)
    assert ran.returncode == 2 and [c[0] for c in calls] == ["scontrol", "python"]


def test_outside_an_allocation_it_says_to_submit_with_sbatch(tmp_path):
    ran, calls = _sbatch(tmp_path, "glm45_air", {})
    assert ran.returncode == 2 and calls == []
    assert ran.stderr.strip().splitlines() == ["error: SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST or SLURM_JOB_ID "
                                               "unset: not inside a SLURM job; submit with sbatch "
                                               "examples/gpu/slurm/<model>.sbatch"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_sigterm_comes_a_step_and_the_stop_grace_ahead(recipe):
    """The signal (and torchrun's wait after it) covers more than the recipe's own
    run.stop_grace_s: the step in progress comes first (python -m moe_rl.plan gives both);
    every script parses."""
    grace = (yaml.safe_load((ROOT / "examples" / "gpu" / f"{recipe}.yaml").read_text())["run"]
             .get("stop_grace_s", 20))
    assert _signal_seconds(recipe) > grace + 300
    for script in [SLURM / f"{recipe}.sbatch", SLURM / "sbatch_common.sh"]:
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
