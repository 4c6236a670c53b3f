"""The shipped tool tokenizer (moe_rl/assets/tool_tokenizer) and the calculator task.

What a multi-turn tool rollout relies on: the chat template's exact text and its prefix
property (a rollout appends later turns' ids instead of re-tokenizing), digits as single
tokens, tool tags that survive decoding, and the reason re-tokenizing is wrong (BPE's
encode(decode(ids)) need not give back ids). No torch model is built here.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest

from moe_rl.config import TaskConfig
from moe_rl.tasks import TASKS, CalculatorTask, Problem, make_task
from moe_rl.tasks.calculator import add, final_answer, tool_conversation
from moe_rl.tasks.tool_tokenizer import (
    ASSETS_DIR,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TAGS,
    VOCAB_SIZE,
    render,
    write_tool_tokenizer,
)
from moe_rl.tokenization import load_tokenizer
from moe_rl.tokenization.hf import HFTokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# The `add` tool as the template lists it: get_json_schema(add) through transformers' tojson.
ADD_SCHEMA_LINE = (
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": '
    '"The first number."}, "b": {"type": "integer", "description": "The second number."}}, '
    '"required": ["a", "b"]}, "return": {"type": "integer", "description": "The sum a + b."}}}'
)


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return load_tokenizer(str(ASSETS_DIR))


def small_problem() -> Problem:
    return Problem(prompt="What is 12 + 34?", answer="46", meta={"task": "calculator", "a": 12, "b": 34, "digits": 2})


def three_turn_conversation() -> list[dict]:
    """System prompt, a question, then three assistant turns: one call, two calls at once
    (with content, answered by two tool messages in a row), and the answer."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 120, "b": 7}}}
    return [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 120 + 7 + 3 + 4?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "127"},
        {"role": "assistant", "content": "Two more.", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 127, "b": 3}}},
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 130, "b": 4}'}},
        ]},
        {"role": "tool", "content": "130"},
        {"role": "tool", "content": "134"},
        {"role": "assistant", "content": "134"},
    ]


# --------------------------------------------------------------------------- chat template


def test_tool_conversation_renders_the_expected_text():
    text = render(tool_conversation(small_problem(), use_tool=True), tools=[add])
    assert text == (
        "<|im_start|>system\n# Tools\n<tools>\n" + ADD_SCHEMA_LINE + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n46<|im_end|>\n"
    )


def test_several_calls_and_tool_results_render_like_qwen3():
    """Calls after content and after each other are newline-separated; string arguments go in
    as given; consecutive tool messages share one user turn; the system content comes first."""
    text = render(three_turn_conversation(), tools=[add])
    assert text == (
        "<|im_start|>system\nYou add numbers.\n\n# Tools\n<tools>\n" + ADD_SCHEMA_LINE + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is 120 + 7 + 3 + 4?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 120, "b": 7}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n127\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nTwo more.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 127, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 130, "b": 4}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n130\n</tool_response>\n<tool_response>\n134\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n134<|im_end|>\n"
    )
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render(plain, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")


def test_prefix_property_text_and_ids(tok):
    """Before each assistant turn, the generation prompt's text, and its ids, are a prefix of
    the conversation's with that turn: a rollout may append ids turn by turn."""
    messages = three_turn_conversation()
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(turns) == 3
    for i in turns:
        prompt = render(messages[:i], tools=[add], add_generation_prompt=True)
        full = render(messages[: i + 1], tools=[add])
        assert full.startswith(prompt)
        prompt_ids, full_ids = tok.encode(prompt), tok.encode(full)
        assert full_ids[: len(prompt_ids)] == prompt_ids


def test_transformers_applies_the_shipped_template_with_tools(tok):
    messages = tool_conversation(small_problem(), use_tool=True)
    hf = tok.hf
    assert hf.chat_template == CHAT_TEMPLATE == (ASSETS_DIR / "chat_template.jinja").read_text()
    text = hf.apply_chat_template(messages, tools=[add], tokenize=False)
    assert text == render(messages, tools=[add])
    ids = hf.apply_chat_template(messages, tools=[add], tokenize=True, return_dict=False)
    assert list(ids) == tok.encode(text)


# --------------------------------------------------------------------------- tokenizer


def test_loads_with_qwen_like_special_ids(tok):
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == VOCAB_SIZE == 512
    ids = {t: tok.hf.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *TOOL_TAGS)}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<tool_call>": 508,
                   "</tool_call>": 509, "<tool_response>": 510, "</tool_response>": 511}
    assert tok.eos_ids == [2, 0] and tok.eos_id == 2 and tok.pad_id == 0 and tok.bos_id == -1


def test_digits_are_single_tokens_and_never_merge(tok):
    digit_ids = [tok.encode(d) for d in string.digits]
    assert all(len(ids) == 1 for ids in digit_ids)
    number = "9081726354"
    assert tok.encode(f"x {number} y") == tok.encode("x ") + [digit_ids[int(d)][0] for d in number] + tok.encode(" y")
    pieces_with_digits = [p for p in tok.hf.get_vocab() if any(c in string.digits for c in p)]
    assert sorted(pieces_with_digits) == list(string.digits)


