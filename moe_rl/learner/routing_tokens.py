"""Per-row routing data ([R, S, ...]: records, replay ids) to and from the router's token
slots, through a micro-batch's `ModelInput` maps, the same for padded and packed input.

A router sees this rank's sequence-parallel shard of the micro-batch's slots, in the
model's order (`ModelInput.rows_N` / `pos_N` say which row and position each slot holds).
Slots that hold no real token (right padding, alignment padding between packed sequences,
padding rows) never carry a row's data: they get `spread_topk` ids, so they never load any
expert more than another (the reason megatron users saw padding pile onto experts
0..k-1), and they are never written into a record."""

from __future__ import annotations

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


def rows_to_slots(rows: torch.Tensor, data_RS: torch.Tensor, mb_rows: torch.Tensor, inp: ModelInput,
                  shard: slice, fill_k: int | None = None, missing_ok: bool = False) -> torch.Tensor:
    """[n_local, ...]: each slot's entry of per-row data [R, S, ...] (rows by global id);
    slots without a real token of a row in `rows` get distinct ids 0..K-1 (`fill_k`) or 0.
    A micro-batch row missing from `rows` is a KeyError, or (`missing_ok`, for replay, whose
    coverage is checked and reported separately) gets the fill."""
    rows_N, pos_N, real_N = inp.rows_N[shard], inp.pos_N[shard], inp.real_N[shard]
    rec_N = row_positions(rows, torch.where(rows_N >= 0, mb_rows[rows_N.clamp(min=0)], -1), missing_ok)
    ok_N = real_N & (rec_N >= 0)
    if bool(ok_N.any()) and int(pos_N[ok_N].max()) >= data_RS.shape[1]:
        raise ValueError(f"routing data covers {data_RS.shape[1]} positions, the micro-batch needs "
                         f"{int(pos_N[ok_N].max()) + 1}")
    out = data_RS[rec_N.clamp(min=0), pos_N.clamp(max=data_RS.shape[1] - 1)]
    if bool((~ok_N).any()):
        out = out.clone()
        out[~ok_N] = torch.arange(fill_k, dtype=out.dtype) if fill_k is not None else 0
    return out


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
