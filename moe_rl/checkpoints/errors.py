"""What a checkpoint that cannot be used says."""

from __future__ import annotations

TRUST_HINT = ("run.trust_checkpoint=true (train) or --trust (tools/convert_checkpoint.py; convert it to "
              "Hugging Face once that way for the other tools)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written as asked; the message names the file and
    the fix (one line: the command-line programs print it as it is)."""
