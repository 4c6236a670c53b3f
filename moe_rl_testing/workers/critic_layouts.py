"""Worker for tests/integration/programs/ppo/test_ppo.py's layout test (run under torchrun).

One launch of 2 processes (`dist_helpers.one_process_then_world`):
reference (rank 0 alone, a one-process world): a fresh tiny MoE -> checkpoint `ckpt0`; a
    critic started from it (the value head then set to fixed values), its values of a fixed
    batch, one update of the clipped value loss towards fixed returns, its values after.
    Then the reward model's step on the same value model: the scores of 6 shipped preference
    pairs (12 rows), one update of its Bradley-Terry surrogate, the scores after.
layouts (2 processes): the same at TP2, EP2 (data parallel 2: a pair's two rows on
    different ranks) and PP2, from `ckpt0`. Results go to <out>/reference.pt and <out>/layouts.pt.
"""

import sys

import torch

from moe_rl.config import load_config, to_dict
from moe_rl.learner.parallel import parallel_layout
from moe_rl_testing.dist_helpers import one_process_then_world
from moe_rl_testing.learner_utils import fixed_batch, learner_of, rl_updates

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}
# (as moe_rl_testing/workers/learner_layouts.py: a larger Adam eps keeps the first step a smooth function of g;
# the critic's optimizer section and the reward model's, `optimizer`, alike)
BASE = ["rl.advantage=gae", "rl.objective=grpo", "parallel.micro_batch_size=4", "critic.optimizer.lr=1e-2",
        "critic.optimizer.adam_eps=1e-3", "critic.optimizer.clip_grad=0.5", "optimizer.adam_eps=1e-3",
        "optimizer.clip_grad=0.5"]


def set_head(gpt) -> None:
    head = getattr(gpt, "value_head", None)
    if head is None:  # (not the last pipeline stage)
        return
    with torch.no_grad():
        # values of the size of rewards in [0, 1] (fp32 noise grows with them: ~2e-6 at |V| ~ 4)
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(11)) * 0.05)
        head.bias.fill_(0.25)


def critic_step(critic, cfg) -> dict:
    from moe_rl.programs.ppo.critic_stage import OLD_VALUES, RETURNS, ValueLossFn

    tokens, _ = fixed_batch()
    values = critic.score_whole(tokens).logp_BT  # (the critic's per-token output: its values)
    returns = torch.randn(values.shape, generator=torch.Generator().manual_seed(12)) * tokens.response_mask()
    update = critic.train_step(tokens, ValueLossFn(cfg.critic), extras={OLD_VALUES: values, RETURNS: returns})
    return {"values": values, "metrics": update, "grad_norm": update["grad_norm"],
            "values_after": critic.score_whole(tokens).logp_BT}


def reward_model_step(model, tp: int) -> dict:
    from moe_rl.programs.reward_model.loss import (
        COEF_KEY,
        compared_slots,
        score_coefficients,
        score_surrogate_loss,
    )
    from moe_rl_testing.workers.dpo_layouts import pairs_batch

    tokens = pairs_batch(tp)
    chosen, rejected = compared_slots(tokens, "divergence")
    scores = model.logprobs(tokens)
    update = model.train_step(tokens, score_surrogate_loss, extras={COEF_KEY: score_coefficients(scores, chosen, rejected)})
    return {"scores": scores, "grad_norm": update["grad_norm"], "scores_after": model.logprobs(tokens)}


def run(mode: str, out: str) -> dict:
    from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.learner.critic import VALUE_HEAD_KEYS, Critic

    result = {}
    for name, overrides in ({"reference": []} if mode == "reference" else LAYOUTS).items():
        cfg = load_config(None, BASE + overrides)
        with parallel_layout(cfg.parallel, seed=3) as layout:
            if mode == "reference":
                save_checkpoint(learner_of(cfg, layout), f"{out}/ckpt0", recipe=to_dict(cfg))
            critic = Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=rl_updates(cfg))
            load_checkpoint(critic, f"{out}/ckpt0", load_optimizer=False, optional=(VALUE_HEAD_KEYS,))
            set_head(critic.gpt)
            result[name] = critic_step(critic, cfg)
            result[name]["rm"] = reward_model_step(critic, layout.tp)
    return result


def main() -> None:
    out = sys.argv[1]
    one_process_then_world(out, lambda: run("reference", out), lambda: run("layouts", out), world_size=2)


if __name__ == "__main__":
    main()
