"""One agent episode's tokens, kept across its chat-completion calls: token in, token out.

    ep = AgentEpisode(key, seed, budget, turns_for, parse)
    feed = ep.begin(messages, tools)          # the ids to feed the engine (or None: budget used)
    message = ep.record(feed, tokens, logprobs, finish, routed)   # the assistant message returned

A call's messages are compared with what the episode has seen: the previous call's messages
plus the assistant message the gateway returned. Compared as messages after normalization
(`normal`): a missing or None `content` equals "", content given as a list of text parts is
their concatenation, tool calls are compared by name and parsed arguments (their ids, and
how the arguments JSON is spelled, do not matter), a tool message's `tool_call_id` and
`name` are ignored. When the call extends them, only the new messages (tool results, a user
turn) are templated, as an observation of the tool episodes (`ChatTurns.observation`), and
appended as ids: earlier turns are never re-encoded. When it does not (the agent rewrote or
dropped a message, changed the system prompt or the tools), the episode starts a new segment
from the call's messages (`ChatTurns.opening`), counted in `resets`; every segment is
trained on as a sequence of its own, with the episode's advantage (`agents.agent_groups`).

Within a segment, as in the tool episodes (`moe_rl.rollout.episodes`): the prompt is the
first call's opening; then the sampled turn's ids (log-probs from the sampler, `observed`
false), each observation's ids (log-prob 0, `observed` true), and the routes of every
position the first time it is fed (R3). Limits: `rl.max_turns` calls, `rl.max_turn_tokens`
per call, `sampler.max_new_tokens` tokens after the prompt. A call past them is answered
with an empty message and finish reason "length" (nothing sampled), the segment truncated;
a turn cut at its room is "length" too and ends the segment.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_rl.rollout.pool import segment_seed


@dataclass(frozen=True)
class Budget:
    """The run's limits on one episode (serve mode: one turn's request alone)."""

    max_turns: int
    """Calls per segment (rl.max_turns)."""
    turn_tokens: int
    """Tokens per call (rl.max_turn_tokens, or what is left of the episode's budget)."""
    episode_tokens: int
    """Tokens after the prompt, turns and observations (sampler.max_new_tokens)."""


@dataclass
class Segment:
    """One sequence of an episode: a prompt and what followed it."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    observed: list[bool] = field(default_factory=list)
    routed: np.ndarray | None = None
    """Routes of the positions fed so far ([prompt + tokens - 1, layers, K])."""
    turns: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each sampled turn in `tokens`."""
    finish: str | None = None
    """"length" once a limit ended it; "stop" while its last turn ended on EOS."""


@dataclass(frozen=True)
class Feed:
    """One call's engine request: the ids fed, the turn's room and its seed."""

    ids: list[int]
    room: int
    seed: int


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's tool calls as the chat template renders them: name and parsed arguments."""
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        out.append({"type": "function", "function": {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}})
    return out


def normal(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the episode compares and templates it (see the module docstring)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    if calls := _calls(message):
        out["tool_calls"] = calls
    return out


class AgentEpisode:
    """An episode's segments and tallies (one per agent episode; `key` = (group, response))."""

    def __init__(self, key: tuple[int, int], seed: int, budget: Budget, turns_for: Callable[[Any], Any],
                 parse: Callable[[str], Any], decode: Callable[[Sequence[int]], str]) -> None:
        self.key, self.seed, self.budget = key, seed, budget
        self.turns_for, self.parse, self.decode = turns_for, parse, decode
        self.segments: list[Segment] = []
        self.calls = 0
        """Engine calls made (the next one's seed index, as the pool's segments)."""
        self.resets = 0
        self.tool_calls = 0
        self.parse_errors = 0
        self.busy = False
        """A call of this episode is in flight (a concurrent one is refused: 409)."""
        self.closed = False
        """The agent's episode is over (its calls are refused)."""
        self._seen: list[dict[str, Any]] | None = None
        self._tools: Any = None

    def begin(self, messages: Sequence[dict[str, Any]], tools: Any) -> Feed | None:
        """The engine request for a call with `messages` and `tools` (appending the new
        messages' ids, or starting a segment); None: the segment's limits are used up."""
        msgs = [normal(m) for m in messages]
        seen = self._seen or []
        extends = (self._seen is not None and tools == self._tools and len(msgs) > len(seen)
                   and msgs[:len(seen)] == seen and all(m["role"] != "assistant" for m in msgs[len(seen):]))
        if extends and self.segments[-1].finish == "length":
            return None
        if extends:
            seg = self.segments[-1]
            ids = self.turns_for(tools).observation(msgs[len(seen):])
            if len(seg.turns) >= self.budget.max_turns or len(seg.tokens) + len(ids) >= self.budget.episode_tokens:
                seg.finish = "length"
                return None
            seg.tokens += ids
            seg.logprobs += [0.0] * len(ids)
            seg.observed += [True] * len(ids)
        else:
            if self.segments:
                self.resets += 1
            self._tools = tools
            self.segments.append(Segment(self.turns_for(tools).opening(msgs)))
        self._seen = msgs
        seg = self.segments[-1]
        room = min(self.budget.turn_tokens, self.budget.episode_tokens - len(seg.tokens))
        return Feed(seg.prompt + seg.tokens, room, segment_seed(self.seed, self.key[1], self.calls))

    def record(self, feed: Feed, tokens: list[int], logprobs: list[float], finish: str,
               routed: np.ndarray | None) -> tuple[dict[str, Any], str]:
        """The engine's turn appended to the segment (cut at its room); returns the assistant
        message (OpenAI shape) and its finish reason."""
        seg = self.segments[-1]
        self.calls += 1
        cut = len(tokens) > feed.room
        tokens, logprobs = tokens[:feed.room], logprobs[:feed.room]
        if routed is not None:
            fed_before = 0 if seg.routed is None else len(seg.routed)
            new = routed[fed_before:len(feed.ids) + len(tokens) - 1]
            seg.routed = new if seg.routed is None else np.concatenate([seg.routed, new])
        start = len(seg.tokens)
        seg.tokens += tokens
        seg.logprobs += logprobs
        seg.observed += [False] * len(tokens)
        seg.turns.append((start, len(seg.tokens)))
        reason = "stop" if finish == "stop" and not cut else "length"
        seg.finish = reason
        text = self.decode(tokens)
        if reason == "length":  # (a turn cut mid-way: its calls are not read, as the tool episodes do)
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            message = self._message(text)
        self._seen = [*(self._seen or []), normal(message)]
        return message, reason

    def _message(self, text: str) -> dict[str, Any]:
        parsed = self.parse(text)
        self.parse_errors += parsed.error is not None
        self.tool_calls += len(parsed.calls)
        if parsed.error is not None:  # (the agent sees what the model wrote, and may answer it)
            return {"role": "assistant", "content": text}
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [
                {"id": f"call_{self.key[0]}_{self.key[1]}_{self.calls}_{i}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for i, c in enumerate(parsed.calls)]
        return message

    def truncated(self) -> bool:
        return bool(self.segments) and self.segments[-1].finish == "length"

    def tally(self) -> tuple[int, int, int]:
        """(turns, tool calls, parse errors) over the episode."""
        return sum(len(s.turns) for s in self.segments), self.tool_calls, self.parse_errors
