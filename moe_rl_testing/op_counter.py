"""Counting a learner pass's aten operations and the host-device synchronisations they would
cost on a GPU, on a CPU (used by bench_host_overhead and tests/unit/learner/test_host_overhead.py).

    with OpCounter(learner) as counter:       # the learner's own weights, grads, Adam states: "device"
        learner.update(batch, loss_fn, plan)
    counter.counts                             # Counter[(region, owner, area, kind)]

On a CPU every tensor is a host tensor, so which of them would live on a GPU is tracked
(taint): the model's parameters, gradient buffers and optimizer states, whatever
megatron-core creates on `torch.cuda.current_device()`, what the learner moves with
`.to(device)` (the learner's GPU branch that moves each micro-batch to the device is taken),
and every output of an operation with a device input. A device tensor reports its device as
`cpu:0` (a host tensor: `cpu`), so code that moves a tensor "to where that one is" behaves
as on a GPU, and a `.to(...)` that would copy between host and device does copy.

Sync-class operations are those that make the host wait for the device's queue when their
input is a device tensor: `_local_scalar_dense` (item, bool, int, float), `nonzero`,
`masked_select`, boolean-mask indexing and assignment, `unique`, `repeat_interleave`
without `output_size`, `bincount`, `equal`, copies to the host (`.cpu()`, a blocking
`.to("cpu")`, `tolist`, `numpy`), and blocking copies to the device (`.to(device)` without
`non_blocking`, `torch.tensor(data, device=...)`, `new_tensor`: torch waits for the copy,
so for the queue before it; found on an H200 by bench/device/gpu_sync_check.py). A
`.to("cpu", non_blocking=True)` lands in pinned memory on a GPU without waiting and is
counted apart (`d2h_async`), as are non-blocking host-to-device copies (`h2d`).

Each operation is charged to the innermost Python frame outside torch, the standard library
and the CPU shims (for an autograd backward op: the frame that made the forward op, from
anomaly mode's traceback): `moe_rl/...` is the project, split by area; `megatron/...` is
megatron.
Regions: "mb" inside megatron's `forward_step` / `backward_step` (one micro-batch's forward,
loss and backward), "step" everywhere else in the measured call.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import sysconfig
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

DEV = torch.device("cpu", 0)
"""What a device tensor reports as its device (a host tensor: plain `cpu`)."""
HOST = torch.device("cpu")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_HERE = os.path.abspath(__file__)
_SHIMS = os.path.join("moe_rl", "learner", "megatron_patches") + os.sep
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')

AREAS = (
    ("routing taps", ("learner/routing/taps.py", "learner/routing/state.py", "learner/routing/tokens.py",
                      "learner/routing/compare.py", "moe_rl/routing/")),
    ("replay checks", ("learner/routing/checks.py",)),
    ("chunked head", ("learner/chunked_logprobs.py", "learner/output_head.py", "learner/logprobs.py")),
    ("packing", ("learner/model_input.py", "learner/microbatch.py")),
    ("packed attention (CPU only)", ("learner/packed_attention.py",)),
    ("loss", ("objectives/", "update.py")),
)
CPU_ONLY_AREAS = ("packed attention (CPU only)",)
"""Project code a GPU does not run: Transformer Engine's THD attention replaces it."""

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "unique_dim_consecutive", "bincount", "equal"}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
_FROM_DATA = {"tensor", "as_tensor", "asarray"}
"""Factories that copy host data: on a GPU device, a blocking copy (a wait)."""


def classify(path: str) -> tuple[str, str]:
    """(owner, area) of a source file: project (split by area), megatron, or other."""
    path = path.replace(os.sep, "/")
    if "/moe_rl/" in path:
        rel = path.rsplit("/moe_rl/", 1)[1]
        for area, prefixes in AREAS:
            if any(rel.startswith(p) for p in prefixes):
                return "project", area
        return "project", "other"
    if "/megatron/" in path:
        return "megatron", "megatron"
    return "other", "other"


def _skipped(path: str) -> bool:
    """Frames passed over: torch, the standard library, this counter, and the CPU shims,
    which stand in for megatron-core's GPU-only code (their ops are their caller's)."""
    return (path.startswith(_TORCH_DIR) or path.startswith(_STDLIB) or path == _HERE or path.startswith("<")
            or _SHIMS in path)


def _is_engine_frame(code: Any) -> bool:
    """A frame of torch's autograd engine entry: ops below it with no frame of their own
    are backward nodes of forward ops."""
    return code.co_filename.startswith(_TORCH_DIR) and code.co_name in ("_engine_run_backward", "run_backward")


