"""Checkpoints through megatron-core `dist_checkpointing`: saved at one TP/EP/PP layout,
loadable at any other; complete or absent, never half-written.

Directory layout:
    <path>/                  dist_checkpointing files (model, optimizer, per-rank RNG)
    <path>/moe_rl.json       step, the layout it was saved at, format version
    <path>/config.yaml       the resolved run config

Atomicity: everything is written into `<path>.tmp-<nonce>` and renamed to `<path>` by rank
0 after every rank finished; a crash leaves only the temp directory (ignored by
`latest_checkpoint` and removed by the next save). Resume restores model, optimizer, LR
schedule, step and, when the layout is unchanged, every rank's RNG states.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from moe_rl.atomic import atomic_write_text
from moe_rl.config import save_config

log = logging.getLogger(__name__)

META_FILE = "moe_rl.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the path and the fix."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(s: str) -> str:
    box = [s]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def is_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / META_FILE).is_file() and (p / "metadata.json").is_file()


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not is_checkpoint(p):
        raise CheckpointError(
            f"{p} is not a moe_rl checkpoint (no {META_FILE} / metadata.json); "
            "pass a directory written by Learner.save or tools/convert_checkpoint.py"
        )
    return json.loads((p / META_FILE).read_text())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """Newest complete checkpoint `step_XXXXXX` under `<run_dir>/checkpoints`, if any."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith("step_") and is_checkpoint(p)]
    return max(done, key=lambda p: read_meta(p)["step"], default=None)


def _has_optimizer_state(learner: Any) -> bool:
    """Adam's moments exist only after the first step; before it there is nothing to save."""
    if learner.optimizer is None:
        return False
    parts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return any(len(p.optimizer.state) > 0 for p in parts)


def _layout_tag(learner: Any) -> dict[str, int]:
    lay = learner.layout
    return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp}


def _rng_object(learner: Any) -> ShardedObject:
    """This rank's RNG states, addressed by (pp, tp, dp) rank so each rank gets its own."""
    lay = learner.layout
    state = {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        state,
        (lay.pp, lay.tp, lay.dp),
        (lay.pp_rank, lay.tp_rank, lay.dp_rank),
        replica_id=0,
    )


def _sharded_state(learner: Any, *, with_optimizer: bool, with_rng: bool, loading: bool) -> dict:
    model_sd = learner.gpt.sharded_state_dict()
    sd: dict[str, Any] = {"model": model_sd}
    if with_optimizer and learner.optimizer is not None:
        sd["optimizer"] = learner.optimizer.sharded_state_dict(model_sd, is_loading=loading)
    if with_rng:
        sd["rng_state"] = _rng_object(learner)
    return sd


def save_checkpoint(
    learner: Any,
    path: str | os.PathLike,
    extra_meta: dict[str, Any] | None = None,
    include_optimizer: bool = True,
) -> Path:
    """Collective. Write model, optimizer, LR schedule, RNG and config to `path` atomically
    (`include_optimizer=False`: model and RNG only, e.g. a shipped base model)."""
    path = Path(path)
    tmp = Path(_broadcast_str(f"{path}.tmp-{uuid.uuid4().hex[:8]}"))
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f"{path.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    try:
        with_opt = include_optimizer and _has_optimizer_state(learner)
        sd = _sharded_state(learner, with_optimizer=with_opt, with_rng=True, loading=False)
        dist_checkpointing.save(sd, str(tmp))
        _barrier()
        if _rank() == 0:
            meta = {
                "format_version": FORMAT_VERSION,
                "step": learner.step,
                "layout": _layout_tag(learner),
                "has_optimizer": with_opt,
                "scheduler": learner.scheduler.state_dict() if with_opt else None,
                **(extra_meta or {}),
            }
            atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2) + "\n")
            save_config(learner.cfg, tmp / "config.yaml")
            if path.exists():
                old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return path


def load_checkpoint(
    learner: Any,
    path: str | os.PathLike,
    *,
    load_optimizer: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """Collective. Load `path` (saved at any layout) into the learner. Optimizer state and
    LR schedule are restored when present and asked for; RNG states only when the layout
    is the one the checkpoint was saved at. Returns the checkpoint's metadata."""
    meta = read_meta(path)
    same_layout = meta.get("layout") == _layout_tag(learner)
    want_opt = load_optimizer and learner.optimizer is not None and meta.get("has_optimizer", False)
    sd = _sharded_state(learner, with_optimizer=want_opt, with_rng=same_layout, loading=True)
    try:
        loaded = dist_checkpointing.load(sd, str(path), strict="assume_ok_unexpected")
    except Exception as e:  # megatron raises several types; name the checkpoint in the error
        raise CheckpointError(f"could not load {path}: {type(e).__name__}: {e}") from e
    missing, _unexpected = learner.gpt.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if strict and missing:
        raise CheckpointError(f"checkpoint {path} lacks parameters {missing[:5]} (model config differs?)")
    if want_opt:
        learner.optimizer.load_state_dict(loaded["optimizer"])
        if meta.get("scheduler") is not None:
            learner.scheduler.load_state_dict(meta["scheduler"])
    elif learner.optimizer is not None:
        # Weights only: mixed-precision optimizers keep fp32 master copies of the params,
        # which must follow the weights just loaded (a no-op for fp32 training).
        learner.optimizer.reload_model_params()
    if same_layout and "rng_state" in loaded:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    elif not same_layout:
        log.info("checkpoint %s saved at layout %s, loading at %s: RNG states not restored",
                 path, meta.get("layout"), _layout_tag(learner))
    learner.step = int(meta.get("step", 0))
    return meta
