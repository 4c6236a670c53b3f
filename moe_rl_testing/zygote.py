"""`python -m moe_rl_testing.zygote CTL_IN CTL_OUT`: an interpreter that imports torch,
megatron-core, transformers, vLLM and moe_rl once, then forks a child per request, each
child a process that runs a module, a script or `-c` code as `python` would, from its own
environment, working directory, argv and output files.

Why: a test suite launches some 300 processes (torchrun ranks, whole programs), and each
spends 10-20 s of CPU importing the same libraries before its first line of work; on the
2-core machine that was most of the suite's time. A fork costs milliseconds. The forked
child is a real process (its own pid, signals, exit status, file descriptors): what the
tests launch it for holds. The client is `moe_rl_testing.forked`.

Protocol, one JSON object a line: a request on CTL_IN
    {"id": 7, "kind": "module"|"script"|"code", "target": "moe_rl.train",
     "argv": [...], "env": {...}, "cwd": "...", "path": [...], "stdout": FILE, "stderr": FILE}
is answered on CTL_OUT by {"id": 7, "pid": PID}; each child's end by {"exit": PID, "code": N}
(N as subprocess gives it: negative for a signal). The first line is {"ready": THREADS,
"path": [...]}: the threads the zygote has after its imports (a child can only be forked
safely from one) and its sys.path without its entry folder and PYTHONPATH, which a request's
"path" puts its own in front of.
Closing CTL_IN ends the zygote (children left running keep running)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys

PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers", "vllm", "moe_rl.train",
           "moe_rl.learner.parallel", "moe_rl.learner.megatron_patches", "moe_rl.sampler.vllm_backend")
"""What every child would import first; moe_rl.train pulls in most of the package."""


def _preload() -> int:
    """Import PRELOAD; the number of threads the process has after (a fork copies only the
    calling thread, so a thread pool started here would be missing in every child)."""
    for name in PRELOAD:
        importlib.import_module(name)
    from vllm import LLM, SamplingParams  # noqa: F401  (vllm's engine modules load on first use)

    return len(os.listdir("/proc/self/task"))


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def _child(req: dict, close_fds: list[int], import_env: dict[str, str]) -> None:
    """In the forked child: become the requested process, run it, exit. Never returns."""
    code, sig = 1, 0
    try:
        os.setsid()  # its own process group: the client can kill it and what it starts
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.environ.clear()
        os.environ.update({**import_env, **req["env"]})  # (what the imports set, as a fresh process has it)
        os.chdir(req["cwd"])
        sys.path[:] = req["path"]
        importlib.invalidate_caches()
        _fresh_streams(unbuffered=bool(req["env"].get("PYTHONUNBUFFERED")))
        _fresh_random_state()
        code, sig = _run(req)
    finally:
        _finish(code, sig)


def _fresh_streams(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr as the interpreter makes them for files: stdout block
    buffered, stderr line buffered, both unbuffered under PYTHONUNBUFFERED."""
    import io

    def stream(fd: int, line: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line and not unbuffered,
                                write_through=unbuffered)

    _OLD_STREAMS.extend([sys.stdout, sys.stderr])
    sys.stdout = sys.__stdout__ = stream(1, False, "strict")
    sys.stderr = sys.__stderr__ = stream(2, True, "backslashreplace")


_OLD_STREAMS: list = []
"""The zygote's streams, which handlers made at import time still hold (flushed at exit)."""


def _fresh_random_state() -> None:
    """The random states a process of its own starts with, not copies of the zygote's:
    Python's and numpy's from the OS, torch's CPU generator at its default seed."""
    import random

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.random.default_generator.manual_seed(_TORCH_DEFAULT_SEED)


_TORCH_DEFAULT_SEED = 67280421310721
"""torch's CPU generator seed in a fresh process (`torch.initial_seed()` before any seeding)."""


def _run(req: dict) -> tuple[int, int]:
    """(exit status, signal to end with: 0 for none) of running the request."""
    import runpy
    import types

    sys.argv = list(req["argv"])
    try:
        if req["kind"] == "module":
            # as `python -m` has it: the module only as __main__ (preloaded, runpy would warn)
            sys.modules.pop(req["target"], None)
            runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
        elif req["kind"] == "script":
            runpy.run_path(req["target"], run_name="__main__")
        else:
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(req["target"], "<string>", "exec"), main.__dict__)
        return 0, 0
    except SystemExit as e:
        if e.code is None:
            return 0, 0
        if isinstance(e.code, int):
            return e.code, 0
        print(e.code, file=sys.stderr)
        return 1, 0
    except KeyboardInterrupt as e:  # the interpreter ends itself by SIGINT after the traceback
        _print_traceback(e)
        return 1, signal.SIGINT
    except BaseException as e:
        _print_traceback(e)
        return 1, 0


def _print_traceback(e: BaseException) -> None:
    """As the interpreter prints it: from the program's first frame (this module's and
    runpy's frames left out)."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)


def _finish(code: int, sig: int) -> None:
    """The interpreter's exit, without its final collections: non-daemon threads joined,
    atexit handlers run, output flushed; then the status (or the signal) it ended with."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr, *_OLD_STREAMS):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if sig:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os._exit(code & 0xFF)


def serve(ctl_in: int, ctl_out: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the handler wakes select via wake_w)
    out = os.fdopen(ctl_out, "w", buffering=1)
    extra = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    base = [p for p in sys.path[1:] if p not in extra]
    before = dict(os.environ)
    threads = _preload()
    # what the imports put into the environment (vLLM sets some "for every process it
    # creates"): a fresh process has them, so every child gets them under its own
    import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    # What the imports built is shared with every child until written; a collection that
    # walked it would write (copy) every page of it in every child: leave it to no collection.
    gc.collect()
    gc.freeze()
    out.write(json.dumps({"ready": threads, "path": base}) + "\n")
    pending, children = b"", set()
    while True:
        readable, _, _ = select.select([ctl_in, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(out, children)
        if ctl_in in readable:
            chunk = os.read(ctl_in, 65536)
            if not chunk:  # the test process is gone: so is what it started
                for pid in children:
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as e:  # (no memory, too many processes): the client falls back
                    out.write(json.dumps({"id": req["id"], "error": str(e)}) + "\n")
                    continue
                if pid == 0:
                    _child(req, [ctl_in, ctl_out, wake_r, wake_w], import_env)
                children.add(pid)
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
        _reap(out, children)


def _reap(out, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        out.write(json.dumps({"exit": pid, "code": _exit_code(status)}) + "\n")


def main() -> None:
    ctl_in, ctl_out = int(sys.argv[1]), int(sys.argv[2])
    os.dup2(2, 1)  # stray prints of the imports go to the log, never into the protocol
    serve(ctl_in, ctl_out)


if __name__ == "__main__":
    main()
