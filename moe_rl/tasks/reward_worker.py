"""Rewards scored in a child process that can be killed: a hung reward costs one response, not the run.

    worker = shared_worker()                                  # this process's one worker
    values, cut = worker.score("my_rewards:score", problems, responses, timeout_s=60.0)

A user reward function (or math-verify on a pathological answer) may never return, and a
thread cannot be stopped in Python (a sympy stall even holds the GIL). So the dataset task's
rewards run in a persistent worker process, started on first use: the parent sends a
batch in one message and reads one small message back per response, each within
`timeout_s` of the previous one. A response that takes longer is cut: the worker is
SIGKILLed and reaped, the response scores 0.0, one warning line names the reward, the row
and the limit, and a fresh worker scores the rest of the batch. Scoring runs in the
worker's main thread, so math-verify's own SIGALRM timeouts work there too.

The worker never outlives the trainer: it asks Linux to SIGKILL it when its parent dies
(prctl PR_SET_PDEATHSIG; strictly, when the parent *thread* that started it ends, so start
it from one that lives as long as the scoring, as the trainer's main thread does), exits
when the parent's end of the pipe closes, sits in its own session (a Ctrl-C or a signal to
the trainer's process group is the trainer's to handle), and is killed at `close_shared`
(the task's close, and interpreter exit). It sees the parent's `sys.path`, sent with the
first batch and again whenever it changes, so a module the parent can import, the worker
can.

It is a fresh interpreter (`subprocess`, not multiprocessing's spawn: that would run the
trainer's `__main__` module and the `moe_rl` package `__init__`, i.e. import torch, 1.3 s
and 200 MB per start): a bootstrap registers the `moe_rl` and `moe_rl.tasks` packages
without running their `__init__`, so the worker imports only the reward modules (numpy,
and math-verify for `math`), and starts in about 0.1 s.

Errors keep their in-process form: a user function that raises or returns a bad value is
the same one-line `RewardError`, raised in the parent from the worker's message; a worker
that dies on its own (the function exits the interpreter, the kernel kills it) is one too.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import SupportsFloat

from moe_rl.tasks.base import Problem
from moe_rl.tasks.rewards import RewardError, RewardFn, make_reward, math_verify_score, row_of

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Seconds a worker may take to start and load a reward (import the user's module, warm
math-verify up) before it scores: not counted against the per-response limit."""

_BOOT = """\
# moe_rl reward worker (moe_rl/tasks/reward_worker.py)
import importlib.util, sys
def bare(name, where):  # the package without its __init__ (moe_rl's imports torch)
    spec = importlib.util.spec_from_file_location(name, where + "/__init__.py", submodule_search_locations=[where])
    sys.modules[name] = importlib.util.module_from_spec(spec)
bare("moe_rl", sys.argv[1])
bare("moe_rl.tasks", sys.argv[1] + "/tasks")
sys.modules["moe_rl"].tasks = sys.modules["moe_rl.tasks"]
from moe_rl.tasks.reward_worker import serve
serve(int(sys.argv[2]), int(sys.argv[3]))
"""


