"""A multi-turn episode's ids, templated once: the opening prompt (with the tools), the ids an
observation appends after an assistant turn, and (for supervised examples) an assistant
turn's own ids.

    turns = ChatTurns(tokenizer, template, tools)
    prompt_ids = turns.opening(messages)              # ... <|im_start|>assistant\\n
    obs_ids = turns.observation(tool_messages)        # after the turn's EOS: \\n<|im_start|>user ...
    turn_ids = turns.assistant(history, message)      # SFT: the turn's text + EOS

Token in, token out: an episode is the ids the engine consumed and produced, one turn after
another. The policy's turns are never decoded and re-encoded (a BPE tokenizer's encode of a
decoded text need not give the ids back, and the learner must score the ids that were
sampled); an observation is rendered by the chat template and encoded once, then appended
as ids.

How an observation's ids are found: the template renders a fixed conversation ending with an
assistant message, and the same conversation with the observation's messages after it (and
the next assistant turn's opening); the second must extend the first, and the observation's
ids are the encoded text after the first's last end-of-turn token (the one the engine
stopped on, so the template's text between turns, e.g. Qwen3's newline, comes with them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from moe_rl.tokenization.hf import TokenizerError

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
"""The fixed conversation observations are rendered after (its content never reaches an id)."""


class ChatTurns:
    """One tokenizer's chat template applied to episodes offering `tools`."""

    def __init__(self, tokenizer: Any, template: str, tools: Sequence[Callable[..., Any] | dict[str, Any]] = (),
                 system_prompt: str = "") -> None:
        if not hasattr(tokenizer, "render_chat"):
            raise TokenizerError(f"multi-turn episodes need a Hugging Face tokenizer with a chat template; "
                                 f"{tokenizer!r} has none")
        self.tokenizer = tokenizer
        self.template = template
        self.tools = list(tools)
        self.system_prompt = system_prompt
        self._probe = self._render(_PROBE, add_generation_prompt=False)
        """The fixed conversation rendered once (every observation is cut out after it)."""
        self.end_of_turn = self._end_of_turn_text()

    def _render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(messages, self.template, self.tools, add_generation_prompt)

    def _end_of_turn_text(self) -> str:
        """The text of the EOS token the template closes an assistant turn with."""
        for eos in self.tokenizer.eos_ids:
            piece = self.tokenizer.hf.convert_ids_to_tokens(eos)
            if piece and f"a{piece}" in self._probe:  # (right after the probe's assistant content "a")
                return piece
        raise TokenizerError("the chat template does not close an assistant turn with one of the tokenizer's EOS "
                             f"tokens ({self.tokenizer.eos_ids}); the engine could not stop at the end of a turn")

    def with_system(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` after `task.system_prompt` when one is set (and the episode has none)."""
        msgs = [dict(m) for m in messages]
        if self.system_prompt and (not msgs or msgs[0].get("role") != "system"):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def opening(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids of an episode's opening conversation, the tools shown, ending with the
        first assistant turn's opening."""
        return self.tokenizer.encode(self._render(self.with_system(messages), add_generation_prompt=True))

    def observation(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The ids appended after an assistant turn's EOS: `messages` (tool results, a user
        turn) and the next assistant turn's opening."""
        before = self._probe
        after = self._render([*_PROBE, *messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise TokenizerError("the chat template renders a conversation differently once messages follow it, so "
                                 "an observation cannot be appended as ids; use a template whose earlier turns "
                                 "do not change (Qwen3's, the shipped tool tokenizer's)")
        cut = before.rindex(self.end_of_turn) + len(self.end_of_turn)
        return self.tokenizer.encode(after[cut:])

    def assistant(self, history: Sequence[dict[str, Any]], message: dict[str, Any]) -> list[int]:
        """An assistant message's ids after `history` as the policy would produce them (a
        supervised example): its text as the template renders it, up to and including the EOS
        that ends the turn."""
        history = self.with_system(history)
        before = self._render(history, add_generation_prompt=True)
        after = self._render([*history, message], add_generation_prompt=False)
        if not after.startswith(before):
            raise TokenizerError("the chat template renders an assistant turn without the generation prompt before "
                                 "it; supervised turns cannot be cut out of it")
        text = after[len(before):]
        end = text.find(self.end_of_turn)
        if end < 0:
            raise TokenizerError(f"the chat template renders an assistant message without {self.end_of_turn!r}")
        return self.tokenizer.encode(text[: end + len(self.end_of_turn)])


def encode_conversation(turns: ChatTurns,
                        messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], list[bool]]:
    """A whole conversation as a supervised episode: (prompt ids up to the first assistant
    turn's opening, the rest's ids, which of those are observations), built as a rollout
    builds it: each assistant turn's own ids (`assistant`), each run of tool / user messages
    between turns as an observation (`observation`)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError("a supervised conversation needs at least one assistant message")
    prompt = turns.opening(messages[:first])
    response: list[int] = []
    observed: list[bool] = []
    i = first
    while i < len(messages):
        if messages[i].get("role") == "assistant":
            ids, flag, i = turns.assistant(messages[:i], messages[i]), False, i + 1
        else:
            j = next((k for k in range(i, len(messages)) if messages[k].get("role") == "assistant"), len(messages))
            if j == len(messages):
                raise ValueError("a supervised conversation must end with an assistant message")
            ids, flag, i = turns.observation(messages[i:j]), True, j
        response += ids
        observed += [flag] * len(ids)
    return prompt, response, observed


def encode_conversations(conversations: Sequence[Sequence[dict[str, Any]]], task: Any, encoder: Any,
                         seq_multiple: int) -> Any:
    """Supervised episodes (a `TokenBatch`) built as the rollout builds them: the task's tools
    shown by `encoder`'s chat template (a `PromptEncoder`), each conversation through
    `encode_conversation`, its observations marked (`TokenBatch.observed_BT`)."""
    from moe_rl.batch import TokenBatch

    if encoder.template is None:
        raise TokenizerError(f"task.name={task.name} teaches tool calls, which need a chat template; set "
                             "task.chat_template=auto with a tokenizer that has one (moe_rl/assets/tool_tokenizer)")
    turns = ChatTurns(encoder.tokenizer, encoder.template, getattr(task, "tools", ()), encoder.system_prompt)
    episodes = [encode_conversation(turns, c) for c in conversations]
    return TokenBatch.from_lists([p for p, _, _ in episodes], [r for _, r, _ in episodes],
                                 pad_id=encoder.tokenizer.pad_id, seq_multiple=seq_multiple,
                                 observed=[o for _, _, o in episodes])