class Taint:
    """Which tensors would live on the device: keyed by storage address (views share it),
    by the tensor object for storage-less (empty) tensors."""

    def __init__(self) -> None:
        self.ptrs: set[int] = set()
        self.empty = WeakTensorKeyDictionary()

    @staticmethod
    def _ptr(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return 0

    def is_dev(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        p = self._ptr(t)
        return p in self.ptrs if p else bool(self.empty.get(t, False))

    def mark(self, t: Any, dev: bool) -> None:
        if not isinstance(t, torch.Tensor):
            return
        p = self._ptr(t)
        if p:
            (self.ptrs.add if dev else self.ptrs.discard)(p)
        else:
            self.empty[t] = dev


def _is_dev_target(device: Any) -> bool | None:
    """True: the compute device; False: the host; None: not a device argument."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return device.type != "cpu" or device.index is not None
    return None


def _to_target(args: tuple, kwargs: dict, taint: Taint) -> tuple[bool | None, bool]:
    """(device target of a `Tensor.to(...)` call, non_blocking)."""
    target = _is_dev_target(kwargs.get("device"))
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            target = taint.is_dev(a)
        elif target is None:
            target = _is_dev_target(a)
    non_blocking = bool(kwargs.get("non_blocking", False)) or any(a is True for a in args[1:])
    return target, non_blocking


def _real_device_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with every device argument mapped to the CPU (a 'cuda' one would fail here)."""
    def fix(a: Any) -> Any:
        return HOST if _is_dev_target(a) is not None and not isinstance(a, int) else a
    return tuple(fix(a) for a in args), {k: (fix(v) if k == "device" else v) for k, v in kwargs.items()}


class OpCounter:
    """Counts aten ops and sync-class ops while active (see the module docstring)."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner
        self.taint = Taint()
        self.counts: Counter[tuple[str, str, str, str]] = Counter()
        """(region, owner, area, kind) -> count; kind: op, dev_op, launch, sync, h2d, d2h_async."""
        self.syncs: Counter[tuple[str, str, str, str]] = Counter()
        """(region, area, file:line, what) -> count of sync-class ops."""
        self.lines: Counter[tuple[str, str, str]] = Counter()
        """(region, op or dev_op, file:line) -> the project's ops (device ops) made there."""
        self.mixed: Counter[tuple[str, str]] = Counter()
        """(op, file:line) -> device ops with a host operand (should stay empty)."""
        self.microbatches = 0
        self.region = "step"
        self.force_dev = False
        self.suspended = False
        self._stack = contextlib.ExitStack()

    # ------------------------------------------------------------------ recording

    def where(self) -> tuple[str, int]:
        """The innermost frame outside torch and the standard library (see the docstring)."""
        f = sys._getframe(2)
        while f is not None:
            code = f.f_code
            if _is_engine_frame(code):
                return self._forward_frame()
            if not _skipped(code.co_filename):
                return code.co_filename, f.f_lineno
            f = f.f_back
        return "<none>", 0

    @staticmethod
    def _forward_frame() -> tuple[str, int]:
        node = torch._C._current_autograd_node()
        stack = node.metadata.get("traceback_") if node is not None else None
        for entry in reversed(stack or []):
            m = _FRAME_RE.search(entry)
            if m and not _skipped(m.group(1)):
                return m.group(1), int(m.group(2))
        return "<autograd>", 0

    def record(self, kind: str, what: str = "", where: tuple[str, int] | None = None) -> None:
        path, line = where or self.where()
        owner, area = classify(path)
        self.counts[(self.region, owner, area, kind)] += 1
        if kind in ("op", "dev_op") and owner == "project":
            self.lines[(self.region, kind, f"{_short(path)}:{line}")] += 1
        if kind == "sync":
            self.syncs[(self.region, f"{owner}/{area}", f"{_short(path)}:{line}", what)] += 1

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        was, self.suspended = self.suspended, True
        try:
            yield
        finally:
            self.suspended = was

    # ------------------------------------------------------------------ activation

    def __enter__(self) -> OpCounter:
        self._seed()
        self._patch()
        self._stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        self._stack.enter_context(_FunctionMode(self))
        self._stack.enter_context(_DispatchMode(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _seed(self) -> None:
        """The learner's weights, gradient buffers and optimizer states live on the device."""
        seen: set[int] = set()
        for root in (self.learner.model, self.learner.optimizer):
            for t in _tensors_in(root, seen):
                self.taint.mark(t, True)

    def _patch(self) -> None:
        import megatron.core.pipeline_parallel.schedules as schedules

        import moe_rl.learner.engine as engine
        import moe_rl.learner.megatron_patches.cpu_torch as shims

        def in_microbatch(fn: Any, counts: bool) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                was, self.region = self.region, "mb"
                self.microbatches += int(counts)
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.region = was
            return wrapped

        self._set(schedules, "forward_step", in_microbatch(schedules.forward_step, True))
        self._set(BackwardCFunction, "_get_user_fn", self._backward_in_mode(BackwardCFunction._get_user_fn))
        self._set(schedules, "backward_step", in_microbatch(schedules.backward_step, False))
        self._set(shims, "_CPU", DEV)  # megatron's torch.cuda.current_device()
        import moe_rl.learner.parallel as parallel

        def waits() -> None:  # (a no-op without CUDA: on a GPU it waits for the queue)
            self.record("sync", "wait_for_device")
            return wait()

        wait = getattr(parallel, "wait_for_device", None)  # (a baseline's learner may have none)
        for name, module in list(sys.modules.items()):
            if wait is not None and name.startswith("moe_rl.") and getattr(module, "wait_for_device", None) is wait:
                self._set(module, "wait_for_device", waits)
        self._set(engine, "torch", _TorchOnGpu("torch"))  # the learner's GPU branch

    def _backward_in_mode(self, get_user_fn: Any) -> Any:
        """A custom autograd Function's backward runs without the forward's torch-function
        mode (the engine does not carry it): enter it again there."""
        def get(node: Any) -> Any:
            user_fn = get_user_fn(node)

            def backward(*args: Any) -> Any:
                with _FunctionMode(self):
                    return user_fn(*args)
            return backward
        return get

    def _set(self, obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        self._stack.callback(setattr, obj, name, old)


def _short(path: str) -> str:
    path = path.replace(os.sep, "/")
    for root in ("/moe_rl/", "/megatron/"):
        if root in path:
            return root.strip("/") + "/" + path.rsplit(root, 1)[1]
    return os.path.basename(path)


def _tensors_in(obj: Any, seen: set[int], depth: int = 6) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, dicts, lists and modules."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        for name in ("main_grad", "grad"):
            extra = getattr(obj, name, None)
            if isinstance(extra, torch.Tensor):
                yield extra
        return
    if isinstance(obj, torch.nn.Module):
        for t in [*torch.nn.Module.parameters(obj), *torch.nn.Module.buffers(obj)]:
            yield from _tensors_in(t, seen, depth)
        for m in obj.modules():  # plain tensor attributes (rotary frequencies, ...)
            yield from (t for t in vars(m).values() if isinstance(t, torch.Tensor))
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__.split(".")[0] in (
            "megatron", "torch", "moe_rl"):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _tensors_in(child, seen, depth - 1)


class _TorchOnGpu(type(torch)):  # type: ignore[misc]
    """`torch` as the learner's engine sees it while counting: a GPU is there (device 0)."""

    cuda = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _shares(a: torch.Tensor, others: list[torch.Tensor]) -> bool:
    p = Taint._ptr(a)
    return bool(p) and any(Taint._ptr(o) == p for o in others)


class _FunctionMode(TorchFunctionMode):
    """Moves between host and device (`.to`, `.cpu`, factories with a device), host reads
    (`tolist`, `numpy`) and the device a device tensor reports."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.c = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        c = self.c
        if c.suspended:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is torch._C.TensorBase.device:
            return DEV if c.taint.is_dev(args[0]) else func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and name in ("to", "cpu", "cuda"):
            if name == "to":
                target, non_blocking = _to_target(args, kwargs, c.taint)
            else:
                target, non_blocking = name == "cuda", bool(kwargs.get("non_blocking", False))
            return self._move(func, args, kwargs, target, non_blocking)
        if src is not None and name in ("tolist", "numpy", "__array__") and c.taint.is_dev(src):
            c.record("sync", f".{name}()")
        if src is not None and name == "new_tensor" and c.taint.is_dev(src) and not any(
                c.taint.is_dev(t) for t in tree_flatten((args[1:], kwargs))[0] if isinstance(t, torch.Tensor)):
            c.record("sync", ".new_tensor(host data)")  # (a blocking copy of the data to the device)
        if "device" in kwargs and _is_dev_target(kwargs["device"]) is not None:
            return self._create(func, args, kwargs, bool(_is_dev_target(kwargs["device"])))
        out = func(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]):
            for o in tree_flatten(out)[0]:  # (from Python data or numpy: a host tensor, maybe at a
                c.taint.mark(o, c.force_dev)  # freed device tensor's address)
        return out

    def _move(self, func: Any, args: tuple, kwargs: dict, target: bool | None, non_blocking: bool) -> Any:
        c, src = self.c, args[0]
        if func.__name__ == "cuda":
            func, args = torch.Tensor.to, (src, HOST)
        rargs, rkw = _real_device_args(args, kwargs)
        out = func(*rargs, **rkw)
        src_dev = c.taint.is_dev(src)
        if target is None or target == src_dev:
            return out
        c.record("h2d" if target else ("d2h_async" if non_blocking else "sync"),
                 "" if target else ".to(cpu)" if func.__name__ == "to" else ".cpu()")
        if target and not non_blocking:  # (a blocking copy waits for the device's queue to reach it)
            c.record("sync", "blocking copy to the device")
        if _shares(out, [src]):  # on a GPU this is a copy
            with c.suspend():
                out = out.clone()
        c.taint.mark(out, target)
        return out

    def _create(self, func: Any, args: tuple, kwargs: dict, target: bool) -> Any:
        c = self.c
        rargs, rkw = _real_device_args(args, kwargs)
        was, c.force_dev = c.force_dev, target
        try:
            out = func(*rargs, **rkw)
        finally:
            c.force_dev = was
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if isinstance(out, torch.Tensor) and _shares(out, inputs) and c.taint.is_dev(out) != target:
            c.record("h2d" if target else "sync", "" if target else f"{func.__name__}(device=cpu)")
            with c.suspend():
                out = out.clone()  # (on a GPU, a copy)
        if target and getattr(func, "__name__", "") in _FROM_DATA and not (inputs and c.taint.is_dev(inputs[0])):
            c.record("sync", f"{func.__name__}(host data, device=...)")  # (a blocking copy of the data)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                c.taint.mark(o, target)
        return out


class _DispatchMode(TorchDispatchMode):
    """Every aten op: counted, its fresh outputs tainted like its inputs, syncs flagged."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        c = self.c
        if c.suspended:
            return func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        fresh = func.__name__.startswith("lift_fresh")  # (torch.tensor(data): its own input, just made)
        dev = c.force_dev or (not fresh and any(c.taint.is_dev(t) for t in inputs))
        out = func(*args, **kwargs)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and (fresh or not _shares(o, inputs)):
                c.taint.mark(o, dev)
        where = c.where()
        c.record("op", where=where)
        if dev:
            c.record("dev_op", where=where)
            if not func.is_view:
                c.record("launch", where=where)
            if not c.force_dev and self._mixed(func, inputs):
                c.record("mixed", where=where)
                c.mixed[(func.__name__, f"{_short(where[0])}:{where[1]}")] += 1
            what = self._sync(func, args, kwargs)
            if what:
                c.record("sync", what, where=where)
            elif func.__name__.startswith("copy_"):
                dst_dev, src_dev = c.taint.is_dev(args[0]), c.taint.is_dev(args[1])
                if src_dev and not dst_dev:
                    c.record("sync", "copy_ to host", where=where)
                elif dst_dev and not src_dev:
                    c.record("h2d", where=where)
                    blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
                    if blocking and args[1].dim() > 0:  # (a host scalar is filled in, not copied)
                        c.record("sync", "blocking copy_ to the device", where=where)
        return out

    def _mixed(self, func: Any, inputs: list[torch.Tensor]) -> bool:
        """A device op with a host operand of more than one element: on a GPU an error (or,
        for an index, a copy), so a sign that the taint missed a move (a check of this file)."""
        if func.__name__.split(".")[0] in ("copy_", "index", "index_put", "index_put_", "_index_put_impl_",
                                           "lift_fresh", "_to_copy"):
            return False
        return any(t.dim() > 0 and t.numel() > 1 and not self.c.taint.is_dev(t) for t in inputs)

    @staticmethod
    def _sync(func: Any, args: tuple, kwargs: dict) -> str:
        """What makes this device op wait for the device ('' if nothing)."""
        name = func._schema.name.split("::")[-1]
        if name in _SYNC_OPS:
            return name
        if name in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                return f"{name} with a bool mask"
        if name == "repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
        return ""
