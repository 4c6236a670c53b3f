"""megatron-core's CUDA assumptions answered for the CPU, without touching `torch.cuda` itself.

megatron-core asks `torch.cuda` for the current device, streams, events and RNG states, and
builds a few scalars with `device="cuda"`. We do not patch `torch.cuda`: vLLM and
transformers run in the same process and must keep seeing the real (CUDA-less) torch.
Instead each loaded megatron module's global name `torch` is pointed at `_CpuTorch`, a thin
view of torch whose `cuda` namespace answers for the CPU and whose tensor factories map a
CUDA device to the CPU. Everything else megatron-core does runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any

import torch

UPSTREAM = ("megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.serialization",
            "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.distributed",
            "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer",
            "megatron.core.pipeline_parallel.schedules", "megatron.core.tensor_parallel",
            "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.moe.router_replay",
            "megatron.core.transformer.moe.token_dispatcher")
"""The megatron-core modules the learner uses, imported before the redirect so it reaches
them all (a module imported after it would still see real torch)."""

_CPU = torch.device("cpu")


def _to_cpu_device(device: Any) -> Any:
    """Map 'cuda', 'cuda:N', torch.device('cuda'), or a bare device index to the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _NoStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:
        return self

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


_THE_STREAM = _NoStream()


class _CpuCuda(types.SimpleNamespace):
    """The `torch.cuda` megatron-core sees on CPU.

    current_device() returns torch.device('cpu') so that megatron's many
    `device=torch.cuda.current_device()` arguments place tensors on the CPU. RNG calls go to
    the CPU generator: on a CPU-only machine that is the device RNG. Streams and events are
    no-ops. Anything not listed falls through to the real torch.cuda.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_cpu_cuda = _CpuCuda(
    current_device=lambda: _CPU,
    device_count=lambda: 1,
    is_available=lambda: False,
    Stream=_NoStream,
    Event=_NoStream,
    current_stream=lambda device=None: _THE_STREAM,
    default_stream=lambda device=None: _THE_STREAM,
    stream=lambda s=None: contextlib.nullcontext(),
    synchronize=lambda device=None: None,
    empty_cache=lambda: None,
    get_rng_state=lambda device="cuda": torch.get_rng_state(),
    set_rng_state=lambda state, device="cuda": torch.set_rng_state(state),
    manual_seed=lambda seed: torch.manual_seed(seed),
    manual_seed_all=lambda seed: torch.manual_seed(seed),
    memory_allocated=lambda device=None: 0,
    max_memory_allocated=lambda device=None: 0,
    reset_peak_memory_stats=lambda device=None: None,
    nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda: None),
)

# Tensor factories megatron calls with device="cuda" (optimizer scalars, clip-grad norms,
# schedule token counters, checkpoint verification flags).
_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor",
)


def _cpu_factory(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """`torch` as megatron-core modules see it on CPU: real torch except `cuda` and the
    device argument of tensor factories. Looked-up attributes are cached on the instance, so
    the indirection costs one dict lookup after the first access."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cpu_cuda
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


_cpu_torch = _CpuTorch()


def redirect_torch_in_megatron_modules() -> int:
    """Point every loaded megatron module's global `torch` at the CPU view."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if (name == "megatron" or name.startswith("megatron.")) and mod is not None:
            if getattr(mod, "torch", None) is torch:
                mod.torch = _cpu_torch  # type: ignore[attr-defined]  # (the patch: a module's global, not in its stub)
                n += 1
    return n


def import_megatron_modules() -> None:
    """Import the megatron-core modules the learner uses (`UPSTREAM`), so the redirect
    reaches them all."""
    import importlib

    for name in UPSTREAM:
        importlib.import_module(name)
