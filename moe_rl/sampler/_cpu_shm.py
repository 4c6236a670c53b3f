"""vLLM-CPU's shared-memory collectives: unlink their segments' names once every rank holds them.

On CPU, vLLM runs a tensor- or pipeline-parallel group's collectives through POSIX shared
memory: each rank creates `/dev/shm/<group name>_<rank in group>` (exclusively: creating a
name that exists fails), then every rank maps every rank's segment. The names are unlinked
only by the C++ manager's static destructor, which does not run when the process ends by a
signal or `os._exit`, nor when an engine is shut down and another built in the same process
(a restart). The group name comes from the engine's torch.distributed init method, which is
the constant "env://" for an engine sharded over trainer processes (`external_launcher`), so
one name left behind makes the next such engine on the machine fail at start with
"create shm in SHMManager failed. errno: 17".

vLLM barriers after every rank has mapped every segment, so once the engine is built the
names serve no one: each worker unlinks its own (`unlink_own_segments`, run in every worker
right after start), the usual create-map-unlink idiom of POSIX shared memory. The mappings
stay valid until the process unmaps them or ends, and nothing is left behind however it
ends. A name left by an engine that died while starting is not ours to remove (another run
may be starting with it): `leftover_segment_error` words that failure as one line naming the
files and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")
_EEXIST_MESSAGE = "create shm in SHMManager failed. errno: 17"


def own_segment_names(groups: Any = None) -> list[str]:
    """The shared-memory names this worker created: one per group whose collectives run
    through shared memory, `<group name>_<this worker's rank in the group>`. `groups`: vLLM's
    registry of group coordinators (name -> weak reference), vLLM's own when None."""
    if groups is None:
        from vllm.distributed import parallel_state

        groups = parallel_state._groups  # (vLLM keeps no public list of its groups)
    names = []
    for ref in list(groups.values()):
        communicator = getattr(ref(), "device_communicator", None)
        group_name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
        if isinstance(group_name, str):
            names.append(f"{group_name}_{communicator.rank}")  # type: ignore[union-attr]  # (set with dist_module)
    return names


def unlink_segments(names: list[str], shm_dir: Path = SHM_DIR) -> int:
    """Unlink each shared-memory name (glibc keeps POSIX shared memory as files in /dev/shm, its
    leading slashes dropped); one already gone is skipped. Returns how many were unlinked."""
    unlinked = 0
    for name in names:
        try:
            (shm_dir / name.lstrip("/")).unlink()
        except FileNotFoundError:
            continue
        unlinked += 1
    return unlinked


def unlink_own_segments() -> int:
    """Unlink the names of this worker's shared-memory segments (module docstring)."""
    return unlink_segments(own_segment_names())


def segment_files(shm_dir: Path = SHM_DIR) -> set[Path]:
    """The files of vLLM-CPU's shared-memory segments under `shm_dir` (any run's)."""
    return set(shm_dir.glob("*cpushm_*")) if shm_dir.is_dir() else set()


def leftover_segment_error(exc: BaseException, shm_dir: Path = SHM_DIR) -> FileExistsError | None:
    """The one-line error for an engine start that failed because a segment name of its group
    already exists; None for any other failure."""
    if _EEXIST_MESSAGE not in str(exc):
        return None
    files = sorted(str(p) for p in segment_files(shm_dir))
    named = ", ".join(files) if files else f"a '*cpushm_*' file under {shm_dir}"
    many = len(files) > 1
    return FileExistsError(
        f"vLLM-CPU could not create its tensor/pipeline-parallel group's shared memory: {named} "
        f"{'exist' if many else 'exists'} already, left by an engine that died while starting (or "
        f"in use by a run of the same layout starting on this machine now); remove {'them' if many else 'it'} "
        "once no such run is starting")
