"""Checkpoint directories on disk, without megatron: the manifest that makes a checkpoint
complete and verifiable, which directories count as checkpoints, trust, stale temp
directories, and the test kill hook.

    digests = digest_files(tmp, list_files(tmp))      # at save, after every file is written
    write_manifest(tmp, digests)                      # last, then the directory is renamed
    ensure_verified(path, trust=False)                # at load, before any file is read

A checkpoint is `<dir>/` with megatron's files, `moe_rl.json` and `config.yaml`, and
`manifest.json`: the size and SHA-256 of every file but `config.yaml` (human-editable text
that is only ever read with a safe YAML loader and validated strictly, so a user may fix a
tokenizer path in it) and the manifest itself. It is written last, into the temp directory,
which is then renamed: a directory named `step_<n>` with a manifest is complete.

Trust model (docs/checkpoints.md): megatron's files include pickles. Nothing of a checkpoint
is unpickled before its manifest verifies; one without a manifest loads only when the user
says it is trusted (`run.trust_checkpoint=true`, `--trust`), and the process remembers
that for the path (`trust`), so the sampler's conversion of the same directory needs no
second flag. A verified checkpoint is still read restricted (`.metadata` through an
unpickler that builds only DCP's metadata classes, every `torch.load` weights_only) unless
the user trusts it: a manifest proves the files are the ones saved, not who saved them. A
manifest that does not verify is never overridden by trust: a file that differs from its
recorded digest is damaged (delete manifest.json to vouch for the files yourself).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from collections import Counter
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
META_FILE = "moe_rl.json"
CONFIG_FILE = "config.yaml"
UNHASHED = (CONFIG_FILE,)
MANIFEST_FORMAT = 1
KILL_ENV = "MOE_RL_TEST_KILL_AT"
STEP_DIR = re.compile(r"^step_(\d+)$")
TRUST_HINT = ("run.trust_checkpoint=true (train) or --trust (tools/convert_checkpoint.py; convert it to "
              "Hugging Face once that way for the other tools)")

_verified: dict[Path, tuple[int, int]] = {}
_trusted: set[Path] = set()
_kill_hits: Counter[str] = Counter()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written as asked; the message names the file and
    the fix (one line: the command-line programs print it as it is)."""


# --------------------------------------------------------------------------- manifest


def list_files(path: Path) -> list[str]:
    """Relative paths of the files a manifest covers, sorted: every regular file under
    `path` but the manifest and the unhashed config."""
    out = []
    for p in path.rglob("*"):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and rel not in (MANIFEST_FILE, *UNHASHED):
            out.append(rel)
    return sorted(out)


