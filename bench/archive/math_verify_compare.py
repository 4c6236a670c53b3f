r"""Which verifier should `task.reward=math` use: the `math-verify` library or the older
hand-written `bench/archive/handwritten_math_verifier.py:math_reward` (the verifier it replaced)?

    python -m bench.archive.math_verify_compare          # prints and writes bench/results/math_verify_compare.md

Both score the same deterministic set of (response, reference, expected) cases, >= 300 of
them in categories that real math data throws at a verifier: integers, negatives, thousands
commas, decimals, fractions, nested `\boxed{}`, GSM8K's `#### 51`, percentages, dollars,
units, scientific notation, square roots, pi, intervals and sets, equivalent forms, wrong
answers that look close, unboxed "the answer is X" text, several boxes (the last counts),
and garbage. Each case's expected label is fixed by construction, not by either verifier.
The library side is `moe_rl.tasks.rewards.math_verify_score`, i.e. exactly what training
uses (its gold/response parsing settings included).
"""

from __future__ import annotations

import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.archive.handwritten_math_verifier import math_reward as handwritten_reward
from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.tasks.answers import reference_answer
from moe_rl.tasks.rewards import math_verify_score
from moe_rl_testing.bench_common import RESULTS_DIR, markdown_table, results_header

SEED = 20260416
NOTE = ("`math-verify` is `moe_rl.tasks.rewards.math_verify_score` (what `task.reward=math` runs); "
        "`math-verify raw` is the library with its default settings and no rewrites. The rewrites "
        "(cut to the last box, `4e4` -> `4\\times 10^{4}`, drop a final period, malformed-operator "
        "normalization for `\\frac12`) were added for failures of the raw library that an earlier run "
        "of this set exposed, so the `math-verify` column is not an unbiased test of them; the raw "
        "column is.\n")
CASES_PER_TEMPLATE = 3


@dataclass(frozen=True)
class Case:
    """One response scored against one reference; `expected` is the right verdict."""

    category: str
    response: str
    reference: str
    expected: bool


def _ints(rng: random.Random, lo: int = 2, hi: int = 999) -> int:
    return rng.randint(lo, hi)


