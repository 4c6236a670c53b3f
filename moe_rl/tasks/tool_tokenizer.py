"""The shipped tool tokenizer: a 512-entry byte-level BPE with a Qwen3-style chat template.

The files in `moe_rl/assets/tool_tokenizer/` are regenerated, byte for byte, by

    python -m moe_rl.tasks.tool_tokenizer [--out DIR]

and load with `moe_rl.tokenization.load_tokenizer(dir)` (an `HFTokenizer`, EOS ids
[<|im_end|>, <|endoftext|>]) or `transformers.AutoTokenizer.from_pretrained(dir)`. It exists
so a tiny model can learn multi-turn tool calls (the `calculator` task) on a CPU: the same
turn and tool-call format as Qwen3, with a vocabulary small enough for a ~1M-parameter model.

Choices:
- byte level: every string encodes (a tool's result can be any text), and decoding is lossless;
- digits are isolated before the byte-level step (`Digits(individual_digits=True)`), so a
  number is always one token per digit and no merge holds a digit: the model sees the same
  digit tokens in the question, the tool call, the tool's result and the answer;
- no regex split inside the byte-level step: merges may cross spaces and punctuation, so the
  fixed text of a conversation (the tools' JSON schema, `What is `, `{"name": "add", ...`)
  becomes a few long tokens (the `add` schema line is one) and a 2-turn tool episode with 5-7
  digit operands (tools turn, question, call, result, answer) is 67-81 tokens (~200 with
  ByteLevel's GPT-2 word regex, which keeps merges inside words);
- a newline ends a pre-token, so nothing after one merges into it: `assistant\n` is a token
  of its own whatever the reply, and the ids of `render(messages, add_generation_prompt=True)`
  are a prefix of the ids of `render(messages + [reply])`, not only its text;
- ids 0-2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special: dropped by
  `decode(skip_special_tokens=True)`), then the 256 bytes, the merges, and last the tool tags
  `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, added tokens that are
  not special, so a decoded response keeps them for a tool-call parser (as Qwen3's does);
- trained on calculator conversations rendered by the template itself (tool and direct
  forms, every one with the `add` tool listed) plus generic ASCII lines, split at the added
  tokens as encoding splits them (a fixed seed, and BPE training breaks ties between equal
  counts by pair ids: running the module twice writes byte-identical files).

The chat template (`CHAT_TEMPLATE`, also written to chat_template.jinja) renders each message
the same whether or not later messages follow, so `render(messages + [reply])` starts with
`render(messages, add_generation_prompt=True)`: a rollout can append the ids of later turns
to the ids it already has instead of re-tokenizing the whole conversation (which BPE would
not reproduce: `encode(decode(ids))` need not equal `ids`, see the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.tasks.calculator import CalculatorTask, add, tool_conversation

if TYPE_CHECKING:
    import tokenizers

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "tool_tokenizer"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens, ids 0-2 in this order (the trainer puts them first)."""
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added tokens that are not special (a decoded response keeps them), the last ids."""
VOCAB_SIZE = 512
"""Every id, added tokens included: 3 special + 256 bytes + 249 merges + 4 tool tags."""
MODEL_MAX_LENGTH = 4096

# The chat template. A cut-down Qwen3 template without thinking blocks; every message
# renders the same whatever follows it (the prefix property in the module docstring).
# - tools: one system turn first, the system message's content (if any), a blank line, then
#   `# Tools` and one JSON line per tool inside <tools></tools>;
# - an assistant message: its content, then each tool call as
#   <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, newline-separated (arguments
#   as JSON, or as given when they are a string already);
# - a run of tool messages: one user turn, each result as <tool_response>\n...\n</tool_response>,
#   newline-separated.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
        {%- if message.role == 'assistant' and message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if message.content or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
                {%- if fn.arguments is string %}
                    {{- fn.arguments }}
                {%- else %}
                    {{- fn.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CORPUS_SEED = 0
CONVERSATIONS = 400
"""Calculator conversations in the training text, half with a tool call, half direct."""
CORPUS_DIGITS = (1, 9)
"""Operand lengths in the training text: wider than the task's 5-7 so other recipes fit."""
# Generic lines (written for this corpus) so merges also serve plain text and tool results
# other than a number; `{n}` becomes a random number.
_GENERIC_LINES = (
    "The answer is {n}.",
    "Let me use the add tool to compute this.",
    "I will add the two numbers.",
    "The sum of these numbers is {n}.",
    "Error: the arguments must be integers, got {n} and a string.",
    "Error: unknown tool.",
    "You are a helpful assistant.",
    "You are a helpful assistant that can call tools.",
    '{{"result": {n}, "ok": true}}',
    '{{"error": "invalid arguments", "ok": false}}',
    "null",
    "Hello! How can I help you today?",
    "What is the capital of France? It is Paris.",
    "Please answer with a number only.",
    "Thank you, that is correct.",
    "I am not sure; let me check again.",
)
GENERIC_REPEATS = 4


