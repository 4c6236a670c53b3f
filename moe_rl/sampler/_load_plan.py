"""A group's weight loading recorded once and replayed as plain copies (the direct route's
`load` part, `_direct_reload.py`).

vLLM's loaders are general: each push runs the model's `load_weights` walk (module
recursion, name mapping, per-expert loaders), yet for the same tensor names, shapes and
layout they do the same thing every time: copy a view of each incoming tensor into a view
of a model-format tensor. `record_plan` runs the loaders once under a dispatch mode that sees
every aten op, and keeps each copy as (incoming tensor, its view) -> (module tensor, its
view), both as offsets, sizes and strides, and each constant fill of a module tensor's view
(the vocabulary's padding rows). A group is not planned (its loaders run at every push)
when its loading does anything else: another write (`set_`, an in-place transform), a copy
from a tensor that is not one of the incoming ones (a computed value) or into a tensor that
is not one of the group's, a dtype-changing view, aliased tensors, a rebound or replaced
tensor, a read of a value (`.item()`, `torch.equal`: loading that branches on values). The
first replay is checked before the plan is trusted: the loaders run, their result is kept
aside, the written tensors are overwritten with a poison pattern, the replay must restore
every byte; a mismatch keeps the loaders for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]
Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(storage offset relative to the tensor's own, sizes, strides), in elements."""


def _geometry(view: torch.Tensor, base_offset: int) -> Geometry:
    return int(view.storage_offset()) - base_offset, tuple(view.size()), tuple(view.stride())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) elements of its storage a tensor covers."""
    start = int(t.storage_offset())
    return start, start + 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()) if n > 0)


def signature(tensors: Named) -> dict[str, tuple[Any, ...]]:
    """What a plan was recorded for: each incoming name's sizes, strides and dtype."""
    return {n: (tuple(t.size()), t.stride(), t.dtype) for n, t in tensors}


@dataclass
class LoadPlan:
    """One group's copies, in the loaders' order (module docstring)."""

    key: dict[str, tuple[Any, ...]]
    copies: list[tuple[str | float, Geometry | None, str, str, Geometry]]
    """(incoming name, its view; module path, tensor name, its view), or for a fill
    (the value, None; module path, tensor name, its view)."""
    loaded: set[str]
    """What the model's `load_weights` returned for the group."""
    trusted: bool = False
    """Set once a replay matched the loaders byte for byte."""
    written: set[tuple[str, str]] = field(init=False)
    """(module path, tensor name) of every tensor the copies and fills write."""

    def __post_init__(self) -> None:
        self.written = {(p, n) for _, _, p, n, _ in self.copies}

    def replay(self, root: torch.nn.Module, group: str, tensors: Named) -> set[str]:
        incoming, targets = dict(tensors), self._targets(root, group)
        for name, src_g, path, tname, dst_g in self.copies:
            dst = targets[path, tname]
            view = dst.as_strided(dst_g[1], dst_g[2], dst.storage_offset() + dst_g[0])
            if src_g is None:
                assert not isinstance(name, str)
                view.fill_(name)
            else:
                assert isinstance(name, str)
                src = incoming[name]
                view.copy_(src.as_strided(src_g[1], src_g[2], src.storage_offset() + src_g[0]))
        return set(self.loaded)

    def _targets(self, root: torch.nn.Module, group: str) -> dict[tuple[str, str], torch.Tensor]:
        # (detached: a norm's weight is a Parameter that requires grad, and the loaders write `.data`)
        return {pt: _module_tensor(root, group, *pt).detach() for pt in self.written}

    def snapshot(self, root: torch.nn.Module, group: str) -> dict[tuple[str, str], torch.Tensor]:
        """The written tensors' current values (to compare the loaders' against)."""
        return {pt: t.detach().clone() for pt, t in self._targets(root, group).items()}

    def poison(self, root: torch.nn.Module, group: str) -> None:
        """Overwrite the written tensors (0xA5 bytes), so a replay that misses a byte shows."""
        for t in self._targets(root, group).values():
            if t.is_contiguous():
                t.view(torch.uint8).fill_(0xA5)
            else:
                t.fill_(float("nan") if t.is_floating_point() else -1)

    def restore(self, root: torch.nn.Module, group: str, snap: dict[tuple[str, str], torch.Tensor]) -> None:
        """Put `snap`'s values back."""
        now = self._targets(root, group)
        for pt, t in snap.items():
            now[pt].copy_(t)

    def matches(self, root: torch.nn.Module, group: str, snap: dict[tuple[str, str], torch.Tensor]) -> bool:
        """Whether the written tensors hold `snap`'s bytes."""
        now = self._targets(root, group)
        return all(_same_bytes(now[pt], t) for pt, t in snap.items())


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_contiguous() and b.is_contiguous():  # (bitwise: NaN payloads and signed zeros count)
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


