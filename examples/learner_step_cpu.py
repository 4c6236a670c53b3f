"""One tiny-MoE learner step on CPU with 2 processes (expert parallel), under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/learner_step_cpu.py
    torchrun --standalone --nproc-per-node 2 examples/learner_step_cpu.py parallel.tensor_model_parallel_size=2

Builds the tiny Qwen3-MoE-shaped model with megatron-core at the requested layout (EP=2 by
default), scores a random batch, takes one Adam step on a REINFORCE-style loss and prints
the loss, gradient norm and how the log-probabilities moved. The same code runs on GPUs
with NCCL and the Transformer Engine spec (`parallel.distributed_backend=nccl`).
"""

import sys

import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import load_config
from moe_rl.learner import Learner, MicroBatchLoss, init_distributed, parallel_layout


def main() -> None:
    overrides = sys.argv[1:] or ["parallel.expert_model_parallel_size=2"]
    cfg = load_config("examples/tiny_model.yaml", ["parallel.micro_batch_size=8", *overrides])
    rank, world = init_distributed(cfg.parallel.distributed_backend)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (6,), generator=g).tolist() for _ in range(16)]
    responses = [torch.randint(4, 128, (8,), generator=g).tolist() for _ in range(16)]
    batch = TokenBatch.from_lists(prompts, responses, seq_multiple=2)
    adv_B = torch.randn(16, generator=g)
    total = batch.response_lens_B.sum()

    def loss_fn(logp_BT, mb):
        mask = mb.batch.response_mask()
        return MicroBatchLoss(-(mb.extras["adv_B"][:, None] * logp_BT * mask).sum() / total)

    with parallel_layout(cfg.parallel, seed=0) as layout:
        updates = max(1, cfg.run.steps * cfg.rl.num_minibatches * cfg.rl.epochs)  # (an RL run's schedule)
        learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=updates)
        before = learner.logprobs(batch)
        metrics = learner.train_step(batch, loss_fn, extras={"adv_B": adv_B})
        after = learner.logprobs(batch)
        if rank == 0:
            moved = ((after - before) * batch.response_mask()).sum(-1)
            agree = float(((moved > 0) == (adv_B > 0)).float().mean())
            print(f"layout {layout.name} (world {world}): loss {metrics['loss']:.4f}, "
                  f"grad norm {metrics['grad_norm']:.3f}; sequences whose logprob moved with the sign "
                  f"of their advantage: {agree:.0%}")


if __name__ == "__main__":
    main()
