"""A Bradley-Terry reward model on preference pairs (`python -m moe_rl.reward_model`), the
starting point of PPO's critic: `loss` (the pair loss over compared slots, its closed-form
gradient, the statistics), `program` (the run, on `moe_rl.programs.preference.program`)."""
