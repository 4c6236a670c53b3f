"""PPO: the RL program with a learned critic (`rl.advantage: gae`).

    critic_stage   the critic as a step component (`moe_rl.programs.rl.component`): its
                   values, GAE's token advantages, the clipped value loss, its own Adam
    gae            GAE, token rewards, whitening, the clipped value loss, the adaptive KL
                   controller (pure torch)

The critic model itself is the learner's (`moe_rl.learner.critic`); the RL program
(`moe_rl.programs.rl`) runs it through the component interface, never by name.
"""