def file_digest(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of one file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def digest_files(path: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(path / name) for name in names}


def share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's part of the files to hash (round robin over the sorted names), so that a
    checkpoint of many shards is hashed by every rank at once."""
    return names[rank::world]


def write_manifest(path: Path, digests: dict[str, dict[str, Any]]) -> None:
    """`manifest.json` with `digests`, written through a temp file that is flushed to disk
    before the rename (the directory's own rename follows it)."""
    doc = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "unhashed": list(UNHASHED),
           "files": dict(sorted(digests.items()))}
    tmp = path / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST_FILE)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of checkpoint `path`; None when it has none."""
    f = path / MANIFEST_FILE
    if not f.is_file():
        return None
    try:
        doc = json.loads(f.read_text())
        files = doc["files"]
        if not isinstance(files, dict) or any(not isinstance(v, dict) for v in files.values()):
            raise TypeError("files is not a mapping of digests")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f} is damaged ({type(e).__name__}: {e}); restore the checkpoint from a "
                              f"copy, or delete {MANIFEST_FILE} and pass {TRUST_HINT} if you trust its files") from e
    return doc


def check_file(path: Path, name: str, want: dict[str, Any]) -> str | None:
    """The problem with one listed file, as a one-line message; None when it verifies."""
    f = path / name
    fix = "restore the checkpoint from a copy (or resume from an older one)"
    if not f.is_file():
        return f"checkpoint file {f} is missing ({MANIFEST_FILE} lists it); {fix}"
    size = f.stat().st_size
    if size != want.get("size"):
        what = "truncated" if size < want.get("size", 0) else "longer than saved"
        return f"checkpoint file {f} is {what} ({size} bytes, {MANIFEST_FILE} says {want.get('size')}); {fix}"
    if file_digest(f)["sha256"] != want.get("sha256"):
        return f"checkpoint file {f} is corrupt (its SHA-256 differs from {MANIFEST_FILE}); {fix}"
    return None


def unlisted_files(path: Path, manifest: dict[str, Any]) -> list[str]:
    return [n for n in list_files(path) if n not in manifest["files"]]


def verify_share(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Check this rank's share of the manifest's files (all of them at world 1). Returns
    the first problem as a one-line message, None when every file of the share verifies.
    A checkpoint without a manifest is a problem here; `ensure_verified` knows about trust."""
    manifest = read_manifest(path)
    if manifest is None:
        return no_manifest_message(path)
    extra = unlisted_files(path, manifest)
    if extra:
        return (f"checkpoint file {path / extra[0]} is not in {MANIFEST_FILE} (added after the save?); remove it, "
                f"or delete {MANIFEST_FILE} and pass {TRUST_HINT} if you trust every file")
    for name in share(sorted(manifest["files"]), rank, world):
        problem = check_file(path, name, manifest["files"][name])
        if problem:
            return problem
    return None


def no_manifest_message(path: Path) -> str:
    return (f"checkpoint {path} has no {MANIFEST_FILE}: nothing vouches for its files, and its pickled "
            f"metadata could run code when read; if you trust where it came from, pass {TRUST_HINT}")


# --------------------------------------------------------------------------- trust and verification


def _stamp(path: Path) -> tuple[int, int]:
    st = (path / MANIFEST_FILE).stat()
    return st.st_mtime_ns, st.st_size


def is_verified(path: str | os.PathLike) -> bool:
    """Verified earlier in this process (or trusted and without a manifest), manifest
    unchanged since."""
    p = Path(path).resolve()
    if p in _trusted and not (p / MANIFEST_FILE).is_file():
        return True
    try:
        return _verified.get(p) == _stamp(p)
    except OSError:
        return False


def mark_verified(path: str | os.PathLike) -> None:
    p = Path(path).resolve()
    _verified[p] = _stamp(p)


def trust(path: str | os.PathLike) -> None:
    """The user vouched for `path` (a checkpoint without a manifest): remember it for this
    process, so later readers of the same directory (the sampler's conversion) accept it."""
    _trusted.add(Path(path).resolve())


def is_trusted(path: str | os.PathLike) -> bool:
    return Path(path).resolve() in _trusted


def ensure_verified(path: str | os.PathLike, *, trust_it: bool = False) -> bool:
    """Verify checkpoint `path` against its manifest before anything of it is read; raise a
    CheckpointError naming the first bad file. Without a manifest it is accepted only when
    `trust_it` (or trusted earlier in this process). Returns whether to read it restricted
    (safe unpickler, weights_only): True unless the user trusts it."""
    p = Path(path)
    if trust_it:
        trust(p)
    if is_verified(p):
        return not is_trusted(p)
    if (p / MANIFEST_FILE).is_file() or not is_trusted(p):
        problem = verify_share(p)
        if problem:
            raise CheckpointError(problem)
        mark_verified(p)
    return not is_trusted(p)


