"""The learner's gradient buffers and optimizer states moved to host memory while the
engines sample, and back before the update (`optimizer.offload_during_rollout`).

Colocated on a GPU, the engine's KV cache can only use what the learner leaves free, and
between updates the learner's gradients (fp32, the size of the model) and Adam states (two
or three more copies) are idle. Each tensor's contents go to a pinned host copy and its
device storage is released (`untyped_storage().resize_(0)`): the tensor objects, and every
view of them (megatron's parameters' `main_grad` are views into one grad buffer, the
optimizer holds its states by reference), stay valid, so nothing has to be re-wired when the
storage is re-grown and the contents copied back, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_rl.learner.engine import Learner


def offloadable_tensors(learner: Learner) -> Iterator[torch.Tensor]:
    """The learner's grad buffers and optimizer state tensors (each storage once)."""
    seen: set[int] = set()
    buffers = [*getattr(learner.model, "buffers", []), *getattr(learner.model, "expert_parallel_buffers", [])]
    tensors = [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
    opts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    for opt in opts:
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen and t.untyped_storage().nbytes():
            seen.add(key)
            yield t


class HostOffload:
    """Moves a learner's idle training state to host memory and back."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self._host: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    def offload(self) -> int:
        """Copy every grad buffer and optimizer state to (pinned, with CUDA) host memory and
        release its storage. Returns the bytes released."""
        if self._host:
            return 0
        pin = torch.cuda.is_available()
        released = 0
        for t in offloadable_tensors(self.learner):
            storage = t.untyped_storage()
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(torch.tensor([], dtype=torch.uint8, device=t.device).set_(storage), non_blocking=pin)
            self._host.append((t, host, storage.nbytes()))
            released += storage.nbytes()
        if pin:
            torch.cuda.synchronize()
        for t, _, _ in self._host:
            t.untyped_storage().resize_(0)
        return released

    def reload(self) -> None:
        """Re-grow every released storage and copy its contents back (bit for bit)."""
        for t, host, nbytes in self._host:
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            torch.tensor([], dtype=torch.uint8, device=t.device).set_(storage).copy_(host, non_blocking=True)
        if self._host and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._host = []
