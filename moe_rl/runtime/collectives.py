"""Collectives of picklable Python objects over a torch.distributed group, the one copy.

    everyone = all_gather_object(mine, group)          # [rank 0's, rank 1's, ...]
    value = broadcast_object(value, src=0, group=group)
    incoming = exchange_objects(outgoing, group)       # outgoing[r] goes to rank r

Each works in a one-process world without a process group (the object comes straight
back), so callers need no special case for world 1. `exchange_objects` is an all-to-all:
a rank receives only what is addressed to it, unlike a gather that hands everything to
everyone (how a step's rows reach the data-parallel ranks that train on them).
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
Group = dist.ProcessGroup | None
"""A process group (None: the default, every rank of the current world)."""


def _size(group: Group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _device() -> torch.device:
    """Where byte payloads must live: the current GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: T, group: Group = None) -> list[T]:
    """Every rank's `obj` in `group`, in group-rank order, on every rank."""
    if _size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: T, src: int = 0, group: Group = None) -> T:
    """Global rank `src`'s `obj` on every rank of `group`."""
    if _size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def exchange_objects(outgoing: list[T], group: Group = None) -> list[T]:
    """All-to-all of objects: `outgoing[r]` is sent to group rank r; returns what each rank
    sent to this one, in group-rank order. Two collectives: the byte counts, then the bytes."""
    n = _size(group)
    if len(outgoing) != n:
        raise ValueError(f"exchange_objects needs one entry per rank ({n}), got {len(outgoing)}")
    if n == 1:
        return list(outgoing)
    dev = _device()
    blobs = [pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in outgoing]
    send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=dev)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8) if sum(map(len, blobs)) else \
        torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv, send.to(dev), output_split_sizes=recv_sizes.tolist(),
                           input_split_sizes=send_sizes.tolist(), group=group)
    data, out, at = recv.cpu().numpy().tobytes(), [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(data[at:at + size]))
        at += size
    return out