class RewardWorker:
    """The parent's handle on one worker process (started lazily, restarted after a cut).

    Protocol on the pipe, per batch: the parent sends (sys.path or None, spec, problems,
    responses); the worker answers None once the reward is loaded, then per response a
    float (the score) or a str (a RewardError's text, which ends the batch)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._path: list[str] | None = None  # the sys.path the worker has
        self._lock = threading.Lock()
        self.starts = 0
        """Worker processes started so far (1 + restarts)."""

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None: none running)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def score(self, spec: str, problems: Sequence[Problem], responses: Sequence[str],
              timeout_s: float) -> tuple[list[float], int]:
        """(rewards, responses cut) of `task.reward=spec` over aligned lists, each response
        given `timeout_s` seconds; a RewardError as in-process scoring would raise it."""
        values: list[float] = []
        cut = 0
        with self._lock:
            while len(values) < len(problems):
                if self._run(spec, problems[len(values):], responses[len(values):], timeout_s, values):
                    continue
                self.close()  # the response in progress hung: kill the worker, score 0.0, go on
                log.warning("task.reward=%s took longer than task.reward_timeout_s=%g s on %s: cut and scored 0.0 "
                            "(reward process restarted); raise task.reward_timeout_s or fix the function",
                            spec, timeout_s, row_of(problems[len(values)]))
                values.append(0.0)
                cut += 1
        return values, cut

    def _run(self, spec: str, problems: Sequence[Problem], responses: Sequence[str], timeout_s: float,
             values: list[float]) -> bool:
        """Score a batch, appending to `values`; False: the next response overran `timeout_s`.
        A failure other than the worker's RewardError message kills the worker (the pipe
        would be out of step with the next batch)."""
        try:
            self._start()
            assert self._conn is not None  # (_start made it)
            path = _parent_path()
            self._conn.send((path if path != self._path else None, spec, list(problems), list(responses)))
            self._path = path
            if _checked(self._receive(START_TIMEOUT_S, spec, problems[0])) is _SILENT:
                self.close()
                raise RewardError(f"task.reward={spec}: the reward process did not load the reward within "
                                  f"{START_TIMEOUT_S:g} s (before scoring {row_of(problems[0])}); check that "
                                  "importing the module does not block")
            for problem in problems:
                message = _checked(self._receive(timeout_s, spec, problem))
                if message is _SILENT:
                    return False
                if not isinstance(message, SupportsFloat):
                    raise RewardError(f"task.reward={spec}: the reward process sent {message!r}, not a number")
                values.append(float(message))
            return True
        except RewardError:
            raise
        except BaseException:
            self.close()
            raise

    def _receive(self, limit_s: float, spec: str, problem: Problem) -> object:
        """The worker's next message, `_SILENT` after `limit_s` without one; a worker that
        died is a RewardError naming the row it was scoring."""
        conn = self._conn
        assert conn is not None  # (_start made it)
        if not conn.poll(limit_s):
            return _SILENT
        try:
            return conn.recv()
        except (EOFError, OSError):
            proc = self._proc
            self.close()
            code = proc.returncode if proc is not None else None
            raise RewardError(f"task.reward={spec}: the reward process died (exit status {code}) on "
                              f"{row_of(problem)}; fix the function (it must return, not exit or crash the "
                              "interpreter)") from None

    def _start(self) -> None:
        """A running worker: the current one, or a new one when none runs."""
        if self.pid is not None:
            return
        self.close()
        ours, theirs = socket.socketpair()
        try:
            root = str(Path(__file__).resolve().parent.parent)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, root, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._path = None
        self.starts += 1

    def close(self) -> None:
        """Kill the worker (SIGKILL: it may be stuck in a reward) and reap it."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


_SILENT = object()
"""What `_receive` returns when the worker sent nothing in time."""


def _checked(message: object) -> object:
    """The worker's message; a str is a RewardError's text, raised here as in-process scoring would."""
    if isinstance(message, str):
        raise RewardError(message)
    return message


def _parent_path() -> list[str]:
    """This process's sys.path, '' (the current directory) made absolute."""
    return [p or os.getcwd() for p in sys.path if isinstance(p, str)]


# --- this process's worker -----------------------------------------------------------------

_shared: RewardWorker | None = None


def shared_worker() -> RewardWorker:
    """This process's worker (one per trainer process, whatever the number of tasks)."""
    global _shared
    if _shared is None:
        _shared = RewardWorker()
        atexit.register(close_shared)
    return _shared


def close_shared() -> None:
    """Kill this process's worker, if one runs (a later `score` starts a new one)."""
    if _shared is not None:
        _shared.close()


# --- the worker process --------------------------------------------------------------------


def serve(fd: int, parent: int) -> None:
    """The worker's loop: score batches from the pipe until it closes (or the parent dies)."""
    _die_with(parent)
    conn = Connection(fd)
    rewards: dict[str, RewardFn] = {}
    while True:
        try:
            path, spec, problems, responses = conn.recv()
            if path is not None:
                sys.path[:] = path
                rewards.clear()
            _score(conn, rewards, spec, problems, responses)
        except (EOFError, OSError):  # the parent closed the pipe (or is gone)
            return


def _score(conn: Connection, rewards: dict[str, RewardFn], spec: str, problems: list[Problem],
           responses: list[str]) -> None:
    """One batch: None once the reward is loaded, then a float per response; a RewardError's
    text instead ends the batch."""
    try:
        if spec not in rewards:
            rewards[spec] = _loaded(spec)
    except RewardError as e:
        conn.send(str(e))
        return
    conn.send(None)
    for problem, response in zip(problems, responses):
        try:
            value = rewards[spec](problem, response)
        except RewardError as e:
            conn.send(str(e))
            return
        except Exception as e:  # (the rewards wrap their errors; anything else is still one line)
            conn.send(f"task.reward={spec} failed with {' '.join(repr(e).split())} on {row_of(problem)}; "
                      "fix the function")
            return
        conn.send(value)


def _loaded(spec: str) -> RewardFn:
    """The reward, warmed up: math-verify imports sympy on first use, which must not count
    against the first response's time limit."""
    import importlib

    importlib.invalidate_caches()  # (a module written since the last batch)
    reward = make_reward(spec)
    if spec.strip() == "math":
        math_verify_score(r"\boxed{1}", "1")
    return reward


def _die_with(parent: int) -> None:
    """SIGKILL this process when the parent dies (Linux; elsewhere the closed pipe ends it)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)