def test_tool_tags_survive_decoding_special_turn_markers_do_not(tok):
    ids = tok.encode('<|im_start|>assistant\n<tool_call>\n{"name": "add"}\n</tool_call><|im_end|>')
    assert tok.decode(ids) == 'assistant\n<tool_call>\n{"name": "add"}\n</tool_call>'
    ids = tok.encode("<tool_response>\n46\n</tool_response><|endoftext|>")
    assert tok.hf.decode(ids, skip_special_tokens=True) == "<tool_response>\n46\n</tool_response>"


def test_any_text_round_trips(tok):
    """Byte level: tool results that are not numbers (errors, unicode, control bytes) encode."""
    for text in ["Error: unknown tool.", string.printable, "naïve 東京 \x00\x7f", '{"ok": false}']:
        assert tok.decode(tok.encode(text)) == text


def test_reencoding_decoded_ids_can_change_them(tok):
    """Why a rollout never re-tokenizes: the model may emit a tool call's text through a
    non-canonical split (`{"` then `name": "add` then `", "arguments": {"a": `, each a token),
    which decodes to text whose canonical encoding is one merged token."""
    emitted = tok.encode('{"') + tok.encode('name": "add", "arguments": {"a": ')
    assert tok.pieces(emitted) == ['{"', 'name":Ġ"add', '",Ġ"arguments":Ġ{"a":Ġ']
    text = tok.decode(emitted)
    assert text == '{"name": "add", "arguments": {"a": '
    assert tok.encode(text) == [454] != emitted


def test_typical_tool_episode_is_short(tok):
    """Tools turn, question, call, result and answer with 5-7 digit operands: 67-81 tokens."""
    problems = CalculatorTask(5, 7).sample(64, seed=0)
    lengths = [len(tok.encode(render(tool_conversation(p, use_tool=True), tools=[add]))) for p in problems]
    assert 60 <= min(lengths) and max(lengths) <= 85


def test_shipped_files_are_what_the_module_writes(tmp_path: Path):
    write_tool_tokenizer(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (ASSETS_DIR / name).read_bytes(), name


# --------------------------------------------------------------------------- calculator task


def test_calculator_problems_are_seeded_and_in_range():
    task = make_task(TaskConfig(name="calculator", min_digits=5, max_digits=7))
    assert isinstance(task, CalculatorTask) and "calculator" in TASKS
    problems = task.sample(200, seed=3)
    assert problems == task.sample(200, seed=3)
    for p in problems:
        a, b = p.meta["a"], p.meta["b"]
        assert p.prompt == f"What is {a} + {b}?" and p.answer == str(a + b)
        assert 5 <= len(str(a)) <= 7 and 5 <= len(str(b)) <= 7
        assert p.meta["digits"] == max(len(str(a)), len(str(b))) and p.meta["task"] == "calculator"
        assert task.completion(p) == p.answer
    assert {len(str(p.meta["a"])) for p in problems} == {5, 6, 7}
    with pytest.raises(ValueError, match="min_digits"):
        CalculatorTask(8, 7)


def test_calculator_reward():
    task, p = CalculatorTask(), small_problem()
    for right in ["46", " 46\n", "46<|im_end|>", "46<|im_end|><|endoftext|>", "46 <|endoftext|>"]:
        assert task.reward(p, right) == 1.0, right
    for wrong in ["47", "046", "46.0", "The answer is 46", "46<|im_end|>x", "<tool_call>46</tool_call>"]:
        assert task.reward(p, wrong) == 0.0, wrong
    for garbage in ["", "<|im_end|>", "\x00\xff", None, 46, b"46"]:
        assert task.reward(p, garbage) == 0.0  # type: ignore[arg-type]
    assert final_answer(" 46 <|im_end|> ") == "46"


def test_tool_conversation_forms():
    p = small_problem()
    tool = tool_conversation(p, use_tool=True)
    assert [m["role"] for m in tool] == ["user", "assistant", "tool", "assistant"]
    assert tool[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]}
    assert tool[2] == {"role": "tool", "content": "46"} and tool[3]["content"] == "46"
    assert tool_conversation(p, use_tool=False) == [{"role": "user", "content": p.prompt},
                                                    {"role": "assistant", "content": "46"}]
    assert tool_conversation(p, use_tool=False, answer="45")[1]["content"] == "45"
    with pytest.raises(ValueError, match="answer"):
        tool_conversation(p, use_tool=True, answer="45")


def test_add_tool_has_a_json_schema():
    from transformers.utils import get_json_schema

    assert CalculatorTask().tools == [add] and add(12, 34) == 46
    assert get_json_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer", "description": "The sum a + b."},
        },
    }
