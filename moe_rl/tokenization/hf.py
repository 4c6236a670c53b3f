"""A checkpoint's own tokenizer, through `transformers.AutoTokenizer` (fast tokenizers only).

`HFTokenizer` has the interface the trainer, SFT and the mismatch tool use for the shipped
SentencePiece model (`moe_rl.tasks.tokenizer.Tokenizer`): `encode` (plain text, no special
tokens added), `decode` (special and out-of-range ids dropped), `eos_id` / `eos_ids`,
`pad_id`, `vocab_size` (every id the tokenizer can produce, added tokens included), plus the
`chat_template` the checkpoint ships.

EOS ids: every id the checkpoint declares: the tokenizer's eos token, then
generation_config.json's `eos_token_id` (an int or a list, e.g. Qwen's `<|im_end|>` and
`<|endoftext|>`), then config.json's. Sampling stops on any of them. Pad: the tokenizer's pad
token, else generation_config.json's `pad_token_id`, else the first EOS id.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
"""Files a Hugging Face directory may carry for its tokenizer (copied whole on export)."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or does not fit its model (one line, with the fix)."""


def declared_ids(model_dir: Path, key: str) -> list[int]:
    """`key` (eos_token_id, pad_token_id) from generation_config.json, then config.json, as a
    list: both files may give an int, a list or null."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get(key)
        except (OSError, json.JSONDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read it ({e})") from None
        for i in [value] if isinstance(value, int) else (value or []):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


class HFTokenizer:
    """A Hugging Face tokenizer directory (or a directory holding tokenizer.json)."""

    def __init__(self, path: str | os.PathLike, model_dir: str | os.PathLike | None = None) -> None:
        """`path`: the tokenizer's directory or its tokenizer.json; `model_dir`: where
        generation_config.json / config.json declare EOS and pad ids (default: `path`)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

        self.path = Path(path)
        directory = self.path.parent if self.path.is_file() else self.path
        tok: PreTrainedTokenizerBase
        try:
            if self.path.is_file():  # a bare tokenizer.json
                tok = PreTrainedTokenizerFast(tokenizer_file=str(self.path))
            else:
                tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TokenizerError(f"{self.path}: cannot load a Hugging Face tokenizer: {' '.join(str(e).split())[:300]}") from None
        self._tok = tok
        self.vocab_size: int = len(tok)
        model_dir = Path(model_dir) if model_dir else directory
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        self.eos_ids: list[int] = list(dict.fromkeys(eos + declared_ids(model_dir, "eos_token_id")))
        if not self.eos_ids:
            raise TokenizerError(f"{self.path}: no EOS token (neither the tokenizer nor generation_config.json "
                                 "declares eos_token_id); sampling needs one to stop")
        self.eos_id: int = self.eos_ids[0]
        pads = declared_ids(model_dir, "pad_token_id")
        self.pad_id: int = tok.pad_token_id if tok.pad_token_id is not None else (pads or self.eos_ids)[0]
        self.bos_id: int = tok.bos_token_id if tok.bos_token_id is not None else -1
        self.chat_template: str | None = tok.chat_template if isinstance(tok.chat_template, str) else None

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids})"

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (chat templates, tests)."""
        return self._tok

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text` alone: no special tokens unless asked."""
        ids = self._tok.encode(text, add_special_tokens=False)
        if bos:
            if self.bos_id < 0:
                raise TokenizerError(f"{self.path}: the tokenizer has no BOS token")
            ids = [self.bos_id, *ids]
        return [*ids, self.eos_id] if eos else ids

    def encode_with_specials(self, text: str) -> list[int]:
        """`tokenizer(text)`: the ids a plain-text prompt gets (the tokenizer's BOS rule)."""
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` without special tokens; ids past the vocabulary (a padded
        embedding may sample them) are dropped."""
        kept = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        return _text(self._tok.decode(kept, skip_special_tokens=True))

    def encode_example(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids + EOS) for a supervised example."""
        return self.encode(prompt), self.encode(completion, eos=True)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        pieces = self._tok.convert_ids_to_tokens([int(i) for i in ids])
        return [pieces] if isinstance(pieces, str) else pieces

    def render_chat(self, messages: Sequence[dict[str, Any]], template: str, tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The text of `messages` under `template` (with `tools`: plain functions or JSON
        schemas, shown as the template shows them), by default ending with the assistant
        turn's opening."""
        return _text(self._tok.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                                   tools=list(tools) if tools else None,
                                                   add_generation_prompt=add_generation_prompt))


def _text(out: object) -> str:
    """A transformers call's text (its annotations allow lists and encodings for other arguments)."""
    if not isinstance(out, str):
        raise TypeError(f"the tokenizer returned {type(out).__name__} where text was expected")
    return out
