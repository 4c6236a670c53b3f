"""megatron checkpoint directory -> Hugging Face directory, streamed, in the model's layout
(Qwen3-MoE, or Glm4-MoE for a sigmoid router / shared expert: `layouts.layout_for`).

    megatron_to_hf("runs/x/checkpoints/step_000050", "runs/x/hf", max_shard_bytes=2 << 30)

Steps: check the directory is a learner checkpoint and read its config.yaml; check the
checkpoint holds exactly the model tensors that config implies, with the right global
shapes (optimizer state and RNG are skipped); plan the safetensors shards from those
shapes; then, inside a temp directory, write config.json, generation_config.json, the
tokenizer files and, one megatron tensor at a time, read it (reassembling whatever TP/EP/PP
chunks it was saved in), split it into its HF tensors and append those to the current
shard. Only a complete directory is renamed to `dst`.

Most HF tensors are stored in the checkpoint exactly as HF wants them: every expert's gate,
up and down projection is its own saved chunk, and so is any tensor saved whole that is
only renamed. Those are copied file to file by the kernel (`copy_file_range`); the others
(q/k/v, and tensors split across TP ranks) are read into one reused buffer, re-laid out and
written (so are the few HF tensors a layout fills with zeros, and tensors whose output
dtype differs). Peak memory is about the largest megatron tensor that needs re-layout, plus
one q_proj copy.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import yaml

from moe_rl.config import Config, ConfigError, ModelConfig, load_saved_config
from moe_rl.convert.dcp import CONFIG_FILE, DcpCheckpoint, RawChunk
from moe_rl.convert.hf_files import find_hf_source, source_dtype, write_from_source, write_own
from moe_rl.convert.hf_layout import HFArchitecture
from moe_rl.convert.layouts import layout_for
from moe_rl.convert.lora_merge import adapter_keys, is_lora_name, merged_weight
from moe_rl.convert.megatron_keys import ConvertError, canonical_key, is_model_key, megatron_specs
from moe_rl.convert.mtp_carry import planned_mtp_tensors, write_mtp_tensors
from moe_rl.convert.safetensors_writer import PlannedTensor, ShardedSafetensorsWriter
from moe_rl.runtime.atomic import atomic_output_dir, check_distinct

DEFAULT_SHARD_BYTES = 2 << 30  # 2 GiB
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def checkpoint_config(path: Path) -> Config:
    """The run config stored beside the weights, errors naming the file."""
    try:
        return load_saved_config(path / CONFIG_FILE)
    except ConfigError as e:
        raise ConvertError(f"{path / CONFIG_FILE}: {e}") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path / CONFIG_FILE} is not valid YAML ({' '.join(str(e).split())})") from e


def match_checkpoint_keys(ckpt: DcpCheckpoint, m: ModelConfig) -> dict[str, str]:
    """{canonical key: key as stored} for every model tensor, after checking the stored
    model tensors are exactly those `m` implies, with the same global shapes."""
    expected = megatron_specs(m)
    stored: dict[str, str] = {}
    for key in ckpt.tensors:
        if is_model_key(key) and not is_lora_name(key):  # (adapters: `stored_adapters`)
            stored[canonical_key(key)] = key
    unexpected = [k for k in stored if k not in expected]
    if unexpected:
        raise ConvertError(
            f"checkpoint tensor {stored[unexpected[0]]!r} is not part of the model described by "
            f"{ckpt.path / CONFIG_FILE} ({len(unexpected)} unexpected; config.yaml does not match the weights?)"
        )
    missing = [k for k in expected if k not in stored]
    if missing:
        raise ConvertError(
            f"checkpoint {ckpt.path} lacks tensor {missing[0]!r} ({len(missing)} missing) that "
            f"{CONFIG_FILE} implies (config.yaml does not match the weights?)"
        )
    for key, shape in expected.items():
        got = ckpt.tensors[stored[key]].shape
        if got != shape:
            raise ConvertError(
                f"checkpoint tensor {stored[key]!r} has global shape {list(got)} but {CONFIG_FILE} "
                f"implies {list(shape)} (config.yaml does not match the weights?)"
            )
    return stored


def stored_adapters(ckpt: DcpCheckpoint, m: ModelConfig) -> dict[str, tuple[str, str]]:
    """{canonical weight key: (A key, B key) as stored} of every LoRA-adapted linear; a
    checkpoint whose adapters its config.yaml does not describe is a ConvertError."""
    lora = {canonical_key(k): k for k in ckpt.tensors if is_model_key(k) and is_lora_name(k)}
    if lora and not m.lora.enabled:
        raise ConvertError(f"checkpoint {ckpt.path} holds LoRA adapters but its {CONFIG_FILE} has model.lora.rank=0 "
                           "(config.yaml does not match the weights?)")
    out = {}
    for key in megatron_specs(m):
        a, b = adapter_keys(key)
        if a in lora and b in lora:
            out[key] = (lora.pop(a), lora.pop(b))
    if lora:
        raise ConvertError(f"checkpoint adapter {next(iter(lora.values()))!r} has no weight to merge into")
    return out


def megatron_to_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: str | torch.dtype | None = None,
    force: bool = False,
    tokenizer: str | os.PathLike | None = None,
    progress: bool = False,
    trust: bool = False,
) -> Path:
    """Convert the learner checkpoint `src` into a Hugging Face directory `dst`.

    dtype: output dtype ("fp32", "bf16" or a torch dtype); None keeps the stored dtype.
    tokenizer: a SentencePiece model for the project's own models' tokenizer files, or a
        Hugging Face directory to take config.json, generation_config.json and the tokenizer
        files from; None: the checkpoint's source (`hf_files.find_hf_source`: the Hugging
        Face directory the run started from), else its recorded SentencePiece tokenizer.
        With a Hugging Face source, `dtype=None` writes the source's dtype.
    progress: show a tqdm bar over the bytes written.
    trust: accept a checkpoint without a manifest (its pickles are read the ordinary way).
    """
    out_dtype = resolve_dtype(dtype)
    ckpt = DcpCheckpoint(src, trust=trust)
    check_distinct(src, dst)
    cfg = checkpoint_config(ckpt.path)
    m = cfg.model
    layout = layout_for(m)
    layout.check_supported(m)
    stored = match_checkpoint_keys(ckpt, m)
    adapters = stored_adapters(ckpt, m)  # LoRA: these weights are written merged, W + (alpha / rank) B A
    dtypes = {key: out_dtype or ckpt.tensors[stored[key]].dtype for key in stored}
    plan = [
        PlannedTensor(spec.name, spec.shape, spec.dtype or dtypes[key])  # a spec may fix its dtype
        for key in megatron_specs(m)
        for spec in layout.hf_specs(key, m)
    ]
    source = _hf_source(cfg, tokenizer)
    if source is not None and out_dtype is None:
        out_dtype = source_dtype(source)
        dtypes = {key: out_dtype or ckpt.tensors[stored[key]].dtype for key in stored}
        plan = [PlannedTensor(spec.name, spec.shape, spec.dtype or dtypes[key])
                for key in megatron_specs(m) for spec in layout.hf_specs(key, m)]
    config_dtype = out_dtype or dtypes["embedding.word_embeddings.weight"]
    mtp = planned_mtp_tensors(source, m)  # DeepseekV3: the source's MTP layers, unchanged
    plan += mtp
    with atomic_output_dir(dst, force=force) as tmp:
        if source is not None:
            write_from_source(tmp, source, m, config_dtype, keep_mtp=bool(mtp))
        else:
            write_own(tmp, m, config_dtype, str(tokenizer) if tokenizer else cfg.task.tokenizer)
        with ShardedSafetensorsWriter(tmp, plan, max_shard_bytes) as writer:
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="convert")
            _write_tensors(writer, ckpt, stored, layout, m, dtypes, bar, adapters)
            if mtp and source is not None:  # (MTP tensors come from a source directory)
                write_mtp_tensors(writer, source, mtp)
            if bar is not None:
                bar.close()
    return Path(dst)


def _hf_source(cfg: Config, tokenizer: str | os.PathLike | None) -> Path | None:
    """Where config.json and the tokenizer files come from (None: written from our own)."""
    if tokenizer:
        p = Path(tokenizer)
        return p if p.is_dir() and (p / "config.json").is_file() else None
    return find_hf_source(cfg.run.init_checkpoint, cfg.task.tokenizer)


def _write_tensors(writer: ShardedSafetensorsWriter, ckpt: DcpCheckpoint, stored: dict[str, str],
                   layout: HFArchitecture, m: ModelConfig, dtypes: dict[str, torch.dtype], bar: Any,
                   adapters: dict[str, tuple[str, str]] | None = None) -> None:
    """Every megatron tensor, in plan order: as file-to-file copies when its HF tensors are
    saved chunks as they are, else read into one reused buffer, re-laid out and written.
    (Fresh memory per tensor would cost a page fault per 4 KiB, more than the read itself.)
    A LoRA-adapted weight (`adapters`) is read, merged with its factors and written."""
    adapters = adapters or {}
    infos = {key: ckpt.tensors[stored[key]] for key in megatron_specs(m)}
    specs = {key: layout.hf_specs(key, m) for key in infos}
    direct = {
        key: _stored_as_is(key, ckpt, stored[key], m, layout)
        if key not in adapters and all((spec.dtype or dtypes[key]) == info.dtype for spec in specs[key]) else None
        for key, info in infos.items()
    }
    nbytes = {key: math.prod(info.shape) * info.dtype.itemsize for key, info in infos.items()}
    arena = torch.empty(max([nbytes[k] for k in infos if direct[k] is None], default=0), dtype=torch.uint8)
    for key, info in infos.items():
        if (chunks_of := direct[key]) is not None:
            for spec, chunk in zip(specs[key], chunks_of):
                writer.copy_from_file(spec.name, spec.shape, info.dtype, chunk.path, chunk.file_offset)
        else:
            full = ckpt.read(stored[key], out=arena[: nbytes[key]].view(info.dtype).view(info.shape))
            if key in adapters:
                a, b = adapters[key]
                full = merged_weight(full, ckpt.read(a), ckpt.read(b), m.lora.scale)
            for name, t in layout.to_hf(key, full, m, dtypes[key]):
                writer.write(name, t)  # written before the buffer is reused
        if bar is not None:
            bar.update(sum(math.prod(s.shape) * (s.dtype or dtypes[key]).itemsize for s in specs[key]))


def _stored_as_is(key: str, ckpt: DcpCheckpoint, stored_key: str, m: ModelConfig,
                  layout: HFArchitecture | None = None) -> list[RawChunk] | None:
    """For each HF tensor of `key`, the saved chunk whose bytes are exactly that tensor's
    (same elements, same row-major order); None unless every HF tensor has one. True of
    renamed tensors saved whole, of each expert's gate / up / down (the expert axis and the
    SwiGLU halves are chunk boundaries at any EP size, with ETP=1), not of q/k/v nor of a
    key with zero-filled HF tensors."""
    chunks = ckpt.raw_chunks(stored_key)
    if chunks is None:
        return None
    info = ckpt.tensors[stored_key]
    meta = torch.empty(info.shape, dtype=info.dtype, device="meta")  # shapes and offsets only
    by_range = {}
    for c in chunks:
        box = meta[c.slices]
        if box.is_contiguous():
            by_range[(box.storage_offset(), box.numel())] = c
    found = []
    for view in (layout or layout_for(m)).hf_views(key, meta, m):
        got = None if view is None or not view.is_contiguous() else by_range.get((view.storage_offset(), view.numel()))
        if got is None:
            return None
        found.append(got)
    return found
