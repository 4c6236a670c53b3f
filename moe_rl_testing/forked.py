"""`subprocess.run` for the tests' Python command lines, each process forked from a zygote
(`moe_rl_testing.zygote`) that has imported torch, megatron-core, transformers, vLLM and
moe_rl once, instead of importing them again (10-20 s of CPU a process on the 2-core machine).

    proc = forked.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "-m", "moe_rl.train", "--config", recipe],
                      env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)

understands `python -m MOD ...`, `python SCRIPT ...`, `python -c CODE ...` and torchrun's
`--standalone --nproc-per-node=N` in front of the first two. A torchrun world is N forked
ranks with the variables torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
...; rank 0 hosts the store), their output in one stdout and one stderr as torchrun's
inherited streams hold it; when a rank fails the others get SIGTERM (then SIGKILL) and the
run's status is 1, as torchrun does. What the zygote cannot stand for runs as a plain
subprocess: another command form, an environment whose import-time variables
(`IMPORT_TIME`: thread counts, dynamo, hash seed, logging set-up) differ from the zygote's,
a moe_rl other than this checkout's on the child's path. Tests of the launcher itself
(torchrun's own messages, signals sent to it, what a fresh interpreter imports) keep
`subprocess`. MOE_RL_TEST_NO_ZYGOTE=1 runs every command as a plain subprocess (to compare,
or to rule the zygote out); MOE_RL_TEST_ZYGOTE_LOG=FILE says which way each command went.
One thing a fork cannot give a child: its own string-hash seed (fixed when an interpreter
starts), so the ranks of a forked world iterate a set of strings in the same order where
torchrun's ranks may not; MOE_RL_TEST_NO_ZYGOTE=1 checks a test against that.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moe_rl_testing import ROOT

ZYGOTE_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
"""The zygote's import-time settings, the ones the tests' children run with."""
PROGRAM_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR"}
"""What a program sets before its imports when the variable is unset (`moe_rl.cli.cpu_environment`):
the zygote imports under them; a request may leave them unset, not set them otherwise."""
IMPORT_TIME = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHDYNAMO_DISABLE", "TORCH_LOGS", "PYTHONHASHSEED",
               "PYTHONWARNINGS", "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC",
               "PYTHONSAFEPATH", "VLLM_TARGET_DEVICE", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH",
               "VLLM_LOGGING_STREAM", "VLLM_LOGGING_PREFIX", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
               "TRANSFORMERS_VERBOSITY", "WANDB_MODE")
"""Variables the preloaded modules (or the interpreter) read while starting: a request must
have the zygote's values. Everything else (MOE_RL_*, the torchrun variables, the variables
vLLM adds for itself once an engine ran in the test process, ...) is read at run time and
is the child's own."""


