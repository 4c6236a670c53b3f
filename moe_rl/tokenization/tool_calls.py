"""An assistant turn's tool calls, read in the model's own format.

    parse = tool_call_parser("auto", chat_template)       # or "hermes" / "glm45"
    turn = parse(text)                                     # ParsedTurn(content, calls, error)

Each model family writes calls its own way, and its chat template renders them that way:
- `hermes` (Qwen2.5 / Qwen3 and the shipped tool base, `moe_rl/assets/tool_tokenizer`):
  `<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>`, one block
  per call, after the turn's content.
- `glm45` (GLM-4.5): `<tool_call>add\\n<arg_key>a</arg_key>\\n<arg_value>1</arg_value>\\n...
  </tool_call>`; values that parse as JSON are taken as JSON, others as strings.
`auto` picks by what the template renders (`<arg_key>`: glm45; `<tool_call>`: hermes) and
refuses a template that renders neither (name the parser then).

A malformed call never raises: the turn comes back with `error`, one line saying what was
wrong, which the environment answers with an error observation (and the rollout counts in
`rollout/tool_parse_errors`). The model decides; the parser only reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "glm45")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn as read: its content outside the call tags, its calls, and the first
    malformed call's one-line description (None: every call parsed)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None


_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _blocks(text: str) -> tuple[str, list[str], str | None]:
    """(content outside the blocks, each block's inside, an unclosed tag's error)."""
    inside = [m.group(1) for m in _BLOCK.finditer(text)]
    rest = _BLOCK.sub("", text)
    error = None
    if "<tool_call>" in rest:
        error = "a <tool_call> is not closed by </tool_call>"
        rest = rest.split("<tool_call>", 1)[0]
    elif "</tool_call>" in rest:
        error = "a </tool_call> has no <tool_call> before it"
        rest = rest.replace("</tool_call>", "")
    return rest.strip(), inside, error


def _short(s: str, n: int = 60) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def parse_hermes(text: str) -> ParsedTurn:
    """`<tool_call>{json}</tool_call>` blocks (see the module docstring)."""
    content, blocks, error = _blocks(text)
    calls: list[ToolCall] = []
    for body in blocks:
        try:
            doc = json.loads(body)
        except json.JSONDecodeError as e:
            error = error or f"tool call {_short(body)!r} is not JSON ({e.msg} at column {e.colno})"
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            error = error or f"tool call {_short(body)!r} has no \"name\" string"
            continue
        args = doc.get("arguments", {})
        if isinstance(args, str):  # (some models write the arguments as a JSON string)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            error = error or f"tool call {doc['name']!r}: \"arguments\" is not an object"
            continue
        calls.append(ToolCall(doc["name"], args))
    return ParsedTurn(content, tuple(calls), error)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse_glm45(text: str) -> ParsedTurn:
    """`<tool_call>name <arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>` blocks."""
    content, blocks, error = _blocks(text)
    calls: list[ToolCall] = []
    for body in blocks:
        name = body.split("<arg_key>", 1)[0].strip()
        if not name:
            error = error or f"tool call {_short(body)!r} has no name before its arguments"
            continue
        args: dict[str, Any] = {}
        for key, raw in _GLM_ARG.findall(body):
            try:
                args[key.strip()] = json.loads(raw)
            except json.JSONDecodeError:
                args[key.strip()] = raw
        leftover = _GLM_ARG.sub("", body[body.index("<arg_key>"):]) if "<arg_key>" in body else ""
        if leftover.strip():
            error = error or f"tool call {name!r}: unreadable arguments {_short(leftover)!r}"
            continue
        calls.append(ToolCall(name, args))
    return ParsedTurn(content, tuple(calls), error)


_BY_NAME: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "glm45": parse_glm45}


def tool_call_parser(name: str, chat_template: str | None) -> Callable[[str], ParsedTurn]:
    """The parser `task.tool_parser=name` names; `auto` reads it off the chat template."""
    if name == "auto":
        if not chat_template or "<tool_call>" not in chat_template:
            raise ValueError("task.tool_parser=auto: the chat template renders no <tool_call> tags, so the model's "
                             f"call format is unknown; set task.tool_parser to one of {', '.join(PARSERS)}")
        name = "glm45" if "<arg_key>" in chat_template else "hermes"
    if name not in _BY_NAME:
        raise ValueError(f"task.tool_parser={name}: unknown; use auto or one of {', '.join(PARSERS)}")
    return _BY_NAME[name]
