"""Worker for tests/integration/plan/test_plan.py (run under torchrun): what the real learner holds, per rank.

    plan_learner.py SPECS.json OUT_DIR

SPECS: {"one": SPEC, "two": SPEC}; SPEC: {"models": {name: [overrides]}, "layouts": {name:
[overrides]}, "tiny": recipe or null}. "one" is measured by rank 0 alone, as a one-process
run (a one-rank world of its own, `dist_helpers.plain_process`), while the other ranks wait
to join the torchrun world; then every rank measures "two" in it: one launch for both.
For every model x layout, each rank builds `moe_rl.learner.Learner` (model from the
overrides, e.g. run.init_checkpoint=<dir with config.json>, resolved as the planner does)
and reports its parameter count, parameter bytes and megatron DDP grad-buffer bytes.
With "tiny" (one process), the recipe's learner also takes one optimizer step and reports
the bytes of Adam's moments. Rank r writes OUT_DIR/<one|two>.r.json.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import load_config
from moe_rl.learner.engine import Learner
from moe_rl.learner.parallel import init_distributed, parallel_layout
from moe_rl.plan.planner import resolve_model
from moe_rl_testing.dist_helpers import plain_process
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss


def grad_buffer_bytes(learner: Learner) -> int:
    buffers = learner.model.buffers + learner.model.expert_parallel_buffers
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)


def adam_state_bytes(learner: Learner) -> int:
    """exp_avg + exp_avg_sq of every parameter (torch's per-tensor `step` scalars aside)."""
    total = 0
    for opt in learner.optimizer.chained_optimizers:
        for state in opt.optimizer.state.values():
            total += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    return total


def measure(learner: Learner) -> dict:
    params = list(learner.gpt.parameters())
    return {
        "rank": dist.get_rank(),
        "pp_rank": learner.layout.pp_rank,
        "params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": grad_buffer_bytes(learner),
    }


def measure_spec(spec: dict) -> dict:
    out = {}
    for model, model_overrides in spec.get("models", {}).items():
        for layout_name, layout_overrides in spec["layouts"].items():
            cfg = resolve_model(load_config(None, model_overrides + layout_overrides)).cfg
            with parallel_layout(cfg.parallel, seed=1) as layout:
                out[f"{model}/{layout_name}"] = measure(learner_of(cfg, layout))
    if spec.get("tiny"):
        cfg = load_config(spec["tiny"], ["parallel.micro_batch_size=4"])
        with parallel_layout(cfg.parallel, seed=1) as layout:
            learner = learner_of(cfg, layout)
            batch, adv_B = fixed_batch()
            learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
            out["tiny"] = {**measure(learner), "adam_bytes": adam_state_bytes(learner)}
    return out


def main() -> None:
    specs, out_dir = json.loads(open(sys.argv[1]).read()), Path(sys.argv[2])
    if os.environ["RANK"] == "0":
        with plain_process():
            assert init_distributed() == (0, 1)
            (out_dir / "one.0.json").write_text(json.dumps(measure_spec(specs["one"])))
    rank, _ = init_distributed()  # the other ranks wait here for rank 0's one-process part
    (out_dir / f"two.{rank}.json").write_text(json.dumps(measure_spec(specs["two"])))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
