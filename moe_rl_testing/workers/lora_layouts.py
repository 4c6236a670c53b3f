"""Worker for tests/integration/learner/test_lora.py's layout test (run under torchrun, 4 processes).

reference (rank 0 alone): a LoRA learner takes one update (so B != 0) and saves `ckpt0`,
    scores the fixed batch, takes a second update, gathers every full tensor, scores again.
layouts (4 processes): TP2, EP2, PP2 and TP2 x ETP2 each load `ckpt0` (adapters resharded
    from one process), score, take the same second update, gather, score again. EP2 saves
    `ckpt_ep2` after it, and checks that a resumed learner takes the same next update.
check (rank 0 alone): `ckpt_ep2` loaded at one process scores the batch.
"""

import sys

from moe_rl.config import load_config, to_dict
from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from moe_rl.learner.parallel import parallel_layout
from moe_rl_testing.dist_helpers import alone_on_rank0, one_process_then_world
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "tp2etp2": ["parallel.tensor_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2"],
}
BASE = ["parallel.micro_batch_size=2", "optimizer.lr=1e-2", "optimizer.adam_eps=1e-3", "model.lora.rank=4",
        "model.lora.alpha=8", "model.lora.modules=[attention,experts]", "model.layer_spec=local"]


def step_and_gather(learner, batch, adv_B):
    from moe_rl.learner.gather import iter_full_tensors

    metrics = learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    return metrics, dict(iter_full_tensors(learner.gpt))


def reference(out: str, batch, adv_B) -> dict:
    from moe_rl.learner.gather import iter_full_tensors

    cfg = load_config(None, BASE)
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout, total_updates=4)
        learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
        save_checkpoint(learner, f"{out}/ckpt0", recipe=to_dict(cfg))
        result = {"logp": learner.logprobs(batch), "params_before": dict(iter_full_tensors(learner.gpt))}
        result["metrics"], result["params"] = step_and_gather(learner, batch, adv_B)
        result["logp_after"] = learner.logprobs(batch)
    return result


def layouts(out: str, batch, adv_B) -> dict:
    from moe_rl.learner.gather import iter_full_tensors

    result = {}
    for name, overrides in LAYOUTS.items():
        cfg = load_config(None, BASE + overrides)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            learner = learner_of(cfg, layout, total_updates=4)
            load_checkpoint(learner, f"{out}/ckpt0")
            r = {"logp": learner.logprobs(batch)}
            r["metrics"], r["params"] = step_and_gather(learner, batch, adv_B)
            r["logp_after"] = learner.logprobs(batch)
            if name == "ep2":
                save_checkpoint(learner, f"{out}/ckpt_ep2", recipe=to_dict(cfg))
                r["next"] = learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
                resumed = learner_of(cfg, layout, total_updates=4)
                load_checkpoint(resumed, f"{out}/ckpt_ep2")
                r["next_resumed"] = resumed.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
                r["params_next"] = dict(iter_full_tensors(learner.gpt))
                r["params_next_resumed"] = dict(iter_full_tensors(resumed.gpt))
            result[name] = r
    return result


def check(out: str, batch) -> dict:
    cfg = load_config(None, BASE)
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout, total_updates=4)
        load_checkpoint(learner, f"{out}/ckpt_ep2")
        return {"logp": learner.logprobs(batch)}


def main() -> None:
    out = sys.argv[1]
    batch, adv_B = fixed_batch()
    one_process_then_world(out, lambda: reference(out, batch, adv_B), lambda: layouts(out, batch, adv_B), world_size=4)
    alone_on_rank0(lambda: check(out, batch), f"{out}/check.pt")


if __name__ == "__main__":
    main()
