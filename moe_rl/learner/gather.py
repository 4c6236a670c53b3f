"""Assemble full (unsharded) parameters from a sharded megatron model, one tensor at a time.

megatron-core describes every parameter shard with a `ShardedTensor`: a global key, the
global shape, and where this rank's piece sits in it (TP slices, the expert axis under EP,
pipeline stages that own different layers). Those keys and global shapes are exactly the
layout of a `dist_checkpointing` checkpoint, so the stream produced here and a checkpoint
read back tensor by tensor are the same thing: the converter and the in-process weight sync
share one canonical "global megatron" layout.

`iter_full_tensors` is collective: every rank of the world must iterate it to the end.
The destination rank gets `(key, full_tensor)` pairs; the others get nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

from moe_rl.learner.parallel import comm_device


@dataclass(frozen=True)
class _Piece:
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    prepend_axis_num: int
    dtype: torch.dtype


def flatten_sharded(sd: dict) -> Iterator[ShardedTensor]:
    for v in sd.values():
        if isinstance(v, ShardedTensor):
            yield v
        elif isinstance(v, list | tuple):
            yield from (x for x in v if isinstance(x, ShardedTensor))
        elif isinstance(v, dict):
            yield from flatten_sharded(v)


def local_main_shards(model: torch.nn.Module) -> list[tuple[_Piece, torch.Tensor]]:
    """This rank's pieces that are the main replica (each global element owned once)."""
    sd = model.sharded_state_dict()
    apply_factories(sd)
    out = []
    for sh in flatten_sharded(sd):
        replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
        if any(r != 0 for r in replica):
            continue
        piece = _Piece(
            sh.key,
            tuple(sh.global_shape),
            tuple(sh.global_offset),
            tuple(sh.local_shape),
            sh.prepend_axis_num,
            sh.data.dtype,
        )
        out.append((piece, sh.data))
    return out


def piece_index(p: _Piece) -> tuple:
    """Index of a piece inside its global tensor (prepended axes are single indices)."""
    idx: list = list(p.global_offset[: p.prepend_axis_num])
    idx += [
        slice(off, off + n)
        for off, n in zip(p.global_offset[p.prepend_axis_num :], p.local_shape)
    ]
    return tuple(idx)


@torch.no_grad()
def iter_full_tensors(model: torch.nn.Module, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (global key, full tensor) on rank `dst`, in a fixed order; collective."""
    local = local_main_shards(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world == 1:
        by_key: dict[str, list[tuple[_Piece, torch.Tensor]]] = {}
        for piece, data in local:
            by_key.setdefault(piece.key, []).append((piece, data))
        for key in sorted(by_key):
            pieces = by_key[key]
            full = torch.empty(pieces[0][0].global_shape, dtype=pieces[0][0].dtype)
            for piece, data in pieces:
                full[piece_index(piece)] = data.detach().cpu()
            yield key, full
        return
    dev = comm_device()  # NCCL moves device tensors only
    metas: list[list[_Piece]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(metas, [p for p, _ in local])
    owners: dict[str, list[tuple[int, int, _Piece]]] = {}
    for r, pieces in enumerate(metas):
        for i, p in enumerate(pieces):
            owners.setdefault(p.key, []).append((r, i, p))
    for key in sorted(owners):
        entries = owners[key]
        first = entries[0][2]
        full = torch.empty(first.global_shape, dtype=first.dtype) if rank == dst else None
        for r, i, p in entries:
            if r == rank == dst:
                full[piece_index(p)] = local[i][1].detach().cpu()
            elif r == rank:
                dist.send(local[i][1].detach().to(dev).contiguous(), dst=dst)
            elif rank == dst:
                buf = torch.empty(p.local_shape, dtype=p.dtype, device=dev)
                dist.recv(buf, src=r)
                full[piece_index(p)] = buf.cpu()
        if rank == dst:
            yield key, full
