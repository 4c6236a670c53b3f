"""Worker for tests/integration/weights/test_weight_sync.py's non-blocking push test (torchrun, 2 processes).

rank 0 (the learner's sender): pushes two layers' tensors with `broadcast_buckets`, notes
    when the push returned, then overwrites its tensors (the next update would), and only
    then waits for the sends to drain.
rank 1 (an engine): busy for 2 s (generating), notes when it starts receiving, receives.
Each rank writes <out>/rank<r>.pt.
"""

import sys
import time

import torch
import torch.distributed as dist

from moe_rl.weights.sync import InFlight, broadcast_buckets, receive_buckets


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.mlp.w{j}", torch.randn(64, 32, generator=g)) for i in range(2) for j in range(2)]


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        named = tensors()
        inflight = InFlight()
        broadcast_buckets(iter(named), 1, dist.group.WORLD, True, 7, inflight)
        returned = time.time()
        for _, t in named:
            t.fill_(-1.0)  # the learner's next update, while the sends are in flight
        inflight.wait()
        result = {"returned": returned, "drained": time.time()}
    else:
        time.sleep(2.0)
        started = time.time()
        got = []
        report = receive_buckets(dist.group.WORLD, got.extend)
        result = {"started": started, "received": got, "version": report.version, "buckets": report.buckets}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
