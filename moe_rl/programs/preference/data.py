r"""Preference pairs from a JSONL or Parquet file, and their token batches.

    {"prompt": "rev 48213 =", "chosen": " 31284", "rejected": " 31248"}
    {"messages": [{"role": "user", "content": "Solve x + 2 = 5."}],
     "chosen": [{"role": "assistant", "content": "x = 3"}], "rejected": "x = 7"}

A row holds the prompt as the RL dataset task reads it (a text under `task.prompt_key`, or a
chat under `task.messages_key`), and `chosen` and `rejected`, each a non-empty string or an
assistant message (a `{"role": "assistant", "content": ...}` object, or a list holding just
one), different from each other. A bad row is a one-line `DatasetError` naming the file, the
row (1-based line for JSONL, 0-based row for Parquet), the field and the fix.

Encoding: the prompt becomes ids exactly as the RL path encodes prompts (`PromptEncoder`:
the checkpoint's tokenizer and chat template, generation prompt included), and each response
`tokenizer.encode(text) + [EOS]`, the ids a policy would sample after that prompt. A batch of
P pairs is 2P rows: the P chosen responses, then the P rejected ones (`pair_rows`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_rl.batch import TokenBatch
from moe_rl.tasks.base import Problem
from moe_rl.tasks.dataset import (
    DatasetError,
    DatasetKeys,
    _describe,
    _prompt_or_messages,
    read_rows,
)

RESPONSE_FIELDS = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One prompt with a preferred and a dispreferred response."""

    problem: Problem
    """The prompt (text or chat), as the RL dataset task holds it; `meta["where"]` names the row."""
    chosen: str
    """The preferred response text (y_w)."""
    rejected: str
    """The dispreferred response text (y_l)."""


def _response(value: Any, where: str, field: str) -> str:
    """A response given as a string or as one assistant message."""
    message = value[0] if isinstance(value, list | tuple) and len(value) == 1 else value
    if isinstance(message, Mapping):
        if message.get("role") != "assistant":
            raise DatasetError(f"{where}: {field!r} is a message with role {_describe(message.get('role'))}; "
                               "a response must be an 'assistant' message (or a string)")
        message = message.get("content")
    if not isinstance(message, str):
        raise DatasetError(f"{where}: {field!r} must be a string or one assistant message "
                           f"{{\"role\": \"assistant\", \"content\": ...}}, got {_describe(value)}; fix the row")
    if not message.strip():
        raise DatasetError(f"{where}: {field!r} is empty; a preference pair needs two non-empty responses")
    return message


def row_pair(record: Any, where: str, keys: DatasetKeys, meta: dict[str, Any]) -> PreferencePair:
    """The pair of one row; anything malformed is a DatasetError naming `where` and the field."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}; write one object per row")
    prompt, messages = _prompt_or_messages(record, where, keys)
    texts = []
    for field in RESPONSE_FIELDS:
        if record.get(field) is None:
            names = ", ".join(str(k) for k in record if record[k] is not None)[:200] or "(none)"
            raise DatasetError(f"{where}: no {field!r} key; the row has keys: {names}; a preference row needs "
                               "'chosen' and 'rejected'")
        texts.append(_response(record[field], where, field))
    if texts[0] == texts[1]:
        raise DatasetError(f"{where}: 'chosen' and 'rejected' are the same text; a pair must differ "
                           "(drop the row)")
    return PreferencePair(Problem(prompt=prompt, answer="", meta={**meta, "where": where}, messages=messages),
                          texts[0], texts[1])


def load_pairs(path: str | os.PathLike, keys: DatasetKeys | None = None) -> list[PreferencePair]:
    """Every row of a preference file, in file order; the first bad row is an error."""
    path, keys = Path(path), keys or DatasetKeys()
    pairs = [row_pair(record, where, keys, {"path": str(path), "line": number})
             for number, where, record in read_rows(path)]
    if not pairs:
        raise DatasetError(f"{path}: no rows; add rows with {keys.prompt!r} (or {keys.messages!r}), "
                           "'chosen' and 'rejected'")
    return pairs


def pairs_of_step(pairs: list[PreferencePair], step: int, n: int, seed: int, shuffle: bool = True) -> list[PreferencePair]:
    """Pairs [step*n, (step+1)*n) of perm_0 + perm_1 + ... (one seeded permutation per
    epoch, file order without `shuffle`): a pure function of the step, so a resumed run
    trains on exactly the pairs the interrupted one would have."""
    orders: dict[int, np.ndarray] = {}
    out = []
    for position in range(step * n, (step + 1) * n):
        epoch, i = divmod(position, len(pairs))
        if epoch not in orders:
            orders[epoch] = (np.random.default_rng([seed, epoch]).permutation(len(pairs)) if shuffle
                             else np.arange(len(pairs)))
        out.append(pairs[int(orders[epoch][i])])
    return out


def encode_pairs(pairs: list[PreferencePair], encoder: Any, seq_multiple: int = 1) -> TokenBatch:
    """2P rows: chosen responses (rows 0..P-1), then rejected ones (P..2P-1), after their
    prompt's ids (`encoder`: a `PromptEncoder`)."""
    tok = encoder.tokenizer
    prompts = [encoder.encode(p.problem) for p in pairs]
    responses = [tok.encode(p.chosen, eos=True) for p in pairs] + [tok.encode(p.rejected, eos=True) for p in pairs]
    return TokenBatch.from_lists(prompts + prompts, responses, pad_id=tok.pad_id, seq_multiple=seq_multiple)


def pair_rows(seq_logp_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([P] chosen, [P] rejected) halves of a 2P-row quantity laid out by `encode_pairs`."""
    P = seq_logp_B.shape[0] // 2
    return seq_logp_B[:P], seq_logp_B[P:]
