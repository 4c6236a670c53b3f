"""A reward function that hangs (issue 50): the response is cut at task.reward_timeout_s,
scores 0.0 and is counted; the reward worker is killed, restarted and never left behind."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from moe_rl.tasks import DatasetTask
from moe_rl.tasks.reward_worker import shared_worker
from moe_rl.tasks.rewards import RewardError
from moe_rl_testing import ROOT

REWARDS = """\
import os, time
def score(prompt, response, answer, metadata):
    if response == "hang":
        time.sleep(1e9)
    if response == "pid":
        return float(os.getpid())
    return float(response == answer)
def boom(prompt, response, answer, metadata):
    return 1 / 0
"""


@pytest.fixture
def task_of(tmp_path, monkeypatch):
    """DatasetTask(data with answers 7, 8, 9, reward=hang_rewards:<fn>, timeout); the
    module is importable here only (a test-made sys.path entry the worker must see)."""
    (tmp_path / "hang_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{a}", "answer": str(a)}) + "\n" for a in (7, 8, 9)))
    made: list[DatasetTask] = []

    def make(fn: str = "score", timeout_s: float = 1.0) -> DatasetTask:
        made.append(DatasetTask(data, reward=f"hang_rewards:{fn}", reward_timeout_s=timeout_s))
        return made[-1]

    yield make
    for task in made:
        task.close()
    sys.modules.pop("hang_rewards", None)


_BEFORE: set[int] = set()
"""Reward workers of this process that earlier tests' tasks left (another module's, when
pytest-xdist runs several modules in one process): not this module's to account for."""


@pytest.fixture(autouse=True)
def _earlier_workers() -> None:
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in _workers())


def _workers() -> list[psutil.Process]:
    """This process's reward workers still running (started since the test began)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:  # (a child may exit between the listing and the look: that one is not running)
            if "reward_worker" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return [p for p in out if p.pid not in _BEFORE]


def test_a_hung_reward_is_cut_scored_zero_and_counted(task_of, caplog):
    task = task_of(timeout_s=1.0)
    p = task.problems
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="moe_rl.tasks"):
        scores = task.score([p[0], p[1], p[2], p[1], p[2]], ["7", "pid", "hang", "pid", "8"])
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 29.0, elapsed  # cut (the reward sleeps 1e9 s); slack for a loaded machine's worker start
    first, second = int(scores.values[1]), int(scores.values[3])
    assert scores.values[0] == 1.0 and scores.values[2] == 0.0 and scores.values[4] == 0.0
    assert scores.timeouts == 1
    assert first != second and not psutil.pid_exists(first)  # killed, reaped, replaced
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("task.reward=hang_rewards:score took longer than task.reward_timeout_s=1 s on ")
    assert "data.jsonl line 3: cut and scored 0.0" in line and line.endswith(
        "raise task.reward_timeout_s or fix the function")
    again = task.score(p, ["7", "8", "pid"])  # the restarted worker goes on
    assert again.values[:2] == [1.0, 1.0] and int(again.values[2]) == second and again.timeouts == 0
    assert task.rewards(p[:1], ["7"]) == [1.0]
    task.close()
    assert not psutil.pid_exists(second) and _workers() == []


def test_reward_errors_and_the_in_process_mode_are_unchanged(task_of):
    """A raising function is the same one-line RewardError from the worker as in this
    process (and leaves the worker usable); reward_timeout_s=0 scores here."""
    messages = []
    for timeout_s in (0.0, 30.0):
        task = task_of("boom", timeout_s)
        with pytest.raises(RewardError) as info:
            task.reward(task.problems[1], "8")
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "\n" not in messages[0]
    assert messages[0].startswith("task.reward=hang_rewards:boom raised ZeroDivisionError('division by zero') on ")
    assert messages[0].endswith("data.jsonl line 2; fix the function (or that row)")
    kept = shared_worker().pid  # the worker that reported the error goes on
    task = task_of(timeout_s=30.0)
    assert kept is not None and int(task.reward(task.problems[0], "pid")) == kept
    here = task_of(timeout_s=0)
    assert here.rewards(here.problems, ["pid", "8", "x"]) == [float(os.getpid()), 1.0, 0.0]


def test_the_worker_dies_with_its_parent(tmp_path):
    """SIGKILL the trainer while its reward worker is stuck in a reward: the worker follows
    (prctl PR_SET_PDEATHSIG; an idle one would also see its pipe close), nothing is left."""
    (tmp_path / "hang_rewards.py").write_text(REWARDS)
    script = ("import sys\n"
              f"sys.path.insert(0, {str(tmp_path)!r})\n"
              "from moe_rl.tasks.base import Problem\n"
              "from moe_rl.tasks.reward_worker import shared_worker\n"
              "w = shared_worker()\n"
              "w.score('hang_rewards:score', [Problem('p', '1')], ['1'], 30.0)\n"
              "print(w.pid, flush=True)\n"
              "w.score('hang_rewards:score', [Problem('p', '1')], ['hang'], 600.0)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.2)  # (into the hanging reward)
        assert _running(worker)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the reward worker outlived its parent")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


ONCE = """\
import os, time
def score(prompt, response, answer, metadata):
    marker = os.path.join(os.path.dirname(__file__), "hung")
    if response and not os.path.exists(marker):  # the first response hangs (not the preflight's "")
        open(marker, "w").close()
        time.sleep(1e9)
    return float(response.strip() == answer)
"""


def test_a_run_counts_its_cut_rewards(megatron_world, tmp_path, monkeypatch):
    """Two RL steps on a dataset whose reward hangs once: step 1 logs reward/timeouts 1, step 2 0."""
    from moe_rl.config import load_config
    from moe_rl.programs.rl import train

    (tmp_path / "once_rewards.py").write_text(ONCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n} ", "answer": str(n)[::-1]}) + "\n" for n in range(1000, 1008)))
    cfg = load_config(ROOT / "examples" / "tiny_rspo.yaml", [
        "rl.prompts_per_step=2", "rl.group_size=2", "sampler.max_new_tokens=4", "sampler.backend=transformers",
        "logging.progress=false", "logging.tensorboard=false", "run.steps=2", "run.save_every=0",
        "run.export_hf=false", f"run.output_dir={tmp_path}", "task.name=dataset", f"task.data_path={data}",
        "task.reward=once_rewards:score", "task.reward_timeout_s=1"])
    train(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/timeouts"] for r in rows] == [1.0, 0.0]
    assert _workers() == []


def test_a_tool_episodes_hanging_reward_is_cut_and_counted(task_of):
    """Multi-turn episodes score through the same `Task.score` (issue 49's follow-up): the
    environment's final reward is cut at task.reward_timeout_s and counted, not run unbounded."""
    from moe_rl.tasks.environment import AssistantTurn, ToolEnvironment

    task = task_of(timeout_s=1.0)
    problem = task.problems[0]
    env = ToolEnvironment(problem, task)
    assert env.step(AssistantTurn("hang")).done
    t0 = time.monotonic()
    assert env.reward() == 0.0 and env.reward_timeouts == 1
    assert time.monotonic() - t0 < 30
    env = ToolEnvironment(problem, task)
    env.step(AssistantTurn(problem.answer))
    assert env.reward() == 1.0 and env.reward_timeouts == 0
