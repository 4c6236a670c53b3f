"""A checkpoint's manifest: written at save, verified at load.

    digests = digest_files(tmp, list_files(tmp))      # at save, after every file is written
    write_manifest(tmp, digests)                      # last, then the directory is renamed
    problem = verify_share(path, rank, world)         # at load: this rank's share of the files
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from moe_rl.checkpoints import CONFIG_FILE, MANIFEST_FILE
from moe_rl.checkpoints.errors import TRUST_HINT, CheckpointError

UNHASHED = (CONFIG_FILE,)
MANIFEST_FORMAT = 1
_RESTORE = "restore the checkpoint from a copy (or resume from an older one)"


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
    """{name: file_digest} of each of `names` under `path`."""
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
    if not f.is_file():
        return f"checkpoint file {f} is missing ({MANIFEST_FILE} lists it); {_RESTORE}"
    size = f.stat().st_size
    if size != want.get("size"):
        what = "truncated" if size < want.get("size", 0) else "longer than saved"
        return f"checkpoint file {f} is {what} ({size} bytes, {MANIFEST_FILE} says {want.get('size')}); {_RESTORE}"
    if file_digest(f)["sha256"] != want.get("sha256"):
        return f"checkpoint file {f} is corrupt (its SHA-256 differs from {MANIFEST_FILE}); {_RESTORE}"
    return None


def unlisted_files(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Files under `path` that the manifest does not cover (added after the save)."""
    return [n for n in list_files(path) if n not in manifest["files"]]


def verify_share(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Check this rank's share of the manifest's files (all of them at world 1). Returns
    the first problem as a one-line message, None when every file of the share verifies.
    A checkpoint without a manifest is a problem here; `trust.ensure_verified` knows about
    trust."""
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
    """Why a checkpoint without a manifest is refused, and how to vouch for it."""
    return (f"checkpoint {path} has no {MANIFEST_FILE}: nothing vouches for its files, and its pickled "
            f"metadata could run code when read; if you trust where it came from, pass {TRUST_HINT}")