# --------------------------------------------------------------------------- directories


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A megatron checkpoint directory written by this package (complete or not)."""
    p = Path(path)
    return (p / META_FILE).is_file() and (p / "metadata.json").is_file()


def is_complete(path: str | os.PathLike) -> bool:
    """Renamed into place with its manifest: what resume may pick."""
    p = Path(path)
    return is_checkpoint(p) and (p / MANIFEST_FILE).is_file()


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's `moe_rl.json` (plain JSON: safe to read before the digests)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not is_checkpoint(p):
        raise CheckpointError(f"{p} is not a moe_rl checkpoint (no {META_FILE} / metadata.json); "
                              "pass a directory written by Learner.save or tools/convert_checkpoint.py")
    try:
        meta = json.loads((p / META_FILE).read_text())
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise CheckpointError(f"checkpoint file {p / META_FILE} is damaged ({e}); restore the checkpoint "
                              "from a copy (or resume from an older one)") from e
    return meta


def step_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_<n>` directory (no temp ones), oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoints.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike, run_id: str | None = None) -> Path | None:
    """Newest complete checkpoint `step_<n>` under `<run_dir>/checkpoints`, of run `run_id`
    when given. Temp directories (`step_<n>.tmp-*`) and directories without a manifest are
    never picked."""
    for _, p in reversed(step_dirs(Path(run_dir) / "checkpoints")):
        if is_complete(p) and (run_id is None or read_meta(p).get("run_id") == run_id):
            return p
    return None


def remove_temps(parent: Path, pattern: str) -> list[Path]:
    """Clean up what killed atomic writes of `<pattern>` (a glob, e.g. "step_*") left under
    `parent`: `<name>.tmp-*` (a write cut short) and `<name>.deleting-*` (a retention cut
    short) are removed; `<name>.old-*` (the previous version, moved aside for a replacement)
    is removed when `<name>` exists, else moved back (the kill came between the two
    renames). Only the owner of `parent` calls this, at its start."""
    touched: list[Path] = []
    if not parent.is_dir():
        return touched
    for p in sorted([*parent.glob(f"{pattern}.tmp-*"), *parent.glob(f"{pattern}.deleting-*")]):
        _remove(p)
        touched.append(p)
    for p in sorted(parent.glob(f"{pattern}.old-*")):
        base = p.with_name(p.name.rsplit(".old-", 1)[0])
        if base.exists() or base.is_symlink():
            _remove(p)
        else:
            os.replace(p, base)
        touched.append(p)
    return touched


def remove_file_temps(parent: Path) -> list[Path]:
    """Remove the hidden `.<name>.<random>.tmp` files that a killed `atomic_write_text`
    left in `parent` (the owner of `parent` calls this, at its start)."""
    found = [p for p in parent.glob(".*.tmp") if p.is_file()] if parent.is_dir() else []
    for p in found:
        p.unlink(missing_ok=True)
    return found


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


# --------------------------------------------------------------------------- test hook


def kill_point(name: str) -> None:
    """Test hook for the chaos test (tests/test_checkpoint_safety.py): with
    `MOE_RL_TEST_KILL_AT=<name>` (or `<name>#<n>`) in the environment, this process SIGKILLs
    itself the first (n-th) time it reaches the point `name`. Unset, it does nothing.
    Points: save.begin, save.file (after each data file of a save), save.dcp, save.meta,
    save.config, save.manifest (before the rename), save.renamed (before retention)."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    point, _, nth = want.partition("#")
    if point != name:
        return
    _kill_hits[name] += 1
    if _kill_hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- failures


def causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps: its __cause__/__context__ chain and, for torch DCP's
    CheckpointException (a BaseException carrying {rank: (exception, traceback)}), each
    rank's exception."""
    out: list[BaseException] = []
    todo = [exc]
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
    import errno

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
    import errno

    name = errno.errorcode.get(e.errno or 0, "")
    fix = _OS_FIXES.get(name)
    where = f": {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
    return f"{e.strerror or name}{where}" + (f" ({fix})" if fix else "")


def describe(exc: BaseException) -> str:
    """`exc` as one line: torch DCP's CheckpointException (whose text holds every rank's
    traceback) as its first rank's exception; others' types named (moe_rl's errors need no
    name); whitespace collapsed, at most 500 characters."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return describe(inner)
    if isinstance(exc, OSError) and exc.filename:
        return describe_os_error(exc)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not type(exc).__module__.startswith("moe_rl."):  # our errors say what they are
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 500 else text[:497] + "..."
