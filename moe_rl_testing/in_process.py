"""A program's `main(argv)` run in the test's own process, as its command line would run it:
the same code from argument parsing to the exit status, without the seconds of importing
torch, megatron and transformers again in a child process.

    ran = run_main(importlib.import_module("moe_rl.train"), ["--config", RECIPE, "run.steps=0"])
    ran.returncode, ran.stdout, ran.stderr         # as subprocess.CompletedProcess has them

What the process boundary itself does (the interpreter's exit status, no traceback printed,
what torch prints at exit, signals, a real file-system limit) needs a subprocess: keep one
per entry point for that. An exception escaping `main` (with --debug) propagates.

Nothing the program changes in the process outlives the call: the working directory,
sys.argv, os.environ (the programs set defaults there), the logging configuration (levels,
handlers).
A torch.distributed world that existed before the call is the test process's (the
`megatron_world` fixture), not the program's: its error path (`moe_rl.cli._quiet_shutdown`,
which tears the program's world down before exiting) leaves it alone, so later tests keep it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Ran:
    """What a `main(argv)` call did: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def load_tool(path: str | Path) -> ModuleType:
    """A script of tools/ (`tools/convert_checkpoint.py`) as a module, for its `main`."""
    path = ROOT / path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _status(code: object) -> int:
    """The exit status the interpreter gives `sys.exit(code)` (a message: 1)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


@contextlib.contextmanager
def _logging_kept() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: lg.level for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    try:
        yield
    finally:
        root.handlers[:], root.level = handlers, level
        for name, lg in logging.Logger.manager.loggerDict.items():
            if isinstance(lg, logging.Logger) and lg.level != levels.get(name, logging.NOTSET):
                lg.setLevel(levels.get(name, logging.NOTSET))


@contextlib.contextmanager
def _environ_kept() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def run_main(module: ModuleType, argv: list[str], env: tuple[tuple[str, str], ...] | dict[str, str] = (),
             cwd: Path = ROOT) -> Ran:
    """`module.main(argv)` in `cwd` (the repository root) with `env` added to os.environ;
    returns its exit status (main's return value or its SystemExit) and what it printed."""
    import torch.distributed as dist

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, _environ_kept(), _logging_kept(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.chdir(cwd)
        mp.setattr(sys, "argv", [getattr(module, "__file__", None) or module.__name__, *argv])
        for key, value in dict(env).items():
            mp.setenv(key, value)
        if dist.is_available() and dist.is_initialized():
            import moe_rl.cli

            mp.setattr(moe_rl.cli, "_quiet_shutdown", lambda: None)  # the test process's world: kept
        try:
            status = _status(module.main(argv))
        except SystemExit as e:  # argparse's errors, and mains that sys.exit
            status = _status(e.code)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=err)  # (the interpreter prints a message it exits with)
    return Ran(status, out.getvalue(), err.getvalue())
