"""Stream tensors into sharded safetensors files, one tensor in memory at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and byte range, then the raw bytes. The header comes first, so a
writer that does not want to hold a shard in memory must know the shard's tensors before
their data: the converter knows every name, shape and dtype from the model config and the
checkpoint metadata, so we plan the shards up front (`plan_shards`), write each header when
its shard opens, and then append tensor bytes as they arrive. The stream must follow the
plan: a tensor out of order, of another shape or dtype, or missing at the end is an error
naming it. Names, sizes and file names follow `transformers.save_pretrained`:
`model-00001-of-00003.safetensors` and `model.safetensors.index.json`.

A tensor arrives either as a tensor (`write`) or as a byte range of another file that
already holds exactly its bytes (`copy_from_file`, a kernel-side copy: most of a megatron
checkpoint's tensors, e.g. every expert's gate, up and down projection, are stored that way).

A stream whose names are not known up front (the sampler's weight sync through a temp
directory) is cut into buckets by the same size rule as the shards and written one bucket
in memory at a time (`write_safetensors_buckets`), each bucket a complete file written the
same way as a shard.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import torch

from moe_rl.convert.megatron_keys import ConvertError

INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


_Item = TypeVar("_Item")


def cut_by_bytes(
    items: Iterable[_Item], nbytes: Callable[[_Item], int], max_bytes: int
) -> Iterator[list[_Item]]:
    """Consecutive groups of at most `max_bytes` (an item larger than that gets a group of
    its own; items are never split), one group at a time: the stream is never held whole."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    group: list[_Item] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += n
    if group:
        yield group


def _check_unique(tensors: Sequence[PlannedTensor]) -> None:
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConvertError(f"tensor {dup!r} is planned twice")


def _check_dtypes(tensors: Sequence[PlannedTensor]) -> None:
    unknown = sorted({t.dtype for t in tensors} - set(DTYPE_NAMES), key=str)
    if unknown:
        raise ConvertError(f"dtype {unknown[0]} has no safetensors name")


