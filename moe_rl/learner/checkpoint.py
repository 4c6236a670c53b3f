"""Checkpoints through megatron-core `dist_checkpointing`: saved at one TP/EP/PP layout,
loadable at any other; complete or invisible, verified before anything is read.

Directory layout:
    <path>/                  dist_checkpointing files (model, optimizer, per-rank RNG)
    <path>/moe_rl.json       step, the layout it was saved at, run id, format version
    <path>/config.yaml       the resolved run config (the saver's: a learner holds only its sections)
    <path>/manifest.json     size and SHA-256 of every file but config.yaml (written last)

Atomicity: everything is written into `<path>.tmp-<nonce>`, the manifest last, and renamed
to `<path>` by rank 0 after every rank finished; a kill leaves only the temp directory,
which `latest_checkpoint` never picks and the run directory removes at its next start.
The files are written by threads of this process (no writer process pool, no
multiprocessing manager: megatron's default starts both, and a SIGKILL left them orphaned;
`checkpoint_writes`), now (`save_checkpoint`) or by a background thread while training goes
on (`start_checkpoint(..., background=True)`, then `PendingSave.finish`, collective).

Loading verifies the manifest first (every rank hashes its share of the files), then reads
under `safe_dcp_reading` (restricted `.metadata` unpickler, `weights_only=True` for every
`torch.load`) unless the user trusts the checkpoint; one without a manifest loads only with
`trust=True`. Resume restores
model, optimizer, LR schedule, step and, when the layout is unchanged, every rank's RNG
states.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from torch.distributed.checkpoint.api import CheckpointException

from moe_rl.checkpoints import MANIFEST_FILE, META_FILE
from moe_rl.checkpoints.directories import is_checkpoint, latest_checkpoint, read_meta
from moe_rl.checkpoints.errors import CheckpointError
from moe_rl.checkpoints.manifest import (
    digest_files,
    list_files,
    share,
    verify_share,
    write_manifest,
)
from moe_rl.checkpoints.temps import remove_temps, rename_into_place
from moe_rl.checkpoints.trust import VERIFIED
from moe_rl.config import save_config, to_dict
from moe_rl.convert.dcp import load_metadata, safe_dcp_reading
from moe_rl.convert.lora_merge import is_lora_name
from moe_rl.learner.checkpoint_state import (
    component_meta,
    has_optimizer_state,
    layout_tag,
    sharded_state,
)
from moe_rl.learner.checkpoint_writes import DcpWrite
from moe_rl.learner.finite import nonfinite_parameter
from moe_rl.learner.optimizer import schedule_kept_note
from moe_rl.runtime.atomic import atomic_write_text
from moe_rl.runtime.collectives import all_gather_object, broadcast_object
from moe_rl.runtime.failures import RunFaultError, describe_error, disk_full
from moe_rl.runtime.fault_hooks import kill_point

if TYPE_CHECKING:
    from moe_rl.learner.engine import Learner

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
__all__ = [
    "META_FILE",
    "CheckpointError",
    "is_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_saved_component",
    "read_meta",
    "save_checkpoint",
    "start_checkpoint",
]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 and raise its failure on every rank (as a CheckpointError), so no
    rank waits at a barrier for a rank that gave up."""
    problem = ""
    if _rank() == 0:
        try:
            fn()
        except CheckpointError as e:
            problem = str(e)
        except OSError as e:
            problem = f"cannot write the checkpoint: {describe_error(e)}"
        except Exception as e:
            problem = f"could not save the checkpoint: {describe_error(e)}"
    problem = broadcast_object(problem, src=0)
    if problem:
        raise CheckpointError(problem)


# --------------------------------------------------------------------------- save


