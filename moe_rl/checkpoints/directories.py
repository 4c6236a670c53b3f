"""Which directories are checkpoints: any written by this package, complete ones (renamed
into place with their manifest), and the newest complete one of a run.

    latest_checkpoint("runs/x", run_id)     # what a resume picks; None when there is none
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from moe_rl.checkpoints import MANIFEST_FILE, META_FILE
from moe_rl.checkpoints.errors import CheckpointError

STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """The name of step `step`'s checkpoint directory, `step_<n>` (six digits at least)."""
    return f"step_{step:06d}"


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
