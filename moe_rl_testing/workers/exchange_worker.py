"""torchrun worker: `exchange_objects` delivers outgoing[r] to rank r and nothing else, and
a StepBatch split by `dp_rows` over the ranks puts every row on exactly one rank."""

import json
import sys

import torch
import torch.distributed as dist

from moe_rl.runtime.collectives import all_gather_object, exchange_objects
from moe_rl.step_batch import dp_rows

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
outgoing = [{"src": rank, "dst": d, "payload": list(range(rank * 100 + d))} for d in range(world)]
outgoing[0] = [] if rank == 1 else outgoing[0]  # an empty message is delivered as such
got = exchange_objects(outgoing)
rows = dp_rows(10, rank, world).tolist()
everyone = all_gather_object({"got": got, "rows": rows})
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(everyone, f)
dist.destroy_process_group()
torch.set_num_threads(1)
