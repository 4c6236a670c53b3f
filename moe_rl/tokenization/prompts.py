"""Problems -> prompt token ids: plain text, or a chat template.

    encoder = PromptEncoder.from_config(cfg.task, tokenizer)
    ids = encoder.encode(problem)          # what the sampler and the learner both see

`task.chat_template`: `auto` uses the tokenizer's own template when it has one (the shipped
SentencePiece model has none: the synthetic tasks' prompts stay plain text), `none` never
uses one, a `.jinja` file replaces it. Under a template, a problem's messages (or its prompt
as one user message), after `task.system_prompt` when set, become exactly the ids of
`apply_chat_template(messages, add_generation_prompt=True)`: the rendered text encoded
without adding special tokens (the template writes them). Without one, the prompt is
encoded as `tokenizer(prompt)` would (a BOS where the tokenizer adds one).

    prompt_ids, completion_ids = encoder.encode_example(problem, completion)   # SFT: + EOS
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_rl.tokenization.hf import TokenizerError

if TYPE_CHECKING:
    from moe_rl.config import TaskConfig
    from moe_rl.tasks.base import Problem


@dataclass(frozen=True)
class PromptEncoder:
    """How a problem becomes prompt ids, for one tokenizer."""

    tokenizer: Any
    template: str | None
    """The chat template text, None for plain text."""
    system_prompt: str = ""

    @classmethod
    def from_config(cls, task: TaskConfig, tokenizer: Any) -> PromptEncoder:
        """`task.chat_template` / `task.system_prompt` applied to `tokenizer`."""
        spec = task.chat_template
        if spec == "none":
            template = None
        elif spec == "auto":
            template = getattr(tokenizer, "chat_template", None)
        else:
            path = Path(spec)
            if not path.is_file():
                raise TokenizerError(f"task.chat_template={spec}: no such file")
            template = path.read_text()
        if template is not None and not hasattr(tokenizer, "render_chat"):
            raise TokenizerError(f"task.chat_template={spec}: chat templates need a Hugging Face tokenizer, "
                                 f"and {tokenizer!r} is the shipped SentencePiece model; set task.chat_template=none")
        if task.system_prompt and template is None:
            raise TokenizerError("task.system_prompt is set but no chat template applies (task.chat_template="
                                 f"{spec}); a system prompt needs one")
        return cls(tokenizer, template, task.system_prompt)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The conversation a problem stands for (system prompt first when set)."""
        msgs = [dict(m) for m in problem.messages] if problem.messages else [{"role": "user", "content": problem.prompt}]
        if self.system_prompt and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def encode(self, problem: Problem) -> list[int]:
        """Prompt ids of `problem` (see the module docstring)."""
        if self.template is None:
            if problem.messages:
                raise TokenizerError(f"a problem{_where(problem)} is a chat (messages) but no chat template "
                                     "applies; set task.chat_template=auto with a tokenizer that has one, or a .jinja file")
            plain = getattr(self.tokenizer, "encode_with_specials", self.tokenizer.encode)
            return plain(problem.prompt)
        return self.tokenizer.encode(self.tokenizer.render_chat(self.messages(problem), self.template))

    def encode_example(self, problem: Problem, completion: str) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids + EOS) of a supervised example: the prompt exactly as
        the sampler sees it (`encode`), the completion as the policy would sample it."""
        return self.encode(problem), self.tokenizer.encode(completion, eos=True)

    def text(self, problem: Problem) -> str:
        """The prompt as the model reads it (for logs and rollout dumps)."""
        if self.template is None:
            return problem.prompt
        return self.tokenizer.render_chat(self.messages(problem), self.template)


def _where(problem: Problem) -> str:
    meta = getattr(problem, "meta", {}) or {}
    return f" ({meta['path']} line {meta['line']})" if "path" in meta and "line" in meta else ""
