"""A LoRA checkpoint's attention adapters as a PEFT adapter directory (adapter_config.json,
adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the base model.

Only the attention adapters have a target both PEFT and the model's transformers class name
alike: q_proj, k_proj, v_proj, o_proj. The learner's fused q/k/v adapter (one A, one B
over megatron's interleaved q/k/v rows) becomes three PEFT adapters sharing that A, each B
the rows of its projection (the converter's own q/k/v re-layout), so each B_x A is exactly
the fused delta's rows. Expert adapters are refused: transformers fuses the experts of
these models into 3-D parameters that PEFT's LoRA does not target, and vLLM cannot apply
LoRA to MoE experts on CPU; export merged instead (`--to hf`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_rl.convert.dcp import DcpCheckpoint
from moe_rl.convert.hf_export import checkpoint_config, stored_adapters
from moe_rl.convert.hf_files import find_hf_source
from moe_rl.convert.layouts import layout_for
from moe_rl.convert.megatron_keys import ConvertError, megatron_shape
from moe_rl.runtime.atomic import atomic_output_dir, check_distinct

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _check_exportable(m, path: Path) -> None:
    """One line for what PEFT cannot take."""
    if not m.lora.enabled:
        raise ConvertError(f"checkpoint {path} has no LoRA adapters (model.lora.rank=0); export it with --to hf")
    others = [x for x in m.lora.modules if x != "attention"]
    if others:
        raise ConvertError(f"--peft exports attention adapters only; {path} also has {', '.join(others)} adapters "
                           "(no adapter format both PEFT and vLLM read covers fused MoE experts yet): export it "
                           "merged with --to hf instead")
    if m.multi_latent_attention:
        raise ConvertError("--peft does not export multi-latent-attention adapters (DeepSeek-V3's projections "
                           "differ from transformers'); export merged with --to hf instead")


def _split_rows(key: str, b: torch.Tensor, m) -> list[tuple[str, torch.Tensor]]:
    """B [out, r] re-laid out as the weight `key` is ([out, in] -> its HF tensors): B is
    padded with zero columns to the weight's width, converted, and cut back to r columns."""
    r = b.shape[-1]
    width = megatron_shape(key, m)[-1]
    if r > width:
        raise ConvertError(f"--peft: model.lora.rank={r} exceeds {key}'s input width {width}")
    padded = torch.zeros(b.shape[0], width, dtype=b.dtype)
    padded[:, :r] = b
    return [(name, t[:, :r].contiguous()) for name, t in layout_for(m).to_hf(key, padded, m)]


def _peft_name(hf_weight: str, factor: str) -> str:
    return f"base_model.model.{hf_weight.removesuffix('.weight')}.{factor}.weight"


def megatron_to_peft(src: str | os.PathLike, dst: str | os.PathLike, *, force: bool = False,
                     trust: bool = False) -> Path:
    """Write the attention adapters of the LoRA checkpoint `src` as a PEFT directory `dst`
    (float32, LoRA scale alpha / rank as trained)."""
    ckpt = DcpCheckpoint(src, trust=trust)
    check_distinct(src, dst)
    cfg = checkpoint_config(ckpt.path)
    m = cfg.model
    _check_exportable(m, ckpt.path)
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for key, (a_key, b_key) in stored_adapters(ckpt, m).items():
        a, b = ckpt.read(a_key).float(), ckpt.read(b_key).float()
        for hf_name, b_part in _split_rows(key, b, m):
            tensors[_peft_name(hf_name, "lora_A")] = a.clone()  # (q, k, v share A: one copy each on disk)
            tensors[_peft_name(hf_name, "lora_B")] = b_part
            targets.add(hf_name.removesuffix(".weight").rsplit(".", 1)[1])
    source = find_hf_source(cfg.run.init_checkpoint, cfg.task.tokenizer)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": m.lora.rank, "lora_alpha": m.lora.alpha,
        "lora_dropout": m.lora.dropout, "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": str(source) if source else None,
    }
    with atomic_output_dir(dst, force=force) as tmp:
        save_file(tensors, str(Path(tmp) / ADAPTER_WEIGHTS))
        (Path(tmp) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return Path(dst)
