"""Worker for tests/integration/learner/test_learner_parallel.py (run under torchrun).

One launch of 4 processes, in three parts:
reference (rank 0 alone, a one-process world): fresh tiny MoE -> checkpoint `ckpt0`;
    logprobs of a fixed batch; the rollout-correction matrix's passes (loss, gradient norm);
    one optimizer step; full parameters after it; logprobs after it.
layouts (4 processes): for TP2, EP2 (alltoall), PP2, TP2xEP2: load `ckpt0`, score the
    same batch, take the same step, gather full parameters (TP2, at data parallel 2, first
    runs the rollout-correction matrix, then takes an update with a NaN loss, which must be
    skipped without a trace). EP2 also checks resume
    (save, step == load, step) and writes `ckpt_ep2` (after its step).
check (rank 0 alone, a one-process world): load `ckpt_ep2` at TP1 and score the batch.
Results go to <out>/{reference,layouts,check}.pt for the test to compare.
"""

import sys

from moe_rl.config import load_config, to_dict
from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from moe_rl.learner.parallel import parallel_layout
from moe_rl_testing.dist_helpers import alone_on_rank0, one_process_then_world
from moe_rl_testing.learner_utils import (
    correction_matrix,
    episode_batch,
    fixed_batch,
    learner_of,
    reinforce_loss,
)

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


def reference(out: str, batch, adv_B) -> dict:
    cfg = load_config(None, BASE)
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        save_checkpoint(learner, f"{out}/ckpt0", recipe=to_dict(cfg))
        result = {"logp": learner.logprobs(batch), "logp_episode": learner.logprobs(episode_batch()[0]),
                  "corrections": correction_matrix(learner, BASE)}
        result["metrics"], result["params"] = step_and_gather(learner, batch, adv_B)
        result["logp_after"] = learner.logprobs(batch)
    return result


def layouts(out: str, batch, adv_B) -> dict:
    result = {}
    for name, overrides in LAYOUTS.items():
        cfg = load_config(None, BASE + overrides)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            learner = learner_of(cfg, layout)
            load_checkpoint(learner, f"{out}/ckpt0")
            r = {"layout": layout.name, "logp": learner.logprobs(batch),
                 "logp_episode": learner.logprobs(episode_batch()[0])}
            if name == "tp2":  # (data parallel 2: the corrections' normalizers cross ranks)
                r["corrections"] = correction_matrix(learner, BASE + overrides)
            if name == "tp2":  # a NaN update first: skipped on every rank, it must leave no trace in the step
                r["nan"] = learner.train_step(batch, nan_loss(batch), extras={"adv_B": adv_B})
            r["metrics"], r["params"] = step_and_gather(learner, batch, adv_B)
            r["logp_after"] = learner.logprobs(batch)
            if name == "ep2":
                save_checkpoint(learner, f"{out}/ckpt_ep2", recipe=to_dict(cfg))
                r["next"] = learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
                resumed = learner_of(cfg, layout)
                load_checkpoint(resumed, f"{out}/ckpt_ep2")
                r["next_resumed"] = resumed.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
            result[name] = r
    return result


def check(out: str, batch) -> dict:
    cfg = load_config(None, BASE)
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        load_checkpoint(learner, f"{out}/ckpt_ep2")
        return {"logp": learner.logprobs(batch)}


def main() -> None:
    """Rank 0 runs the reference alone, all four the layouts, then rank 0 loads the EP2
    checkpoint alone: one process start where there were three."""
    out = sys.argv[1]
    batch, adv_B = fixed_batch()
    one_process_then_world(out, lambda: reference(out, batch, adv_B), lambda: layouts(out, batch, adv_B), world_size=4)
    alone_on_rank0(lambda: check(out, batch), f"{out}/check.pt")


if __name__ == "__main__":
    main()
