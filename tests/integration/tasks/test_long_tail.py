"""`task.length_profile`: the `repeat` task's long tail of answer lengths (the asynchronous
rollout's workload, examples/tiny_long_tail.yaml), its reward, `uniform` leaving the other
tasks as they were, and the one-line refusals."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import re
from collections import Counter

import numpy as np
import pytest

from moe_rl.config import ConfigError, TaskConfig, load_config
from moe_rl.tasks import Problem, RepeatTask, make_task
from moe_rl.tasks.repeat import LONG_TAIL_MAX_COPIES
from moe_rl.tasks.tokenizer import Tokenizer
from moe_rl_testing import ROOT
from moe_rl_testing.in_process import run_main

LONG_TAIL = RepeatTask(3, 5, "long_tail")  # the recipe's setting


def answer_tokens(p: Problem) -> int:
    """The completion's tokens with the shipped tokenizer, EOS excluded: the space + one per digit."""
    return 1 + len(p.answer)


def test_prompt_and_answer_format():
    p = LONG_TAIL.sample(50, seed=0)[2]
    x, k = re.fullmatch(r"rep (\d+) x(\d+) =", p.prompt).groups()
    assert p.answer == x * int(k) and p.meta == {"task": "repeat", "digits": len(x), "copies": int(k)}
    tok = Tokenizer()
    for p in LONG_TAIL.sample(200, seed=1):
        completion = LONG_TAIL.completion(p)
        assert len(tok.encode(completion)) == answer_tokens(p)
        assert tok.encode(p.prompt) + tok.encode(completion) == tok.encode(p.prompt + completion)
        assert len(tok.encode(p.prompt)) <= 13


def test_long_tail_lengths_are_mostly_short_sometimes_hundreds():
    """The distribution repeat.py documents: K = 1 (1/2), 2 (3/10), else log-uniform on
    [3, 50]; with 3-5 digits 81% of answers are at most 12 tokens, the longest 251."""
    problems = LONG_TAIL.sample(20_000, seed=0)
    lengths = np.array([answer_tokens(p) for p in problems])
    copies = Counter(p.meta["copies"] for p in problems)
    assert abs(copies[1] / 20_000 - 0.5) < 0.015 and abs(copies[2] / 20_000 - 0.3) < 0.015
    assert set(copies) == set(range(1, LONG_TAIL_MAX_COPIES + 1))  # every K of the tail drawn
    tail = np.array([p.meta["copies"] for p in problems if p.meta["copies"] >= 3])
    assert abs((tail >= 20).mean() - math.log(51 / 20) / math.log(51 / 3)) < 0.03  # log-uniform
    assert 0.79 < (lengths <= 12).mean() < 0.83
    assert 0.035 < (lengths > 100).mean() < 0.06
    assert lengths.min() == 4 and lengths.max() <= 1 + 5 * LONG_TAIL_MAX_COPIES == 251
    assert lengths.max() > 200
    assert 150 < np.percentile(lengths, 99) < 210


def test_long_tail_is_deterministic_from_the_seed():
    assert LONG_TAIL.sample(64, seed=7) == LONG_TAIL.sample(64, seed=7)
    assert LONG_TAIL.sample(64, seed=7) != LONG_TAIL.sample(64, seed=8)
    assert LONG_TAIL.batch(3, 16, 1234) == RepeatTask(3, 5, "long_tail").batch(3, 16, 1234)
    assert LONG_TAIL.batch(3, 16, 1234) != LONG_TAIL.batch(4, 16, 1234)
    first = [(p.prompt, p.answer) for p in LONG_TAIL.sample(4, seed=0)]
    assert first == [("rep 67326 x1 =", "67326"), ("rep 136 x1 =", "136"), ("rep 831 x16 =", "831" * 16),
                     ("rep 75654 x2 =", "75654" * 2)]


def test_repeat_uniform_and_the_config():
    task = make_task(TaskConfig(name="repeat", min_digits=3, max_digits=5))
    assert isinstance(task, RepeatTask) and task.length_profile == "uniform"
    problems = task.sample(600, seed=0)
    assert {p.meta["copies"] for p in problems} == {1, 2, 3}
    assert {answer_tokens(p) for p in problems} <= set(range(4, 17))
    task = make_task(TaskConfig(name="repeat", length_profile="long_tail", min_digits=3, max_digits=5))
    assert task.sample(32, seed=3) == LONG_TAIL.sample(32, seed=3)
    assert task.max_copies == LONG_TAIL_MAX_COPIES
    with pytest.raises(ValueError, match=r"length_profile must be one of \['uniform', 'long_tail'\], got 'x'"):
        RepeatTask(3, 5, "x")


def test_reward_is_exact_match():
    task, p = RepeatTask(), Problem("rep 4821 x3 =", "482148214821")
    assert task.completion(p) == " 482148214821"
    for right in (" 482148214821", "482148214821", " 482148214821</s>", " 482148214821<pad><pad>"):
        assert task.reward(p, right) == 1.0, right
    for wrong in (" 48214821", " 4821482148214821", " 4821 4821 4821", " 482148214812", "", None, "</s>"):
        assert task.reward(p, wrong) == 0.0, wrong
    long = LONG_TAIL.sample(200, seed=2)
    assert all(LONG_TAIL.reward(q, LONG_TAIL.completion(q)) == 1.0 for q in long)
    assert all(LONG_TAIL.reward(q, LONG_TAIL.completion(q)[:-1]) == 0.0 for q in long)  # one digit short


# Problems and batches drawn before the setting existed (sha256 of their (prompt, answer)s).
BEFORE = {"reverse": "e7dd2140bcea9b18", "sort": "a1b3fcf58e81d04b", "add": "87f5387a2a6d9a72"}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_uniform_leaves_the_other_tasks_as_they_were(name):
    assert TaskConfig().length_profile == "uniform"
    task = make_task(TaskConfig(name=name, length_profile="uniform"))
    drawn = task.sample(1000, seed=0) + task.batch(3, 16, 1234)
    assert hashlib.sha256(repr([(p.prompt, p.answer) for p in drawn]).encode()).hexdigest()[:16] == BEFORE[name]


@pytest.mark.parametrize("name", ["reverse", "sort", "add", "dataset"])
def test_tasks_without_a_long_tail_refuse_it(name, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError) as e:
        make_task(TaskConfig(name=name, length_profile="long_tail", data_path=str(data)))
    assert str(e.value) == (f"task.length_profile=long_tail: task {name} cannot draw it (its answers have the one "
                            "length range of its settings); use task.name=repeat or task.length_profile=uniform")


def test_an_unknown_profile_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.length_profile=longtail"])
    assert str(e.value) == "task.length_profile: 'longtail' is not one of ['uniform', 'long_tail']"


def test_the_command_line_refuses_in_one_line():
    ran = run_main(importlib.import_module("moe_rl.train"),
                   ["--check", "--config", str(ROOT / "examples" / "tiny_rspo.yaml"), "task.length_profile=long_tail"])
    assert ran.returncode == 2 and not ran.stdout
    assert [ln for ln in ran.stderr.splitlines() if ln.strip()] == [
        "python -m moe_rl.train: error: task.length_profile=long_tail: task reverse cannot draw it (its "
        "answers have the one length range of its settings); use task.name=repeat or task.length_profile=uniform"]
