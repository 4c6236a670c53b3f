"""Run megatron-core on CPU: every CUDA assumption it makes, redirected, in one place.

megatron-core is written for CUDA. Its code asks `torch.cuda` for the current device,
streams, events and RNG states, and builds a few scalars with `device="cuda"`. On a machine
without CUDA (CI, laptops) those calls fail. We do not patch `torch.cuda` itself: vLLM and
transformers run in the same process and must keep seeing the real (CUDA-less) torch.
Instead, each megatron module's global name `torch` is pointed at `_CpuTorch`, a thin view
of torch whose `cuda` namespace answers for the CPU and whose tensor factories map a CUDA
device to the CPU. Everything else megatron-core does runs unchanged.

The remaining shims replace single megatron functions whose CUDA use cannot be redirected
that way; each says what it replaces and why. `apply()` is idempotent and does nothing when
CUDA is available. Call it before building a model (the learner does, inside its entry
points, never at import time: vLLM's spawned processes re-import `__main__`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types
from typing import Any

import torch

log = logging.getLogger(__name__)

_APPLIED = False
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


def _redirect_torch_in_megatron_modules() -> int:
    """Point every loaded megatron module's global `torch` at the CPU view."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if (name == "megatron" or name.startswith("megatron.")) and mod is not None:
            if getattr(mod, "torch", None) is torch:
                mod.torch = _cpu_torch
                n += 1
    return n


def _import_megatron_modules() -> None:
    """Import the megatron-core modules the learner uses, so the redirect reaches them all
    (a module imported after `apply()` would still see real torch)."""
    import megatron.core.dist_checkpointing
    import megatron.core.dist_checkpointing.serialization
    import megatron.core.dist_checkpointing.strategies.torch
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.pipeline_parallel.schedules
    import megatron.core.tensor_parallel
    import megatron.core.transformer.moe.moe_layer
    import megatron.core.transformer.moe.router_replay
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401


class _CpuRNGStatesTracker:
    """Replaces megatron's CudaRNGStatesTracker on CPU.

    megatron keeps named device-RNG states (data-parallel, tensor-parallel, expert-parallel)
    and forks into them around dropout and weight initialisation. Its implementation reads
    `torch.cuda.default_generators`. Here the states are CPU generator states and `fork`
    swaps the global CPU generator, which is what dropout on CPU draws from.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
        if force_reset or not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _CpuRNGStatesTracker):
            mrandom._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    initialize_rng_tracker(force_reset=True)


def _patch_alltoall_split_sizes() -> None:
    """gloo's all_to_all_single wants split sizes as Python ints. megatron's alltoall
    dispatcher computes them as numpy int64 arrays on the host (`.numpy()`), which the
    gloo binding rejects; convert them. NCCL accepts either, so GPU runs never see this."""
    from megatron.core.tensor_parallel import mappings

    original = mappings._AllToAll.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        as_list = lambda s: None if s is None else [int(x) for x in s]  # noqa: E731
        return original(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward)


def _allow_torch_norm_with_sequence_parallel() -> None:
    """The local layer spec builds norms with `WrappedTorchNorm`, which refuses sequence
    parallel: under SP each TP rank normalises different tokens, so the norm weights' grads
    must be summed over TP, and megatron only does that for params tagged
    `sequence_parallel=True` (its fused/TE norms tag themselves). We build the same torch norm
    and add the tag, which makes `finalize_model_grads` sum those grads across TP. (The
    shared q/k norms are tagged too: their per-rank grads come from disjoint heads, and the
    sum is again the full gradient.)"""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,  # noqa: N807
                zero_centered_gamma=False, normalization="LayerNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"moe_rl builds RMSNorm models, got {config.normalization}")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


def _clip_grads_without_cuda_type_check() -> None:
    """megatron's `clip_grad_by_total_norm_fp32` asserts every grad's type string is
    'torch.cuda.FloatTensor' before scaling. On CPU the fp32 grads are 'torch.FloatTensor'.
    Same clipping (grads scaled in place by max_norm / (total_norm + 1e-6) when that is < 1),
    with the dtype checked instead of the CUDA type string."""
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        for g in grads:
            if g.dtype != torch.float32:
                raise TypeError(f"expected fp32 main grads, got {g.dtype}")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _tied_embedding_sync_without_cuda() -> None:
    """With tied embeddings under pipeline parallelism the last stage keeps its own copy of
    the word embeddings, and `LanguageModule.setup_embeddings_and_output_layer` makes the two
    copies equal with `weight.data = weight.data.cuda()` and an all-reduce over the embedding
    group. On CPU `.cuda()` raises; during that one call it is the identity (the data is
    already where gloo wants it), and the all-reduce runs as written."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _define_missing_te_general_gemm() -> None:
    """megatron-core 0.16 imports `te_general_gemm` inside a try block and never defines the
    name when Transformer Engine is absent, so the router's gating linear raises NameError.
    Its own fallback (plain torch.mm) runs once the name exists and is None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> bool:
    """Install the CPU shims if CUDA is absent. Returns True when they are active."""
    global _APPLIED
    _import_megatron_modules()
    _define_missing_te_general_gemm()
    # Not a CPU matter: the local spec's torch norms under sequence parallel, on any device.
    _allow_torch_norm_with_sequence_parallel()
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    n = _redirect_torch_in_megatron_modules()
    _patch_rng_tracker()
    _patch_alltoall_split_sizes()
    _clip_grads_without_cuda_type_check()
    _tied_embedding_sync_without_cuda()
    _APPLIED = True
    log.debug("megatron-core CPU shims applied (%d modules redirected)", n)
    return True

