"""What a broadcast push puts on the wire (`sampler.sync`): whole tensors, or patches of the
elements whose bits changed since the last push.

    wire = WireFormat("delta", full_every=10, precision="bf16")
    out, kinds, whole_bytes = wire.encode(bucket, full=wire.next_push_is_full())  # rank 0
    bucket = wire.decode(out, kinds)                                               # an engine rank

Tensors travel in the sampler's dtype when the sampler's precision is a plain cast (fp32,
bf16: `moe_rl.sampler.precision.transform_weight`, which the engine then applies again as a
no-op), so a bf16 sampler receives half the bytes and its rounding hides the small updates
from the delta. fp8 precisions receive the learner's tensors (their rounding needs them).

With `delta`, each tensor goes as the smaller of: the whole tensor, or a patch (the flat
indices of the elements whose bits differ from the previous push, int32 below 2^31
elements, and their new values). Every `full_every`-th push (the first included) sends
every tensor whole. Both sides keep the last pushed tensors (one copy of the model in the
wire dtype, rank 0's on its broadcast device, an engine rank's on the device it receives
on): rank 0 to find what changed, the engine rank to rebuild whole tensors from patches
before its engine loads them (vLLM loads and processes whole tensors whatever changed).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moe_rl.sampler.precision import transform_weight

Bucket = list[tuple[str, torch.Tensor]]
Kinds = list[tuple[str, str]]
"""(name, "full" | "patch") of each tensor of a bucket, in order."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CAST_PRECISIONS = ("fp32", "bf16")


def changed_indices(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64) of the elements whose bits differ (NaNs and -0.0 included)."""
    view = _INT_VIEW[new.element_size()]
    a, b = new.detach().contiguous().view(-1).view(view), old.contiguous().view(-1).view(view)
    return torch.nonzero(a != b).view(-1)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def encode_tensor(new: torch.Tensor, old: torch.Tensor | None) -> tuple[str, list[torch.Tensor]]:
    """("patch", [indices, values]) when that is fewer bytes than the whole tensor (and
    `old` has its shape and dtype), else ("full", [new])."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return "full", [new]
    idx = changed_indices(new, old)
    idx_dtype = index_dtype(new.numel())
    if idx.numel() * (idx_dtype.itemsize + new.element_size()) >= new.numel() * new.element_size():
        return "full", [new]
    return "patch", [idx.to(idx_dtype), new.detach().contiguous().view(-1)[idx]]


def apply_patch(base: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Write a patch's values into `base` (in place) at its flat indices."""
    base.view(-1)[indices.long()] = values.to(base.device)


class WireFormat:
    """One side's encoder/decoder of pushes (`sampler.sync`, `sampler.full_sync_every`)."""

    def __init__(self, sync: str = "full", full_every: int = 1, precision: str | None = None) -> None:
        if sync not in ("full", "delta"):
            raise ValueError(f"sampler.sync must be full or delta, got {sync!r}")
        if full_every < 1:
            raise ValueError(f"sampler.full_sync_every must be >= 1, got {full_every}")
        self.sync, self.full_every, self.precision = sync, full_every, precision
        self.held: dict[str, torch.Tensor] = {}
        """The last pushed tensors (delta only): what the next patches apply to."""
        self.pushes = 0

    def cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor as it travels: in the sampler's dtype where that is a plain cast."""
        return transform_weight(name, t, self.precision) if self.precision in _CAST_PRECISIONS else t

    def next_push_is_full(self) -> bool:
        """Rank 0, once per push: whether this push sends every tensor whole."""
        full = self.sync == "full" or self.pushes % self.full_every == 0
        self.pushes += 1
        return full

    def encode(self, bucket: Bucket, full: bool, device: torch.device) -> tuple[Bucket, Kinds | None, int]:
        """(the tensors to send, each tensor's kind (None: plain whole tensors), the bytes of
        the bucket's tensors sent whole)."""
        cast = [(n, self.cast(n, t)) for n, t in bucket]
        whole = sum(t.numel() * t.element_size() for _, t in cast)
        if self.sync == "full":
            return cast, None, whole
        out: Bucket = []
        kinds: Kinds = []
        for name, t in cast:
            kind, parts = encode_tensor(t, None if full else self.held.get(name))
            kinds.append((name, kind))
            out.extend(_named(name, kind, parts))
            self._remember(name, kind, parts, device)
        return out, kinds, whole

    def decode(self, received: Bucket, kinds: Kinds | None) -> Bucket:
        """The whole tensors of a received bucket (patches applied to the held tensors)."""
        if kinds is None:
            return received
        parts = iter(t for _, t in received)
        bucket: Bucket = []
        for name, kind in kinds:
            got = [next(parts)] if kind == "full" else [next(parts), next(parts)]
            self._remember(name, kind, got, got[0].device)
            bucket.append((name, self.held[name]))
        return bucket

    def _remember(self, name: str, kind: str, parts: list[torch.Tensor], device: torch.device) -> None:
        if kind == "full":
            held = self.held.get(name)
            if held is not None and held.shape == parts[0].shape and held.dtype == parts[0].dtype:
                held.copy_(parts[0])
            else:
                self.held[name] = parts[0].detach().to(device, copy=True).contiguous()
        else:
            apply_patch(self.held[name], *parts)


def _named(name: str, kind: str, parts: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    if kind == "full":
        yield name, parts[0]
    else:
        yield f"{name}#indices", parts[0]
        yield f"{name}#values", parts[1]


def wire_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)
