"""Weight sync from the learner to the engines, in layer-aligned buckets.

The learner's stream (`moe_rl.learner.export.hf_named_tensors`) runs collectives while it
is iterated, so the trainer's side iterates it, on every rank and to the end, and hands
each engine one bucket at a time. What an engine does with a bucket (vLLM enters its own
process-group world for the reload) can then never change which collectives run.

A bucket never splits a decoder layer: vLLM finishes a layer's reload (the CPU MoE repack
included) at the end of each call, so a layer must arrive whole in one call.

Separate placement: rank 0 holds the full tensors and broadcasts each bucket (its names,
shapes and dtypes first, then the tensors) over a group of itself and the engine ranks,
which load it into their engines; an empty announcement ends the sync.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.worlds import bridge

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

Bucket = list[tuple[str, torch.Tensor]]


def layer_of(name: str) -> int | None:
    """Decoder layer index of a Hugging Face tensor name (None: embeddings, final norm, head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def layer_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group a layer-ordered stream into buckets of at least `bucket_bytes` (the last may be
    smaller), cut only where the decoder layer changes."""
    bucket: Bucket = []
    size, current = 0, object()
    for name, tensor in named_tensors:
        layer = layer_of(name)
        if bucket and layer != current and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        current = layer
    if bucket:
        yield bucket


@dataclass
class SyncReport:
    """One weight sync, as seen by one rank."""

    seconds: float = 0.0
    """Wall time from the first gathered tensor to the last bucket loaded."""
    bytes_streamed: int = 0
    """Bytes of full tensors handed to this rank's engine."""
    buckets: int = 0
    """Engine calls."""

    def metrics(self) -> dict[str, float]:
        return {"sync/seconds": self.seconds, "sync/bytes_streamed": float(self.bytes_streamed),
                "sync/buckets": float(self.buckets)}


def stream_in_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                      load: Callable[[Bucket], None] | None) -> SyncReport:
    """Drain `named_tensors` in buckets, passing each to `load` (None: drain only, for a
    rank without an engine)."""
    report, t0 = SyncReport(), time.perf_counter()
    for bucket in layer_buckets(named_tensors, bucket_bytes):
        report.buckets += 1
        report.bytes_streamed += sum(t.numel() * t.element_size() for _, t in bucket)
        if load is not None:
            load(bucket)
    report.seconds = time.perf_counter() - t0
    return report


def _device() -> torch.device:
    """Where broadcast payloads live: the current GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, group: object,
                      send: bool) -> SyncReport:
    """Drain `named_tensors`; with `send` (global rank 0), broadcast every bucket over
    `group` to the engine ranks (`receive_buckets`). Collective over `group` for the sender."""
    report, t0 = SyncReport(), time.perf_counter()
    for bucket in layer_buckets(named_tensors, bucket_bytes):
        report.buckets += 1
        report.bytes_streamed += sum(t.numel() * t.element_size() for _, t in bucket)
        if send:
            with bridge():
                dev = _device()
                dist.broadcast_object_list([[(n, tuple(t.shape), t.dtype) for n, t in bucket]], src=0, group=group)
                for _, t in bucket:
                    dist.broadcast(t.to(dev).contiguous(), src=0, group=group)
    if send:
        with bridge():
            dist.broadcast_object_list([None], src=0, group=group)
    report.seconds = time.perf_counter() - t0
    return report


def receive_buckets(group: object, load: Callable[[Bucket], None]) -> SyncReport:
    """An engine rank's side of `broadcast_buckets`: receive and load buckets until the end."""
    report, t0 = SyncReport(), time.perf_counter()
    while True:
        with bridge():
            box: list = [None]
            dist.broadcast_object_list(box, src=0, group=group)
            if box[0] is None:
                break
            dev = _device()
            bucket = []
            for name, shape, dtype in box[0]:
                t = torch.empty(shape, dtype=dtype, device=dev)
                dist.broadcast(t, src=0, group=group)
                bucket.append((name, t))
        report.buckets += 1
        report.bytes_streamed += sum(t.numel() * t.element_size() for _, t in bucket)
        load(bucket)
    report.seconds = time.perf_counter() - t0
    return report
