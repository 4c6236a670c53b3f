"""Weight streams in the Hugging Face (Qwen3-MoE) layout: read, bucket, write.

A weight stream is an iterable of `(name, full tensor)` with checkpoint names, e.g.
`model.layers.3.mlp.experts.5.down_proj.weight`. The learner's converter produces one; a
Hugging Face directory is one too (`iter_checkpoint`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_EXPERT_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.")


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in `model_dir`, one at a time."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """Tensor names of a safetensors directory (headers only, no data read)."""
    names: list[str] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def expert_layer_id(name: str) -> int | None:
    """Layer index of a routed-expert tensor name, None for anything else."""
    m = _EXPERT_LAYER.search(name)
    return int(m.group(1)) if m else None


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into lists of about `bucket_bytes` (a tensor is never split)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def write_safetensors_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, bucket_bytes: int
) -> list[str]:
    """Write the stream as `bucket-00000.safetensors`, ... under `out_dir`, one bucket in
    memory at a time. Returns the tensor names written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for i, bucket in enumerate(buckets(named_tensors, bucket_bytes)):
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
        save_file(tensors, str(out_dir / f"bucket-{i:05d}.safetensors"), metadata={"format": "pt"})
        names.extend(tensors)
    return names