def _prepare_target(path: Path, tmp: Path, replace_foreign: bool) -> None:
    """Rank 0: the parent exists, `path` is absent or a checkpoint (or may be replaced),
    stale temps of this name are gone, the temp directory is created."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; move it or choose another path")
    if path.exists() and not replace_foreign and not is_checkpoint(path) and any(path.iterdir()):
        raise CheckpointError(f"{path} exists and is not a moe_rl checkpoint; it is not replaced: "
                              "choose another output path (or remove it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_temps(path.parent, glob.escape(path.name))
    tmp.mkdir()


def _finish(recipe: Mapping[str, Any], tmp: Path, path: Path, meta: dict[str, Any], digests: dict) -> None:
    """Rank 0: moe_rl.json, config.yaml, the manifest (last), then the rename."""
    atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2) + "\n")
    kill_point("save.meta")
    save_config(recipe, tmp / "config.yaml")
    kill_point("save.config")
    digests.update(digest_files(tmp, [META_FILE]))
    write_manifest(tmp, digests)
    kill_point("save.manifest")
    rename_into_place(tmp, path)
    VERIFIED.add(path)  # what this process wrote needs no re-hash by its next reader (the export)
    kill_point("save.renamed")


def _saving(path: Path, tmp: Path) -> contextlib.AbstractContextManager:
    """Any failure of a save becomes a one-line CheckpointError (a full disk named as such)
    and leaves nothing of the save (rank 0 removes the temp directory)."""

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        except (Exception, CheckpointException) as e:
            full = disk_full(e, tmp)
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise CheckpointError(f"disk full while saving checkpoint {path}: free space on that file system "
                                      "or choose another run.output_dir (nothing was kept of this save)") from e
            raise CheckpointError(f"could not save checkpoint {path}: {describe_error(e)}") from e

    return guard()


class PendingSave:
    """A checkpoint being written (`start_checkpoint`): its data files are written now or in
    the background; `finish` (collective) then writes moe_rl.json, config.yaml and the
    manifest, last, and renames the temp directory into place. Until then the checkpoint
    does not exist for `latest_checkpoint`; `abandon` leaves only the temp directory, which
    the run directory removes at its next start."""

    def __init__(self, path: Path, tmp: Path, write: DcpWrite, meta: dict[str, Any], recipe: Mapping[str, Any],
                 start_seconds: float) -> None:
        self.path, self.tmp, self._write, self._meta, self._recipe = path, tmp, write, meta, recipe
        self.started = time.monotonic()
        """When the save began (time.monotonic())."""
        self.seconds = start_seconds
        """The save's own duration so far: its start, then (once finished) the writing of the
        data files and the finish, not the steps a background write overlapped."""

    @property
    def step(self) -> int:
        """The trainer step saved (the loop's `trainer_step`, else the learner's update count)."""
        return int(self._meta.get("trainer_step", self._meta["step"]))

    def done(self) -> bool:
        """This rank's data files are written (the others may still be writing theirs)."""
        return self._write.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for this rank's data files; whether they are written."""
        return self._write.wait(timeout)

    def finish(self) -> Path:
        """Collective: complete the checkpoint and make it visible; returns its path."""
        self._write.wait()
        t0 = time.perf_counter()
        with _saving(self.path, self.tmp):
            self._write.finish()
            kill_point("save.dcp")
            _barrier()
            digests: dict = {}
            for part in all_gather_object(self._write.digests):  # (the data files, hashed by their writers)
                digests.update(part)
            rest = [n for n in list_files(self.tmp) if n != META_FILE and n not in digests]
            for part in all_gather_object(digest_files(self.tmp, share(rest, _rank(), _world()))):
                digests.update(part)
            _on_rank0(lambda: _finish(self._recipe, self.tmp, self.path, self._meta, digests))
        _barrier()
        self.seconds += self._write.write_seconds + time.perf_counter() - t0
        return self.path

    def abandon(self) -> None:
        """Give up on this save: nothing more is written under its name (a background write
        still running ends with the process; its temp directory is removed at the next start)."""
        log.warning("abandoned checkpoint %s (step %d) before it was complete; the previous checkpoint stays the "
                    "latest", self.path, self.step)


