"""Per-row routing data ([R, S, ...]: records, replay ids) to and from the router's token
slots, through a micro-batch's `ModelInput` maps, the same for padded and packed input.

A router sees this rank's sequence-parallel shard of the micro-batch's slots, in the
model's order (`ModelInput.rows_N` / `pos_N` say which row and position each slot holds).
Slots that hold no real token (right padding, alignment padding between packed sequences,
padding rows) never carry a row's data: they get `spread_topk` ids, so they never load any
expert more than another (the reason megatron users saw padding pile onto experts
0..k-1), and they are never written into a record."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.learner.model_input import ModelInput
from moe_rl.routing.record import row_positions


def slot_shard(inp: ModelInput, tp: int, tp_rank: int, sequence_parallel: bool) -> slice:
    """The slots this rank's routers see: its contiguous 1/tp of them under sequence parallel."""
    n = inp.slots
    if not sequence_parallel or tp == 1:
        return slice(0, n)
    per = n // tp
    return slice(tp_rank * per, (tp_rank + 1) * per)


@dataclass(frozen=True)
class SlotSource:
    """Where each slot of a micro-batch shard reads per-row routing data [R, S, ...] (rows by
    global id): found once per micro-batch and source, then used for each of its tensors."""

    index: tuple[torch.Tensor, torch.Tensor]
    """([n_local] row in the source, [n_local] position), clamped into the data."""
    covered_N: torch.Tensor
    """[n_local] bool: the slot holds a real token of a row the source has."""
    fill_N: torch.Tensor | None
    """[m] the other slots (None: there are none)."""


def slot_source(rows: torch.Tensor, width: int, mb_rows: torch.Tensor, inp: ModelInput, shard: slice,
                missing_ok: bool = False) -> SlotSource:
    """The `SlotSource` of data for global rows `rows`, `width` positions each. A micro-batch
    row missing from `rows` is a KeyError, or (`missing_ok`, for replay, whose coverage is
    checked and reported separately) reads the fill."""
    rows_N, pos_N, real_N = inp.rows_N[shard], inp.pos_N[shard], inp.real_N[shard]
    rec_N = row_positions(rows, torch.where(rows_N >= 0, mb_rows[rows_N.clamp(min=0)], -1), missing_ok)
    ok_N = real_N & (rec_N >= 0)
    if bool(ok_N.any()) and int(pos_N[ok_N].max()) >= width:
        raise ValueError(f"routing data covers {width} positions, the micro-batch needs "
                         f"{int(pos_N[ok_N].max()) + 1}")
    fill_N = (~ok_N).nonzero().squeeze(1)
    return SlotSource((rec_N.clamp(min=0), pos_N.clamp(max=width - 1)), ok_N, fill_N if fill_N.numel() else None)


def from_rows(data_RS: torch.Tensor, source: SlotSource, fill_k: int | None = None) -> torch.Tensor:
    """[n_local, ...]: each slot's entry of `data_RS`; slots without a real token of a row the
    source has get distinct ids 0..K-1 (`fill_k`) or 0."""
    out = data_RS[source.index]  # (advanced indexing: a copy, free to fill)
    if source.fill_N is not None:
        out[source.fill_N] = torch.arange(fill_k, dtype=out.dtype) if fill_k is not None else 0
    return out


def rows_to_slots(rows: torch.Tensor, data_RS: torch.Tensor, mb_rows: torch.Tensor, inp: ModelInput,
                  shard: slice, fill_k: int | None = None, missing_ok: bool = False) -> torch.Tensor:
    """[n_local, ...]: each slot's entry of per-row data [R, S, ...] (rows by global id);
    slots without a real token of a row in `rows` get distinct ids 0..K-1 (`fill_k`) or 0
    (`slot_source` and `from_rows` in one)."""
    return from_rows(data_RS, slot_source(rows, data_RS.shape[1], mb_rows, inp, shard, missing_ok), fill_k)


def slots_to_rows(values_N: torch.Tensor, inp: ModelInput, rows: int, seq_len: int, fill: float = 0,
                  fill_k: int | None = None) -> torch.Tensor:
    """[rows, seq_len, ...] on the micro-batch's grid from every slot's values [N, ...]
    (all slots, gathered over sequence parallel); positions without a real token hold `fill`
    (ids: the distinct placeholder ids 0..K-1 with `fill_k`)."""
    out = values_N.new_full((rows, seq_len, *values_N.shape[1:]), fill)
    if fill_k is not None:
        out[...] = torch.arange(fill_k, dtype=out.dtype)
    real = inp.real_N
    out[inp.rows_N[real], inp.pos_N[real]] = values_N[real]
    return out


def spread_topk(slots: torch.Tensor, num_experts: int, topk: int) -> torch.Tensor:
    """[n, K] sorted expert ids for slots `slots` (global slot indices): slot n takes experts
    (n*K + j) mod E, so any run of slots spreads evenly over every expert."""
    ids = (slots[:, None] * topk + torch.arange(topk)[None, :]) % num_experts
    return ids.sort(dim=-1).values
