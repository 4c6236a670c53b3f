r"""The hand-written math verifier that `task.reward=math` used before math-verify, kept
only so `bench/archive/math_verify_compare.py` can reproduce the comparison that retired it.

Final-answer extraction and comparison for math responses.

    extract_answer("... so the area is \boxed{\frac{3}{4}}.")   -> "\frac{3}{4}"
    extract_answer("It costs $1,250.")                          -> "1,250"
    answers_match("\frac{3}{4}", "0.75")                        -> True

Extraction takes the last balanced `\boxed{...}` (nested braces allowed; a box that never
closes, as in a truncated response, is ignored); without one, the last number in the text
(signs, thousands commas, decimals, exponents, `a/b`, `%`). Both sides are then
normalized (`$` and LaTeX delimiters, spacing, `\left`/`\right`, `\text{}`, a trailing
unit such as `\text{ cm}`, `^\circ`, thousands commas, a trailing period, a leading `+`,
`x = ...`) and compared numerically (relative tolerance 1e-6) when both parse as numbers
(`\frac{a}{b}`, `a/b`, decimals, exponents), else as normalized strings. `%` is dropped,
so "50%" equals "50" (not 0.5). Every function returns a value for any input; none raises.
"""

from __future__ import annotations

import math
import re

REL_TOL = 1e-6
ABS_TOL = 1e-9

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# An unsigned number: 1,234,567 | 1234 | 12.5 | .5, with an optional exponent.
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
# A sign counts only where it cannot be a binary operator (not after a word or a bracket).
_SIGN = r"(?:(?<![\w)\]}])[-+])?"
_NUMBER_IN_TEXT = re.compile(rf"{_SIGN}(?:{_UNSIGNED})(?:/(?:{_UNSIGNED}))?%?")

_PLAIN_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"(-?)\\frac(\d)(\d)")  # \frac12
_SLASH = re.compile(r"([^/]+)/([^/]+)")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}")
# "5 \text{ cm}" -> "5": a unit after a value; a bare "\text{yes}" is kept.
_TRAILING_UNIT = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}$")
_ASSIGNMENT = re.compile(r"[A-Za-z]\w*=(.+)")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LATEX_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "~")
_REMOVED = ("\\$", "$", "\\(", "\\)", "\\[", "\\]", "\\left", "\\right", "^\\circ", "^{\\circ}")


def last_boxed(text: str) -> str | None:
    r"""Content of the last complete `\boxed{...}` (or `\boxed x`) in `text`, else None."""
    found = None
    for m in _BOXED.finditer(text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            content = _braced(text, i)
            if content is not None:
                found = content
        else:  # `\boxed 5`: the next whitespace-free run
            run = re.match(r"[^\s$]+", text[i:])
            if run:
                found = run.group(0)
    return found


def _braced(text: str, start: int) -> str | None:
    """Text inside the brace group opening at text[start]; None if it never closes."""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : j]
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` (with sign, commas, fraction bar, %), else None."""
    matches = _NUMBER_IN_TEXT.findall(text.replace("−", "-"))
    return matches[-1] if matches else None


def extract_answer(response: object) -> str | None:
    r"""The final answer of a response: last `\boxed{}` content, else the last number."""
    if not isinstance(response, str):
        return None
    boxed = last_boxed(response)
    return boxed if boxed is not None else last_number(response)


def reference_answer(answer: str) -> str:
    r"""The answer inside a dataset's reference: `\boxed{}` content, text after GSM8K's
    `####`, or the whole string."""
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    if "####" in answer:
        return answer.rsplit("####", 1)[1]
    return answer


def normalize_answer(answer: str) -> str:
    r"""Canonical text of an answer: no spacing, `$`, `\text{}`, thousands commas, ..."""
    s = answer.strip().replace("−", "-")
    for token in _REMOVED:
        s = s.replace(token, "")
    for token in _LATEX_SPACING:
        s = s.replace(token, "")
    s = _TRAILING_UNIT.sub("", s)
    s = _TEXT_MACRO.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\%", "%")
    s = "".join(s.split())
    s = s.rstrip(".")
    s = _THOUSANDS_COMMA.sub("", s)
    assignment = _ASSIGNMENT.fullmatch(s)
    if assignment:
        s = assignment.group(1)
    return s.removeprefix("+")


def parse_number(normalized: str) -> float | None:
    r"""Value of a normalized answer: int, decimal, exponent, `a/b`, `\frac{a}{b}`, `n%`."""
    s = normalized.removesuffix("%")
    value = None
    try:
        if _PLAIN_NUMBER.fullmatch(s):
            value = float(s)
        elif frac := _FRAC.fullmatch(s) or _FRAC_SHORT.fullmatch(s):
            sign, num, den = frac.groups()
            value = _ratio(num, den)
            if value is not None and sign:
                value = -value
        elif slash := _SLASH.fullmatch(s):
            value = _ratio(*slash.groups())
    except (ValueError, OverflowError, ZeroDivisionError):
        return None
    # inf/nan (1e999, overflowing ratios) compare as strings instead.
    return value if value is not None and math.isfinite(value) else None


def _ratio(num: str, den: str) -> float | None:
    if not (_PLAIN_NUMBER.fullmatch(num) and _PLAIN_NUMBER.fullmatch(den)):
        return None
    return float(num) / float(den)


def answers_match(predicted: str | None, reference: str) -> bool:
    """True when the two answers are numerically close, or identical after normalization."""
    if not isinstance(predicted, str) or not isinstance(reference, str):
        return False
    pred, ref = normalize_answer(predicted), normalize_answer(reference)
    if not pred or not ref:
        return False
    pred_value, ref_value = parse_number(pred), parse_number(ref)
    if pred_value is not None and ref_value is not None:
        return math.isclose(pred_value, ref_value, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    return pred == ref


def math_reward(response: object, reference: str) -> float:
    """1.0 when the response's final answer matches the reference answer, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), reference_answer(reference)) else 0.0