def _numbers(rng: random.Random) -> Iterator[Case]:
    """Integers, negatives, thousands commas, decimals."""
    for _ in range(CASES_PER_TEMPLATE * 2):
        n = _ints(rng)
        yield Case("integers", f"So we get \\boxed{{{n}}}.", str(n), True)
        yield Case("integers", f"The result is {n}.", str(n), True)
        yield Case("integers", f"\\boxed{{{n + 1}}}", str(n), False)
        yield Case("negatives", f"Thus $x = -{n}$, so \\boxed{{-{n}}}.", f"-{n}", True)
        yield Case("negatives", f"The temperature drops to -{n}.", f"-{n}", True)
        yield Case("negatives", f"\\boxed{{{n}}}", f"-{n}", False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        n = rng.randint(1_000, 9_999_999)
        yield Case("commas", f"The total is \\boxed{{{n:,}}}.", str(n), True)
        yield Case("commas", f"In all, {n:,} people came.", str(n), True)
        yield Case("commas", f"\\boxed{{{n}}}", f"{n:,}", True)
        yield Case("commas", f"\\boxed{{{n + 10:,}}}", str(n), False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        whole, frac = _ints(rng, 0, 99), rng.choice([5, 25, 75, 125])
        value = f"{whole}.{frac}"
        yield Case("decimals", f"\\boxed{{{value}0}}", value, True)
        yield Case("decimals", f"It weighs {value} kg in the end, so the answer is {value}.", value, True)
        yield Case("decimals", f"\\boxed{{{whole}.{frac + 1}}}", value, False)


def _fractions(rng: random.Random) -> Iterator[Case]:
    """\\frac, \\dfrac, a/b, shorthand \\frac34, and nesting inside \\boxed."""
    for _ in range(CASES_PER_TEMPLATE * 2):
        a, b = rng.randint(1, 20), rng.randint(21, 40)
        yield Case("fractions", f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a}/{b}", True)
        yield Case("fractions", f"\\boxed{{\\dfrac{{{2 * a}}}{{{2 * b}}}}}", f"\\frac{{{a}}}{{{b}}}", True)
        yield Case("fractions", f"The probability is {a}/{b}.", f"\\frac{{{a}}}{{{b}}}", True)
        yield Case("fractions", f"\\boxed{{\\frac{{{b}}}{{{a}}}}}", f"\\frac{{{a}}}{{{b}}}", False)
    for a, b in [(1, 2), (3, 4), (2, 3), (5, 7)]:
        yield Case("fractions", f"\\boxed{{\\frac{a}{b}}}", f"{a}/{b}", True)
    for _ in range(CASES_PER_TEMPLATE * 2):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        yield Case("boxed_nesting", f"\\boxed{{\\frac{{\\sqrt{{{a}}}}}{{{b}}}}}",
                   f"\\frac{{\\sqrt{{{a}}}}}{{{b}}}", True)
        yield Case("boxed_nesting", f"\\boxed{{{{{a * b}}}}}", str(a * b), True)
        yield Case("boxed_nesting", f"\\boxed{{{a}^{{{b}}}}}", str(a**b), True)
        yield Case("boxed_nesting", f"\\boxed{{\\left(\\frac{{{a}}}{{{b}}}\\right)^{{2}}}}",
                   f"\\frac{{{a * a}}}{{{b * b}}}", True)
        yield Case("boxed_nesting", f"\\boxed{{\\frac{{{a}}}{{{b}+1}}}}",
                   f"\\frac{{{a}}}{{{b}}}", False)


def _word_problems(rng: random.Random) -> Iterator[Case]:
    """GSM8K references, percentages, dollars, units."""
    for _ in range(CASES_PER_TEMPLATE * 2):
        n, m = _ints(rng, 2, 50), _ints(rng, 2, 50)
        gsm = f"She had {n} and bought {m} more: {n}+{m}=<<{n}+{m}={n + m}>>{n + m}.\n#### {n + m}"
        yield Case("gsm8k", f"She has {n} + {m} = {n + m} apples.\n#### {n + m}", gsm, True)
        yield Case("gsm8k", f"{n} plus {m} is {n + m}. The answer is {n + m}.", gsm, True)
        yield Case("gsm8k", f"\\boxed{{{n + m}}}", gsm, True)
        yield Case("gsm8k", f"{n} + {m} = {n + m + 1}\n#### {n + m + 1}", gsm, False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        p = _ints(rng, 1, 99)
        yield Case("percentages", f"\\boxed{{{p}\\%}}", str(p), True)
        yield Case("percentages", f"The discount is {p}%.", str(p), True)
        yield Case("percentages", f"\\boxed{{{p}}}", f"{p}\\%", True)
        yield Case("percentages", f"\\boxed{{{p + 1}\\%}}", str(p), False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        d, c = _ints(rng, 1, 99), rng.randint(1_000, 99_999)
        yield Case("dollars", f"\\boxed{{\\${d}}}", str(d), True)
        yield Case("dollars", f"She pays ${d} in total.", str(d), True)
        yield Case("dollars", f"The house costs \\${c:,}.00, so the answer is \\boxed{{{c:,}}}.", str(c), True)
        yield Case("dollars", f"\\boxed{{\\${d + 2}}}", str(d), False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        u = _ints(rng, 2, 500)
        yield Case("units", f"\\boxed{{{u} \\text{{ cm}}}}", str(u), True)
        yield Case("units", f"The rope is {u} meters long.", str(u), True)
        yield Case("units", f"\\boxed{{{u}^\\circ}}", str(u), True)
        yield Case("units", f"\\boxed{{{u + 3}\\text{{ km}}}}", str(u), False)


def _symbolic(rng: random.Random) -> Iterator[Case]:
    """Scientific notation, square roots, pi, intervals and sets."""
    for _ in range(CASES_PER_TEMPLATE * 2):
        a, e = rng.randint(1, 9), rng.randint(3, 7)
        yield Case("scientific", f"\\boxed{{{a} \\times 10^{{{e}}}}}", str(a * 10**e), True)
        yield Case("scientific", f"\\boxed{{{a}e{e}}}", str(a * 10**e), True)
        yield Case("scientific", f"\\boxed{{{a}.5 \\times 10^{{-3}}}}", f"0.00{a}5", True)
        yield Case("scientific", f"\\boxed{{{a} \\times 10^{{{e + 1}}}}}", str(a * 10**e), False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        k, s = rng.randint(2, 5), rng.choice([2, 3, 5, 7])
        yield Case("sqrt", f"\\boxed{{{k}\\sqrt{{{s}}}}}", f"\\sqrt{{{k * k * s}}}", True)
        yield Case("sqrt", f"\\boxed{{\\sqrt{{{s}}}}}", f"\\sqrt{s}", True)
        yield Case("sqrt", f"\\boxed{{\\sqrt{{{s + 1}}}}}", f"\\sqrt{{{s}}}", False)
    for k in range(2, 2 + CASES_PER_TEMPLATE * 2):
        yield Case("pi", f"\\boxed{{{k}\\pi}}", f"{k}\\pi", True)
        yield Case("pi", f"\\boxed{{\\frac{{\\pi}}{{{k}}}}}", f"\\pi/{k}", True)
        yield Case("pi", f"The area is $\\boxed{{{k * k}\\pi}}$ square units.", f"{k * k}\\pi", True)
        yield Case("pi", f"\\boxed{{{k + 1}\\pi}}", f"{k}\\pi", False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        a, b = rng.randint(-9, 0), rng.randint(1, 9)
        yield Case("intervals_sets", f"\\boxed{{({a}, {b}]}}", f"({a},{b}]", True)
        yield Case("intervals_sets", f"\\boxed{{[{a}, \\infty)}}", f"[{a},\\infty)", True)
        yield Case("intervals_sets", f"\\boxed{{\\{{{b}, {a}\\}}}}", f"\\{{{a}, {b}\\}}", True)
        yield Case("intervals_sets", f"\\boxed{{({a}, {b})}}", f"({a},{b}]", False)


def _forms(rng: random.Random) -> Iterator[Case]:
    """Equivalent forms and close-looking wrong answers."""
    pairs = [("0.5", "\\frac{1}{2}"), ("\\frac{2}{4}", "0.5"), ("x = 3", "3"), ("1.0", "1"),
             ("6/3", "2"), ("0.25", "1/4"), ("\\frac{10}{4}", "2.5"), ("2.50", "\\frac52"),
             ("y=-4", "-4"), ("0.125", "\\frac{1}{8}"), ("4.0", "\\frac{8}{2}"), ("+7", "7")]
    for resp, ref in pairs:
        yield Case("equivalent", f"\\boxed{{{resp}}}", ref, True)
        yield Case("equivalent", f"So the answer is ${resp}$.", ref, True)
    close = [("0.33", "\\frac{1}{3}"), ("12", "21"), ("-5", "5"), ("125", "1250"), ("1/2", "2"),
             ("3.14", "\\pi"), ("0.5", "5"), ("\\frac{1}{4}", "4"), ("100", "1000"),
             ("2\\sqrt{2}", "2\\sqrt{3}"), ("x = 4", "3"), ("1.41", "\\sqrt{2}")]
    for resp, ref in close:
        yield Case("close_wrong", f"\\boxed{{{resp}}}", ref, False)
        yield Case("close_wrong", f"The answer is {resp}.", ref, False)
    for _ in range(CASES_PER_TEMPLATE):
        n = _ints(rng)
        yield Case("close_wrong", f"\\boxed{{{n}.1}}", str(n), False)
        yield Case("close_wrong", f"\\boxed{{{n}{n % 9 + 1}}}", str(n), False)  # one digit more


def _answer_text(rng: random.Random) -> Iterator[Case]:
    """Unboxed final answers after reasoning with other numbers, and several boxes."""
    for _ in range(CASES_PER_TEMPLATE * 2):
        a, b = _ints(rng, 2, 60), _ints(rng, 2, 60)
        yield Case("answer_text", f"We have {a} apples and {b} pears, so the answer is {a + b}.", str(a + b), True)
        yield Case("answer_text", f"{a} * {b} = {a * b}\nFinal answer: {a * b}", str(a * b), True)
        yield Case("answer_text", f"Adding {a} and {b}.\nThe final answer is ${a + b}$. I hope it is correct.",
                   str(a + b), True)
        yield Case("answer_text", f"Answer: {a + b}", str(a + b), True)
        yield Case("answer_text", f"We have {a} apples and {b} pears, so the answer is {a + b + 1}.",
                   str(a + b), False)
    for _ in range(CASES_PER_TEMPLATE * 2):
        a, b = _ints(rng), _ints(rng)
        if a == b:
            b += 1
        yield Case("multiple_boxes", f"First \\boxed{{{a}}}; wait, that is wrong. It is \\boxed{{{b}}}.", str(b), True)
        yield Case("multiple_boxes", f"First \\boxed{{{a}}}; wait, that is wrong. It is \\boxed{{{b}}}.", str(a), False)
        yield Case("multiple_boxes", f"\\boxed{{{a}}} or \\boxed{{{b}}}", str(b), True)


def _garbage(rng: random.Random) -> Iterator[Case]:
    """Junk that must score 0 (and must not crash or hang either verifier)."""
    junk = ["", "   ", "asdf", "}{{\\boxed{", "\\boxed{}", "\\boxed{", "NaN", "inf", "None",
            "\\frac{1}{0}", "$$$$", "\\boxed{9^{9^{9^{9}}}}", "0/0", "{{{{{{{{", "\\sqrt{-}",
            "I don't know.", "\u0000\u0001", "1" * 400, "\\boxed{\\boxed{\\boxed{}}}", "#### "]
    for text in junk:
        yield Case("garbage", text, str(_ints(rng)), False)
    alphabet = "\\{}$^_0123456789abc +-*/()[]=,."
    for _ in range(CASES_PER_TEMPLATE * 4):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(5, 60)))
        yield Case("garbage", text, "123456789", False)


GENERATORS: tuple[Callable[[random.Random], Iterator[Case]], ...] = (
    _numbers, _fractions, _word_problems, _symbolic, _forms, _answer_text, _garbage)


def make_cases(seed: int = SEED) -> list[Case]:
    """Every case, in a fixed order (one generator after the other, one seeded stream)."""
    rng = random.Random(seed)
    return [case for gen in GENERATORS for case in gen(rng)]


def raw_math_verify(response: str, reference: str) -> float:
    """math-verify with library defaults and none of `rewards.py`'s rewrites (a baseline)."""
    from math_verify import parse, verify

    gold = parse(f"${reference_answer(reference).strip()}$") or parse(reference)
    return 1.0 if gold and verify(gold, parse(response)) else 0.0


NAMES = ("hand-written", "math-verify", "math-verify raw")


def score_all(cases: list[Case]) -> dict[str, list[bool]]:
    """Per verifier, whether each case's verdict equals its expected label, plus timings."""
    verifiers = dict(zip(NAMES, (handwritten_reward, math_verify_score, raw_math_verify)))
    correct: dict[str, list[bool]] = {}
    for name, fn in verifiers.items():
        t0 = time.perf_counter()
        correct[name] = [(fn(c.response, c.reference) == 1.0) == c.expected for c in cases]
        correct[f"{name} ms/case"] = [(time.perf_counter() - t0) * 1e3 / len(cases)]  # type: ignore[list-item]
    return correct


def report(cases: list[Case], correct: dict[str, list[bool]]) -> str:
    """Markdown: overall and per-category accuracy, then every disagreement."""
    names = list(NAMES)
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(cases):
        by_cat[c.category].append(i)
    rows = [["overall", len(cases)] + [_pct(correct[n], range(len(cases))) for n in names]]
    rows += [[cat, len(idx)] + [_pct(correct[n], idx) for n in names] for cat, idx in by_cat.items()]
    ms = [f"{correct[f'{n} ms/case'][0]:.2f}" for n in names]
    out = markdown_table(["category", "cases"] + [f"{n} accuracy" for n in names], rows)
    out += (f"\nMean time per case: {', '.join(f'{n} {t} ms' for n, t in zip(names, ms))} "
            "(math-verify refuses the garbage case `\\boxed{9^{9^{9^{9}}}}` up front as too big to "
            "build; raw waits out the library's 5 s timeout on it).\n\n" + NOTE)
    out += "\n## Disagreements of hand-written and math-verify (verdict of each verifier; `expected` is the right one)\n\n"
    dis = [[c.category, _md(c.response), _md(c.reference), c.expected] +
           [correct[n][i] == c.expected for n in names[:2]]
           for i, c in enumerate(cases) if correct[names[0]][i] != correct[names[1]][i]]
    out += markdown_table(["category", "response", "reference", "expected"] + [f"{n} says" for n in names[:2]], dis)
    raw = [[c.category, _md(c.response), _md(c.reference), c.expected]
           for i, c in enumerate(cases) if not correct[names[2]][i]]
    out += "\n## Where math-verify raw is wrong\n\n" + markdown_table(["category", "response", "reference", "expected"], raw)
    return out


def _pct(flags: list[bool], idx: range | list[int]) -> str:
    idx = list(idx)
    hits = sum(flags[i] for i in idx)
    return f"{100 * hits / len(idx):.1f}% ({hits}/{len(idx)})"


def _md(text: str) -> str:
    """A cell-safe rendering: one line, pipes escaped, long junk shortened."""
    text = text.replace("\n", "\\n").replace("|", "\\|").replace("\u0000", "\\x00").replace("\u0001", "\\x01")
    return f"`{text[:70]}{'…' if len(text) > 70 else ''}`" if text.strip() else "(blank)"


def main(quick: bool = False) -> None:
    """Score every case with both verifiers; print and write the Markdown report."""
    cases = make_cases()
    if quick:
        cases = cases[::10]
    table = report(cases, score_all(cases))
    header = results_header("math_verify_compare") + (
        f"Generated by `python -m bench.archive.math_verify_compare` ({len(cases)} cases, seed {SEED}); "
        "labels are set by construction.\n\n")
    print(header + table)
    if not quick:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        atomic_write_text(RESULTS_DIR / "math_verify_compare.md", header + table)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
