"""Read a megatron `dist_checkpointing` checkpoint one global tensor at a time, without
megatron.

A learner checkpoint (`moe_rl.learner.checkpoint.save_checkpoint`) is a PyTorch
Distributed Checkpoint (DCP) directory: `.metadata` (pickled DCP metadata: every key's
global shape and dtype, and where each saved chunk lives), `__<rank>_<i>.distcp` files of
torch-serialised chunks, megatron's `metadata.json` (backend `torch_dist`) and `common.pt`,
plus our `moe_rl.json` and `config.yaml`. Tensor keys are the ShardedTensor keys with
global shapes: the chunks saved by each TP/EP/PP rank tile the global tensor, so reading a
key into a tensor of its global shape reassembles it whatever the layout it was saved at.
Keys that are not model weights (optimizer state `chained_0.optimizer.state...`, RNG,
`_extra_state`) are listed but never read here.

Reading. Each saved chunk is one `torch.save` zip record inside a `.distcp` file; DCP's own
loader unpickles it into a fresh tensor and copies that into the destination. The fast path
here reads the record's raw storage bytes straight into the destination slice (one copy,
no temporary, no allocation when the caller passes a reused `out`) after checking, from the
record's pickle and zip headers, that it is exactly one contiguous little-endian tensor of
the chunk's shape and dtype stored uncompressed. Anything else (other torch formats, DCP
storage transforms) falls back to `torch.distributed.checkpoint.load`, which the tests
check gives identical tensors.
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from moe_rl.convert.megatron_keys import ConvertError

META_FILE = "moe_rl.json"  # moe_rl.learner.checkpoint.META_FILE (that module imports megatron)
CONFIG_FILE = "config.yaml"


class _CachedMetadataReader(FileSystemReader):
    """FileSystemReader that unpickles `.metadata` once, not once per `dcp.load`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


def check_checkpoint_dir(path: str | os.PathLike) -> Path:
    """`path` as a Path if it is a learner checkpoint directory; ConvertError otherwise."""
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        raise ConvertError(f"checkpoint {p} is not a directory")
    missing = [n for n in (META_FILE, "metadata.json", ".metadata", CONFIG_FILE) if not (p / n).is_file()]
    if missing:
        hint = (" (it looks like a Hugging Face directory: use --to megatron)"
                if (p / "config.json").is_file() else "")
        raise ConvertError(
            f"{p} is not a megatron checkpoint written by the learner: it lacks {', '.join(missing)}{hint}"
        )
    try:
        backend = json.loads((p / "metadata.json").read_text()).get("sharded_backend")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConvertError(f"{p / 'metadata.json'} is not megatron's checkpoint metadata: {e}") from e
    if backend != "torch_dist":
        raise ConvertError(f"{p} uses sharded backend {backend!r}; only 'torch_dist' (DCP) is supported")
    return p


