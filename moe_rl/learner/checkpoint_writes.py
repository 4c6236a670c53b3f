"""How a checkpoint's data files are written: by threads of the trainer's own process, now
or in the background while training goes on.

    write = DcpWrite(sharded_state_dict, tmp_dir, background=True)   # collective: plan, stage
    ... steps ...                                                      # the files are written meanwhile
    write.finish()                                                     # collective: megatron's .metadata

megatron-core's `dist_checkpointing.save(..., async_sharded_save=True)` splits a save into
a collective start (the plan, `common.pt`, the data staged for writing), a write of this
rank's files that needs no other rank, and a collective finish (the global `.metadata`).
Its own asynchronous caller runs the write in forked writer processes and collects their
results through a `multiprocessing.Manager`: a SIGKILL of the trainer left both orphaned.
Here the write runs in threads of this process (`moe_rl.learner.megatron_patches.dcp_writes`),
so nothing outlives a killed trainer; in the background, in one thread that owns a private host copy of every
tensor taken at the start (`_staged`), so the next optimizer steps, which change the live
tensors in place, cannot reach the files.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing

from moe_rl.checkpoints.manifest import digest_files
from moe_rl.learner.megatron_patches import dcp_writes


@contextlib.contextmanager
def one_openmp_thread() -> Iterator[None]:
    """torch at one thread while megatron saves (the main thread's count back after).

    Why: megatron gathers the checkpoint's metadata with `all_gather_object` (57 KB for the
    tiny model), and gloo copies the gathered bytes on its own worker thread. A thread's
    first parallel op fixes its OpenMP team size at torch's thread count of that moment; a
    team on gloo's thread makes the process hold more OpenMP threads than CPUs, and libgomp
    then shortens every thread's spin-wait: on 2 CPUs every later update took 2.5x as long
    (`examples/tiny_grpo.yaml`: 0.38 -> 0.95 s from the first save on; 0.35-0.41 s with this).
    Begun at one thread, gloo's threads stay single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _staged(write_buckets: list) -> list:
    """The buckets with a private host copy of every tensor: megatron stages only device
    tensors (its D2H copy); a host tensor (every tensor on CPU, an offloaded optimizer's
    state) would otherwise be written while the next step changes it in place."""
    out = []
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        copies = [(item, t.detach().to("cpu", copy=True)) for item, t in tensor_data]
        out.append((file_name, storage_key, (bytes_data, copies)))
    return out


class DcpWrite:
    """One `dist_checkpointing.save` of a sharded state dict into `tmp`: started now
    (collective), its data files written now or by a background thread, finished by
    `finish` (collective)."""

    def __init__(self, sharded_state_dict: dict, tmp: Path, *, background: bool) -> None:
        self.tmp = tmp
        self.digests: dict[str, dict[str, Any]] = {}
        """The manifest entries of the data files this rank wrote, hashed by the writer as
        soon as they are written (in the background too: the finish hashes only the rest)."""
        with dcp_writes.in_process(), one_openmp_thread():
            self._request = dist_checkpointing.save(sharded_state_dict, str(tmp), async_sharded_save=True)
        args = list(self._request.async_fn_args)
        if self._request.async_fn is not None:
            args[1] = _staged(args[1]) if background else self._request.preload_fn()
        self._args = args
        self.error: BaseException | None = None
        """What the write raised outside megatron's own error reporting (re-raised by finish)."""
        self.write_seconds = 0.0
        """How long writing and hashing this rank's data files took (once done)."""
        self._thread: threading.Thread | None = None
        if background:  # (a daemon: an abandoned write never keeps a stopping process alive)
            self._thread = threading.Thread(target=self._write, name="ckpt-background", daemon=True)
            self._thread.start()
        else:
            self._write()

    def _write(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._request.async_fn is not None:
                self._request.async_fn(*self._args, **self._request.async_fn_kwargs)
                self.digests = digest_files(self.tmp, [name for _, name, _ in self._args[1]])
        except BaseException as e:  # (a thread's exception would otherwise only be printed)
            self.error = e
        self.write_seconds = time.perf_counter() - t0

    def done(self) -> bool:
        """This rank's files are written (or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: until written); whether it is done."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done()

    def finish(self) -> None:
        """Collective: wait for this rank's files, then megatron's finish (the write results
        gathered, `.metadata` written by rank 0)."""
        self.wait()
        if self.error is not None:
            raise self.error
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # (every rank's files are written: as megatron's synchronous save)
        with one_openmp_thread():
            for fn in self._request.finalize_fns:
                fn()
