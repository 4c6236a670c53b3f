"""Supervised warm start: turn a random tiny MoE into a base policy with partial success.

    python -m moe_rl.sft --config examples/tiny_sft.yaml [section.key=value ...]
    torchrun --nproc-per-node 2 -m moe_rl.sft --config examples/tiny_sft.yaml parallel.expert_model_parallel_size=2

Each step minimises the negative log-likelihood of `sft.batch_size` reference completions
(`moe_rl.programs.sft`); every `run.eval_every` steps it measures the expected exact-match
reward of sampling (`eval/expected_reward`) and stops once it reaches `sft.target_reward`.
The run directory is every program's: config.yaml, metrics.jsonl, TensorBoard, checkpoints
every `run.save_every` steps and at the last, `run.resume=true` continues, Ctrl-C or
SIGTERM saves after the step in progress (exit status 130 / 143), summary.json. The
finished model alone (no optimizer state) goes to `sft.output` (default `<run>/base`), and
from a Hugging Face directory (examples/hf_sft.yaml) also to `<run>/hf` (run.export_hf).
Errors are one line (exit 2); `--debug` shows the traceback. `--check [--nproc N]` only
checks the recipe and its inputs for N ranks and prints one line.
"""

from __future__ import annotations

from moe_rl.cli import run_main

PROG = "python -m moe_rl.sft"


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, __doc__, argv, program=_program)


def _program() -> type:
    from moe_rl.programs.sft import SFTProgram

    return SFTProgram


if __name__ == "__main__":
    main()
