"""What the programs that learn from preference pairs share (DPO in `moe_rl.programs.dpo`,
the reward model in `moe_rl.programs.reward_model`): `data` (preference rows -> pairs ->
token batches), `preflight` (input checks, `--check`), `program` (the step, evaluation and
summary of a pairs run in the one run loop)."""
