"""The shell commands of the README and docs/, as a reader would type them: extraction from
the fenced `bash` / `sh` blocks, and the rewrites that let a test run them outside the
reader's machine (their outputs into a temp dir, their placeholders into real files).

    for cmd in doc_commands(ROOT / "README.md", ROOT):
        cmd.where, cmd.env, cmd.argv      # "README.md:44", (("VAR", "1"),), ("python", "-m", ...)
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```(\S*)\s*$")
OPTIONAL_FLAG = re.compile(r"\[(--[^\[\]]*)\]")  # `[--max-problems 500]` documents an optional flag
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Where a documented command writes: the flag or key, and the value is the output path.
OUTPUT_FLAGS = ("--dst", "--out")
OUTPUT_KEYS = ("sft.output=",)


@dataclass(frozen=True)
class DocCommand:
    """One command of a shell block (backslash continuations joined, comments dropped)."""

    where: str
    """`file:line` of the command's first line, relative to the repository root."""
    env: tuple[tuple[str, str], ...]
    """Leading `VAR=value` assignments."""
    argv: tuple[str, ...]
    """The command's words, optional flags (`[--k 8]`) taken as given."""

    @property
    def text(self) -> str:
        return shlex.join(self.argv)


def doc_commands(path: Path, root: Path) -> list[DocCommand]:
    """Every command of every shell block of the Markdown file `path`, in file order."""
    name, out = str(path.relative_to(root)), []
    block, pending, start = None, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            block = fence.group(1) if block is None else None
            continue
        if block not in SHELL_BLOCKS:
            continue
        start = start if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(OPTIONAL_FLAG.sub(r"\1", pending + line), comments=True)
        pending = ""
        if words:
            env = []
            while words and ENV_ASSIGNMENT.match(words[0]):
                key, value = words.pop(0).split("=", 1)
                env.append((key, value))
            out.append(DocCommand(f"{name}:{start}", tuple(env), tuple(words)))
    return out


def redirect_outputs(argv: tuple[str, ...], tmp: Path) -> tuple[str, ...]:
    """The command with each output path (`--dst X`, `--out X`, `sft.output=X`) moved into
    `tmp` (same base name): documented commands must not write into the tree or /tmp."""
    out = list(argv)
    for i, word in enumerate(out):
        if i and out[i - 1] in OUTPUT_FLAGS:
            out[i] = str(tmp / Path(word).name)
        for key in OUTPUT_KEYS:
            if word.startswith(key):
                out[i] = key + str(tmp / Path(word[len(key):]).name)
    return tuple(out)


def replace_paths(argv: tuple[str, ...], stand_ins: dict[str, str]) -> tuple[str, ...]:
    """Each word, or the value of a `key=value` word, that is a documented path in
    `stand_ins` (or lies under one) replaced by its stand-in."""

    def swap(path: str) -> str:
        for doc_path, real in stand_ins.items():
            if path == doc_path or path.startswith(doc_path + "/"):
                return real + path[len(doc_path):]
        return path

    out = []
    for word in argv:
        key, eq, value = word.partition("=")
        out.append(key + eq + swap(value) if eq and not word.startswith("-") else swap(word))
    return tuple(out)
