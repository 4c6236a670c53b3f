"""Worker for tests/integration/convert/test_convert_glm4.py: a DeepSeek-style model (sigmoid router with a
non-zero expert bias, one shared expert, QK-norm, a leading dense layer) through the
Glm4-MoE layout.

save1 <out> (torchrun, 1 process): a learner whose routers get random expert biases (set
    directly: megatron only moves them while training) saves `c1`, scores the fixed batch;
    then c1 is converted to HF (`hf1`) and back to a megatron checkpoint (`rt1`).
ep2 <out> (torchrun, 2 processes, EP=2): c1 loaded at EP=2 is saved again (`c_ep2`), scored,
    and streamed as HF tensors (`hf_named_tensors`); a second learner loads `hf1`
    (`load_hf_weights`) and scores the batch.
vllm <out> (plain python): the sampler package's vLLM backend on `hf1` samples a few tokens,
    re-scores them after a weight sync of the same weights, and again after a sync with the
    expert biases zeroed.
Results go to <out>/<mode>.pt (or .json) for the test to compare.
"""

import json
import os
import sys

import torch

from moe_rl.config import to_dict
from moe_rl_testing.workers.convert_worker import fixed_batch

DS = [
    "parallel.micro_batch_size=4",
    "model.init_method_std=0.05",
    "model.num_dense_layers=1",
    "model.moe_router_score_function=sigmoid",
    "model.moe_router_enable_expert_bias=true",
    "model.moe_shared_expert_intermediate_size=64",  # = moe_ffn_hidden_size: n_shared_experts=1
]
EP2 = ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"]
BIAS_STD = 0.1  # about the spread of the sigmoid scores at init: it changes which experts win


@torch.no_grad()
def set_expert_biases(gpt: torch.nn.Module, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    n = 0
    for name, buf in gpt.named_buffers():
        if name.endswith("router.expert_bias"):
            buf.copy_(torch.randn(buf.shape, generator=g) * BIAS_STD)
            n += 1
    return n


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "vllm":
        return run_vllm(out)
    import torch.distributed as dist

    from moe_rl.config import load_config
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.learner.engine import Learner
    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.learner.hf_import import hf_to_megatron, load_hf_weights
    from moe_rl.learner.parallel import init_distributed, parallel_layout

    rank, _ = init_distributed()
    batch = fixed_batch()
    result = {"tokens_BS": batch.tokens_BS, "prompt_lens_B": batch.prompt_lens_B,
              "response_lens_B": batch.response_lens_B, "response_width": batch.response_width}
    if mode == "save1":
        cfg = load_config(None, DS)
        with parallel_layout(cfg.parallel, seed=5) as layout:
            learner = Learner(cfg.model, cfg.parallel, layout)
            assert set_expert_biases(learner.gpt, seed=3) == cfg.model.num_layers - cfg.model.num_dense_layers
            save_checkpoint(learner, f"{out}/c1", recipe=to_dict(cfg))
            result["logp"] = learner.logprobs(batch)
        megatron_to_hf(f"{out}/c1", f"{out}/hf1")
        hf_to_megatron(f"{out}/hf1", f"{out}/rt1")
    elif mode == "ep2":
        cfg = load_config(None, DS + EP2)
        with parallel_layout(cfg.parallel, seed=7) as layout:
            learner = Learner(cfg.model, cfg.parallel, layout)
            load_checkpoint(learner, f"{out}/c1")
            save_checkpoint(learner, f"{out}/c_ep2", recipe=to_dict(cfg))
            result["logp"] = learner.logprobs(batch)
            result["stream"] = dict(hf_named_tensors(learner))  # empty on rank 1
            from_hf = Learner(cfg.model, cfg.parallel, layout)
            load_hf_weights(from_hf, f"{out}/hf1")
            result["hf1_logp"] = from_hf.logprobs(batch)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if rank == 0:
        torch.save(result, f"{out}/{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_vllm(out: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from moe_rl.sampler import VLLMEngineConfig, make_sampler
    from moe_rl.sampler.weights import iter_checkpoint

    hf1 = f"{out}/hf1"
    sampler = make_sampler(hf1, VLLMEngineConfig(precision="fp32", seed=0, max_model_len=64))
    prompts = [[5, 17, 33, 42], [9, 8, 7]]
    r = sampler.generate(prompts, n=1, max_new_tokens=6, temperature=1.0, seed=1)
    responses = r.response_token_ids
    sampler.update_weights(iter_checkpoint(hf1))  # weight sync of the same weights
    synced = sampler.score(prompts, responses)
    sampler.update_weights(
        (name, torch.zeros_like(t) if name.endswith("e_score_correction_bias") else t)
        for name, t in iter_checkpoint(hf1)
    )
    unbiased = sampler.score(prompts, responses)
    sampler.close()
    rows = [{"prompt": p, "response": resp, "logprobs": lp, "synced": s, "unbiased": u}
            for p, resp, lp, s, u in zip(prompts, responses, r.logprobs, synced, unbiased)]
    with open(f"{out}/vllm.json", "w") as f:
        json.dump({"rows": rows}, f)


if __name__ == "__main__":
    main()