def start_checkpoint(
    learner: Learner,
    path: str | os.PathLike,
    extra_meta: dict[str, Any] | None = None,
    include_optimizer: bool = True,
    *,
    recipe: Mapping[str, Any],
    replace_foreign: bool = False,
    components: Mapping[str, Any] | None = None,
    background: bool = False,
) -> PendingSave:
    """Collective. Begin saving model, optimizer, LR schedule, RNG and `recipe` to `path`
    as `save_checkpoint` does, and return the save to `finish`. With `background`, this
    rank's data files are written by a thread while the caller goes on (training may change
    the weights meanwhile: the thread writes a copy taken now; at most the host memory of
    this rank's shard); without, they are written before this returns."""
    if recipe.get("model") != to_dict(learner.model_cfg):
        raise ValueError("save_checkpoint: recipe's model is not the learner's model section (config.yaml would "
                         "describe another model than the weights)")
    t0 = time.perf_counter()
    path = Path(path)
    components = dict(components or {})
    _refuse_nonfinite(learner, path, components)
    tmp = Path(broadcast_object(f"{path}.tmp-{uuid.uuid4().hex[:8]}", src=0))
    _on_rank0(lambda: _prepare_target(path, tmp, replace_foreign))
    _barrier()
    kill_point("save.begin")
    with _saving(path, tmp):
        with_opt = include_optimizer and has_optimizer_state(learner)
        optimizers = frozenset(n for n, m in components.items() if include_optimizer and has_optimizer_state(m))
        sd = sharded_state(learner, with_optimizer=with_opt, with_rng=True, loading=False, components=components,
                            optimizers=optimizers)
        write = DcpWrite(sd, tmp, background=background)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": learner.step,
        "layout": layout_tag(learner),
        "has_optimizer": with_opt,
        "scheduler": learner.scheduler.state_dict() if with_opt and learner.scheduler is not None else None,
        **_trainable_meta(learner),
        **(extra_meta or {}),
    }
    for name, model in components.items():
        meta[name] = component_meta(model, name in optimizers)
    return PendingSave(path, tmp, write, meta, recipe, time.perf_counter() - t0)


def _trainable_meta(learner: Learner) -> dict[str, Any]:
    """With LoRA or frozen groups: what trains (adapters, frozen groups) and where the frozen
    base weights came from (`base_origin`: the starting checkpoint or Hugging Face
    directory, carried over resumes; None for a fresh initialisation)."""
    m = learner.model_cfg
    if not m.lora.enabled and not m.freeze:
        return {}
    return {"trainable": {"lora_rank": m.lora.rank, "lora_modules": list(m.lora.modules), "freeze": list(m.freeze)},
            "base_origin": getattr(learner, "base_origin", None)}


def _refuse_nonfinite(learner: Learner, path: Path, components: Mapping[str, Any]) -> None:
    """Collective: no checkpoint is ever written with a NaN or inf weight (the learner skips
    such updates, so one here is a defect or a damaged start); nothing of the save exists yet."""
    for name, model in {"model": learner, **components}.items():
        bad = nonfinite_parameter(model.gpt)
        if bad is not None:
            raise RunFaultError(f"refusing to save checkpoint {path}: {name} parameter {bad} holds NaN or inf; the "
                                "latest checkpoint stays the newest valid one: resume from it (run.resume=true)",
                                everywhere=True)


def save_checkpoint(
    learner: Learner,
    path: str | os.PathLike,
    extra_meta: dict[str, Any] | None = None,
    include_optimizer: bool = True,
    *,
    recipe: Mapping[str, Any],
    replace_foreign: bool = False,
    components: Mapping[str, Any] | None = None,
) -> Path:
    """Collective. Write model, optimizer, LR schedule, RNG and `recipe` (the resolved run
    config's plain data, `moe_rl.config.to_dict`, saved as config.yaml: what a resume
    compares and the converters read; its model section is the learner's) to `path` atomically
    (`include_optimizer=False`: model and RNG only, e.g. a shipped base model). An existing
    checkpoint at `path` is replaced once the new one is complete; an existing directory
    that is not a checkpoint is refused unless `replace_foreign` (the converter's --force).
    `components`: named models trained beside the actor (PPO's `{"critic": Critic}`), each
    saved under keys of its own with its optimizer, schedule and step. A full disk, an
    unwritable directory or a file in the way is a one-line CheckpointError."""
    return start_checkpoint(learner, path, extra_meta, include_optimizer, recipe=recipe,
                            replace_foreign=replace_foreign, components=components).finish()