class Zygote:
    """One preloaded interpreter per test process, started on first use."""

    def __init__(self) -> None:
        ctl_in_r, self._ctl_in = os.pipe()
        self._ctl_out, ctl_out_w = os.pipe()
        self.log = tempfile.NamedTemporaryFile(prefix="moe_rl_zygote.", suffix=".log", delete=False)
        atexit.register(os.unlink, self.log.name)
        self.env = dict(os.environ, **ZYGOTE_ENV, **PROGRAM_DEFAULTS, PYTHONPATH=str(ROOT))
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            self.env.pop(key, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "moe_rl_testing.zygote", str(ctl_in_r), str(ctl_out_w)],
                                     pass_fds=(ctl_in_r, ctl_out_w), env=self.env, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        os.close(ctl_in_r)
        os.close(ctl_out_w)
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self.ready: dict[str, Any] | None = None
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        with os.fdopen(self._ctl_out, "r") as lines:
            for line in lines:
                msg = json.loads(line)
                with self._cond:
                    if "ready" in msg:
                        self.ready = msg
                    elif "error" in msg:  # the fork failed: -1 tells spawn
                        self._pids[msg["id"]] = -1
                    elif "pid" in msg:
                        self._pids[msg["id"]] = msg["pid"]
                        self.exits.pop(msg["pid"], None)  # (a reused pid: an earlier child's end is not its)
                    else:
                        self.exits[msg["exit"]] = msg["code"]
                    self._cond.notify_all()
        with self._cond:
            self.dead = True
            self._cond.notify_all()

    def _await(self, what, timeout: float = 300) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: what() is not None or self.dead, timeout):
                raise TimeoutError(f"the zygote did not answer in {timeout:.0f} s (log: {self.log.name})")
            if what() is None:
                raise RuntimeError(f"the zygote died: {Path(self.log.name).read_text()[-4000:]}")
            return what()

    def usable(self) -> bool:
        """Preloaded with one thread (a fork copies only the calling thread)."""
        ready = self._await(lambda: self.ready)
        return ready["ready"] == 1

    def spawn(self, kind: str, target: str, argv: list[str], env: dict[str, str], cwd: str,
              path: list[str], stdout: str, stderr: str) -> int:
        req_id = next(self._ids)
        req = {"id": req_id, "kind": kind, "target": target, "argv": argv, "env": env, "cwd": cwd, "path": path,
               "stdout": stdout, "stderr": stderr}
        with self._lock:  # (one request a write: two threads' lines never interleave)
            os.write(self._ctl_in, (json.dumps(req) + "\n").encode())
        pid = self._await(lambda: self._pids.get(req_id))
        if pid < 0:
            raise OSError(f"the zygote could not fork (log: {self.log.name})")
        return pid

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self.exits.get(pid)

    def wait_any(self, pids: list[int], deadline: float) -> None:
        """Until one of `pids` ends or `deadline` (time.monotonic) passes."""
        with self._cond:
            self._cond.wait_for(lambda: any(p in self.exits for p in pids) or self.dead,
                                max(0.0, deadline - time.monotonic()))

    def base_path(self) -> list[str]:
        """The zygote's sys.path without its entry folder and PYTHONPATH."""
        return self._await(lambda: self.ready)["path"]


@functools.cache
def zygote() -> Zygote:
    return Zygote()


def _parse(cmd: list[str]) -> tuple[int, str, str, list[str]] | None:
    """(ranks, kind, target, argv) of a command line the zygote can run; None otherwise.
    ranks 0: a plain process, not a torchrun world."""
    if not cmd or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    rest, ranks = list(cmd[1:]), 0
    if rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
        while rest and rest[0].startswith("--"):
            opt = rest.pop(0)
            if opt.startswith(("--nproc-per-node=", "--nproc_per_node=")):
                ranks = int(opt.partition("=")[2])
            elif opt != "--standalone":
                return None
        if ranks < 1:
            return None
    if rest[:1] == ["-m"] and len(rest) > 1:
        return ranks, "module", rest[1], [rest[1], *rest[2:]]
    if rest[:1] == ["-c"] and len(rest) > 1 and not ranks:
        return ranks, "code", rest[1], ["-c", *rest[2:]]
    if rest and not rest[0].startswith("-"):
        return ranks, "script", rest[0], rest
    return None


def _child_path(kind: str, target: str, env: dict[str, str], cwd: str, base: list[str]) -> list[str] | None:
    """The sys.path `python` would give the child; None when a moe_rl other than this
    checkout's would come first on it (the zygote's is this checkout's)."""
    entry = {"module": cwd, "script": os.path.dirname(os.path.realpath(os.path.join(cwd, target))), "code": ""}[kind]
    own = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for folder in [entry or cwd, *own]:
        if os.path.isfile(os.path.join(folder, "moe_rl", "__init__.py")) and \
                os.path.realpath(folder) != os.path.realpath(ROOT):
            return None
    return [entry, *own, *base]


