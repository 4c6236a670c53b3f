r"""The `dataset` task (JSONL/Parquet rows -> problems, epoch walk) and its rewards.

Fast and model-free: files are written to tmp_path; `math` runs the math-verify library.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

import pytest

from moe_rl.config import TaskConfig
from moe_rl.tasks import TASKS, DatasetTask, make_task
from moe_rl.tasks.base import Problem
from moe_rl.tasks.dataset import DatasetError, DatasetKeys
from moe_rl.tasks.rewards import RewardError, make_reward, math_verify_score

ROWS = [
    {"prompt": "What is 17 * 3?", "answer": "51"},
    {"prompt": "Half of one?", "answer": 0.5, "metadata": {"source": "frac", "level": 1}},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Solve x + 2 = 5."}], "answer": 3},
    {"prompt": "GSM: 48 / 2 + 48?", "answer": "48/2=24, 24+48=72\n#### 72"},
]


def write_jsonl(path: Path, rows: list[object], blank_lines: bool = False) -> Path:
    lines = [json.dumps(r) for r in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


def write_raw(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist reads row 0's keys only
    pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in columns}), path)
    return path


def same_content(a: Problem, b: Problem) -> bool:
    return (a.prompt, a.answer, a.messages, a.meta["metadata"]) == (
        b.prompt, b.answer, b.messages, b.meta["metadata"])


# --- loading -------------------------------------------------------------------------------


def test_jsonl_and_parquet_give_equal_problems(tmp_path):
    from_jsonl = DatasetTask(write_jsonl(tmp_path / "d.jsonl", ROWS, blank_lines=True))
    # Parquet needs one type per column: the answers as strings, as a real export would have.
    parquet_rows = [{**r, "answer": str(r["answer"])} for r in ROWS]
    from_parquet = DatasetTask(write_parquet(tmp_path / "d.parquet", parquet_rows))
    assert len(from_jsonl.problems) == len(from_parquet.problems) == len(ROWS)
    assert all(same_content(a, b) for a, b in zip(from_jsonl.problems, from_parquet.problems))
    assert [p.meta["line"] for p in from_jsonl.problems] == [1, 3, 5, 7]  # blank lines skipped
    assert [p.meta["line"] for p in from_parquet.problems] == [0, 1, 2, 3]


def test_rows_become_problems(tmp_path):
    problems = DatasetTask(write_jsonl(tmp_path / "d.jsonl", ROWS)).problems
    assert (problems[0].prompt, problems[0].answer) == ("What is 17 * 3?", "51")
    assert problems[1].answer == "0.5" and problems[1].meta["metadata"] == {"source": "frac", "level": 1}
    assert problems[0].meta["metadata"] == {} and problems[0].messages is None
    chat = problems[2]
    assert chat.prompt == "Solve x + 2 = 5." and chat.answer == "3"
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    assert problems[3].meta["path"] == str(tmp_path / "d.jsonl") and problems[3].meta["line"] == 4


def test_custom_keys_through_the_registry(tmp_path):
    rows = [{"question": "1 + 1?", "solution": 2, "info": {"k": "v"}},
            {"chat": [{"role": "user", "content": "2 + 2?"}], "solution": "4"}]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    cfg = TaskConfig(name="dataset", data_path=str(path), prompt_key="question", messages_key="chat",
                     answer_key="solution", metadata_key="info", shuffle=False)
    task = make_task(cfg)
    assert "dataset" in TASKS and isinstance(task, DatasetTask)
    assert [(p.prompt, p.answer) for p in task.problems] == [("1 + 1?", "2"), ("2 + 2?", "4")]
    assert task.problems[0].meta["metadata"] == {"k": "v"}
    assert task.completion(task.problems[0]) == " \\boxed{2}"
    assert task.reward(task.problems[0], task.completion(task.problems[0])) == 1.0


BAD_ROWS = [
    ('{"question": "q", "solution": "s"}',
     "line 2: no 'prompt' (or 'messages') key; the row has keys: question, solution; set task.prompt_key"),
    ('{"prompt": "q"}', "line 2: no 'answer' key; the row has keys: prompt; set task.answer_key"),
    ('{"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": 1}',
     "line 2: has both 'prompt' and 'messages'; keep one of them in each row"),
    ('{"prompt": "", "answer": 1}', "line 2: 'prompt' must be a non-empty string, got str ''"),
    ('{"prompt": "q", "answer": [1]}', "line 2: 'answer' must be a non-empty string or a finite number"),
    ('{"prompt": "q", "answer": true}', "line 2: 'answer' must be a non-empty string or a finite number"),
    ('{"prompt": "q", "answer": "1", "metadata": "easy"}', "line 2: 'metadata' must be an object"),
    ('{"messages": [{"role": "bot", "content": "hi"}], "answer": 1}',
     "line 2: messages[0] has role str 'bot'; use one of system, user, assistant"),
    ('{"messages": [{"role": "system", "content": "hi"}], "answer": 1}',
     "line 2: 'messages' has no 'user' message"),
    ('{"messages": [{"role": "user", "content": 5}], "answer": 1}', "line 2: messages[0] 'content' must be a string"),
    ('{"messages": [], "answer": 1}', "line 2: 'messages' must be a non-empty list"),
    ('{"prompt": "q", "answer": 1', "line 2: invalid JSON"),
    ('[1, 2]', "line 2: expected a JSON object, got list"),
]


@pytest.mark.parametrize(("line", "message"), BAD_ROWS)
def test_a_bad_row_is_a_one_line_error_naming_the_line(tmp_path, line, message):
    path = write_raw(tmp_path / "data.jsonl", ['{"prompt": "ok", "answer": 1}', line])
    with pytest.raises(DatasetError) as info:
        DatasetTask(path)
    text = str(info.value)
    assert text.startswith(f"{path} {message}"), text
    assert "\n" not in text


def test_bad_parquet_row_and_bad_files(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "q", "answer": "1"}, {"prompt": None, "answer": "2"}])
    with pytest.raises(DatasetError, match=r"d\.parquet row 1: no 'prompt' \(or 'messages'\) key; "
                       r"the row has keys: answer; set task.prompt_key"):
        DatasetTask(path)
    with pytest.raises(DatasetError, match=r"data\.csv: unsupported file type '\.csv'; use one of \.jsonl, \.parquet"):
        DatasetTask(tmp_path / "data.csv")
    with pytest.raises(DatasetError, match=r"no such file; check task\.data_path"):
        DatasetTask(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="no rows"):
        DatasetTask(write_raw(tmp_path / "empty.jsonl", ["", "  "]))
    (tmp_path / "bin.jsonl").write_bytes(b'{"prompt": "q", "answer": 1}\n\xff\xfe\n')
    with pytest.raises(DatasetError, match=r"bin\.jsonl line 2: not valid UTF-8"):
        DatasetTask(tmp_path / "bin.jsonl")
    with pytest.raises(DatasetError, match=r"needs task\.data_path"):
        make_task(TaskConfig(name="dataset"))


# --- order ---------------------------------------------------------------------------------


@pytest.fixture
def ten_rows(tmp_path) -> Path:
    return write_jsonl(tmp_path / "ten.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)])


def answers(problems: list[Problem]) -> list[int]:
    return [int(p.answer) for p in problems]


def test_epoch_walk_visits_every_row_once_per_epoch(ten_rows):
    task = DatasetTask(ten_rows)
    walk = [answers(task.batch(step, 4, seed=7)) for step in range(5)]  # 20 rows = 2 epochs
    flat = [a for batch in walk for a in batch]
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # each epoch has its own permutation
    assert task.epoch_of(5, 4) == 2.0 and task.epoch_of(1, 4) == 0.4
    assert answers(task.batch(3, 4, seed=7)) == walk[3]  # stateless: a resumed run agrees
    assert answers(DatasetTask(ten_rows).batch(3, 4, seed=7)) == walk[3]
    assert flat[:10] != [a for s in range(3) for a in answers(task.batch(s, 4, seed=8))][:10]


def test_no_shuffle_is_file_order_and_sample_is_seeded(ten_rows):
    task = DatasetTask(ten_rows, shuffle=False)
    assert [answers(task.batch(s, 3, seed=1)) for s in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]
    assert answers(task.sample(12, 5)) == answers(task.sample(12, 5))
    assert sorted(answers(task.sample(10, 5))) == list(range(10))


# --- rewards -------------------------------------------------------------------------------

MATH_CASES = [
    (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 51.", "#### 51", 1.0),
    (r"\boxed{1,250}", "1250", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{(1, 2]}", "(1,2]", 1.0),
    (r"first \boxed{3}, no wait: \boxed{4}", "4", 1.0),
    (r"first \boxed{3}, no wait: \boxed{4}", "3", 0.0),
    (r"\boxed{4e4}", "40000", 1.0),
    (r"\boxed{25\%}", "25", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    (r"\boxed{12}", "21", 0.0),
    (r"\boxed{(2^3)^2}", "64", 1.0),
    (r"\boxed{10^{-3}}", "0.001", 1.0),
    ("}{{\\boxed{", "3", 0.0),
    ("", "3", 0.0),
    (None, "3", 0.0),
]


@pytest.mark.parametrize(("response", "reference", "expected"), MATH_CASES)
def test_math_reward(response, reference, expected):
    assert math_verify_score(response, reference) == expected


def test_math_reward_works_off_the_main_thread():
    """SIGALRM timeouts only work in the main thread; elsewhere they are switched off."""
    results: list[float] = []

    def score() -> None:
        results.append(math_verify_score(r"\boxed{\frac{1}{2}}", "0.5"))
        # Without a timeout this tower would hold the GIL for minutes; it is refused up front.
        results.append(math_verify_score(r"\boxed{9^{9^{9^{9}}}}", "3"))

    worker = threading.Thread(target=score, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert results == [1.0, 0.0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, response, answer, metadata):\n"
        "    return float(response.strip() == answer) + metadata.get('bonus', 0)\n"
        "def boom(prompt, response, answer, metadata):\n"
        "    return 1 / 0\n"
        "def text(prompt, response, answer, metadata):\n"
        "    return 'x'\n"
        "def nan(prompt, response, answer, metadata):\n"
        "    return float('nan')\n"
        "def flag(prompt, response, answer, metadata):\n"
        "    return True\n"
        "NOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_user_reward_function(tmp_path, user_module):
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "p", "answer": "7", "metadata": {"bonus": 0.5}},
                                                 {"prompt": "q", "answer": "8"}])
    task = DatasetTask(path, reward="my_rewards:score")
    assert task.rewards(task.problems, [" 7</s>", "9"]) == [1.5, 0.0]
    for fn, message in [("boom", r"task.reward=my_rewards:boom raised ZeroDivisionError\('division by zero'\) "
                                 r"on .*data\.jsonl line 2; fix the function"),
                        ("text", r"task.reward=my_rewards:text returned 'x' \(str\) on .*data\.jsonl line 2; "
                                 "it must return a float"),
                        ("nan", r"task.reward=my_rewards:nan returned NaN on .*data\.jsonl line 2; it must return a finite"),
                        ("flag", r"task.reward=my_rewards:flag returned True \(bool\)")]:
        task = DatasetTask(path, reward=f"my_rewards:{fn}")
        with pytest.raises(RewardError, match=message):
            task.reward(task.problems[1], "8")


def test_bad_reward_specs(user_module):
    for spec, message in [("nope", "is neither 'math' nor 'module.path:function'"),
                          ("no_such_module_xyz:f", r"cannot import 'no_such_module_xyz' \(ModuleNotFoundError"),
                          ("my_rewards:missing", "module 'my_rewards' has no attribute 'missing'"),
                          ("my_rewards:NOT_A_FUNCTION", "is a int, not a function")]:
        with pytest.raises(RewardError, match=message) as info:
            make_reward(spec)
        assert "\n" not in str(info.value)
    assert math.isclose(make_reward("math")(Problem("p", "2"), r"\boxed{2}"), 1.0)


def test_default_batch_of_the_base_task():
    task = make_task(TaskConfig(name="add"))
    assert task.batch(3, 4, seed=1) == task.batch(3, 4, seed=1) != task.batch(4, 4, seed=1)
    assert DatasetKeys().prompt == "prompt"
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        DatasetTask.batch(object.__new__(DatasetTask), 0, 1, seed=-1)
