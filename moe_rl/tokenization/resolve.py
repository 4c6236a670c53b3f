"""Which tokenizer a run uses (`task.tokenizer`), and the check that it fits the model.

Never a silent fallback: a checkpoint with its own tokenizer is always paired with it, and
the shipped 128-piece SentencePiece model is used only for the project's own models:
- `auto` (or ""): a Hugging Face directory's own files (a `tokenizer.model` byte-identical
  to the shipped one marks the project's own exported models and loads as SentencePiece,
  same ids); a moe_rl checkpoint's recorded `task.tokenizer` (its config.yaml); no
  checkpoint at all (a model built from the recipe): the shipped model. A Hugging Face
  directory without tokenizer files is an error naming the fix.
- `shipped`: the shipped model; refused for a checkpoint that has a tokenizer of its own.
- a path: a tokenizer directory or tokenizer.json (Hugging Face), or a `.model` file
  (SentencePiece).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moe_rl.tokenization.hf import HFTokenizer, TokenizerError

SHIPPED = "shipped"


def _is_shipped_file(path: Path) -> bool:
    from moe_rl.tasks.tokenizer import SHIPPED_MODEL

    return path.is_file() and path.read_bytes() == SHIPPED_MODEL.read_bytes()


def has_own_tokenizer(directory: Path) -> bool:
    """A Hugging Face directory that carries tokenizer files other than the shipped model."""
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        return not _is_shipped_file(directory / "tokenizer.model")
    return (directory / "tokenizer.model").is_file() and not _is_shipped_file(directory / "tokenizer.model")


def _recorded_tokenizer(checkpoint: Path) -> str:
    """The `task.tokenizer` a moe_rl checkpoint's config.yaml records ("" is the shipped one)."""
    import yaml

    try:
        data = yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise TokenizerError(f"{checkpoint}/config.yaml: cannot read the recorded tokenizer ({e})") from None
    recorded = str(((data.get("task") or {}).get("tokenizer")) or "")
    if recorded in ("", "auto", SHIPPED):
        return SHIPPED
    from moe_rl.config.shipped import shipped_path

    return shipped_path(recorded)  # (a shipped base records its shipped tokenizer by its place in the tree)


def resolve_spec(spec: str, checkpoint: str | os.PathLike | None) -> str:
    """`task.tokenizer` made concrete: "shipped" or a path (see the module docstring)."""
    ckpt = Path(checkpoint) if checkpoint else None
    hf_dir = ckpt if ckpt is not None and (ckpt / "config.json").is_file() else None
    if spec in ("", "auto"):
        if hf_dir is not None:
            if has_own_tokenizer(hf_dir):
                return str(hf_dir)
            if _is_shipped_file(hf_dir / "tokenizer.model"):
                return SHIPPED
            raise TokenizerError(f"run.init_checkpoint={hf_dir} has no tokenizer files (tokenizer.json, "
                                 "tokenizer_config.json or tokenizer.model); set task.tokenizer=<its tokenizer directory>")
        if ckpt is not None and (ckpt / "config.yaml").is_file():
            return _recorded_tokenizer(ckpt)
        return SHIPPED
    if spec == SHIPPED and hf_dir is not None and has_own_tokenizer(hf_dir):
        raise TokenizerError(f"task.tokenizer=shipped but run.init_checkpoint={hf_dir} has its own tokenizer; the "
                             "shipped 128-piece model would encode prompts into ids that mean something else. "
                             "Use task.tokenizer=auto")
    return spec


def load_tokenizer(spec: str = "auto", checkpoint: str | os.PathLike | None = None) -> Any:
    """The tokenizer for `task.tokenizer=spec` with `run.init_checkpoint=checkpoint`."""
    from moe_rl.tasks.tokenizer import Tokenizer

    concrete = resolve_spec(spec, checkpoint)
    if concrete == SHIPPED:
        return Tokenizer(None)
    path = Path(concrete)
    if not path.exists():
        raise TokenizerError(f"task.tokenizer={concrete} does not exist; give a tokenizer directory, "
                             "tokenizer.json or .model file, or auto for the checkpoint's own")
    model_dir = Path(checkpoint) if checkpoint and (Path(checkpoint) / "config.json").is_file() else None
    if path.suffix == ".model" or (path.is_dir() and _only_sentencepiece(path)):
        return Tokenizer(path)
    return HFTokenizer(path, model_dir=model_dir)


def _only_sentencepiece(directory: Path) -> bool:
    """A directory read as SentencePiece: only a tokenizer.model, or the shipped one (the
    project's exports also carry an equivalent tokenizer.json; the .model is the reference)."""
    sp = directory / "tokenizer.model"
    if _is_shipped_file(sp):
        return True
    return sp.is_file() and not (directory / "tokenizer.json").is_file() \
        and not (directory / "tokenizer_config.json").is_file()


def check_fits_model(tok: Any, vocab_size: int, where: str = "model.vocab_size") -> None:
    """The tokenizer's ids (vocabulary, EOS, pad) must all exist in the model's embedding."""
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"the tokenizer {tok!r} has {tok.vocab_size} tokens but {where}={vocab_size}: "
                             "it belongs to another model; use the checkpoint's own tokenizer")
    special = {"eos": getattr(tok, "eos_ids", [tok.eos_id]), "pad": [tok.pad_id]}
    for name, ids in special.items():
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise TokenizerError(f"the tokenizer's {name} id {bad[0]} is outside {where}={vocab_size}: "
                                 "the tokenizer and the model disagree")