def plan_shards(tensors: Sequence[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Cut the ordered tensor list into shards of at most `max_shard_bytes` (a tensor larger
    than that gets a shard of its own; tensors are never split)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    _check_unique(tensors)
    return list(cut_by_bytes(tensors, lambda t: t.nbytes, max_shard_bytes))


def _header(shard: Sequence[PlannedTensor]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        entries[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors itself writes
    return struct.pack("<Q", len(raw)) + raw


def _write_all(f: BinaryIO, data: memoryview) -> None:
    """Write every byte (an unbuffered file may take fewer per call)."""
    done = 0
    while done < len(data):
        done += f.write(data[done:])


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes through the buffer protocol: no copy for a contiguous CPU tensor."""
    data = tensor.detach().cpu().contiguous()
    return memoryview(data.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # (numpy's stubs declare __buffer__ for Python >= 3.12 only)


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class ShardedSafetensorsWriter:
    """Write `tensors` (in that order) under `out_dir` as planned shards plus the index.

        with ShardedSafetensorsWriter(out, planned, max_shard_bytes) as w:
            for name, t in stream:
                w.write(name, t)
        # the index is written on a clean exit, after checking nothing is missing
    """

    def __init__(self, out_dir: str | Path, tensors: Sequence[PlannedTensor], max_shard_bytes: int) -> None:
        _check_dtypes(tensors)
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.total_bytes = sum(t.nbytes for t in tensors)
        self._order = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._next = 0
        self._file: BinaryIO | None = None
        self._file_index = -1
        self.bytes_written = 0

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._file is not None:
            self._file.close()
            self._file = None

    def _open(self, i: int) -> None:
        if self._file is not None:
            self._file.close()
        path = self.out_dir / shard_file_name(i, len(self.shards))
        # Unbuffered: every write is large, and copy_from_file writes through the fd.
        self._file = open(path, "wb", buffering=0)  # closed by _open / close / __exit__
        self._file_index = i
        _write_all(self._file, memoryview(_header(self.shards[i])))

    def _next_planned(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> PlannedTensor:
        """Check `name` is the next planned tensor, with that shape and dtype; open its shard."""
        if self._next >= len(self._order):
            raise ConvertError(f"tensor {name!r} was not planned (all {len(self._order)} planned tensors are written)")
        shard_i, want = self._order[self._next]
        if name != want.name:
            raise ConvertError(f"tensor {name!r} arrived where {want.name!r} was planned")
        if tuple(shape) != want.shape or dtype != want.dtype:
            raise ConvertError(
                f"tensor {name!r} has shape {list(shape)} {dtype}, planned {list(want.shape)} {want.dtype}"
            )
        if shard_i != self._file_index:
            self._open(shard_i)
        return want

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next planned tensor; it must match the plan's name, shape and dtype."""
        want = self._next_planned(name, tuple(tensor.shape), tensor.dtype)
        assert self._file is not None  # (_next_planned opened its shard)
        _write_all(self._file, _raw_bytes(tensor))
        self.bytes_written += want.nbytes
        self._next += 1

    def copy_from_file(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, path: Path, offset: int) -> None:
        """Append the next planned tensor from the raw bytes (row-major, little-endian) at
        `offset` of another file, copied inside the kernel (`copy_file_range`): the data
        never passes through this process's memory."""
        want = self._next_planned(name, shape, dtype)
        out = self._file
        assert out is not None  # (_next_planned opened its shard)
        src = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < want.nbytes:
                try:
                    n = os.copy_file_range(src, out.fileno(), want.nbytes - done, offset + done)
                except OSError:  # an old kernel, or filesystems that refuse it: copy by hand
                    chunk = os.pread(src, min(want.nbytes - done, 64 << 20), offset + done)
                    _write_all(out, memoryview(chunk))
                    n = len(chunk)
                if n <= 0:
                    raise ConvertError(f"{path} ends before offset {offset + done} (copying {name!r})")
                done += n
        finally:
            os.close(src)
        self.bytes_written += want.nbytes
        self._next += 1

    def close(self) -> Path:
        """Finish the last shard and write the index; every planned tensor must be written."""
        if self._next < len(self._order):
            raise ConvertError(f"tensor {self._order[self._next][1].name!r} was planned but never written")
        if self._file is not None:
            self._file.close()
            self._file = None
        weight_map = {
            t.name: shard_file_name(i, len(self.shards)) for i, shard in enumerate(self.shards) for t in shard
        }
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        path = self.out_dir / INDEX_FILE
        path.write_text(json.dumps(index, indent=2) + "\n")
        return path


# --------------------------------------------------------------------------- unplanned streams


def write_safetensors_file(path: str | Path, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """One complete safetensors file of tensors already in memory, in the given order."""
    planned = [PlannedTensor(name, tuple(t.shape), t.dtype) for name, t in named_tensors]
    _check_dtypes(planned)
    _check_unique(planned)
    with open(path, "wb", buffering=0) as f:
        _write_all(f, memoryview(_header(planned)))
        for _, t in named_tensors:
            _write_all(f, _raw_bytes(t))


def _tensor_nbytes(named: tuple[str, torch.Tensor]) -> int:
    return named[1].numel() * named[1].element_size()


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a `(name, tensor)` stream into lists of at most `bucket_bytes` (the shard rule)."""
    return cut_by_bytes(named_tensors, _tensor_nbytes, bucket_bytes)


def write_safetensors_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, bucket_bytes: int
) -> list[str]:
    """Write the stream as `bucket-00000.safetensors`, ... under `out_dir`, one bucket in
    memory at a time. Returns the tensor names written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    for i, bucket in enumerate(buckets(named_tensors, bucket_bytes)):
        tensors = [(name, t.detach().to("cpu").contiguous()) for name, t in bucket]
        write_safetensors_file(out_dir / f"bucket-{i:05d}.safetensors", tensors)
        names.extend(name for name, _ in tensors)
    return names
