"""megatron <-> Hugging Face conversion on files (no megatron import here).

    megatron_to_hf(ckpt_dir, hf_dir)          # streamed, any TP/EP/PP layout, atomic output
    megatron_to_peft(ckpt_dir, peft_dir)      # a LoRA run's attention adapters as a PEFT directory
    HFCheckpoint(hf_dir), megatron_tensors()  # an HF directory as global megatron tensors
    layout_for(model_cfg)                     # Qwen3-MoE, Glm4-MoE for a sigmoid router /
                                              # shared expert, DeepseekV3 for MLA (layouts.py)

The live learner's stream is `moe_rl.learner.export.hf_named_tensors`, and HF -> megatron
checkpoint is `moe_rl.learner.hf_import.hf_to_megatron` (both need megatron, so they live
in the learner package); `tools/convert_checkpoint.py` is the CLI over both directions.
"""

from moe_rl.convert.dcp import DcpCheckpoint
from moe_rl.convert.hf_checkpoint import HFCheckpoint, check_tensors, megatron_tensors
from moe_rl.convert.hf_export import DEFAULT_SHARD_BYTES, megatron_to_hf
from moe_rl.convert.hf_layout import HFArchitecture
from moe_rl.convert.layouts import (
    check_supported,
    from_hf,
    hf_config,
    hf_specs,
    layout_for,
    layout_for_hf,
    model_config_from_hf,
    to_hf,
)
from moe_rl.convert.megatron_keys import ConvertError, megatron_specs
from moe_rl.convert.peft_export import megatron_to_peft
from moe_rl.convert.safetensors_writer import ShardedSafetensorsWriter
from moe_rl.runtime.atomic import atomic_output_dir

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ConvertError",
    "DcpCheckpoint",
    "HFArchitecture",
    "HFCheckpoint",
    "ShardedSafetensorsWriter",
    "atomic_output_dir",
    "check_supported",
    "check_tensors",
    "from_hf",
    "hf_config",
    "hf_specs",
    "layout_for",
    "layout_for_hf",
    "megatron_specs",
    "megatron_tensors",
    "megatron_to_hf",
    "megatron_to_peft",
    "model_config_from_hf",
    "to_hf",
]
