"""Files and directories that are complete or absent: written under a temp name, renamed last.

    atomic_write_text("runs/x/summary.json", text)   # readers never see half a file

    with atomic_output_dir("out/hf", force=False) as tmp:
        ... write files into tmp ...
    # out/hf now exists with everything; on an exception inside the block, tmp is removed
    # and out/hf is untouched (absent, or the previous version when force=True)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


def _inside(a: Path, b: Path) -> bool:
    """True when `a` is `b` or lies under it."""
    return a == b or b in a.parents


def check_distinct(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Refuse a destination that is, contains or sits inside the source: replacing it would
    destroy the input."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if _inside(d, s) or _inside(s, d):
        raise ValueError(f"destination {dst} overlaps the source {src}; pick another path")


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temp directory `<dst>.tmp-<nonce>` beside `dst`; rename it to `dst` when
    the block finishes, remove it when the block raises. An existing `dst` is an error
    unless `force`, in which case it is replaced only after the new one is complete."""
    dst = Path(dst)
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists; pass --force (force=True) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    nonce = uuid.uuid4().hex[:8]
    tmp = dst.with_name(f"{dst.name}.tmp-{nonce}")
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.with_name(f"{dst.name}.old-{nonce}")
            os.replace(dst, old)
            os.replace(tmp, dst)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temp file and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
