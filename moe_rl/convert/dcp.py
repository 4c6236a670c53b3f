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

Safety. A checkpoint is verified against its manifest (`moe_rl.checkpoints`) before
anything is read, and `.metadata` is read with an unpickler that builds only DCP's own
metadata classes, torch sizes and dtypes (`load_metadata`): a crafted `.metadata` cannot run
code even when its manifest matches. `safe_dcp_reading()` puts the same rules under torch's
and megatron's own loaders (the learner's `load_checkpoint`): the restricted `.metadata`
reader, and `weights_only=True` for every `torch.load`. A checkpoint the user trusts
(no manifest, `--trust`) is read the ordinary way.

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
import contextlib
import errno
import io
import json
import math
import os
import pickle
import struct
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from moe_rl.checkpoints import CONFIG_FILE, META_FILE
from moe_rl.checkpoints.errors import TRUST_HINT, CheckpointError
from moe_rl.checkpoints.trust import ensure_verified
from moe_rl.convert.megatron_keys import ConvertError
from moe_rl.runtime.failures import describe_error

METADATA_FILE = ".metadata"
# What a DCP `.metadata` of this package's checkpoints is made of (torch 2.13): the classes
# are plain dataclasses and enums, `_get_layout` maps a name to a torch.layout.
_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS = {
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                        "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global (a function that could run
    code on load) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")


def load_metadata(path: str | os.PathLike) -> Metadata:
    """A DCP `.metadata` file read with the restricted unpickler; CheckpointError naming the
    file when it holds anything but DCP metadata."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, KeyError, TypeError,
            ValueError) as e:
        raise CheckpointError(f"{path} is not plain DCP metadata ({e}); it is not read, since unpickling it "
                              f"could run code; if you trust this checkpoint, pass {TRUST_HINT}") from e
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path} holds a {type(md).__name__}, not DCP metadata")
    return md


def _safe_read_metadata(self: FileSystemReader, *args: Any, **kwargs: Any) -> Metadata:
    """FileSystemReader.read_metadata with the restricted unpickler (same result)."""
    md = load_metadata(self._get_metadata_path(kwargs.get("rank")))
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    assert md.storage_meta is not None
    md.storage_meta.load_id = self.load_id
    return md


@contextlib.contextmanager
def safe_dcp_reading() -> Iterator[None]:
    """Inside: torch DCP's `.metadata` reads use the restricted unpickler and every
    `torch.load` is `weights_only=True` (TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides even the
    explicit `weights_only=False` of DCP's byte objects: RNG state, `_extra_state`)."""
    saved_env = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    original = FileSystemReader.read_metadata
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    FileSystemReader.read_metadata = _safe_read_metadata  # type: ignore[method-assign]  # (the patch: DCP's own reader)
    try:
        yield
    finally:
        FileSystemReader.read_metadata = original  # type: ignore[method-assign]  # (restored)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _CachedMetadataReader(FileSystemReader):
    """FileSystemReader that reads `.metadata` once, not once per `dcp.load`; with the
    restricted unpickler unless the checkpoint is trusted."""

    def __init__(self, path: str | os.PathLike, restricted: bool = True) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None
        self._restricted = restricted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            read = _safe_read_metadata if self._restricted else FileSystemReader.read_metadata
            self._metadata = read(self, *args, **kwargs)
        return self._metadata


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


def check_checkpoint_dir(path: str | os.PathLike, *, trust: bool = False) -> tuple[Path, bool]:
    """`path` as a Path if it is a learner checkpoint directory whose manifest verifies (or
    that the user trusts), and whether to read it restricted; ConvertError / CheckpointError
    otherwise."""
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
    restricted = ensure_verified(p, trust=trust)
    try:
        backend = json.loads((p / "metadata.json").read_text()).get("sharded_backend")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConvertError(f"{p / 'metadata.json'} is not megatron's checkpoint metadata: {e}") from e
    if backend != "torch_dist":
        raise ConvertError(f"{p} uses sharded backend {backend!r}; only 'torch_dist' (DCP) is supported")
    return p, restricted


class DcpCheckpoint:
    """Tensor listing and one-key-at-a-time reads of a DCP checkpoint directory, verified
    against its manifest first (`trust=True` accepts one without a manifest)."""

    def __init__(self, path: str | os.PathLike, *, trust: bool = False) -> None:
        self.path, restricted = check_checkpoint_dir(path, trust=trust)
        self._reader = _CachedMetadataReader(self.path, restricted=restricted)
        try:
            metadata = self._reader.read_metadata()
        except CheckpointError:
            raise
        except Exception as e:  # a truncated or foreign .metadata (trusted): name the file
            raise ConvertError(f"cannot read {self.path / METADATA_FILE}: {type(e).__name__}: {e}") from e
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
        try:
            if not self._read_raw(key, out):
                self.read_with_dcp(key, out)
        except (ConvertError, CheckpointError):
            raise
        except (Exception, CheckpointException) as e:  # a trusted checkpoint's damaged file
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ConvertError(f"cannot read tensor {key!r} of checkpoint {self.path} ({describe_error(e)}): one of its "
                               "files is truncated or damaged; restore it from a copy") from e
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
        entry = metadata.state_dict_metadata[key]
        if not isinstance(entry, TensorStorageMetadata):
            return None  # (a byte object, not a tensor: DCP reads it)
        chunks = entry.chunks
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
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # (numpy's stubs declare __buffer__ for Python >= 3.12 only)
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
