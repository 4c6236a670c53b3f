"""Checkpoint directories on disk, without megatron (the learner's `checkpoint` module
writes and reads their contents through megatron-core).

A checkpoint is `<dir>/` with megatron's files, `moe_rl.json` and `config.yaml`, and
`manifest.json`: the size and SHA-256 of every file but `config.yaml` (human-editable text
that is only ever read with a safe YAML loader and validated strictly, so a user may fix a
tokenizer path in it) and the manifest itself. It is written last, into the temp directory,
which is then renamed: a directory named `step_<n>` with a manifest is complete.

    errors       CheckpointError, and the hint that says how to trust a checkpoint
    manifest     write and verify the manifest (SHA-256 of every file)
    trust        whether a checkpoint may be read, and whether restricted
    directories  which directories are checkpoints, complete ones, the newest of a run
    temps        renaming a finished temp directory into place, cleaning up killed writes
    chaos        the chaos test's kill hook (MOE_RL_TEST_KILL_AT)

Trust model (docs/checkpoints.md): megatron's files include pickles. Nothing of a checkpoint
is unpickled before its manifest verifies; one without a manifest loads only when the user
says it is trusted (`run.trust_checkpoint=true`, `--trust`, passed as `trust=` by every
reader). A verified checkpoint is still read restricted (`.metadata` through an unpickler
that builds only DCP's metadata classes, every `torch.load` weights_only) unless the user
trusts it: a manifest proves the files are the ones saved, not who saved them. A manifest
that does not verify is never overridden by trust: a file that differs from its recorded
digest is damaged (delete manifest.json to vouch for the files yourself).
"""

from __future__ import annotations

MANIFEST_FILE = "manifest.json"
"""Size and SHA-256 of every other file but the config; written last."""
META_FILE = "moe_rl.json"
"""Step, layout, run id, format version: plain JSON, safe to read before verification."""
CONFIG_FILE = "config.yaml"
"""The resolved run config; not hashed (a user may fix a path in it)."""