def _import_mismatch(env: dict[str, str], zyg: Zygote) -> str | None:
    """The first import-time variable whose value in `env` is not the zygote's; None when
    what the child would have imported under `env` is what the zygote has."""
    for key in IMPORT_TIME:
        if env.get(key) != zyg.env.get(key):
            return key
    for key in PROGRAM_DEFAULTS:
        if key in env and env[key] != zyg.env[key]:
            return key
    return None


def _note(line: str) -> None:
    """MOE_RL_TEST_ZYGOTE_LOG=FILE: one line per command, forked or why not."""
    if path := os.environ.get("MOE_RL_TEST_ZYGOTE_LOG"):
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {line}\n")


def _torchrun_env(env: dict[str, str], ranks: int, rank: int, port: int) -> dict[str, str]:
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(ranks),
                ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                TORCHELASTIC_USE_AGENT_STORE="False")


class Launch:
    """Forked processes running one command line: one, or a torchrun world's ranks."""

    GRACE_S = 30.0
    """A failed rank's peers get SIGTERM, then SIGKILL this long after (torchrun's default)."""

    def __init__(self, zyg: Zygote, pids: list[int], world: bool) -> None:
        self.zygote, self.pids, self.world = zyg, pids, world
        self._terminated_at: float | None = None

    @property
    def pid(self) -> int:
        return self.pids[0]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def rank_codes(self) -> list[int | None]:
        """Each process's own exit status (negative: the signal), None while it runs."""
        return [self.zygote.exit_code(p) for p in self.pids]

    def send_signal(self, sig: int, rank: int | None = None) -> None:
        """To the process (or to one rank); in a world, to every rank by default (torchrun
        passes a signal on to its workers). A process already ended is skipped."""
        for pid in self.pids if rank is None else [self.pids[rank]]:
            if self.zygote.exit_code(pid) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def poll(self) -> int | None:
        """The status once every process has ended (a world's: 1 if a rank failed); None
        before. In a world with a failed rank, the others are ended as torchrun ends them:
        SIGTERM at once, SIGKILL after GRACE_S."""
        codes = self.rank_codes()
        if self.zygote.dead and any(c is None for c in codes):
            raise RuntimeError(f"the zygote died: {Path(self.zygote.log.name).read_text()[-4000:]}")
        if self.world and any(c not in (None, 0) for c in codes) and any(c is None for c in codes):
            now = time.monotonic()
            if self._terminated_at is None:
                self._terminated_at = now
                self._signal(signal.SIGTERM)
            elif now - self._terminated_at > self.GRACE_S:
                self._signal(signal.SIGKILL)
        if any(c is None for c in codes):
            return None
        return (1 if any(c != 0 for c in codes) else 0) if self.world else codes[0]

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end (`poll`'s status). subprocess.TimeoutExpired after `timeout`
        seconds, the processes killed first."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while (status := self.poll()) is None:
            if time.monotonic() >= deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.pids, timeout or 0)
            live = [p for p in self.pids if self.zygote.exit_code(p) is None]
            self.zygote.wait_any(live, min(deadline, time.monotonic() + 1.0))
        return status

    def kill(self) -> None:
        """SIGKILL to every process's group; returns once they have ended (or after 30 s)."""
        self._signal(signal.SIGKILL)
        end = time.monotonic() + 30
        while not self.zygote.dead and any(c is None for c in self.rank_codes()) and time.monotonic() < end:
            self.zygote.wait_any(self.pids, end)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            if self.zygote.exit_code(pid) is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, sig)  # (its group: what it started goes too)