# --------------------------------------------------------------------------- load


def _verify(path: Path, trust: bool) -> bool:
    """Collective. Check the manifest (each rank hashes its share of the files) before any
    file is read; returns whether to read restricted (True unless trusted). A checkpoint
    without a manifest passes only on trust. Every rank takes part in the gather, also one
    that verified (or wrote) this checkpoint before, so none waits for another."""
    if trust and not (path / MANIFEST_FILE).is_file():
        log.warning("checkpoint %s has no %s; loading it because it is trusted (run.trust_checkpoint / --trust)",
                    path, MANIFEST_FILE)
        return False
    mine = None if path in VERIFIED else verify_share(path, _rank(), _world())
    problem = next((p for p in all_gather_object(mine) if p), None)
    if problem:
        raise CheckpointError(problem)
    VERIFIED.add(path)
    return not trust


def _load_files(learner: Learner, path: Path, sd: dict, restricted: bool) -> dict:
    if restricted:
        load_metadata(path / ".metadata")  # refused here, in one line (DCP would log a traceback and retry)
    reading = safe_dcp_reading() if restricted else contextlib.nullcontext()
    try:
        with reading:
            # log_unexpected: entries the model asks for that the checkpoint lacks are dropped
            # before the read (a checkpoint made with the local spec has none of the TE spec's
            # fp8 `_extra_state`); a missing *parameter* is caught by load_checkpoint's check.
            return dist_checkpointing.load(sd, str(path), strict="log_unexpected")
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"could not load {path}: {describe_error(e)}") from e


def load_checkpoint(
    learner: Learner,
    path: str | os.PathLike,
    *,
    load_optimizer: bool = True,
    strict: bool = True,
    trust: bool = False,
    components: Mapping[str, Any] | None = None,
    missing_hint: str = "",
    optional: tuple[str, ...] = (),
    restore_rng: bool = True,
    adapters_optional: bool = False,
) -> dict[str, Any]:
    """Collective. Load `path` (saved at any layout) into the learner, after checking its
    manifest (`trust=True` accepts a checkpoint without one). Optimizer state and LR
    schedule are restored when present and asked for; RNG states when `restore_rng` and the
    layout is the one the checkpoint was saved at (a resume; starting weights leave the
    run's own seeded RNG alone). `components`: the named models saved beside the actor
    (PPO's `{"critic": Critic}`: weights, optimizer, schedule and step); a checkpoint that
    lacks one is a one-line error ending with `missing_hint`. `optional`: parameter-name
    prefixes the checkpoint may lack (a critic started from the actor's weights has no value
    head in them). `adapters_optional`: LoRA adapters the checkpoint lacks keep their initial
    values (a LoRA run starting from a full model's weights). Returns the checkpoint's metadata."""
    path = Path(path)
    components = dict(components or {})
    restricted, meta = _checked_meta(path, trust, list(components), missing_hint)
    same_layout = meta.get("layout") == layout_tag(learner)
    with_rng = restore_rng and same_layout
    want_opt = load_optimizer and learner.optimizer is not None and meta.get("has_optimizer", False)
    optimizers = frozenset(n for n in components if load_optimizer and meta[n].get("has_optimizer", False))
    sd = sharded_state(learner, with_optimizer=want_opt, with_rng=with_rng, loading=True, components=components,
                        optimizers=optimizers)
    saved_adapters = bool(meta.get("trainable", {}).get("lora_rank"))
    sd["model"] = {k: v for k, v in sd["model"].items()  # (not asked of the files)
                   if not k.startswith(optional) and not (adapters_optional and not saved_adapters and is_lora_name(k))}
    loaded = _load_files(learner, path, sd, restricted)
    _load_weights(learner, loaded["model"], path, strict, optional, adapters_optional)
    _load_optimizer(learner, loaded.get("optimizer"), meta.get("scheduler") if want_opt else None, want_opt)
    for name, model in components.items():
        _load_weights(model, _saved_weights(loaded, name), path, strict, optional)
        _load_optimizer(model, loaded.get(f"{name}_optimizer"), meta[name].get("scheduler"), name in optimizers)
        model.step = int(meta[name].get("step", 0))
    if restore_rng:
        _restore_rng(loaded, same_layout, path, meta, learner)
    learner.step = int(meta.get("step", 0))
    learner.base_origin = meta.get("base_origin") or str(path.resolve())
    return meta


