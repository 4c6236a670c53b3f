"""Result files committed in batches as they land, not one commit per seed.

A study runs for hours across sessions; each finished run writes a small result file at once
(so a stop loses nothing finished), and the files are committed a few at a time: a commit
every `every` files, and whatever is pending when a block ends or the runner stops. Only the
result paths go into a commit: whatever else the working tree holds stays out of it.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

COMMIT_EVERY = 4
"""Result files per commit while a block runs (two runs at a time: about one commit per pair
of rounds); a block's end commits the rest."""

SUBJECT_LIMIT = 72


@dataclass
class _Landed:
    path: Path
    line: str
    collapsed: bool


@dataclass
class ResultCommits:
    """Collects finished runs' result files and commits them in batches.

    `study` starts every subject ("mismatch pilot-lr: 4 runs landed, 1 collapsed"); each run's
    own line ("grpo seed 3 kept training (final reward 0.562, k3 5.84e-13)") goes in the body.
    With `enabled` false nothing is committed (the files are still written by the caller)."""

    study: str
    enabled: bool = True
    every: int = COMMIT_EVERY
    _pending: dict[str, list[_Landed]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, block: str, path: Path, line: str, collapsed: bool) -> None:
        """Record one landed file; commits the block's batch once it holds `every` files."""
        if not self.enabled:
            return
        with self._lock:
            self._pending.setdefault(block, []).append(_Landed(path, line, collapsed))
            if len(self._pending[block]) >= self.every:
                self._commit(block)

    def flush(self, block: str | None = None) -> None:
        """Commit what is pending (of `block`, or of every block)."""
        with self._lock:
            for name in [block] if block is not None else list(self._pending):
                self._commit(name)

    def _commit(self, block: str) -> None:
        landed = self._pending.pop(block, [])
        if not landed:
            return
        collapsed = sum(x.collapsed for x in landed)
        subject = f"{self.study} {block}: {len(landed)} run(s) landed, {collapsed} collapsed"
        body = "\n".join(f"- {x.line}" for x in landed)
        commit_paths([x.path for x in landed], subject[:SUBJECT_LIMIT] + "\n\n" + body)


def commit_paths(paths: list[Path], message: str) -> None:
    """Commit `paths` alone with `message`, retrying while another git command holds the index
    (work goes on in the same checkout); a failure is printed, never raised: the files are
    written already and the next batch or a hand commit picks them up."""
    repo = paths[0].parent
    names = [str(p) for p in paths]
    err = ""
    for attempt in range(20):
        add = subprocess.run(["git", "add", "--", *names], cwd=repo, capture_output=True, text=True)
        if add.returncode == 0:
            proc = subprocess.run(["git", "commit", "-q", "-m", message, "--", *names], cwd=repo,
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                return
            err = proc.stderr
        else:
            err = add.stderr
        if "index.lock" not in err:
            break
        time.sleep(0.5 * (attempt + 1))
    print(f"!! could not commit {len(paths)} result file(s) ({names[0]}, ...): "
          f"{err.strip() or 'nothing to commit'}", flush=True)
