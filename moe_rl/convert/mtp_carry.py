"""Multi-token-prediction (MTP) layers carried from the source directory into an export.

The learner does not build a DeepseekV3 model's MTP layers (`deepseek_v3` module docstring):
they are frozen and out of the RL loss, so the trained model's MTP layers are the source's.
An export of such a model (`hf_export.megatron_to_hf`) therefore appends the source's MTP
tensors, bytes and dtype unchanged, after the trained ones, and keeps config.json's
`num_nextn_predict_layers`, so the exported directory is as complete as the source. A
source without MTP tensors, or a layout that does not carry them (Glm4-MoE writes
num_nextn_predict_layers 0), contributes nothing.
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.config import ModelConfig
from moe_rl.convert.deepseek_v3 import mtp_layer_of
from moe_rl.convert.hf_checkpoint import HFCheckpoint
from moe_rl.convert.layouts import layout_for
from moe_rl.convert.safetensors_writer import PlannedTensor, ShardedSafetensorsWriter


def carries_mtp(m: ModelConfig) -> bool:
    """Whether exports of `m` keep the source's MTP layers."""
    return bool(m.mtp_num_layers) and getattr(layout_for(m), "carries_mtp", False)


def planned_mtp_tensors(source: Path | None, m: ModelConfig) -> list[PlannedTensor]:
    """The source's MTP tensors (name order), with their stored shapes and dtypes."""
    if source is None or not carries_mtp(m):
        return []
    with HFCheckpoint(source) as hf:
        names = sorted(n for n in hf.names() if mtp_layer_of(n, hf.config) is not None)
        return [PlannedTensor(n, hf.shape(n), hf.dtype(n)) for n in names]  # headers only


def write_mtp_tensors(writer: ShardedSafetensorsWriter, source: Path, planned: list[PlannedTensor]) -> None:
    """Copy the planned MTP tensors from `source` into `writer`, as stored."""
    with HFCheckpoint(source) as hf:
        for p in planned:
            writer.write(p.name, hf.get(p.name))
