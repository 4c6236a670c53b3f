"""megatron's CUDA RNG tracker, replaced on the CPU by one over CPU generator states."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

UPSTREAM = ("megatron.core.tensor_parallel.random:initialize_rng_tracker",
            "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER",
            "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER_INITIALIZED",
            "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
            "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
            "megatron.core.tensor_parallel.random:get_cuda_rng_tracker")


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


def apply() -> None:
    """Replace the tracker and megatron's device-RNG state functions with the CPU's."""
    from megatron.core.tensor_parallel import random as mrandom

    def initialize_rng_tracker(*args: Any, force_reset: bool = False, **kwargs: Any) -> None:
        if force_reset or not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _CpuRNGStatesTracker):
            mrandom._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    initialize_rng_tracker(force_reset=True)
