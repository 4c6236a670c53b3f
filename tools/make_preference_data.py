"""Preference pairs for the shipped digit tasks: chosen = the correct answer, rejected = a
plausible wrong one, written as `moe_rl.dpo` reads them.

    python tools/make_preference_data.py --out moe_rl/assets/preferences [--task reverse] [--train 2048] [--eval 256]

Writes <out>/<task>_prefs_train.jsonl and <out>/<task>_prefs_eval.jsonl, one
`{"prompt", "chosen", "rejected"}` object per line, in the task's own prompt/completion
format (`moe_rl.tasks.synthetic`: "rev 48213 =" -> " 31284"). The wrong answer is, with equal
odds, the correct one with one digit replaced, with two neighbouring (different) digits
swapped, or the operand left as it is (for reverse/sort; for add, the sum off by a power of
ten's digit). Training and held-out problems come from different seeds; the files are a
pure function of the arguments (the shipped moe_rl/assets/preferences files are reproduced exactly).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_rl.config import TaskConfig
from moe_rl.tasks import make_task
from moe_rl.tasks.base import Problem

EVAL_SEED_OFFSET = 1_000_003


def replace_digit(answer: str, rng: np.random.Generator) -> str:
    """`answer` with one digit changed to another digit."""
    i = int(rng.integers(len(answer)))
    wrong = str((int(answer[i]) + int(rng.integers(1, 10))) % 10)
    return answer[:i] + wrong + answer[i + 1:]


def swap_neighbours(answer: str, rng: np.random.Generator) -> str | None:
    """`answer` with two neighbouring different digits swapped (None: all digits equal)."""
    spots = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
    if not spots:
        return None
    i = spots[int(rng.integers(len(spots)))]
    return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]


def wrong_answer(problem: Problem, rng: np.random.Generator) -> str:
    """A wrong answer that differs from `problem.answer` (see the module docstring)."""
    kind = int(rng.integers(3))
    operand = problem.prompt.split(" ")[1]
    candidates = {0: lambda: replace_digit(problem.answer, rng), 1: lambda: swap_neighbours(problem.answer, rng),
                  2: lambda: operand if operand.isdigit() else replace_digit(problem.answer, rng)}
    wrong = candidates[kind]()
    return wrong if wrong and wrong != problem.answer else replace_digit(problem.answer, rng)


def preference_rows(task_name: str, n: int, seed: int) -> list[dict[str, str]]:
    """`n` rows of {prompt, chosen, rejected} for problems of `task_name` drawn from `seed`."""
    task = make_task(TaskConfig(name=task_name))  # 4-6 digit operands, as the tiny recipes
    rng = np.random.default_rng(seed)
    rows = []
    for problem in task.sample(n, rng):
        rows.append({"prompt": problem.prompt, "chosen": task.completion(problem),
                     "rejected": f" {wrong_answer(problem, rng)}"})
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the two files")
    ap.add_argument("--task", default="reverse", choices=("reverse", "sort", "add"), help="shipped digit task")
    ap.add_argument("--train", type=int, default=2048, help="training pairs")
    ap.add_argument("--eval", type=int, default=256, help="held-out pairs")
    ap.add_argument("--seed", type=int, default=0, help="seed of the training problems (held-out: seed + 1000003)")
    args = ap.parse_args(argv)
    if args.train < 1 or args.eval < 1:
        print(f"{ap.prog}: error: --train and --eval must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    for split, n, seed in (("train", args.train, args.seed), ("eval", args.eval, args.seed + EVAL_SEED_OFFSET)):
        path = out / f"{args.task}_prefs_{split}.jsonl"
        write_jsonl(preference_rows(args.task, n, seed), path)
        print(f"wrote {n} pairs to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
