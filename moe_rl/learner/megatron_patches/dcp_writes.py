"""dist_checkpointing's file writes in threads of the trainer's process, not forked writers.

megatron-core's asynchronous save writes each rank's files in forked writer processes and
collects their results through a `multiprocessing.Manager` (a spawned server process and a
resource tracker); a SIGKILL of the trainer left both orphaned. `in_process()` swaps its
results queue and its writer for threads of this process (file I/O releases the GIL, so
the files are still written in parallel), for the duration of one save.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from moe_rl.runtime.fault_hooks import kill_point

UPSTREAM = ("megatron.core.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue",
            "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.write_preloaded_data",
            "megatron.core.dist_checkpointing.strategies.filesystem_async:"
            "FileSystemWriterAsync.write_preloaded_data_multiproc")
SIGNATURES = {
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.write_preloaded_data_multiproc":
        ("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
}


def _write_bucket(transform_list: list, use_msc: bool, i: int, bucket: Any) -> Any:
    """One bucket (one `.distcp` file) through megatron's own writer; its results or error."""
    local: queue.Queue[Any] = queue.Queue()
    count: queue.Queue[int] = queue.Queue()
    count.put(i)
    FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, use_msc=use_msc)
    return local.get()[1]


def _write_buckets_in_process(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                              results: Any) -> None:
    """Megatron's `write_preloaded_data_multiproc` with threads of this process instead of
    forked writer processes: the files are still written in parallel (file I/O releases the
    GIL), and nothing outlives a SIGKILL of the trainer."""
    out: dict[int, Any] | Exception = {}
    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="ckpt-write") as pool:
        futures = {pool.submit(_write_bucket, transform_list, use_msc, i, b): i for i, b in enumerate(write_buckets)}
        for future in as_completed(futures):
            written = future.result()
            if isinstance(written, Exception):
                out = written
            elif isinstance(out, dict):
                out[futures[future]] = written
            kill_point("save.file")
    results.put(out)


@contextlib.contextmanager
def in_process() -> Iterator[None]:
    """dist_checkpointing.save with its writes in this process: megatron's results queue is
    a `multiprocessing.Manager()` (a spawned server process and a resource tracker, both
    orphaned by a SIGKILL of the trainer) and its writers are forked processes."""
    saved = (filesystem_async._get_write_results_queue, FileSystemWriterAsync.__dict__["write_preloaded_data_multiproc"])
    filesystem_async._get_write_results_queue = queue.Queue
    FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_process)
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = saved[0]
        FileSystemWriterAsync.write_preloaded_data_multiproc = saved[1]
