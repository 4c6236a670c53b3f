r"""Where the answer sits in a reference or a response: the last `\boxed{}`, or the text
after GSM8K's `####` (shared by the dataset task and the math reward)."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    r"""Content of the last complete `\boxed{...}` (or `\boxed x`) in `text`, else None (a
    box that never closes, as in a truncated response, is ignored)."""
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


def reference_answer(answer: str) -> str:
    r"""The answer inside a dataset's reference: `\boxed{}` content, text after GSM8K's
    `####`, or the whole string."""
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    if "####" in answer:
        return answer.rsplit("####", 1)[1]
    return answer
