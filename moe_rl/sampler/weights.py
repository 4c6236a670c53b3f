"""Weight streams in the Hugging Face (Qwen3-MoE) layout: read them, name their experts.

A weight stream is an iterable of `(name, full tensor)` with checkpoint names, e.g.
`model.layers.3.mlp.experts.5.down_proj.weight`. The learner's converter produces one; a
Hugging Face directory is one too (`iter_checkpoint`). Writing a stream to safetensors
files is the converter's (`moe_rl.convert.safetensors_writer.write_safetensors_buckets`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

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
