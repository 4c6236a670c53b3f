"""torchrun worker (2 gloo ranks): chunked log-probs with the vocabulary split over the ranks
equal the single-process full-logits reference, values and gradients. Writes, from rank 0,
every rank's error per quantity and case to argv[1]: max |chunked - exact| / max(1, max |exact|),
"exact" being the full logits in fp64 (fp32 cases are chunked in fp32)."""

import json
import sys

import torch
import torch.distributed as dist

from moe_rl.learner.chunked_logprobs import chunked_token_logprobs, vocab_shard_start
from moe_rl_testing.logprob_reference import full_token_logprobs, logprob_case, values_and_grads

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tp_group = dist.new_group(list(range(world)))
CASES = [  # (tokens, hidden, vocab, chunk, temperature, dtype)
    (13, 8, 38, 3, 1.0, torch.float64),
    (40, 16, 102, 7, 0.7, torch.float32),
    (5, 4, 10, 64, 1.5, torch.float64),
]


def shard_case(case: dict, vocab: int) -> dict:
    shard = vocab // world
    return dict(case, weight_VH=case["weight_VH"][rank * shard:(rank + 1) * shard])


errors = []
for i, (n, h, v, chunk, temperature, dtype) in enumerate(CASES):
    case = logprob_case(n, h, v, seed=100 + i, dtype=dtype)  # the same on every rank
    exact = {k: v.double() if v.is_floating_point() else v for k, v in case.items()}
    want = values_and_grads(full_token_logprobs, exact, temperature=temperature)
    mine = shard_case(case, v)
    start = vocab_shard_start(mine["weight_VH"], tp_group)
    got = values_and_grads(chunked_token_logprobs, mine, temperature=temperature, chunk_tokens=chunk,
                           tp_group=tp_group, vocab_start=start)
    want["grad_w"] = shard_case({"weight_VH": want["grad_w"]}, v)["weight_VH"]
    err = {k: (got[k].double() - want[k]).abs().max().item() / max(1.0, want[k].abs().max().item())
           for k in want}
    owned = ((case["targets_N"] >= start) & (case["targets_N"] < start + v // world)).sum().item()
    errors.append({"rank": rank, "case": i, "owned_targets": owned, **err})

everyone = [None] * world
dist.all_gather_object(everyone, errors)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump([e for per_rank in everyone for e in per_rank], f)
dist.destroy_process_group()
