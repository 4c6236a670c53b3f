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

import gc
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
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from vllm import LLM, SamplingParams  # noqa: F401  (vllm's engine modules load on first use)

    return len(os.listdir("/proc/self/task"))


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def _child(req: dict, close_fds: list[int]) -> None:
    """In the forked child: become the requested process, run it, exit. Never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: the client can kill it and what it starts
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[:] = req["path"]
        if req["env"].get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        import random

        random.seed()  # (a process of its own would not share the zygote's seed)
        code = _run(req)
    finally:
        _finish(code)


def _run(req: dict) -> int:
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
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        _print_traceback(e)
        return -signal.SIGINT
    except BaseException as e:
        _print_traceback(e)
        return 1


def _print_traceback(e: BaseException) -> None:
    """As the interpreter prints it: from the program's first frame (this module's and
    runpy's frames left out)."""
    import traceback

    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


def _finish(code: int) -> None:
    """The interpreter's exit, without its final collections: non-daemon threads joined,
    atexit handlers run, output flushed; then the status (or the signal) it ended with."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def serve(ctl_in: int, ctl_out: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the handler wakes select via wake_w)
    out = os.fdopen(ctl_out, "w", buffering=1)
    extra = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    base = [p for p in sys.path[1:] if p not in extra]
    threads = _preload()
    # What the imports built is shared with every child until written; a collection that
    # walked it would write (copy) every page of it in every child: leave it to no collection.
    gc.collect()
    gc.freeze()
    out.write(json.dumps({"ready": threads, "path": base}) + "\n")
    pending = b""
    while True:
        readable, _, _ = select.select([ctl_in, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(out)
        if ctl_in in readable:
            chunk = os.read(ctl_in, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, [ctl_in, ctl_out, wake_r, wake_w])
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
        _reap(out)


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exit": pid, "code": _exit_code(status)}) + "\n")


def main() -> None:
    ctl_in, ctl_out = int(sys.argv[1]), int(sys.argv[2])
    os.dup2(2, 1)  # stray prints of the imports go to the log, never into the protocol
    serve(ctl_in, ctl_out)


if __name__ == "__main__":
    main()