def _module_tensor(root: torch.nn.Module, group: str, path: str, name: str) -> torch.Tensor:
    module = root if path == group else root.get_submodule(path[len(group) + 1:] if group else path)
    tensor = getattr(module, name)
    assert isinstance(tensor, torch.Tensor)
    return tensor


_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                torch.ops.aten.equal.default}
"""Ops whose result depends on a tensor's values: loading that branches on them is not a
fixed set of copies."""


class _UnplannableError(Exception):
    pass


class _Recorder(TorchDispatchMode):
    """Sees the loaders' aten ops; keeps their copies (module docstring)."""

    def __init__(self, incoming: Named, targets: dict[int, tuple[str, str, torch.Tensor]]) -> None:
        super().__init__()
        self.incoming, self.targets = incoming, targets
        self.copies: list[tuple[str | float, Geometry | None, str, str, Geometry]] = []
        self.why: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if self.why is None:
            try:
                self._see(func, args)
            except _UnplannableError as e:
                self.why = str(e)
        return func(*args, **(kwargs or {}))

    def _see(self, func: Any, args: Sequence[Any]) -> None:
        if func is torch.ops.aten.copy_.default:
            name, tensor = self._source(args[1])
            path, tname, dst_g = self._target(args[0])
            self.copies.append((name, _geometry(args[1], int(tensor.storage_offset())), path, tname, dst_g))
        elif func is torch.ops.aten.fill_.Scalar or func is torch.ops.aten.zero_.default:
            path, tname, dst_g = self._target(args[0])
            value = args[1] if func is torch.ops.aten.fill_.Scalar else 0
            self.copies.append((value, None, path, tname, dst_g))
        elif func._schema.is_mutable or func in _VALUE_READS:
            raise _UnplannableError(f"the loaders call {func}")

    def _target(self, dst: torch.Tensor) -> tuple[str, str, Geometry]:
        target = self.targets.get(dst.untyped_storage().data_ptr())
        if target is None:
            raise _UnplannableError(f"a write into a tensor outside the group ({tuple(dst.shape)})")
        path, tname, base = target
        if dst.dtype != base.dtype:
            raise _UnplannableError(f"a dtype-changing view of {path}.{tname}")
        return path, tname, _geometry(dst, int(base.storage_offset()))

    def _source(self, src: torch.Tensor) -> tuple[str, torch.Tensor]:
        ptr, (lo, hi) = src.untyped_storage().data_ptr(), _span(src)
        found = [(n, t) for n, t in self.incoming
                 if t.untyped_storage().data_ptr() == ptr and _span(t)[0] <= lo and hi <= _span(t)[1]]
        if len(found) != 1 or found[0][1].dtype != src.dtype:
            raise _UnplannableError("a copy from a computed or ambiguous source")
        return found[0]


def record_plan(root: torch.nn.Module, group: str, tensors: Named,
           load: Callable[[Named], set[str]]) -> tuple[set[str], LoadPlan | None]:
    """Run `load` (the model's loaders) on a group's tensors and record its plan; the plan is
    None (with the reason logged) when the loading is not plain copies."""
    targets: dict[int, tuple[str, str, torch.Tensor]] = {}
    aliased = False
    for path, module in root.named_modules(prefix=group):
        for tname, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or t.is_meta or t.numel() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            aliased |= ptr in targets
            targets[ptr] = (path, tname, t)
    before = {k: v[2].data_ptr() for k, v in targets.items()}
    modules = dict(root.named_modules(prefix=group))
    recorder = _Recorder(tensors, targets)
    with recorder:
        loaded = load(tensors)
    why = recorder.why or ("aliased tensors" if aliased else None)
    if why is None and any(t.data_ptr() != before[k] or getattr(modules[p], n, None) is not t
                           for k, (p, n, t) in targets.items()):
        why = "the loaders rebound or replaced a tensor"
    if why is None and len({n for n, _ in tensors}) != len(tensors):
        why = "a name pushed twice"
    if why is not None:
        log.info("direct weight reload: %s loads through vLLM's loaders at every push (%s)", group, why)
        return loaded, None
    return loaded, LoadPlan(signature(tensors), recorder.copies, set(loaded))
