"""Text <-> token ids for a run: the checkpoint's own tokenizer (or the shipped SentencePiece
model for the project's own models) and the chat template that turns problems into prompts.

    tok = load_tokenizer(cfg.task.tokenizer, cfg.run.init_checkpoint)
    check_fits_model(tok, cfg.model.vocab_size)
    ids = PromptEncoder.from_config(cfg.task, tok).encode(problem)
"""

from moe_rl.tokenization.hf import TOKENIZER_FILES, HFTokenizer, TokenizerError, declared_ids
from moe_rl.tokenization.prompts import PromptEncoder
from moe_rl.tokenization.resolve import (
    SHIPPED,
    check_fits_model,
    has_own_tokenizer,
    load_tokenizer,
    resolve_spec,
)

__all__ = [
    "SHIPPED",
    "TOKENIZER_FILES",
    "HFTokenizer",
    "PromptEncoder",
    "TokenizerError",
    "check_fits_model",
    "declared_ids",
    "has_own_tokenizer",
    "load_tokenizer",
    "resolve_spec",
]
