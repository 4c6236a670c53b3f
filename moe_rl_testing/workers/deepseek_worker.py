"""Worker for tests/integration/convert/test_deepseek_v3.py::test_two_process_layouts_match_transformers (run under
torchrun, 2 processes): at each layout given, one after the other in the one launch (TP2:
heads, the query / kv latents' column-parallel projections and sequence-parallel tokens
split; EP2: global expert ids and expert biases), each DeepseekV3 directory loaded, its
fixed batch scored, and its HF stream compared with the saved tensors. Rank 0 writes
{layout: {name: {"logp", "bad_stream"}}} to OUT.

    deepseek_worker.py tp2,ep2 OUT NAME=HF_DIR...
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moe_rl.config import load_config
from moe_rl.learner.export import hf_named_tensors
from moe_rl.learner.parallel import init_distributed, parallel_layout
from moe_rl_testing.deepseek_fixtures import learner_from_hf
from moe_rl_testing.learner_utils import fixed_batch

LAYOUTS = {"tp2": ("parallel.tensor_model_parallel_size=2",), "ep2": ("parallel.expert_model_parallel_size=2",)}


def main() -> None:
    pars, out = sys.argv[1].split(","), sys.argv[2]
    dirs = {a.split("=", 1)[0]: Path(a.split("=", 1)[1]) for a in sys.argv[3:]}
    rank, _ = init_distributed()
    batch, _ = fixed_batch()
    results = {}
    for par in pars:
        results[par] = {}
        with parallel_layout(load_config(None, list(LAYOUTS[par])).parallel, seed=5) as lay:
            for name, path in dirs.items():
                learner = learner_from_hf(path, lay, LAYOUTS[par])
                logp = learner.logprobs(batch)
                stream = dict(hf_named_tensors(learner))  # rank 0 gets the pairs
                saved = load_file(str(path / "model.safetensors"))
                mtp = {n for n in saved if n.startswith("model.layers.3.")}
                bad = [n for n, t in stream.items() if not torch.equal(t, saved[n])]
                bad += [n for n in set(saved) - mtp if n not in stream] if rank == 0 else []
                results[par][name] = {"logp": logp, "bad_stream": bad}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
