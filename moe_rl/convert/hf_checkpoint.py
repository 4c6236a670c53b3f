"""Read a Hugging Face directory (Qwen3-MoE, Glm4-MoE or DeepseekV3) as global megatron tensors, one key
at a time.

`HFCheckpoint(dir)` opens config.json and the safetensors files (through the index when
there is one) lazily; `megatron_tensors(hf, model_cfg)` yields `(megatron key, tensor)`
in the learner's key order, built by the layout's `from_hf`. Before the first tensor it
checks that the directory holds exactly the tensors the config implies: a missing tensor,
an unexpected one (e.g. a shared expert in a Qwen3-MoE directory) or a wrong shape is a
ConvertError naming it. A tied output head may be stored or not, in either layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moe_rl.config import ModelConfig
from moe_rl.convert.layouts import layout_for, model_config_from_hf
from moe_rl.convert.megatron_keys import ConvertError, megatron_specs
from moe_rl.convert.safetensors_writer import DTYPE_NAMES, INDEX_FILE

TIED_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class HFCheckpoint:
    """config.json plus lazily opened safetensors files of a Hugging Face model directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        p = Path(path)
        if not p.is_dir():
            raise ConvertError(f"Hugging Face directory {p} does not exist or is not a directory")
        if not (p / "config.json").is_file():
            hint = " (it looks like a megatron checkpoint: use --to hf)" if (p / ".metadata").is_file() else ""
            raise ConvertError(f"{p} is not a Hugging Face model directory: no config.json{hint}")
        self.path = p
        self.config: dict[str, Any] = json.loads((p / "config.json").read_text())
        self._file_of: dict[str, Path] = {}
        if (p / INDEX_FILE).is_file():
            weight_map = json.loads((p / INDEX_FILE).read_text())["weight_map"]
            for name, file in weight_map.items():
                if not (p / file).is_file():
                    raise ConvertError(f"{p / INDEX_FILE} maps {name!r} to {file}, which does not exist")
                self._file_of[name] = p / file
        else:
            files = sorted(p.glob("*.safetensors"))
            if not files:
                raise ConvertError(f"{p} has no *.safetensors files")
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        self._file_of[name] = file
        self._open: dict[Path, Any] = {}

    def model_config(self, base: ModelConfig | None = None) -> ModelConfig:
        return model_config_from_hf(self.config, base)

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of tensor `name`, from the file header (no data read)."""
        stored = self._handle(name).get_slice(name).get_dtype()
        by_name = {v: k for k, v in DTYPE_NAMES.items()}
        if stored not in by_name:
            raise ConvertError(f"{self.path}: tensor {name!r} has dtype {stored}, which this converter cannot copy")
        return by_name[stored]

    def _handle(self, name: str) -> Any:
        file = self._file_of.get(name)
        if file is None:
            raise ConvertError(f"Hugging Face directory {self.path} has no tensor {name!r}")
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file]

    def get(self, name: str) -> torch.Tensor:
        if name == TIED_HEAD and name not in self._file_of and self.config.get("tie_word_embeddings"):
            name = EMBEDDING  # a tied head that was not stored is the embedding
        return self._handle(name).get_tensor(name)

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_tensors(hf: HFCheckpoint, m: ModelConfig) -> None:
    """Exactly the tensors `m` implies, with their shapes (headers only, no data read)."""
    layout = layout_for(m)
    layout.check_supported(m)
    specs = {s.name: s.shape for s in layout.hf_specs_all(m)}
    names = {n for n in hf.names() if not layout.ignored_hf_tensor(n, hf.config)}  # e.g. MTP layers
    extra = sorted(names - set(specs))
    missing = [n for n in specs if n not in names]
    if not m.untie_embeddings_and_output_weights:
        if TIED_HEAD in extra:
            # Some writers store the tied head anyway; it must then be the embedding.
            if not torch.equal(hf.get(TIED_HEAD), hf.get(EMBEDDING)):
                raise ConvertError(f"config.json says tie_word_embeddings=true but {TIED_HEAD} differs from {EMBEDDING}")
            extra.remove(TIED_HEAD)
        if TIED_HEAD in missing:  # a layout that writes the head (Glm4-MoE) reads the embedding
            missing.remove(TIED_HEAD)
    if extra:
        raise ConvertError(
            f"unexpected tensor {extra[0]!r} in {hf.path} ({len(extra)} unexpected): the {layout.name} "
            "config implies no such tensor (a different architecture, or config.json does not match the weights?)"
        )
    if missing:
        raise ConvertError(f"tensor {missing[0]!r} is missing from {hf.path} ({len(missing)} missing)")
    for name, shape in specs.items():
        got = hf.shape(EMBEDDING if name == TIED_HEAD and name not in names else name)
        if got != shape:
            raise ConvertError(
                f"Hugging Face tensor {name!r} has shape {list(got)} but config.json implies {list(shape)}"
            )


def megatron_tensors(
    hf: HFCheckpoint, m: ModelConfig, keys: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(megatron key, full tensor)` for `keys` (default: all, in layer order), after
    `check_tensors`. Tensors keep the file's dtype."""
    check_tensors(hf, m)
    layout = layout_for(m)
    for key in keys if keys is not None else megatron_specs(m):
        yield key, layout.from_hf(key, hf.get, m)
