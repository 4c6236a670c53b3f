"""Preference tuning: DPO (or IPO) against the frozen starting checkpoint.

    python -m moe_rl.dpo --config examples/tiny_dpo.yaml [section.key=value ...]
    torchrun --nproc-per-node 2 -m moe_rl.dpo --config examples/tiny_dpo.yaml parallel.expert_model_parallel_size=2

Reads `{prompt | messages, chosen, rejected}` rows from task.data_path (held-out pairs from
task.eval_data_path), encodes them with the checkpoint's tokenizer and chat template as the
RL path encodes prompts, and trains run.init_checkpoint for run.steps steps of
dpo.batch_size pairs (`moe_rl.programs.dpo.program`). The run directory is the RL trainer's:
config.yaml, metrics.jsonl and TensorBoard (learner/loss, rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected, eval/*), checkpoints
(run.save_every; run.resume=true continues), summary.json, and <run>/hf at the end
(run.export_hf). Errors are one line (exit 2); `--debug` shows the traceback. `--check
[--nproc N]` only checks the recipe and its inputs for N ranks and prints one line.
"""

from __future__ import annotations

from moe_rl.cli import run_main

PROG = "python -m moe_rl.dpo"


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, __doc__, argv, program=_program)


def _program() -> type:
    from moe_rl.programs.dpo.program import DPOProgram

    return DPOProgram



if __name__ == "__main__":
    main()
