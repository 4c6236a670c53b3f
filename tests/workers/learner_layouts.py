"""Worker for tests/test_learner_parallel.py (run under torchrun).

reference (1 process): fresh tiny MoE -> checkpoint `ckpt0`; logprobs of a fixed batch;
    one optimizer step; full parameters after it; logprobs after it.
layouts (4 processes): for TP2, EP2 (alltoall), PP2, TP2xEP2: load `ckpt0`, score the
    same batch, take the same step, gather full parameters (TP2 first takes an update with
    a NaN loss, which must be skipped without a trace). EP2 also checks resume
    (save, step == load, step) and writes `ckpt_ep2` (after its step).
check (1 process): load `ckpt_ep2` at TP1 and score the batch.
Results go to <out>/<mode>.pt for the test to compare.
"""

import sys

import torch
import torch.distributed as dist
from learner_utils import episode_batch, fixed_batch, learner_of, reinforce_loss

from moe_rl.config import load_config
from moe_rl.learner.parallel import init_distributed, parallel_layout

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "tp2ep2": ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],
}
# Adam's first step is lr * g / (|g| + eps), ~lr * sign(g) when |g| >> eps: elements whose
# true gradient is ~0 would flip sign with fp32 summation-order noise between layouts. A
# larger eps keeps the update a smooth function of g, so the comparison measures the
# parallel math rather than noise at zero.
BASE = ["parallel.micro_batch_size=2", "optimizer.lr=1e-2", "optimizer.adam_eps=1e-3",
        "optimizer.clip_grad=0.5"]


def nan_loss(batch):
    """The reinforce loss times NaN (every gradient NaN)."""
    from moe_rl.learner import MicroBatchLoss

    loss_fn = reinforce_loss(batch)

    def poisoned(logp_BT, mb):
        out = loss_fn(logp_BT, mb)
        return MicroBatchLoss(out.loss * float("nan"), out.metrics, out.weight)

    return poisoned


def step_and_gather(learner, batch, adv_B):
    from moe_rl.learner.gather import iter_full_tensors

    metrics = learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    full = dict(iter_full_tensors(learner.gpt))
    return metrics, full


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    rank, _ = init_distributed()
    batch, adv_B = fixed_batch()
    result = {}
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint

    if mode == "reference":
        cfg = load_config(None, BASE)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            learner = learner_of(cfg, layout)
            save_checkpoint(learner, f"{out}/ckpt0", config=cfg)
            result["logp"] = learner.logprobs(batch)
            result["logp_episode"] = learner.logprobs(episode_batch()[0])
            result["metrics"], result["params"] = step_and_gather(learner, batch, adv_B)
            result["logp_after"] = learner.logprobs(batch)
    elif mode == "layouts":
        for name, overrides in LAYOUTS.items():
            cfg = load_config(None, BASE + overrides)
            with parallel_layout(cfg.parallel, seed=3) as layout:
                learner = learner_of(cfg, layout)
                load_checkpoint(learner, f"{out}/ckpt0")
                r = {"layout": layout.name, "logp": learner.logprobs(batch),
                     "logp_episode": learner.logprobs(episode_batch()[0])}
                if name == "tp2":  # a NaN update first: skipped on every rank, it must leave no trace in the step
                    r["nan"] = learner.train_step(batch, nan_loss(batch), extras={"adv_B": adv_B})
                r["metrics"], r["params"] = step_and_gather(learner, batch, adv_B)
                r["logp_after"] = learner.logprobs(batch)
                if name == "ep2":
                    save_checkpoint(learner, f"{out}/ckpt_ep2", config=cfg)
                    r["next"] = learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
                    resumed = learner_of(cfg, layout)
                    load_checkpoint(resumed, f"{out}/ckpt_ep2")
                    r["next_resumed"] = resumed.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
                result[name] = r
    elif mode == "check":
        cfg = load_config(None, BASE)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            learner = learner_of(cfg, layout)
            load_checkpoint(learner, f"{out}/ckpt_ep2")
            result["logp"] = learner.logprobs(batch)
    else:
        raise SystemExit(f"unknown mode {mode}")
    if rank == 0:
        torch.save(result, f"{out}/{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
