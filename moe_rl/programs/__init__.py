"""The programs a user runs, each driven by the one run loop (`moe_rl.loop`):

    rl/            the GRPO family (`python -m moe_rl.train`): learner and engine roles,
                   the update phase, the policy loss, step components
    ppo/           PPO's critic as a step component of rl/, GAE
    dpo/           DPO / IPO (`python -m moe_rl.dpo`)
    reward_model/  a Bradley-Terry reward model (`python -m moe_rl.reward_model`)
    preference/    what DPO and the reward model share
    sft            the supervised warm start (`python -m moe_rl.sft`)

A program supplies its setup, one step, its evaluation and its state
(`moe_rl.loop.Program`); the loop owns resume, stepping, signals, saves, metrics and the
summary.
"""
