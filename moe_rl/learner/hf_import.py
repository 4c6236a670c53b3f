"""Start the learner from a Hugging Face directory (Qwen3-MoE, Glm4-MoE or DeepseekV3), and write it as a
megatron checkpoint.

    load_hf_weights(learner, "hf-dir")              # any layout; no communication
    hf_to_megatron("hf_dir", "ckpt_dir")            # one process: a checkpoint any layout loads

`load_full_tensors` is the inverse of `gather.iter_full_tensors`: given global megatron
tensors, each rank copies the slices it owns into its parameters, through the same
ShardedTensor descriptions megatron uses for checkpoints (so TP slices, the global expert
ids of this EP rank, the SwiGLU gate/up halves and the pipeline stage's layers all follow
megatron's own layout; the router's expert bias is a float32 buffer, not a parameter).
No process communicates: every rank reads from the files the HF tensors that its pieces of
the keys its pipeline stage holds need (one key at a time; at expert parallelism, only its
own experts' tensors) and keeps its slices.

`hf_to_megatron` is not streaming: it builds a one-process learner of the HF model's size
(fp32 or bf16 as config.json says), loads the weights into it and lets
`checkpoint.save_checkpoint` write the dist_checkpointing directory, which is then loadable
at any TP/EP/PP layout like every learner checkpoint. Peak memory is the model once plus
the largest tensor; writing DCP files directly would stream, but then megatron's own
per-module extra state objects (layer-spec dependent) would have to be forged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.models.gpt import GPTModel

from moe_rl.config import Config, ModelConfig, to_dict, validate
from moe_rl.convert.hf_checkpoint import HFCheckpoint, check_tensors
from moe_rl.convert.layouts import layout_for
from moe_rl.convert.lora_merge import is_lora_name
from moe_rl.convert.megatron_keys import ConvertError, canonical_key, check_shape, megatron_specs
from moe_rl.learner.gather import flatten_sharded, own_storages, piece_index
from moe_rl.runtime.atomic import check_distinct

if TYPE_CHECKING:
    from moe_rl.config.model import ParamsDtype


@torch.no_grad()
def load_full_tensors(model: GPTModel, fetch: Callable[[str, list[tuple]], torch.Tensor], m: ModelConfig,
                      optional: tuple[str, ...] = ()) -> int:
    """Copy this rank's slices of every global tensor into `model`'s parameters.

    `fetch(key, wanted)` returns the global megatron tensor of a (canonical) key, of which
    only the indices `wanted` (this rank's pieces) are read; it is called once per key this
    rank holds. Keys starting with an `optional` prefix are left as they are (the critic's
    value head). Returns the number of slices copied."""
    expected = megatron_specs(m)
    sd = model.sharded_state_dict()
    apply_factories(sd)  # SwiGLU fc1: two ShardedTensors (gate, up) viewing one parameter
    storages = own_storages(model)
    pieces: dict[str, list[ShardedTensor]] = {}
    for sh in flatten_sharded(sd):
        if sh.key.startswith(optional) or is_lora_name(sh.key):  # (adapters keep their initial values)
            continue
        key = canonical_key(sh.key)
        if key not in expected:
            raise ConvertError(f"learner tensor {sh.key!r} has no counterpart in the model config")
        if sh.data.untyped_storage().data_ptr() not in storages:  # a copy would load nothing
            raise RuntimeError(f"sharded tensor {sh.key!r} does not view a parameter or buffer; cannot load in place")
        pieces.setdefault(key, []).append(sh)
    copied = 0
    for key, shards in pieces.items():
        full = fetch(key, [piece_index(sh) for sh in shards])
        check_shape(key, tuple(full.shape), expected[key], "megatron tensor")
        for sh in shards:
            check_shape(key, tuple(full.shape), tuple(sh.global_shape), "megatron tensor")
            piece = full[piece_index(sh)]
            if tuple(piece.shape) != tuple(sh.data.shape):
                raise ConvertError(f"slice of {key!r} has shape {list(piece.shape)}, the parameter {list(sh.data.shape)}")
            sh.data.copy_(piece)  # views the parameter (factories chunk by view); casts to its dtype
            copied += 1
    return copied


def _broken_file(hf_dir: Path) -> Path | None:
    """The first file of an HF directory that does not open as what it claims to be."""
    from safetensors import safe_open

    for f in sorted(hf_dir.glob("*.json")):
        try:
            json.loads(f.read_text())
        except (ValueError, OSError):
            return f
    for f in sorted(hf_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    h.get_slice(name).get_shape()
        except Exception:  # SafetensorError, OSError: this is the damaged file
            return f
    return None


@contextlib.contextmanager
def hf_read_errors(hf_dir: str | os.PathLike) -> Iterator[None]:
    """Errors from reading a Hugging Face directory as ConvertErrors naming the damaged file
    (safetensors' SafetensorError and json's errors name none)."""
    try:
        yield
    except ConvertError:
        raise
    except Exception as e:
        if type(e).__name__ != "SafetensorError" and not isinstance(e, json.JSONDecodeError | UnicodeDecodeError):
            raise
        bad = _broken_file(Path(hf_dir))
        what = f"{bad} is damaged" if bad else f"a file of {hf_dir} is damaged"
        raise ConvertError(f"{what} ({' '.join(str(e).split())}); restore it from the original model "
                           "directory") from e


def load_hf_weights(learner, hf_dir: str | os.PathLike, optional: tuple[str, ...] = ()) -> None:
    """Load a Hugging Face directory into `learner` (any layout; every rank reads the files
    itself). The directory's config.json must describe the learner's model, and tensors are
    cast to the dtype of the parameter (or buffer) they load into. `optional`: parameter
    prefixes the directory does not hold (the critic's value head)."""
    with hf_read_errors(hf_dir), HFCheckpoint(hf_dir) as hf:
        m = learner.model_cfg
        got = hf.model_config(base=m)
        fields = [f.name for f in dataclasses.fields(ModelConfig) if getattr(got, f.name) != getattr(m, f.name)
                  and f.name != "params_dtype"]
        if fields:
            f = fields[0]
            raise ConvertError(
                f"{hf.path}/config.json describes model.{f}={getattr(got, f)!r} but the learner has "
                f"model.{f}={getattr(m, f)!r}"
            )
        check_tensors(hf, m)
        layout = layout_for(m)
        # No cast here: each slice is cast as it is copied, so the float32 expert bias of a
        # bf16 model is not rounded through bf16 on the way.
        # each rank fetches only the HF tensors its pieces read (at EP, its own experts)
        load_full_tensors(learner.gpt, lambda key, wanted: layout.from_hf(key, hf.get, m, wanted), m, optional)
    if learner.optimizer is not None:
        # bf16: the optimizer's fp32 main params were copied from the old weights.
        learner.optimizer.reload_model_params()


def hf_to_megatron(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    dtype: str | None = None,
    force: bool = False,
    base: ModelConfig | None = None,
) -> Path:
    """Write the Hugging Face directory `src` as a learner checkpoint `dst` (one process).

    dtype: "fp32" / "bf16" parameter dtype of the checkpoint; None follows config.json.
    base: the model settings config.json does not describe (layer spec, fp8, ...; defaults).
    The checkpoint's config.yaml is the default run config with that model."""
    from moe_rl.learner.checkpoint import save_checkpoint
    from moe_rl.learner.engine import Learner
    from moe_rl.learner.parallel import init_distributed, parallel_layout

    dst = Path(dst)
    with hf_read_errors(src), HFCheckpoint(src) as hf:
        m = hf.model_config(base=base or ModelConfig())
        if dtype is not None:
            m = dataclasses.replace(m, params_dtype=cast("ParamsDtype", dtype))  # (validate(cfg) below refuses others)
        cfg = Config(model=m)
        validate(cfg)
        check_tensors(hf, m)  # before building anything: a bad directory fails fast
    check_distinct(src, dst)
    if dst.exists() and not force:
        raise FileExistsError(f"{dst} already exists; pass --force (force=True) to replace it")
    init_distributed()
    with parallel_layout(cfg.parallel, seed=cfg.run.seed) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout)
        load_hf_weights(learner, src)
        # save_checkpoint writes <dst>.tmp-<nonce> and renames it: complete or absent.
        return save_checkpoint(learner, dst, recipe=to_dict(cfg), extra_meta={"converted_from": str(Path(src).resolve())},
                               replace_foreign=force)
