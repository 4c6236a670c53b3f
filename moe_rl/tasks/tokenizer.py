"""The project's tiny SentencePiece tokenizer: training, the learner's wrapper, HF export.

The shipped model `assets/moe_rl_tiny.model` (~1.5 KB) is regenerated, byte for byte, by

    python -m moe_rl.tasks.tokenizer --out moe_rl/tasks/assets [--hf-out DIR]

It is a 128-piece BPE model trained on text from the synthetic tasks plus a few math-like
lines (fixed seeds, one thread), with choices that make the digit tasks easy to learn and
the ids identical in the learner, transformers and vLLM:

- ids 0-3 are <pad>, <unk>, <s> (BOS), </s> (EOS); nothing adds BOS or EOS implicitly;
- every digit is its own token (split_digits), so "48213" is always 5 tokens;
- every printable ASCII character is a piece; anything else is <unk> (no byte fallback:
  its 256 byte pieces would not fit the 128-entry vocabulary);
- no dummy prefix, no whitespace folding, identity normalization: encoding is lossless for
  ASCII (decode(encode(s)) == s) and a space starts a token ("▁"), so splitting a text
  before a space does not change its ids: encode(p) + encode(" 31284") == encode(p + " 31284").

`write_hf_tokenizer(dir)` adds tokenizer.json (a `tokenizers` BPE built from the same
pieces), tokenizer.model and tokenizer_config.json to a Hugging Face model directory, so
`AutoTokenizer.from_pretrained(dir)` and vLLM produce the same ids as `Tokenizer.encode`
(no BOS, no prefix space). One known difference: a prompt containing the literal text
"</s>" (or another special piece) is one special token for transformers and plain
characters for SentencePiece; no task prompt contains them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import string
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import sentencepiece as spm

from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.tasks.base import sft_examples
from moe_rl.tasks.synthetic import AddTask, ReverseTask, SortTask

if TYPE_CHECKING:
    import tokenizers

ASSETS_DIR = Path(__file__).parent / "assets"
SHIPPED_MODEL = ASSETS_DIR / "moe_rl_tiny.model"

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
VOCAB_SIZE = 128
WHITESPACE = "▁"  # SentencePiece's visible space (U+2581)
# Printable ASCII minus the space, which SentencePiece turns into WHITESPACE.
ASCII_CHARS = "".join(c for c in string.printable if c.isprintable() and c != " ")

# Everything that shapes the model; changing any of it changes the shipped file.
TRAINER_OPTIONS = {
    "model_type": "bpe",
    "vocab_size": VOCAB_SIZE,
    "character_coverage": 1.0,
    "required_chars": ASCII_CHARS,
    "split_digits": True,
    "byte_fallback": False,
    "add_dummy_prefix": False,
    "remove_extra_whitespaces": False,
    "normalization_rule_name": "identity",
    "pad_id": PAD_ID,
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "pad_piece": PAD,
    "unk_piece": UNK,
    "bos_piece": BOS,
    "eos_piece": EOS,
    "num_threads": 1,
    "shuffle_input_sentence": False,
    "input_sentence_size": 0,
    "minloglevel": 2,
}

CORPUS_SEED = 0
TASK_LINES = 2000  # per synthetic task
MATH_LINES = 600
_MATH_TEMPLATES = (
    "What is {a} + {b}?",
    "What is {a} - {b}?",
    "What is {a} * {b}?",
    "Compute {a}/{b}.",
    "Solve for x: {a}x + {b} = {c}.",
    "The answer is \\boxed{{{c}}}.",
    "So x = \\frac{{{a}}}{{{b}}} and the answer is \\boxed{{-{c}}}.",
    "It costs ${a}.{b}, or {a},{c} in total.",
    "{a}% of {b} is {c}.",
    "Find y if y = {a}.{b}e-{c}.",
)


# --------------------------------------------------------------------------- training


def training_corpus() -> list[str]:
    """The training text: SFT lines of every synthetic task (1-8 digits) + math-like lines."""
    lines = []
    for offset, task in enumerate((ReverseTask(1, 8), SortTask(1, 8), AddTask(1, 8))):
        pairs = sft_examples(task, TASK_LINES, seed=CORPUS_SEED + offset)
        lines += [prompt + completion for prompt, completion in pairs]
    rng = np.random.default_rng(CORPUS_SEED)
    for i in range(MATH_LINES):
        a, b, c = (int(v) for v in rng.integers(0, 1000, size=3))
        lines.append(_MATH_TEMPLATES[i % len(_MATH_TEMPLATES)].format(a=a, b=b, c=c))
    return lines


def train_tokenizer(out_path: str | os.PathLike, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train the tokenizer on `training_corpus()` and write the model file to `out_path`."""
    model = io.BytesIO()
    options: dict[str, Any] = {**TRAINER_OPTIONS, "vocab_size": vocab_size}
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_corpus()), model_writer=model, **options
    )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(model.getvalue())
    return out_path