def start(cmd: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
          stdout: str | None = None, stderr: str | None = None) -> Launch | None:
    """Fork `cmd`'s process(es), output appended to the files `stdout` and `stderr`
    (os.devnull when None); None when the zygote cannot run it (module docstring)."""
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(cwd or os.getcwd())
    cmd = [str(c) for c in cmd]
    parsed = _parse(cmd)
    if parsed is None or os.environ.get("MOE_RL_TEST_NO_ZYGOTE"):
        _note(f"subprocess (command form or MOE_RL_TEST_NO_ZYGOTE): {cmd[1:4]}")
        return None
    ranks, kind, target, argv = parsed
    zyg = zygote()
    if zyg.dead:  # (killed, say by the OOM killer): a new one
        zygote.cache_clear()
        zyg = zygote()
    why = "the zygote has threads" if not zyg.usable() else _import_mismatch(env, zyg)
    path = None if why else _child_path(kind, target, env, cwd, zyg.base_path())
    if path is None:
        _note(f"subprocess ({why or 'another checkout on the path'}): {cmd[1:4]}")
        return None
    _note(f"forked x{ranks or 1}: {cmd[1:4]}")
    if kind == "script":
        target = os.path.join(cwd, target)
    out, err = stdout or os.devnull, stderr or os.devnull
    from moe_rl.runtime.process_group import free_port

    port = free_port()
    launch = Launch(zyg, [], world=ranks > 0)
    try:
        for rank in range(max(ranks, 1)):
            child_env = _torchrun_env(env, ranks, rank, port) if ranks else env
            launch.pids.append(zyg.spawn(kind, target, argv, child_env, cwd, path, out, err))
    except OSError:
        launch.kill()
        _note(f"subprocess (the zygote could not fork): {cmd[1:4]}")
        return None
    return launch


@contextlib.contextmanager
def _outputs() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="moe_rl_forked.") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        Path(out).touch()
        Path(err).touch()
        yield out, err


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float | None = None, capture_output: bool = False, text: bool = False,
        check: bool = False, **other: Any) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, ...) with the process(es) forked from the zygote where it can
    run them (output captured or dropped), a plain subprocess.run otherwise (and for any
    argument beyond these: stdin, input, ...)."""
    with _outputs() as (out, err):
        launch = None if other else start(cmd, env, cwd, out if capture_output else None,
                                          err if capture_output else None)
        if launch is None:
            return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=capture_output,
                                  text=text, check=check, **other)
        try:
            code = launch.wait(timeout)
        except subprocess.TimeoutExpired as e:
            e.cmd, e.output, e.stderr = cmd, _read(out, text), _read(err, text)
            raise
        except BaseException:  # (interrupted, the zygote gone): nothing it started lives on
            launch.kill()
            raise
        done = subprocess.CompletedProcess(cmd, code, _read(out, text) if capture_output else None,
                                           _read(err, text) if capture_output else None)
        done.rank_codes = launch.rank_codes()  # type: ignore[attr-defined]
    if check:
        done.check_returncode()
    return done


def _read(path: str, text: bool) -> str | bytes:
    data = Path(path).read_bytes()
    return data.decode(errors="replace") if text else data


def popen(cmd: list[str], *, cwd: str | Path, env: dict[str, str], stderr: Path) -> Launch | subprocess.Popen:
    """subprocess.Popen(cmd, stdout=DEVNULL, stderr=<the file `stderr`>) for a run a test
    watches and signals: forked where the zygote can run it. Either answers poll(), wait(),
    send_signal(), pid and returncode."""
    stderr.touch()
    launch = start(cmd, env, cwd, None, str(stderr))
    if launch is not None:
        return launch
    with stderr.open("a") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)


_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)")


def rank_exit_codes(done: subprocess.CompletedProcess | Launch | subprocess.Popen,
                    stderr: str | None = None) -> dict[int, int]:
    """{rank: exit status} of a torchrun world that ended (a forked world: every rank's, from
    the launcher; a real torchrun: the failed ranks its report in `stderr` names)."""
    codes = done.rank_codes() if isinstance(done, Launch) else getattr(done, "rank_codes", None)
    if codes is not None:
        return {rank: code for rank, code in enumerate(codes) if code is not None}
    text = stderr if stderr is not None else getattr(done, "stderr", None) or ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return {int(rank): int(code) for rank, code in _TORCHRUN_FAILURE.findall(text)}
