"""The non-weight files of an exported Hugging Face directory.

A model that came from a Hugging Face directory goes back out as that directory did: its
config.json with every field preserved (architectures, rope scaling, dtype, fields this
project does not read) after checking that it describes the exported model,
generation_config.json, and every tokenizer file, byte for byte. The source is found from
the checkpoint's config.yaml: `run.init_checkpoint` when it is a Hugging Face directory (or,
for a run started from a learner checkpoint, that checkpoint's own source, followed back),
else a Hugging Face tokenizer directory recorded in `task.tokenizer`.

The project's own models (no source) get the files written from the model config and the
shipped SentencePiece tokenizer (`moe_rl.tasks.tokenizer.write_hf_tokenizer`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from moe_rl.config import ModelConfig
from moe_rl.convert.hf_layout import TORCH_DTYPE_NAMES, generation_config
from moe_rl.convert.layouts import hf_config, model_config_from_hf
from moe_rl.convert.megatron_keys import ConvertError

SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
              "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
              "chat_template.json")
"""Copied from the source directory as they are, when present."""

# The model fields an exported config.json must agree on with the learner's (training
# settings such as the dispatcher or aux-loss coefficients are not in config.json).
_MODEL_FIELDS_SKIPPED = {"params_dtype", "layer_spec", "fp8", "recompute", "init_method_std",
                         "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type",
                         "moe_router_load_balancing_type", "moe_router_bias_update_rate"}


def _read_yaml_config(ckpt: Path) -> dict[str, Any]:
    import yaml

    try:
        return yaml.safe_load((ckpt / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def find_hf_source(init_checkpoint: str, tokenizer: str, depth: int = 8) -> Path | None:
    """The Hugging Face directory a checkpoint's model came from (module docstring), from its
    recipe's run.init_checkpoint and task.tokenizer."""
    init = Path(init_checkpoint) if init_checkpoint else None
    for _ in range(depth):
        if init is None or not init.is_dir():
            break
        if (init / "config.json").is_file():
            return init
        data = _read_yaml_config(init)
        nxt = (data.get("run") or {}).get("init_checkpoint")
        init = Path(nxt) if nxt else None
    tok = Path(tokenizer) if tokenizer not in ("", "auto", "shipped") else None
    if tok is not None and tok.is_dir() and (tok / "config.json").is_file():
        return tok
    return None


def _check_describes(source_cfg: dict[str, Any], m: ModelConfig, source: Path) -> None:
    """The source config.json must describe the exported model, field by field."""
    try:
        theirs = model_config_from_hf(source_cfg, base=m)
    except (ConvertError, NotImplementedError, KeyError) as e:
        raise ConvertError(f"{source}/config.json: {e}") from None
    diff = [f"{k}: model {getattr(m, k)!r}, config.json {getattr(theirs, k)!r}"
            for k in m.__dataclass_fields__ if k not in _MODEL_FIELDS_SKIPPED and getattr(m, k) != getattr(theirs, k)]
    if diff:
        raise ConvertError(f"{source}/config.json does not describe the checkpoint's model ({'; '.join(diff[:3])}); "
                           "pass the right source directory")


def write_from_source(out_dir: Path, source: Path, m: ModelConfig, dtype: torch.dtype, *,
                      keep_mtp: bool = False) -> None:
    """config.json (the source's, dtype set to the exported one), the side files copied.
    `keep_mtp`: the export carries the source's MTP layers (`mtp_carry`), so config.json keeps
    num_nextn_predict_layers; otherwise it becomes 0 (the layers are not written)."""
    try:
        source_cfg = json.loads((source / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{source}/config.json: cannot read it ({e})") from None
    _check_describes(source_cfg, m, source)
    out = dict(source_cfg)
    for key in ("dtype", "torch_dtype"):
        if key in out or key == "dtype":
            out[key] = TORCH_DTYPE_NAMES[dtype]
    if out.get("num_nextn_predict_layers") and not keep_mtp:  # not exported (see glm4_moe)
        out["num_nextn_predict_layers"] = 0
    (out_dir / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)


def _write_own_hf_tokenizer(out_dir: Path, m: ModelConfig, dtype: torch.dtype, directory: Path) -> None:
    """`write_own` for a model trained with a Hugging Face tokenizer directory: its files
    copied, EOS ids (every one it declares) and pad from it."""
    from moe_rl.tokenization import TOKENIZER_FILES, HFTokenizer

    tok = HFTokenizer(directory)
    if tok.vocab_size > m.vocab_size:
        raise ConvertError(f"tokenizer {directory} has {tok.vocab_size} tokens but model.vocab_size={m.vocab_size}")
    ids = {"bos_token_id": tok.bos_id if tok.bos_id >= 0 else None, "eos_token_id": tok.eos_ids[0],
           "pad_token_id": tok.pad_id}
    (out_dir / "config.json").write_text(json.dumps(hf_config(m, dtype, **ids), indent=2) + "\n")
    gen = generation_config(bos_token_id=ids["bos_token_id"], eos_token_id=tok.eos_ids,  # (a turn may end on any of them)
                            pad_token_id=ids["pad_token_id"])
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            shutil.copyfile(directory / name, out_dir / name)


def source_dtype(source: Path) -> torch.dtype | None:
    """The dtype the source config.json declares (exports keep it unless asked otherwise)."""
    try:
        cfg = json.loads((source / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return {v: k for k, v in TORCH_DTYPE_NAMES.items()}.get(name)


def write_own(out_dir: Path, m: ModelConfig, dtype: torch.dtype, tokenizer: str | None) -> None:
    """The project's own model: config.json and generation_config.json from the model
    config, tokenizer files from the SentencePiece model (token ids: bos / eos / pad), or a
    copy of the Hugging Face tokenizer directory the model was trained with (the tool base's
    BPE with its chat template)."""
    from moe_rl.tasks.tokenizer import Tokenizer, write_hf_tokenizer

    spec = None if tokenizer in (None, "", "auto", "shipped") else tokenizer
    if spec is not None and not spec.endswith(".model") and Path(spec).is_dir() \
            and (Path(spec) / "tokenizer.json").is_file():
        return _write_own_hf_tokenizer(out_dir, m, dtype, Path(spec))
    tok = Tokenizer(spec)
    if tok.vocab_size > m.vocab_size:
        raise ConvertError(f"tokenizer {tok.path} has {tok.vocab_size} pieces but model.vocab_size={m.vocab_size}")
    ids = {"bos_token_id": tok.bos_id if tok.bos_id >= 0 else None, "eos_token_id": tok.eos_id,
           "pad_token_id": tok.pad_id}
    (out_dir / "config.json").write_text(json.dumps(hf_config(m, dtype, **ids), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(**ids), indent=2) + "\n")
    write_hf_tokenizer(out_dir, tok.path)