# --------------------------------------------------------------------------- wrapper


class Tokenizer:
    """A SentencePiece model as the learner and trainer use it (picklable).

    `model_path` is a .model file, a directory holding tokenizer.model, or None for the
    shipped model.

    `encode` adds no BOS/EOS unless asked; `decode` drops special and out-of-range ids (a
    model whose vocabulary is padded past the tokenizer's may sample those). Models without
    a pad piece use EOS for padding.
    """

    def __init__(self, model_path: str | os.PathLike | None = None) -> None:
        self.path = Path(model_path) if model_path else SHIPPED_MODEL
        if self.path.is_dir():  # a Hugging Face model directory written by write_hf_tokenizer
            self.path = self.path / "tokenizer.model"
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer model {self.path} does not exist")
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size: int = self._sp.get_piece_size()
        self.unk_id: int = self._sp.unk_id()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        if self.eos_id < 0:
            raise ValueError(f"tokenizer model {self.path} has no EOS piece; sampling needs one")
        self.pad_id: int = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
        self.eos_ids: list[int] = [self.eos_id]
        self.chat_template: str | None = None  # SentencePiece models carry none

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, with BOS/EOS only when asked."""
        ids = self._sp.encode(text)
        if bos:
            if self.bos_id < 0:
                raise ValueError(f"tokenizer model {self.path} has no BOS piece")
            ids = [self.bos_id, *ids]
        return [*ids, self.eos_id] if eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: pad/BOS/EOS and ids outside the vocabulary are dropped, <unk> is " ⁇ "."""
        kept = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        return self._sp.decode(kept)

    def encode_example(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids + EOS): one SFT example, tokenized as the policy
        would produce it when the completion starts with a space (all tasks' do)."""
        return self.encode(prompt), self.encode(completion, eos=True)

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """The piece strings of `ids` (for debugging and tests)."""
        return [self._sp.id_to_piece(int(i)) for i in ids]


def load_sentencepiece(path: str | os.PathLike | None = "") -> Tokenizer:
    """A SentencePiece model path, or "" / None / "shipped" for the shipped model. (A run's
    `task.tokenizer` is resolved by `moe_rl.tokenization.load_tokenizer`.)"""
    return Tokenizer(None if path in (None, "", "shipped") else path)


# --------------------------------------------------------------------------- HF export


def _load_proto(model_path: Path):  # -> sentencepiece_model_pb2.ModelProto
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # (generated protobuf code: no stub declares it)
    proto.ParseFromString(model_path.read_bytes())
    return proto


def _check_convertible(proto, model_path: Path) -> None:
    """The HF pipeline below reproduces SentencePiece only for models trained like ours."""
    normalizer, trainer = proto.normalizer_spec, proto.trainer_spec
    problems = []
    if trainer.model_type != trainer.BPE:
        problems.append("model_type is not bpe")
    if trainer.byte_fallback:
        problems.append("byte_fallback is on")
    if normalizer.add_dummy_prefix:
        problems.append("add_dummy_prefix is on")
    if normalizer.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces is on")
    if normalizer.precompiled_charsmap:
        problems.append(f"normalization is {normalizer.name!r}, not identity")
    if problems:
        raise ValueError(
            f"cannot export {model_path} to a Hugging Face tokenizer: {', '.join(problems)}. "
            "Only models trained by moe_rl.tasks.tokenizer.train_tokenizer are supported; "
            "use a real model's own tokenizer files instead."
        )


def build_hf_tokenizer(model_path: str | os.PathLike | None = None) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` that encodes and decodes like the SentencePiece model."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers.models import BPE

    path = Path(model_path) if model_path else SHIPPED_MODEL
    proto = _load_proto(path)
    _check_convertible(proto, path)
    normal = proto.SentencePiece.NORMAL
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    # SentencePiece BPE merges the adjacent pair whose union has the best score; pieces are
    # stored best first, so listing each merged piece's splits in piece order gives the
    # same priorities as merge ranks.
    merges = [
        (p.piece[:k], p.piece[k:])
        for p in proto.pieces
        if p.type == normal
        for k in range(1, len(p.piece))
        if p.piece[:k] in vocab and p.piece[k:] in vocab
    ]
    tok = HfTokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=proto.trainer_spec.unk_piece, fuse_unk=True)
    )
    # Spaces become "▁" and start a new word, never prepended: SentencePiece without the
    # dummy prefix. Decoding maps "▁" back to a space, keeping a leading one.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(WHITESPACE, prepend_scheme="never", split=True)
    tok.decoder = decoders.Metaspace(WHITESPACE, prepend_scheme="never", split=True)
    tok.add_special_tokens(
        [
            AddedToken(p.piece, special=True, normalized=False)
            for p in proto.pieces
            if p.type in (proto.SentencePiece.CONTROL, proto.SentencePiece.UNKNOWN)
        ]
    )
    return tok


def probe_texts() -> list[str]:
    """Strings on which the SentencePiece and HF tokenizers must agree: task lines and ASCII."""
    lines = training_corpus()[::50]
    return [*lines, ASCII_CHARS, " " + ASCII_CHARS + "  ", "rev 48213 =", " 31284", ""]


def _check_same_ids(hf_tok: tokenizers.Tokenizer, sp: Tokenizer, texts: Sequence[str]) -> None:
    for text in texts:
        want, got = sp.encode(text), hf_tok.encode(text, add_special_tokens=True).ids
        if want != got:
            raise RuntimeError(
                f"HF tokenizer disagrees with {sp.path} on {text!r}: {got} vs {want}"
            )


def write_hf_tokenizer(
    out_dir: str | os.PathLike, model_path: str | os.PathLike | None = None
) -> Path:
    """Write tokenizer.json, tokenizer.model, tokenizer_config.json and
    special_tokens_map.json into `out_dir` (a Hugging Face model directory).

    Checks before writing that the HF tokenizer gives the SentencePiece ids on
    `probe_texts()`. The model's config.json should carry bos_token_id, eos_token_id and
    pad_token_id from `Tokenizer` (the checkpoint converter writes it).
    """
    sp = Tokenizer(model_path)
    hf_tok = build_hf_tokenizer(sp.path)
    _check_same_ids(hf_tok, sp, probe_texts())

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special = {
        name: sp.pieces([i])[0]
        for name, i in (
            ("bos_token", sp.bos_id),
            ("eos_token", sp.eos_id),
            ("unk_token", sp.unk_id),
            ("pad_token", sp.pad_id),
        )
        if i >= 0
    }
    config = {
        # The generic fast tokenizer: it reads tokenizer.json as is. A model-specific class
        # (LlamaTokenizer, Qwen2Tokenizer) would rebuild the pipeline with its own
        # prefix-space and BOS rules.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    atomic_write_text(out_dir / "tokenizer.json", hf_tok.to_str(pretty=True))
    atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(out_dir / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    # The SentencePiece file too, so the learner can load the tokenizer from the same dir.
    shutil.copyfile(sp.path, out_dir / "tokenizer.model")
    return out_dir


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m moe_rl.tasks.tokenizer",
        description="Train the shipped tiny SentencePiece tokenizer (deterministic).",
    )
    parser.add_argument("--out", default=str(ASSETS_DIR), help="directory for moe_rl_tiny.model")
    parser.add_argument("--hf-out", default="", help="also write HF tokenizer files here")
    args = parser.parse_args(argv)
    path = train_tokenizer(Path(args.out) / SHIPPED_MODEL.name)
    tok = Tokenizer(path)
    print(f"wrote {path} ({path.stat().st_size} bytes, vocab_size={tok.vocab_size})")
    if args.hf_out:
        print(f"wrote HF tokenizer files to {write_hf_tokenizer(args.hf_out, path)}")


if __name__ == "__main__":
    main()
