"""What every sampler backend returns and promises: `Rollouts` and the `Sampler` protocol.

Token-id in, token-id out: the trainer tokenizes and decodes; samplers never see text.

Logprob semantics (shared by all backends, checked by the tests): the logprob of a sampled
token is taken from the distribution it was actually sampled from, i.e.
`log_softmax(logits / temperature)` after top-p truncation and renormalisation. With
`top_p=1` (our runs) that is exactly what the learner computes, `log_softmax(logits / T)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from moe_rl.batch import ragged_rows

FINISH_REASONS = ("stop", "length")


@dataclass
class Rollouts:
    """Responses to a batch of prompts, `n` per prompt, ordered prompt-major.

    Response r answers prompt `prompt_index[r]`; all n responses of prompt 0 come first,
    then those of prompt 1, and so on. A response that stopped on EOS ends with the EOS
    token (the learner scores it too) and has finish reason "stop"; one cut at
    max_new_tokens has "length".

    `routed_experts[r]` (when the backend returns them) is vLLM's layout: an unsigned int
    array (uint8, uint16 above 256 experts) `[prompt_len + response_len - 1, L, K]` with
    the top-k expert ids of every position fed through the model (prompt included, the
    last sampled token never fed), K per token in the router's top-k order. L is indexed
    by decoder-layer number (vLLM sizes it `num_hidden_layers`), so it equals the number
    of MoE layers when every layer is MoE; rows of dense layers, if any, are 0.
    """

    prompt_token_ids: list[list[int]]
    prompt_index: list[int]
    response_token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    routed_experts: list[np.ndarray] | None = None

    def __post_init__(self) -> None:
        R = len(self.response_token_ids)
        if not (len(self.prompt_index) == len(self.logprobs) == len(self.finish_reasons) == R):
            raise ValueError("Rollouts: per-response lists must all have one entry per response")
        for ids, lps in zip(self.response_token_ids, self.logprobs):
            if len(ids) != len(lps):
                raise ValueError("Rollouts: every response needs one logprob per token")
        if self.routed_experts is not None and len(self.routed_experts) != R:
            raise ValueError("Rollouts: routed_experts needs one array per response")

    def __len__(self) -> int:
        return len(self.response_token_ids)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_token_ids)

    def to_padded(self, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded `[B, T]` tensors, T = longest response.

        Returns `response_ids_BT` (int64, `pad_token_id` where masked), `logprobs_BT`
        (float32, 0 where masked), `mask_BT` (bool) and `lengths_B` (int64).
        """
        B = len(self)
        lengths_B = torch.tensor([len(r) for r in self.response_token_ids], dtype=torch.int64)
        T = int(lengths_B.max()) if B else 0
        ids_BT = torch.full((B, T), pad_token_id, dtype=torch.int64)
        for b, ids in enumerate(self.response_token_ids):
            ids_BT[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        logp_BT = ragged_rows(self.logprobs, T)
        mask_BT = torch.arange(T)[None, :] < lengths_B[:, None]
        return {"response_ids_BT": ids_BT, "logprobs_BT": logp_BT, "mask_BT": mask_BT, "lengths_B": lengths_B}


class Generates(Protocol):
    """What only samples needs of an engine (`Sampler.generate`; the evaluation's
    `GenerateOnly` wraps one)."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int = 1, max_new_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
                 prompt_seeds: Sequence[int] | None = None) -> Rollouts:
        """As `Sampler.generate`."""
        ...


@runtime_checkable
class Sampler(Protocol):
    """A rollout engine the trainer can sample from, score with, and push weights into."""

    @property
    def returns_routed_experts(self) -> bool:
        """Whether `generate` fills `Rollouts.routed_experts` (vLLM on CPU cannot)."""
        ...

    @property
    def precision(self) -> str:
        """The sampler's weight precision (`sampler.precision`, resolved: fp32, bf16, ...)."""
        ...

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int = 1,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        prompt_seeds: Sequence[int] | None = None,
    ) -> Rollouts:
        """Sample n responses per prompt. Same seed (and weights) -> same rollouts.
        `seed=None` draws a fresh, still reproducible, seed from the sampler's own stream.
        `prompt_seeds` (one per prompt, `base_seeds` of a larger call) replaces `seed`: a
        prompt's responses then depend on its own seed only, so a batch split over several
        engines samples what one engine would."""
        ...

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        response_token_ids: Sequence[Sequence[int]],
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Teacher-forced `log_softmax(logits / temperature)` of each response token."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors named in the Hugging Face Qwen3-MoE layout.
        Tensors of a layer may not be split across calls; a call may cover only some layers."""
        ...

    def close(self) -> None:
        """Release the engine; the trainer's process group and thread count are kept."""
        ...


@runtime_checkable
class SleepingSampler(Sampler, Protocol):
    """A sampler that frees its device memory between steps (vLLM's sleep mode,
    sampler.sleep_between_steps) and wakes for its next call by itself."""

    def sleep(self) -> None:
        """Release the weights and KV cache until the next call."""
        ...


# --------------------------------------------------------------------------- helpers


def check_generate_args(n: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy decoding), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def base_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One base seed per prompt from a call seed; sample j of prompt i uses `base_i + j`.

    vLLM derives the seed of sample j of a request as `request_seed + j`, so request seeds
    are drawn at random (not `seed + i`) to keep nearby call seeds from sharing samples."""
    return [int(b) for b in np.random.default_rng(seed).integers(0, 2**31 - 1 - n, size=num_prompts)]


def expand_seeds(prompt_seeds: Sequence[int], num_prompts: int, n: int) -> list[int]:
    """One seed per response, prompt-major: `prompt_seeds[i] + j` for sample j of prompt i."""
    if len(prompt_seeds) != num_prompts:
        raise ValueError(f"prompt_seeds has {len(prompt_seeds)} seeds for {num_prompts} prompts")
    return [int(b) + j for b in prompt_seeds for j in range(n)]


def sample_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per response, prompt-major, from a call seed."""
    return expand_seeds(base_seeds(seed, num_prompts, n), num_prompts, n)


def read_eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS id(s) from generation_config.json, else config.json; [] when neither has one."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids = [eos] if isinstance(eos, int) else list(eos)
                break
    return ids


def resolve_eos(model_dir: str | Path, eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return read_eos_token_ids(model_dir)
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
