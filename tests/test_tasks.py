"""Tasks: registry, synthetic generators and verifiers, the math verifier, the JSONL loader."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.config import TaskConfig
from moe_rl.tasks import (
    TASKS,
    AddTask,
    MathJsonlTask,
    Problem,
    ReverseTask,
    SortTask,
    make_task,
    register_task,
    sft_examples,
)
from moe_rl.tasks.math_jsonl import MAX_REPORTED_LINES, load_problems
from moe_rl.tasks.math_verify import (
    answers_match,
    extract_answer,
    math_reward,
    normalize_answer,
    parse_number,
    reference_answer,
)

SYNTHETIC = (ReverseTask, SortTask, AddTask)
GARBAGE = ["", "   ", "</s>", "<pad>", "\x00\xff\n", "⁇ ⁇", "rev 48213 =", None, 12345, b"1"]

# --------------------------------------------------------------------------- registry


def test_registry_names_and_default_task():
    assert set(TASKS) == {"reverse", "sort", "add", "math_jsonl"}
    task = make_task(TaskConfig())
    assert isinstance(task, ReverseTask)
    assert (task.min_digits, task.max_digits) == (4, 6)
    assert isinstance(make_task(TaskConfig(name="add", min_digits=1, max_digits=2)), AddTask)


def test_unknown_task_lists_valid_names():
    with pytest.raises(
        ValueError, match=r"unknown task 'revers'; valid names: reverse, sort, add, math_jsonl"
    ):
        make_task(TaskConfig(name="revers"))


def test_duplicate_registration_and_read_only_registry():
    with pytest.raises(ValueError, match="already registered"):
        register_task("reverse", ReverseTask.from_config)
    with pytest.raises(TypeError):
        TASKS["x"] = ReverseTask.from_config  # type: ignore[index]


def test_math_jsonl_needs_data_path():
    with pytest.raises(ValueError, match="data_path"):
        make_task(TaskConfig(name="math_jsonl"))


@pytest.mark.parametrize("lo,hi", [(0, 3), (5, 4), (1, 19)])
def test_bad_digit_range(lo, hi):
    with pytest.raises(ValueError, match="min_digits"):
        ReverseTask(lo, hi)


# --------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize(
    "task,prompt,answer",
    [
        (ReverseTask(), "rev 48213 =", "31284"),
        (SortTask(), "sort 48213 =", "12348"),
        (AddTask(), "add 4821+139 =", "4960"),
    ],
)
def test_synthetic_verifier_hand_written(task, prompt, answer):
    p = Problem(prompt, answer)
    assert task.completion(p) == f" {answer}"
    correct = [f" {answer}", answer, f" {answer} ", f" {answer}\n", f" {answer}</s>",
               f" {answer}</s> 999", f" {answer}<pad><pad>"]  # fmt: skip
    for response in correct:
        assert task.reward(p, response) == 1.0, response
    wrong = [f" {answer}0", f" {answer[:-1]}", f" 0{answer}", f" {answer} {answer}",
             f" {answer[::-1]}x", f" {answer[0]} {answer[1:]}", f"{prompt} {answer}"]  # fmt: skip
    for response in wrong:
        assert task.reward(p, response) == 0.0, response
    for response in GARBAGE:
        assert task.reward(p, response) == 0.0, response


def test_synthetic_answers_are_right():
    for p in ReverseTask(1, 8).sample(200, seed=1):
        x = re.fullmatch(r"rev (\d+) =", p.prompt).group(1)
        assert p.answer == x[::-1] and p.meta["digits"] == len(x)
    for p in SortTask(1, 8).sample(200, seed=1):
        x = re.fullmatch(r"sort (\d+) =", p.prompt).group(1)
        assert p.answer == "".join(sorted(x))
    for p in AddTask(1, 8).sample(200, seed=1):
        a, b = re.fullmatch(r"add (\d+)\+(\d+) =", p.prompt).groups()
        assert int(p.answer) == int(a) + int(b)


@pytest.mark.parametrize("cls", SYNTHETIC)
def test_operand_lengths_cover_the_range(cls):
    task = cls(4, 6)
    lengths = set()
    for p in task.sample(300, seed=0):
        for x in re.findall(r"\d+", p.prompt):
            assert 4 <= len(x) <= 6 and x[0] != "0"
            lengths.add(len(x))
    assert lengths == {4, 5, 6}


@pytest.mark.parametrize("cls", SYNTHETIC)
def test_own_completion_scores_one(cls):
    task = cls()
    problems = task.sample(64, seed=3)
    assert all(task.reward(p, task.completion(p)) == 1.0 for p in problems)
    shifted = problems[1:] + problems[:1]
    assert task.rewards(problems, [task.completion(q) for q in shifted]).count(1.0) <= 2


@pytest.mark.parametrize("cls", SYNTHETIC)
def test_sampling_is_deterministic(cls):
    task = cls()
    assert task.sample(32, seed=7) == task.sample(32, seed=7)
    assert task.sample(32, seed=7) != task.sample(32, seed=8)
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    first = task.sample(8, rng_a)
    assert first == task.sample(8, rng_b)
    assert task.sample(8, rng_a) != first  # a Generator is advanced, not reset
    assert task.sample(0, seed=1) == []


def test_sample_argument_errors():
    with pytest.raises(ValueError):
        ReverseTask().sample(-1, seed=0)
    with pytest.raises(TypeError):
        ReverseTask().sample(4, seed="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 problems but 1"):
        ReverseTask().rewards(ReverseTask().sample(2, 0), [" 1"])


def test_sft_examples():
    task = ReverseTask()
    pairs = sft_examples(task, 16, seed=0)
    problems = task.sample(16, seed=0)
    assert pairs == [(p.prompt, f" {p.answer}") for p in problems]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_rewards_in_range_on_any_text(text):
    problems = [Problem("rev 12 =", "21"), Problem("What is 1/2?", "\\frac{1}{2}")]
    for task, p in [(ReverseTask(), problems[0]), (AddTask(), problems[0])]:
        assert task.reward(p, text) in (0.0, 1.0)
    assert math_reward(text, problems[1].answer) in (0.0, 1.0)


# --------------------------------------------------------------------------- math verifier


@pytest.mark.parametrize(
    "response,expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("first \\boxed{1}, finally \\boxed{2}", "2"),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("nested \\boxed{a_{1}+{b}}", "a_{1}+{b}"),
        ("\\boxed{\\boxed{7}}", "7"),
        ("$\\boxed {-3}$", "-3"),
        ("\\boxed 5$ done", "5"),
        ("\\fbox{9}", "9"),
        ("unclosed \\boxed{12 ... so 13", "13"),  # a truncated box: fall back to last number
        ("It costs $1,250.", "1,250"),
        ("1,2345 apples", "2345"),  # not a thousands comma
        ("x = -5", "-5"),
        ("10-5 leaves 5", "5"),
        ("10-5", "5"),  # a minus after a digit is an operator
        ("so -0.75 it is", "-0.75"),
        ("between 3/4 and", "3/4"),
        ("about 1.5e-3 m", "1.5e-3"),
        ("we get 50%", "50%"),
        ("value −7 (unicode minus)", "-7"),
        ("1, 2, 3", "3"),
        ("no numbers here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "predicted,reference",
    [
        ("42", "42"),
        ("42.0", "42"),
        ("\\frac{3}{4}", "0.75"),
        ("\\dfrac{3}{4}", "3/4"),
        ("-\\frac{1}{2}", "-0.5"),
        ("\\frac12", "0.5"),
        ("1,250", "1250"),
        ("1,234,567.5", "1234567.5"),
        ("$1,250", "1250"),
        ("+5", "5"),
        ("5.", "5"),
        ("x = 5", "5"),
        ("50%", "50"),
        ("50\\%", "50"),
        ("1e3", "1000"),
        ("2.5E-2", "0.025"),
        ("0.3333333", "1/3"),  # within rel 1e-6
        ("5 \\text{ cm}", "5"),
        ("\\text{yes}", "yes"),
        ("90^\\circ", "90"),
        ("\\left(1, 2\\right)", "(1,2)"),
        ("  7 ", "7"),
    ],
)
def test_answers_match(predicted, reference):
    assert answers_match(predicted, reference)


@pytest.mark.parametrize(
    "predicted,reference",
    [
        ("41", "42"),
        ("-42", "42"),
        ("0.7", "3/4"),
        ("0.333", "1/3"),
        ("1/0", "0"),
        ("yes", "no"),
        ("", "0"),
        (None, "0"),
        ("1e999", "1e998"),  # both overflow: compared as strings
    ],
)
def test_answers_differ(predicted, reference):
    assert not answers_match(predicted, reference)


def test_normalize_and_parse():
    assert normalize_answer(" $\\$1,000.$ ") == "1000"
    assert parse_number("\\frac{1}{0}") is None
    assert parse_number("abc") is None
    assert parse_number("-3.5e2") == -350.0


@pytest.mark.parametrize(
    "answer,expected",
    [("\\boxed{12}", "12"), ("reasoning...\n#### 72", " 72"), ("3/4", "3/4")],
)
def test_reference_answer(answer, expected):
    assert reference_answer(answer) == expected


def test_math_reward():
    assert math_reward("So the total is \\boxed{1,250} dollars.", "1250") == 1.0
    assert math_reward("Total: 1250 dollars, or 125 tens", "1250") == 0.0  # last number
    assert math_reward("It is 72.", "Work...\n#### 72") == 1.0
    assert math_reward("It is \\boxed{0.5}", "\\boxed{\\frac{1}{2}}") == 1.0
    assert math_reward("garbage", "3") == 0.0


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789-+.,/%{}\\boxedfrac $e ")), max_size=40))
def test_math_verifier_never_raises(text):
    answers_match(extract_answer(text), text)
    parse_number(normalize_answer(text))


# --------------------------------------------------------------------------- JSONL task


def _write(path, lines):
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def test_jsonl_malformed_lines_are_reported_and_skipped(tmp_path, caplog):
    path = _write(
        tmp_path / "data.jsonl",
        [
            '{"prompt": "What is 2+2?", "answer": "4"}',  # 1 ok
            "{not json",  # 2
            '{"prompt": "no answer"}',  # 3
            "",  # 4 blank: ignored silently
            '{"prompt": "", "answer": "1"}',  # 5 empty prompt
            '{"prompt": "numeric answer", "answer": 7, "id": "q6"}',  # 6 ok
            '["a", "list"]',  # 7
            '{"prompt": 5, "answer": "1"}',  # 8 wrong type
            '{"prompt": "bool", "answer": true}',  # 9 wrong type
            b'{"prompt": "\xff\xfe", "answer": "1"}',  # 10 bad UTF-8
            '{"prompt": "p", "answer": "  "}',  # 11 empty answer
            '{"prompt": "last", "answer": "\\\\frac{1}{2}"}',  # 12 ok
        ],
    )
    with caplog.at_level(logging.WARNING, logger="moe_rl.tasks.math_jsonl"):
        problems = load_problems(path)
    assert [p.meta["line"] for p in problems] == [1, 6, 12]
    assert problems[1].answer == "7" and problems[1].meta["fields"] == {"id": "q6"}
    messages = [r.getMessage() for r in caplog.records]
    for line_no in (2, 3, 5, 7, 8, 9, 10, 11):
        assert any(f"data.jsonl:{line_no}:" in m for m in messages), line_no
    assert not any(f"data.jsonl:{n}:" in m for m in messages for n in (1, 4, 6, 12))
    assert any("skipped 8 malformed line(s)" in m for m in messages)


def test_jsonl_report_is_capped(tmp_path, caplog):
    path = _write(
        tmp_path / "d.jsonl", ["bad"] * (MAX_REPORTED_LINES + 5) + ['{"prompt":"p","answer":"1"}']
    )
    with caplog.at_level(logging.WARNING, logger="moe_rl.tasks.math_jsonl"):
        assert len(load_problems(path)) == 1
    assert len(caplog.records) == MAX_REPORTED_LINES + 1
    assert f"skipped {MAX_REPORTED_LINES + 5} malformed" in caplog.records[-1].getMessage()


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        MathJsonlTask(tmp_path / "nope.jsonl")
    path = _write(tmp_path / "all_bad.jsonl", ["{", '{"prompt": "x"}'])
    with pytest.raises(ValueError, match=r"all_bad\.jsonl has no valid problems \(2 malformed"):
        MathJsonlTask(path)
    with pytest.raises(ValueError, match=r"empty\.jsonl"):
        MathJsonlTask(_write(tmp_path / "empty.jsonl", [""]))


def test_jsonl_bom_and_task(tmp_path):
    lines = [f'{{"prompt": "What is {i} + {i}?", "answer": "{2 * i}"}}' for i in range(10)]
    path = _write(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + lines[0].encode(), *lines[1:]])
    task = make_task(TaskConfig(name="math_jsonl", data_path=str(path)))
    assert len(task.problems) == 10
    batch = task.sample(25, seed=0)
    assert batch == task.sample(25, seed=0) and batch != task.sample(25, seed=1)
    assert len({p.prompt for p in batch[:10]}) == 10  # a full pass before any repeat
    p = batch[0]
    assert task.completion(p) == f" \\boxed{{{p.answer}}}"
    assert task.reward(p, task.completion(p)) == 1.0
    assert task.reward(p, f"I think it is {int(p.answer) + 1}") == 0.0
    for response in GARBAGE:
        assert task.reward(p, response) in (0.0, 1.0)
