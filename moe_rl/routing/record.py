"""What the learner records about routing, and the sampler's routing aligned to it.

A `RoutingRecord` is the routing of some sequences (rows of a rollout batch) through some
MoE layers (one pipeline stage's), per token position: the top-k expert ids that were used
and the router's log-probability of each of them. Never the full [tokens, E] score matrix:
ids are uint8 (E <= 256) or int16, log-probs fp32, so a token costs L*K*(1+4) bytes.

Position p's routing is the routing of the hidden state at p, which produces the logits
that score the token at p+1. Response token j (absolute position prompt_len + j) is
therefore scored by routing at position prompt_len + j - 1, the same position whose
logits give its log-probability.

vLLM returns `routed_experts` per sequence as `[prompt_len + response_len - 1, L, K]`:
every position that was fed through the model (the last sampled token never is).
`align_sampler_routing` places those arrays on the learner's [B, S] grid; positions vLLM
never saw (the last token, right padding) are marked invalid and route afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe_rl.batch import TokenBatch


def ids_dtype(num_experts: int) -> torch.dtype:
    """uint8 for up to 256 experts, int16 beyond (up to 32768)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids")


@dataclass
class RoutingRecord:
    """Routing of `rows` (global row ids) through `layers` (global MoE layer indices)."""

    rows: torch.Tensor
    """[R] int64 global row ids this record holds, in storage order."""
    layers: list[int]
    """Global MoE layer indices (0-based over MoE layers) of the L axis."""
    ids_RSLK: torch.Tensor
    """[R, S, L, K] expert ids that were used (uint8 / int16), sorted within K."""
    logp_RSLK: torch.Tensor
    """[R, S, L, K] fp32 log routing probability of those experts (softmax over all E, or the
    normalised sigmoid score) under the router that made this record."""
    fresh_ids_RSLK: torch.Tensor | None = None
    """[R, S, L, K] the router's own top-k when replay forced other ids (else None: same as ids)."""

    @property
    def nbytes(self) -> int:
        t = [self.ids_RSLK, self.logp_RSLK] + ([self.fresh_ids_RSLK] if self.fresh_ids_RSLK is not None else [])
        return sum(x.numel() * x.element_size() for x in t)

    @property
    def own_ids_RSLK(self) -> torch.Tensor:
        """The router's own choice (differs from `ids_RSLK` only under replay)."""
        return self.ids_RSLK if self.fresh_ids_RSLK is None else self.fresh_ids_RSLK


@dataclass
class ReplayIds:
    """Expert ids to force through the routers (routing replay), per global row.

    R2 replays the learner's own old routing (`from_record`); R3 the sampler's, aligned to
    a rank's rows of the step by `align_sampler_routing` (rows by global id, `valid_RS` marking the
    positions the sampler routed: the last token and right padding route afresh)."""

    rows: torch.Tensor
    """[R] int64 global row ids."""
    ids_RSLK: torch.Tensor
    """[R, S, L, K] expert ids for the MoE layers of the L axis."""
    valid_RS: torch.Tensor | None = None
    """[R, S] positions that carry ids (None: all); others route afresh."""

    @staticmethod
    def from_record(record: RoutingRecord) -> ReplayIds:
        return ReplayIds(record.rows, record.ids_RSLK)

    def select_layers(self, layers: Sequence[int]) -> ReplayIds:
        """The same rows restricted to `layers` (global MoE layer indices, e.g. the ones a
        pipeline stage owns), in that order."""
        index = torch.tensor(list(layers), dtype=torch.long)
        return ReplayIds(self.rows, self.ids_RSLK[:, :, index], self.valid_RS)


def row_positions(rows: torch.Tensor, query: torch.Tensor, missing_ok: bool = False) -> torch.Tensor:
    """Position in `rows` (global row ids, as stored) of each id in `query`; -1 in `query`
    (a padding row) stays -1, an id `rows` does not hold is a KeyError (-1 with `missing_ok`)."""
    size = int(max(rows.max().item() if rows.numel() else -1, query.max().item() if query.numel() else -1)) + 1
    lookup = torch.full((max(size, 1),), -1, dtype=torch.long)
    lookup[rows] = torch.arange(rows.numel())
    idx = torch.where(query >= 0, lookup[query.clamp(min=0)], -1)
    missing = (query >= 0) & (idx < 0)
    if not missing_ok and bool(missing.any()):
        raise KeyError(f"no routing data for rows {query[missing].tolist()[:8]}")
    return idx


def align_sampler_routing(
    routed_experts: Sequence[np.ndarray | torch.Tensor],
    batch: TokenBatch,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place vLLM-layout routing on the learner's grid.

    `routed_experts[b]` is `[prompt_len_b + response_len_b - 1, L, K]` for sequence b. vLLM
    indexes L by decoder layer (dense layers carry zeros); `moe_layers` are the decoder
    indices of the MoE layers, which select and order the learner's MoE-layer axis (None:
    the array already holds exactly the MoE layers). Returns `ids_BSLK` (sorted within K,
    dtype from `ids_dtype`) and `valid_BS` (True where the sampler routed that position).
    Raises ValueError naming the sequence on a shape mismatch.
    """
    B, S = batch.batch_size, batch.seq_len
    if len(routed_experts) != B:
        raise ValueError(f"routed_experts has {len(routed_experts)} sequences, batch has {B}")
    first = torch.as_tensor(np.asarray(routed_experts[0])) if B else torch.zeros(0, 1, 1)
    L_in, K = first.shape[1], first.shape[2]
    select = None
    if moe_layers is not None and L_in != len(moe_layers):
        if max(moe_layers, default=-1) >= L_in:
            raise ValueError(f"routed_experts has {L_in} layers; MoE layers {list(moe_layers)} do not fit")
        select = torch.tensor(list(moe_layers), dtype=torch.long)
    L = len(select) if select is not None else L_in
    ids = torch.zeros(B, S, L, K, dtype=ids_dtype(num_experts))
    ids[...] = torch.arange(K, dtype=ids.dtype)  # distinct placeholder ids where invalid
    valid = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        arr = torch.as_tensor(np.asarray(routed_experts[b]))
        expect = int(batch.prompt_lens_B[b] + batch.response_lens_B[b]) - 1
        if arr.dim() != 3 or arr.shape[0] != expect or arr.shape[1:] != (L_in, K):
            raise ValueError(
                f"routed_experts[{b}] has shape {tuple(arr.shape)}; expected "
                f"[{expect}, {L_in}, {K}] (prompt_len + response_len - 1, layers, top-k)"
            )
        if select is not None:
            arr = arr[:, select]
        if arr.numel() and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
            raise ValueError(f"routed_experts[{b}] holds expert ids outside [0, {num_experts})")
        ids[b, :expect] = arr.sort(dim=-1).values.to(ids.dtype)
        valid[b, :expect] = True
    return ids, valid
