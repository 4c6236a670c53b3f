"""What the trainers that learn from preference pairs share (DPO in `moe_rl.dpo`, the reward
model in `moe_rl.reward_model`): `data` (preference rows -> pairs -> token batches),
`preflight` (input checks, `--check`), `loop` (the step loop, run directory, evaluation,
checkpoints and signals)."""
