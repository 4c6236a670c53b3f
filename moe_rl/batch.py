"""Token batches: prompts followed by responses, right-padded (pure torch).

Every sequence is `prompt + response` starting at position 0 and padded on the right, so
RoPE positions are the natural 0..len-1 and the causal mask alone keeps padding from
touching real tokens. Response token j of sequence b sits at absolute position
`prompt_lens_B[b] + j` and is predicted by the logits at the position before it.

Response-aligned tensors (`[B, T]`: logprobs, masks, advantages) index responses from 0;
`T` is the response width (the longest response, or a fixed width such as the sampler's
`max_new_tokens` so shapes stay equal across steps).

Multi-turn episodes (`moe_rl.rollout.episodes`): the "response" is everything after the
prompt, the policy's turns and the environment's observations (tool results, user turns)
between them. `observed_BT` marks the observation tokens: they are fed, attended to and
routed like any other, but the policy did not sample them, so `response_mask` (what every
loss, log-prob and statistic counts) leaves them out; `span_mask` keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    """B sequences of prompt + response tokens, right-padded to S."""

    tokens_BS: torch.Tensor
    """[B, S] int64 token ids; positions past prompt + response hold `pad_id`."""
    prompt_lens_B: torch.Tensor
    """[B] int64 prompt lengths (>= 1: the first response token needs a preceding logit)."""
    response_lens_B: torch.Tensor
    """[B] int64 response lengths (0 allowed: the sequence then contributes nothing)."""
    response_width: int
    """T: width of response-aligned tensors; >= every response length."""
    observed_BT: torch.Tensor | None = None
    """[B, T] bool: response-side tokens the environment put there (tool results, user
    turns of a multi-turn episode), not sampled by the policy. None: there are none."""

    def __post_init__(self) -> None:
        B = self.tokens_BS.shape[0]
        if self.tokens_BS.dim() != 2:
            raise ValueError(f"tokens_BS must be [B, S], got shape {tuple(self.tokens_BS.shape)}")
        for name in ("prompt_lens_B", "response_lens_B"):
            t = getattr(self, name)
            if t.shape != (B,):
                raise ValueError(f"{name} must have shape [{B}], got {tuple(t.shape)}")
        if B and int(self.prompt_lens_B.min()) < 1:
            raise ValueError("every prompt needs at least one token (prompt_lens_B >= 1)")
        if B and int((self.prompt_lens_B + self.response_lens_B).max()) > self.tokens_BS.shape[1]:
            raise ValueError("prompt + response longer than tokens_BS")
        if B and int(self.response_lens_B.max()) > self.response_width:
            raise ValueError(
                f"response_width={self.response_width} is shorter than the longest response "
                f"({int(self.response_lens_B.max())})"
            )
        if self.observed_BT is not None and (self.observed_BT.shape != (B, self.response_width)
                                             or self.observed_BT.dtype != torch.bool):
            raise ValueError(f"observed_BT must be a bool [{B}, {self.response_width}] tensor, got "
                             f"{self.observed_BT.dtype} {tuple(self.observed_BT.shape)}")

    @property
    def batch_size(self) -> int:
        return self.tokens_BS.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens_BS.shape[1]

    @property
    def total_lens_B(self) -> torch.Tensor:
        return self.prompt_lens_B + self.response_lens_B

    def to(self, device: torch.device | str) -> TokenBatch:
        """The same batch with its tensors on `device`."""
        return TokenBatch(self.tokens_BS.to(device), self.prompt_lens_B.to(device),
                          self.response_lens_B.to(device), self.response_width,
                          None if self.observed_BT is None else self.observed_BT.to(device))

    def span_mask(self) -> torch.Tensor:
        """[B, T] bool: True where a response-side token exists (the policy's or an observation)."""
        j = torch.arange(self.response_width, device=self.tokens_BS.device)
        return j[None, :] < self.response_lens_B[:, None]

    def response_mask(self) -> torch.Tensor:
        """[B, T] bool: True at the tokens the policy sampled, the ones every loss, log-prob and
        statistic counts (`span_mask` without the observations of a multi-turn episode)."""
        span = self.span_mask()
        if self.observed_BT is None:
            return span
        return span & ~self.observed_BT.to(span.device)

    def scoring_positions(self) -> torch.Tensor:
        """[B, T] int64: the position whose logits (and routing) score each response token,
        prompt_len - 1 + j, clamped into [0, S - 1] (the one copy of the rule; slots past a
        response are clamped, not meaningful)."""
        j = torch.arange(self.response_width, device=self.tokens_BS.device)
        return (self.prompt_lens_B[:, None] - 1 + j[None, :]).clamp(min=0, max=self.seq_len - 1)

    def scored_positions(self) -> torch.Tensor:
        """[B, S] bool: True at the positions whose logits score a token the policy sampled
        (prompt_len - 1 ... prompt_len + response_len - 2, less the observations')."""
        s = torch.arange(self.seq_len, device=self.tokens_BS.device)[None, :]
        lo = (self.prompt_lens_B - 1)[:, None]
        out = (s >= lo) & (s < lo + self.response_lens_B[:, None])
        if self.observed_BT is not None:
            j = (s - lo).clamp(min=0, max=self.response_width - 1)
            out &= ~self.observed_BT.to(out.device).gather(1, j)
        return out

    def response_tokens(self) -> torch.Tensor:
        """[B, T] int64 response token ids (pad positions hold 0): each sits one position
        after the one that scores it."""
        idx = (self.scoring_positions() + 1).clamp(max=self.seq_len - 1)
        return torch.where(self.span_mask(), self.tokens_BS.gather(1, idx), 0)

    def select(self, index: torch.Tensor | slice) -> TokenBatch:
        """Sub-batch of the given rows (same S and T)."""
        return TokenBatch(
            self.tokens_BS[index],
            self.prompt_lens_B[index],
            self.response_lens_B[index],
            self.response_width,
            None if self.observed_BT is None else self.observed_BT[index],
        )

    @staticmethod
    def from_lists(
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        pad_id: int = 0,
        response_width: int | None = None,
        seq_multiple: int = 1,
        min_seq_len: int = 1,
        observed: Sequence[Sequence[bool]] | None = None,
    ) -> TokenBatch:
        """Pack token lists; S is at least `min_seq_len` (a width shared with other ranks'
        rows) and rounded up to `seq_multiple` (e.g. the TP size). `observed`: per response,
        which of its tokens are an environment's observations (None: none are)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
        S = max(max(lens, default=1), min_seq_len)
        S = -(-S // seq_multiple) * seq_multiple
        tokens = torch.full((len(prompts), S), pad_id, dtype=torch.long)
        for b, (p, r) in enumerate(zip(prompts, responses)):
            seq = list(p) + list(r)
            tokens[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        width = max((len(r) for r in responses), default=0)
        if response_width is not None:
            width = response_width
        observed_BT = None
        if observed is not None:
            observed_BT = torch.zeros(len(prompts), width, dtype=torch.bool)
            for b, (flags, r) in enumerate(zip(observed, responses)):
                if len(flags) != len(r):
                    raise ValueError(f"row {b}: {len(flags)} observation flags for {len(r)} response tokens")
                observed_BT[b, : len(flags)] = torch.tensor(list(flags), dtype=torch.bool)
        return TokenBatch(
            tokens,
            torch.tensor([len(p) for p in prompts], dtype=torch.long),
            torch.tensor([len(r) for r in responses], dtype=torch.long),
            width,
            observed_BT,
        )


def ragged_rows(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """[len(rows), width] fp32: each row's values from column 0, zeros after (e.g. the
    sampler's per-token logprobs of responses of different lengths)."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for b, values in enumerate(rows):
        if len(values) > width:
            raise ValueError(f"row {b} has {len(values)} values, more than the width {width}")
        out[b, : len(values)] = torch.tensor(list(values), dtype=torch.float32)
    return out
