"""The temp names of atomic directory writes: putting a finished `<name>.tmp-<nonce>` in
place of `<name>`, and cleaning up what a killed write left.

    rename_into_place(tmp, path)            # the last act of a save
    remove_temps(run_dir / "checkpoints", "step_*")   # at the owner's next start
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def rename_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished directory `tmp` to `path`, replacing an existing `path` only now
    (moved aside as `<name>.old-<nonce>` between the two renames, then removed), and sync
    the parent so the rename itself survives a power cut."""
    if path.exists():
        old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
