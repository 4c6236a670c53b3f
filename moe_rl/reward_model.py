"""A reward model on preference pairs: the starting transformer for PPO's critic.

    python -m moe_rl.reward_model --config examples/tiny_rm.yaml [section.key=value ...]
    torchrun --nproc-per-node 2 -m moe_rl.reward_model --config examples/tiny_rm.yaml parallel.expert_model_parallel_size=2

Reads the DPO trainer's `{prompt | messages, chosen, rejected}` rows (task.data_path; held
out: task.eval_data_path), encodes them with the checkpoint's tokenizer and chat template,
and trains a value model (run.init_checkpoint's transformer with a scalar head that starts
small and random: rm.head_init_scale, 0 for a zero head) for run.steps steps of
rm.batch_size pairs so that chosen responses score higher (`moe_rl.programs.reward_model.program`).
The run directory is the RL trainer's: config.yaml, metrics.jsonl and TensorBoard
(learner/loss, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
rewards/slot_accuracies, eval/*), checkpoints
(run.save_every; run.resume=true continues) and summary.json; start PPO's critic from the
last one with critic.init_checkpoint. Errors are one line (exit 2); `--debug` shows the
traceback. `--check [--nproc N]` only checks the recipe and its inputs and prints one line.
"""

from __future__ import annotations

from moe_rl.cli import run_main

PROG = "python -m moe_rl.reward_model"


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, __doc__, argv, program=_program)


def _program() -> type:
    from moe_rl.programs.reward_model.program import RewardModelProgram

    return RewardModelProgram



if __name__ == "__main__":
    main()
