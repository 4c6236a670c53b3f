"""The guard on every change moe_rl makes to megatron-core (`moe_rl/learner/megatron_patches/`):
each symbol a patch replaces or relies on still exists in the installed megatron-core, with
the parameters the patch passes on, so that an upgrade that moves one fails here, naming
the symbol and the patch, instead of somewhere inside a training step."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from pathlib import Path

import pytest

from moe_rl.learner import megatron_patches

FOLDER = Path(megatron_patches.__file__).parent


def resolve(symbol: str) -> object:
    """`module` or `module:Qual.name` -> the object (AttributeError / ImportError if gone)."""
    module, _, qualname = symbol.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def test_every_module_of_the_folder_is_a_listed_patch():
    modules = sorted(p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__")
    assert modules == sorted(megatron_patches.PATCH_MODULES)


@pytest.mark.parametrize("name", megatron_patches.PATCH_MODULES)
def test_the_symbols_each_patch_relies_on_still_exist(name):
    patch = importlib.import_module(f"moe_rl.learner.megatron_patches.{name}")
    assert patch.UPSTREAM, f"{name} names no upstream symbol"
    version = importlib.metadata.version("megatron-core")
    for symbol in patch.UPSTREAM:
        try:
            resolve(symbol)
        except (ImportError, AttributeError) as e:
            pytest.fail(f"megatron-core {version} has no {symbol} ({e}): the patch "
                        f"moe_rl/learner/megatron_patches/{name}.py relies on it; update the patch")
    for symbol, params in getattr(patch, "SIGNATURES", {}).items():
        got = tuple(inspect.signature(resolve(symbol)).parameters)
        assert got[: len(params)] == params, (
            f"megatron-core {version} changed {symbol}'s parameters to {got} (the patch "
            f"moe_rl/learner/megatron_patches/{name}.py passes {params}); update the patch")


def test_a_moved_symbol_fails_naming_it():
    with pytest.raises(AttributeError):
        resolve("megatron.core.tensor_parallel.mappings:_AllToAll.no_such_method")


def test_the_patches_are_applied_once_and_answer_for_the_cpu(megatron_world):
    """On this CPU machine: megatron's modules see a torch whose `cuda.current_device()` is
    the CPU, the RNG tracker is the CPU one, and a second `apply()` changes nothing."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        pytest.skip("the CPU patches are off where CUDA exists")
    assert megatron_patches.apply() is True
    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "_CpuRNGStatesTracker"
    assert mrandom.torch.cuda.current_device() == torch.device("cpu")
    assert megatron_patches.apply() is True and tensor_parallel.get_cuda_rng_tracker() is tracker