class DcpCheckpoint:
    """Tensor listing and one-key-at-a-time reads of a DCP checkpoint directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = check_checkpoint_dir(path)
        self._reader = _CachedMetadataReader(self.path)
        try:
            metadata = self._reader.read_metadata()
        except Exception as e:  # a truncated or foreign .metadata: name the file
            raise ConvertError(f"cannot read {self.path / '.metadata'}: {type(e).__name__}: {e}") from e
        self.tensors: dict[str, TensorInfo] = {
            key: TensorInfo(tuple(md.size), md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        self._raw: dict[str, list[RawChunk] | None] = {}

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The full global tensor `key` in its saved dtype, written into `out` when given
        (a buffer to reuse: same shape and dtype, contiguous) or into fresh memory."""
        info = self.tensors.get(key)
        if info is None:
            raise ConvertError(f"checkpoint {self.path} has no tensor {key!r}")
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        elif tuple(out.shape) != info.shape or out.dtype != info.dtype or not out.is_contiguous():
            raise ValueError(f"out for {key!r} must be a contiguous {info.dtype} {list(info.shape)} tensor")
        if not self._read_raw(key, out):
            self.read_with_dcp(key, out)
        return out

    def read_with_dcp(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """`read` through torch.distributed.checkpoint.load (the reference path)."""
        # no_dist: read in this process only, even inside a torchrun job (DCP warns that
        # it assumes exactly that).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(
                {key: out},
                storage_reader=self._reader,
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
        return out

    # ------------------------------------------------------------------ fast path

    def raw_chunks(self, key: str) -> list[RawChunk] | None:
        """Where each saved chunk of `key` sits in the files, as raw row-major bytes of the
        tensor's dtype; None when some chunk is not such a plain record (use `read`)."""
        if key not in self._raw:
            self._raw[key] = self._locate(key)
        return self._raw[key]

    def _locate(self, key: str) -> list[RawChunk] | None:
        metadata = self._reader.read_metadata()
        info = self.tensors[key]
        chunks = metadata.state_dict_metadata[key].chunks
        if sum(math.prod(c.sizes) for c in chunks) != math.prod(info.shape):
            return None  # chunks do not tile the tensor exactly once: let DCP decide
        located = []
        for chunk in chunks:
            sinfo = metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            if sinfo is None or getattr(sinfo, "transform_descriptors", None):
                return None
            path = self.path / sinfo.relative_path
            start = _raw_tensor_offset(path, sinfo.offset, sinfo.length, info.dtype, tuple(chunk.sizes))
            if start is None:
                return None
            located.append(RawChunk(tuple(chunk.offsets), tuple(chunk.sizes), path, start))
        return located

    def _read_raw(self, key: str, out: torch.Tensor) -> bool:
        """Read every chunk of `key` straight into `out`; False when there is no raw layout."""
        chunks = self.raw_chunks(key)
        if chunks is None:
            return False
        for c in chunks:
            dest = out[c.slices]
            if dest.is_contiguous():
                _pread_into(c.path, c.file_offset, dest)
            else:  # e.g. a column slice under TP: read whole, then scatter
                tmp = torch.empty(c.sizes, dtype=out.dtype)
                _pread_into(c.path, c.file_offset, tmp)
                dest.copy_(tmp)
        return True


@dataclass(frozen=True)
class RawChunk:
    """A saved chunk of a global tensor: its box in the global tensor, and the file offset
    of its bytes (row-major, the tensor's dtype, little-endian)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: Path
    file_offset: int

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64,
}


class _TensorRecord(pickle.Unpickler):
    """Unpickles a torch.save'd tensor's data.pkl into (storage dtype, storage numel,
    offset, size, stride) without touching data; anything but one plain tensor raises."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        kind, dtype, _key, _location, numel = pid  # ('storage', FloatStorage, '0', 'cpu', n)
        if kind != "storage":
            raise pickle.UnpicklingError(str(kind))
        return dtype, numel


class _Slice(io.RawIOBase):
    """A read-only window [base, base + length) of an open file (what zipfile needs)."""

    def __init__(self, f: io.BufferedReader, base: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.base + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data


def _raw_tensor_offset(path: Path, base: int, length: int, dtype: torch.dtype, size: tuple[int, ...]) -> int | None:
    """File offset of the raw bytes of a torch.save record at [base, base + length) when it
    holds exactly one contiguous little-endian tensor of `size` and `dtype`, else None."""
    try:
        with open(path, "rb") as f, zipfile.ZipFile(_Slice(f, base, length)) as z:
            names = z.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl")]
            data = [n for n in names if "/data/" in n]
            if len(pkl) != 1 or len(data) != 1:
                return None
            prefix = pkl[0][: -len("data.pkl")]
            if prefix + "byteorder" in names and z.read(prefix + "byteorder") != b"little":
                return None
            (st_dtype, st_numel), offset, t_size, t_stride = _TensorRecord(io.BytesIO(z.read(pkl[0]))).load()
            numel = math.prod(size)
            # Row-major: the strides of every dim longer than 1 are the contiguous ones
            # (a length-1 dim's stride is arbitrary and never used).
            row_major = all(st == math.prod(size[i + 1 :]) for i, (st, n) in enumerate(zip(t_stride, size)) if n > 1)
            zinfo = z.getinfo(data[0])
            if (st_dtype != dtype or st_numel != numel or offset != 0 or t_size != size or not row_major
                    or zinfo.compress_type != zipfile.ZIP_STORED or zinfo.file_size != numel * dtype.itemsize):
                return None
            f.seek(base + zinfo.header_offset)
            header = f.read(30)  # zip local file header; the data follows its name and extra field
            if header[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            return base + zinfo.header_offset + 30 + name_len + extra_len
    except (pickle.UnpicklingError, zipfile.BadZipFile, ValueError, TypeError, KeyError, struct.error):
        return None


def _pread_into(path: Path, offset: int, dest: torch.Tensor) -> None:
    """Fill contiguous `dest` with the bytes of `path` at `offset`."""
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise ConvertError(f"{path} ends before offset {offset + done}")
            done += n
    finally:
        os.close(fd)