def render(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None,
           add_generation_prompt: bool = False, template: str = CHAT_TEMPLATE) -> str:
    """`messages` rendered by the chat template with transformers' own Jinja environment
    (the exact text `apply_chat_template(..., tokenize=False)` gives), without a tokenizer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([list(messages)], tools=list(tools) if tools else None,  # type: ignore[str-unpack]  # (annotated -> str, returns (texts, indices))
                                        chat_template=template, add_generation_prompt=add_generation_prompt)
    return rendered[0]


def tool_training_corpus() -> list[str]:
    """The training text: rendered calculator conversations, then generic ASCII lines."""
    task = CalculatorTask(*CORPUS_DIGITS)
    problems = task.sample(CONVERSATIONS, seed=CORPUS_SEED)
    texts = [render(tool_conversation(p, use_tool=i % 2 == 0), tools=[add]) for i, p in enumerate(problems)]
    rng = np.random.default_rng(CORPUS_SEED)
    for _ in range(GENERIC_REPEATS):
        texts += [line.format(n=int(rng.integers(0, 10**6))) for line in _GENERIC_LINES]
    # Every printable ASCII character once, so each has been seen next to its neighbours.
    texts.append(string.printable)
    return texts


def segments(texts: Sequence[str]) -> Iterator[str]:
    """The pieces of `texts` between added tokens: what encoding hands to the pre-tokenizer
    (added tokens are matched first), so no merge is wasted on the tags' own characters."""
    pattern = re.compile("|".join(re.escape(t) for t in (*SPECIAL_TOKENS, *TOOL_TAGS)))
    for text in texts:
        yield from (piece for piece in pattern.split(text) if piece)


def train_tool_tokenizer() -> tokenizers.Tokenizer:
    """Train the BPE on `tool_training_corpus()` and add the tool tags (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE())
    # A newline ends a pre-token (kept with the text before it), so what follows one never
    # merges into it: the generation prompt's `assistant\n` is a whole token whatever the
    # reply, and the prompt's ids are a prefix of the whole conversation's ids. Then digits:
    # each becomes a pre-token of its own, so no merge can take one in. ByteLevel without its
    # regex: merges may cross spaces and punctuation (see the module docstring).
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="merged_with_previous"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TAGS),  # the trainer's count includes the special tokens
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tok.train_from_iterator(segments(tool_training_corpus()), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"the tool tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, "
                           f"not {VOCAB_SIZE}: the corpus ran out of merges")
    return tok


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer (it reads tokenizer.json as is, no
    model-specific prefix-space or BOS rules), no BOS, and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def tool_generation_config(tok: tokenizers.Tokenizer) -> dict[str, Any]:
    """generation_config.json: sampling stops at the end of a turn or of the text (as Qwen's)."""
    return {
        "eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)],
        "pad_token_id": tok.token_to_id(ENDOFTEXT),
    }


def write_tool_tokenizer(out_dir: str | os.PathLike = ASSETS_DIR) -> Path:
    """Train and write tokenizer.json, tokenizer_config.json, chat_template.jinja and
    generation_config.json into `out_dir`."""
    tok = train_tool_tokenizer()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "tokenizer.json", tok.to_str(pretty=True) + "\n")
    atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2) + "\n")
    atomic_write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)
    atomic_write_text(out_dir / "generation_config.json", json.dumps(tool_generation_config(tok), indent=2) + "\n")
    return out_dir


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m moe_rl.tasks.tool_tokenizer",
        description="Train the shipped tool tokenizer (byte-level BPE + chat template; deterministic).",
    )
    parser.add_argument("--out", default=str(ASSETS_DIR), help="directory for the tokenizer files")
    args = parser.parse_args(argv)
    out = write_tool_tokenizer(args.out)
    print(f"wrote {out} (vocab_size={VOCAB_SIZE})")


if __name__ == "__main__":
    main()
