"""Assemble full (unsharded) parameters from a sharded megatron model, one tensor at a time.

megatron-core describes every parameter shard with a `ShardedTensor`: a global key, the
global shape, and where this rank's piece sits in it (TP slices, the expert axis under EP,
pipeline stages that own different layers). Those keys and global shapes are exactly the
layout of a `dist_checkpointing` checkpoint, so the stream produced here and a checkpoint
read back tensor by tensor are the same thing: the converter and the in-process weight sync
share one canonical "global megatron" layout.

Both iterators are collective: every rank of the world must iterate them to the end, in
the trainer's process-group context, whatever it does with the tensors.
- `iter_full_tensors(model, dst)`: rank `dst` gets `(key, full_tensor)` pairs, the others
  nothing (the checkpoint converter; separate placement, where rank 0 broadcasts them to
  the engine ranks);
- `iter_full_tensors_everywhere(model)`: every rank gets every full tensor (an engine per
  rank, colocated placement). A piece a rank already holds (a data-parallel replica, its
  own shard) is copied locally; a piece it lacks is received point-to-point from one rank
  that holds it, so a rank receives exactly the bytes it lacks (0 at pure data parallelism). Tensors are
  assembled on the collective device (the GPU under NCCL: no pageable-host round trip).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.models.gpt import GPTModel

from moe_rl.learner.parallel import comm_device
from moe_rl.runtime.collectives import all_gather_object


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
    return [(p, d) for p, d, main in local_shards(model) if main]


_SHARDS_ATTR = "_moe_rl_local_shards"


def own_storages(model: torch.nn.Module) -> set[int]:
    """Storage addresses of the model's parameters and buffers (the router's expert bias is a
    buffer): a tensor whose storage is among them is a view of the model, not a copy."""
    return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}


def local_shards(model: torch.nn.Module) -> list[tuple[_Piece, torch.Tensor, bool]]:
    """Every piece this rank holds, replicas included: (piece, data, is the main replica).

    Building megatron's sharded state dict walks every module (9 of the 10 ms of a tiny
    model's weight push on CPU; every expert of every layer at scale), so the pieces are kept
    on the model when each one's data is a view of a parameter or buffer: the views then
    always read the current weights (updates and checkpoint loads write the parameters in
    place). A piece that is a copy makes the model rebuild them at every call."""
    cached = model.__dict__.get(_SHARDS_ATTR)
    if cached is not None:
        return cached
    out = _build_local_shards(model)
    owned = own_storages(model)
    if all(data.untyped_storage().data_ptr() in owned for _, data, _ in out):
        model.__dict__[_SHARDS_ATTR] = out  # (not a submodule, parameter or buffer)
    return out


def _build_local_shards(model: GPTModel) -> list[tuple[_Piece, torch.Tensor, bool]]:
    sd = model.sharded_state_dict()
    apply_factories(sd)
    out = []
    for sh in flatten_sharded(sd):
        replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
        piece = _Piece(
            sh.key,
            tuple(sh.global_shape),
            tuple(sh.global_offset),
            tuple(sh.local_shape),
            sh.prepend_axis_num,
            sh.data.dtype,
        )
        out.append((piece, sh.data, all(r == 0 for r in replica)))
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
    metas: list[list[_Piece]] = all_gather_object([p for p, _ in local])
    owners: dict[str, list[tuple[int, int, _Piece]]] = {}
    for r, held in enumerate(metas):
        for i, p in enumerate(held):
            owners.setdefault(p.key, []).append((r, i, p))
    for key in sorted(owners):
        entries = owners[key]
        first = entries[0][2]
        whole = torch.empty(first.global_shape, dtype=first.dtype) if rank == dst else None
        for r, i, p in entries:
            if r == rank == dst:
                assert whole is not None
                whole[piece_index(p)] = local[i][1].detach().cpu()
            elif r == rank:
                dist.send(local[i][1].detach().to(dev).contiguous(), dst=dst)
            elif whole is not None:  # (rank == dst)
                buf = torch.empty(p.local_shape, dtype=p.dtype, device=dev)
                dist.recv(buf, src=r)
                whole[piece_index(p)] = buf.cpu()
        if whole is not None:  # (rank == dst)
            yield key, whole


@dataclass
class SyncTraffic:
    """What `iter_full_tensors_everywhere` moved for this rank (filled as it iterates)."""

    bytes_received: int = 0
    """Bytes this rank received from other ranks."""
    bytes_sent: int = 0
    """Bytes this rank sent to other ranks."""
    bytes_local: int = 0
    """Bytes this rank copied from pieces it already held."""


@torch.no_grad()
def iter_full_tensors_everywhere(
    model: torch.nn.Module, traffic: SyncTraffic | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (global key, full tensor) on every rank, in the same fixed order; collective."""
    traffic = traffic if traffic is not None else SyncTraffic()
    dev = comm_device()
    shards = local_shards(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    metas: list[list[tuple[_Piece, bool]]] = all_gather_object([(p, main) for p, _, main in shards])
    mine = {(p.key, p.global_offset): d for p, d, _ in shards}
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    pieces: dict[str, dict[tuple[int, ...], _Piece]] = {}
    for r, entries in enumerate(metas):
        for p, _ in entries:
            holders.setdefault((p.key, p.global_offset), []).append(r)
            pieces.setdefault(p.key, {})[p.global_offset] = p
    for key in sorted(pieces):
        first = next(iter(pieces[key].values()))
        full = torch.empty(first.global_shape, dtype=first.dtype, device=dev)
        for offset in sorted(pieces[key]):
            p = pieces[key][offset]
            _fill_piece(full, p, mine.get((key, offset)), sorted(holders[(key, offset)]), rank, world, dev, traffic)
        yield key, full


def _fill_piece(full: torch.Tensor, p: _Piece, data: torch.Tensor | None, holders: list[int], rank: int,
                world: int, dev: torch.device, traffic: SyncTraffic) -> None:
    """Put piece `p` into `full` on every rank: copied where held, else received from the
    holder `holders[r % len(holders)]` (spreading the sends over the replicas)."""
    nbytes = math.prod(p.local_shape) * p.dtype.itemsize
    ops = []
    if data is not None:
        full[piece_index(p)] = data.detach().to(dev)
        traffic.bytes_local += nbytes
        for r in range(world):
            if r not in holders and holders[r % len(holders)] == rank:
                ops.append(dist.P2POp(dist.isend, data.detach().to(dev).contiguous(), r))
                traffic.bytes_sent += nbytes
    else:
        buf = torch.empty(p.local_shape, dtype=p.dtype, device=dev)
        ops.append(dist.P2POp(dist.irecv, buf, holders[rank % len(holders)]))
        traffic.bytes_received += nbytes
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if data is None:
        full[piece_index(p)] = buf
