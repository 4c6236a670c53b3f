"""Tasks: registry, synthetic generators and verifiers, the math verifier, the JSONL loader."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.config import TaskConfig
from moe_rl.tasks import (
    TASKS,
    AddTask,
    Problem,
    ReverseTask,
    SortTask,
    make_task,
    register_task,
    sft_examples,
)
from moe_rl.tasks.rewards import math_verify_score

SYNTHETIC = (ReverseTask, SortTask, AddTask)
GARBAGE = ["", "   ", "</s>", "<pad>", "\x00\xff\n", "⁇ ⁇", "rev 48213 =", None, 12345, b"1"]

# --------------------------------------------------------------------------- registry


def test_registry_names_and_default_task():
    assert set(TASKS) == {"reverse", "sort", "add", "repeat", "calculator", "math_jsonl", "dataset"}
    task = make_task(TaskConfig())
    assert isinstance(task, ReverseTask)
    assert (task.min_digits, task.max_digits) == (4, 6)
    assert isinstance(make_task(TaskConfig(name="add", min_digits=1, max_digits=2)), AddTask)


def test_unknown_task_lists_valid_names():
    with pytest.raises(
        ValueError, match=r"unknown task 'revers'; valid names: reverse, sort, add, repeat, calculator, math_jsonl, dataset"
    ):
        make_task(TaskConfig(name="revers"))


def test_duplicate_registration_and_read_only_registry():
    with pytest.raises(ValueError, match="already registered"):
        register_task("reverse", ReverseTask.from_config)
    with pytest.raises(TypeError):
        TASKS["x"] = ReverseTask.from_config  # type: ignore[index]


def test_math_jsonl_is_the_dataset_task():
    """The older name of the dataset task (its own reader and verifier were retired: the
    math-verify comparison in bench/results/math_verify_compare.md)."""
    assert TASKS["math_jsonl"] is TASKS["dataset"]
    for name in ("math_jsonl", "dataset"):
        with pytest.raises(ValueError, match="data_path"):
            make_task(TaskConfig(name=name))


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
    assert math_verify_score(text, problems[1].answer) in (0.0, 1.0)
