"""Whether a checkpoint may be read, and how.

    restricted = ensure_verified(path, trust=args.trust)   # before any file of it is read

Trust is the caller's to say on every read (`trust=`: run.trust_checkpoint, --trust); nothing
remembers it. What the process does remember is which checkpoints verified (`VERIFIED`),
with their manifest's (mtime, size) then, so that the next reader of the same directory (the
sampler's conversion of the checkpoint the learner just loaded, the export of the one it just
saved) does not hash every file again while the manifest is unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_rl.checkpoints import MANIFEST_FILE
from moe_rl.checkpoints.errors import CheckpointError
from moe_rl.checkpoints.manifest import verify_share


class VerifiedCheckpoints:
    """Checkpoint directories whose every file matched their manifest in this process; one
    counts as verified only while its manifest is the one that was checked."""

    def __init__(self) -> None:
        self._stamps: dict[Path, tuple[int, int]] = {}

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int]:
        st = (path / MANIFEST_FILE).stat()
        return st.st_mtime_ns, st.st_size

    def __contains__(self, path: str | os.PathLike) -> bool:
        p = Path(path).resolve()
        try:
            return self._stamps.get(p) == self._stamp(p)
        except OSError:
            return False

    def add(self, path: str | os.PathLike) -> None:
        """`path` verified just now (or was just written with its manifest)."""
        p = Path(path).resolve()
        self._stamps[p] = self._stamp(p)


VERIFIED = VerifiedCheckpoints()
"""This process's memory of verified checkpoints (a cache: it never changes a verdict)."""


def ensure_verified(path: str | os.PathLike, *, trust: bool = False) -> bool:
    """Verify checkpoint `path` against its manifest before anything of it is read; raise a
    CheckpointError naming the first bad file. Without a manifest it is accepted only when
    the user `trust`s it. Returns whether to read it restricted (safe unpickler,
    weights_only): True unless trusted."""
    p = Path(path)
    if trust and not (p / MANIFEST_FILE).is_file():
        return False
    if p not in VERIFIED:
        problem = verify_share(p)
        if problem:
            raise CheckpointError(problem)
        VERIFIED.add(p)
    return not trust