def load_saved_component(model: Any, path: str | os.PathLike, name: str, *, trust: bool = False,
                         missing_hint: str = "") -> None:
    """Collective. Load the component `name` saved beside a run's actor in `path` (its
    weights; not its optimizer, schedule or RNG) into `model`, at any layout: e.g. the
    starting critic of another run (a value-pretraining run's, `critic.init_checkpoint`)."""
    path = Path(path)
    restricted, _ = _checked_meta(path, trust, [name], missing_hint)
    loaded = _load_files(model, path, {name: model.gpt.sharded_state_dict(prefix=f"{name}.")}, restricted)
    _load_weights(model, _saved_weights(loaded, name), path, True, ())
    _load_optimizer(model, None, None, wanted=False)  # (fp32 master copies follow the weights)
    model.step = 0


def _checked_meta(path: Path, trust: bool, needed: list[str], hint: str) -> tuple[bool, dict[str, Any]]:
    """Collective. (read restricted?, metadata) of a checkpoint whose manifest checks out;
    each component in `needed` must be in it, else a one-line error ending with `hint`."""
    if not is_checkpoint(path):
        read_meta(path)  # raises the one-line error naming what is missing
    restricted = _verify(path, trust)
    meta = read_meta(path)
    for name in needed:
        if name not in meta:
            raise CheckpointError(f"checkpoint {path} holds no {name}" + (f" ({hint})" if hint else ""))
    return restricted, meta


def _saved_weights(loaded: dict, name: str) -> dict:
    """Component `name`'s model state dict from loaded files (its keys carry `<name>.`)."""
    return {k.removeprefix(f"{name}."): v for k, v in loaded[name].items()}


def _load_weights(learner: Learner, model_sd: dict, path: Path, strict: bool, optional: tuple[str, ...],
                  adapters_optional: bool = False) -> None:
    missing, _unexpected = learner.gpt.load_state_dict(model_sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith(optional)
               and not (adapters_optional and is_lora_name(k))]
    if strict and missing:
        raise CheckpointError(f"checkpoint {path} lacks parameters {missing[:5]} (model config differs?)")


def _load_optimizer(learner: Learner, state: Any, scheduler: dict | None, wanted: bool) -> None:
    if wanted:
        if learner.optimizer is None or learner.scheduler is None:
            raise CheckpointError("a frozen learner (no optimizer) cannot load an optimizer state")
        learner.optimizer.load_state_dict(state)
        if scheduler is not None:
            note = schedule_kept_note(scheduler, learner.scheduler)
            learner.scheduler.load_state_dict(scheduler)
            if note:
                log.warning("%s", note)
    elif learner.optimizer is not None:
        # Weights only: mixed-precision optimizers keep fp32 master copies of the params,
        # which must follow the weights just loaded (a no-op for fp32 training).
        learner.optimizer.reload_model_params()


def _restore_rng(loaded: dict, same_layout: bool, path: Path, meta: dict, learner: Learner) -> None:
    rng = loaded.get("rng_state")
    # megatron's tracker holds CUDA generator states on a GPU and (through the CPU shims) CPU
    # generator states on the host; the two differ in size and never load into each other.
    saved_on_gpu = rng is not None and rng.get("cuda") is not None
    if same_layout and rng is not None and saved_on_gpu != torch.cuda.is_available():
        log.info("checkpoint %s was saved on %s: its RNG states are not restored on %s", path,
                 *(("a GPU", "the CPU") if saved_on_gpu else ("the CPU", "a GPU")))
    elif same_layout and rng is not None:
        torch.set_rng_state(rng["cpu"])
        if saved_on_gpu:
            torch.cuda.set_rng_state(rng["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
    elif not same_layout:
        log.info("checkpoint %s saved at layout %s, loading at %s: RNG states not restored",
                 path, meta.get("layout"), layout_tag(learner))
