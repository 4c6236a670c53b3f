"""The programs a user runs, each driven by the one run loop (`moe_rl.loop`):

    rl/      the GRPO family and PPO (`python -m moe_rl.train`): learner and engine roles
    sft      the supervised warm start (`python -m moe_rl.sft`)

DPO and the reward model (`python -m moe_rl.dpo`, `python -m moe_rl.reward_model`) share
`moe_rl.programs.preference`. A program supplies its setup, one step, its evaluation and its state
(`moe_rl.loop.Program`); the loop owns resume, stepping, signals, saves, metrics and the
summary.
"""
