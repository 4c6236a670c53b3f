"""Exceptions as one line a user can act on: what went wrong, where, and the fix.

    print(f"{prog}: error: {describe_error(e)}")       # DCP's per-rank wrapper unwrapped, <= 500 chars
    if disk_full(e, where=out_dir): ...           # ENOSPC anywhere in the chain, or torch's hint of it

The command-line programs (`moe_rl.cli`), the learner's checkpoint save and load and the
converter all word their failures through here.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

INTERNAL_ERROR, USER_ERROR, RUN_FAULT = 1, 2, 3
"""Exit statuses: a bug; the user's input or machine (config, files, checkpoints, a full
disk); a fault met while training (`RunFaultError`, a rank of the job that ended)."""


class RunFaultError(RuntimeError):
    """A run that cannot go on for a reason met while training, not a bug and not the
    recipe's syntax: updates that stay non-finite, an engine that failed with no restart
    left. Its message is the one line printed (what happened, where, the likely causes and
    what to do); the run ends with status RUN_FAULT and the latest checkpoint stays valid.
    `everywhere`: every rank raises the same one (rank 0 alone prints it)."""

    def __init__(self, message: str, *, everywhere: bool = False) -> None:
        super().__init__(message)
        self.everywhere = everywhere


def causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps: its __cause__/__context__ chain and, for torch DCP's
    CheckpointException (a BaseException carrying {rank: (exception, traceback)}), each
    rank's exception."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return [e for e in out if isinstance(e, BaseException)]


_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def disk_full(exc: BaseException, where: str | os.PathLike | None = None) -> bool:
    """Did `exc` come from a full disk? ENOSPC / EDQUOT anywhere in its causes (as an errno,
    or as the text of one a worker thread re-raised), or torch's
    zip writer failing ("unexpected pos 704 vs 598", which loses the errno) while the file
    system holding `where` has less than 1 MiB left."""
    found = causes(exc)
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in found):
        return True
    # torch.distributed.checkpoint's writer threads re-raise an OSError as
    # RuntimeError("Worker failure: [Errno 28] No space left on device"): only the text is left
    if any(os.strerror(n) in str(e) for e in found for n in (errno.ENOSPC, errno.EDQUOT)):
        return True
    if where is None or not any(any(m in str(e) for m in _WRITE_FAILURES) for e in found):
        return False
    p = Path(where)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free < (1 << 20)
    except OSError:
        return False


_OS_FIXES = {
    "ENOSPC": "disk full: free space there or write elsewhere",
    "EDQUOT": "disk quota exceeded: free space there or write elsewhere",
    "EACCES": "not permitted: choose a directory you can write, or fix its permissions",
    "EPERM": "not permitted: choose a directory you can write, or fix its permissions",
    "EROFS": "read-only file system: write elsewhere",
    "ENOTDIR": "a file stands where a directory should be: move it or choose another path",
    "EEXIST": "something already exists there: move it or choose another path",
    "EISDIR": "a directory stands where a file should be: choose another path",
    "ENOENT": "it does not exist: check the path",
}


def describe_os_error(e: OSError) -> str:
    """`<what went wrong>: <path> (<the fix>)` for an OSError that names a path."""
    name = errno.errorcode.get(e.errno or 0, "")
    fix = _OS_FIXES.get(name)
    where = f": {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
    return f"{e.strerror or name}{where}" + (f" ({fix})" if fix else "")


def describe_error(exc: BaseException) -> str:
    """`exc` as one line: torch DCP's CheckpointException (whose text holds every rank's
    traceback) as its first rank's exception; others' types named (moe_rl's errors need no
    name); whitespace collapsed, at most 500 characters."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return describe_error(inner)
    if isinstance(exc, OSError) and exc.filename:
        return describe_os_error(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not type(exc).__module__.startswith("moe_rl."):  # our errors say what they are
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 500 else text[:497] + "..."


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def lost_peer(exc: BaseException) -> bool:
    """Did `exc` come from another rank of the job ending mid-collective (gloo's closed or
    reset connection, NCCL's remote exit)? This rank's failure is then a consequence, not
    the cause: the rank that ended, or torchrun, reports the cause."""
    return any(isinstance(e, RuntimeError | OSError) and any(m in str(e) for m in _PEER_GONE) for e in causes(exc))


def is_user_error(exc: BaseException) -> bool:
    """Errors about the user's input or machine, as opposed to bugs: our own error types,
    ValueError / OSError (bad values, missing or unwritable files), safetensors' and torch
    DCP's / megatron's checkpoint errors (a damaged or mismatched checkpoint)."""
    from moe_rl.checkpoints.errors import CheckpointError

    if isinstance(exc, CheckpointError | ValueError | OSError):  # (ConfigError is a ValueError)
        return True
    name, module = type(exc).__name__, type(exc).__module__
    return name in ("SafetensorError", "CheckpointException", "CheckpointingException") or module.startswith(
        ("safetensors", "torch.distributed.checkpoint", "megatron.core.dist_checkpointing"))


def exit_status(exc: BaseException) -> int:
    """The status a program leaves with after `exc` (the command-line programs' one line,
    `moe_rl.cli.error_line`, and what an experiment tracker records)."""
    from moe_rl.checkpoints.errors import CheckpointError

    if not isinstance(exc, ValueError | CheckpointError) and disk_full(exc):
        return USER_ERROR
    if isinstance(exc, RunFaultError) or lost_peer(exc):
        return RUN_FAULT
    return USER_ERROR if is_user_error(exc) else INTERNAL_ERROR
