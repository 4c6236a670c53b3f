"""Evaluate a checkpoint alone: greedy accuracy and pass@k on a held-out dataset.

    python -m moe_rl.eval --checkpoint runs/x/hf --data heldout.jsonl [--k 8] [--max-problems 200]
    python -m moe_rl.eval --checkpoint runs/x/checkpoints/step_000050 --data heldout.jsonl \\
        --config examples/hf_rspo.yaml sampler.backend=transformers

The checkpoint is a Hugging Face directory or a learner checkpoint (converted to a
temporary Hugging Face directory first). Prompts go through the checkpoint's own tokenizer
and chat template, rewards through `task.reward` (default `math`), sampling through the
recipe's sampler settings, exactly as `run.eval_every` evaluates during training
(`moe_rl.rollout.evaluate`). Prints one JSON object; `--out` also writes it (atomically).
`--check` stops after checking the flags, the files and the recipe (`eval OK: ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_rl.cli import add_debug_flag, cpu_environment, run_guarded, setup_logging

PROG = "python -m moe_rl.eval"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="Hugging Face directory or learner checkpoint")
    ap.add_argument("--data", required=True, help="held-out JSONL or Parquet (the dataset task's format)")
    ap.add_argument("--config", default=None, help="recipe for sampler / task settings (default: built-in defaults)")
    ap.add_argument("--k", type=int, default=4, help="samples per prompt for pass@k (default: 4)")
    ap.add_argument("--max-problems", type=int, default=0, help="evaluate the first N prompts (default: all)")
    ap.add_argument("--out", default="", help="also write the JSON result here")
    ap.add_argument("--check", action="store_true",
                    help="check the flags, files and recipe, print `eval OK: ...` and exit (nothing is built)")
    add_debug_flag(ap)
    ap.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    return ap.parse_args(argv)


def check_inputs(args: argparse.Namespace) -> None:
    """The files the flags name exist. Checked here, before they become recipe keys, so the
    error names the flag the user typed (not `task.data_path` / `run.init_checkpoint`)."""
    from moe_rl.config import ConfigError

    if not Path(args.data).is_file():
        raise ConfigError(f"--data {args.data}: no such file; give a JSONL or Parquet file of held-out prompts")
    if not Path(args.checkpoint).is_dir():
        raise ConfigError(f"--checkpoint {args.checkpoint}: no such directory; give a Hugging Face directory "
                          "(e.g. runs/<name>/hf) or a learner checkpoint (runs/<name>/checkpoints/step_N)")


def eval_recipe(args: argparse.Namespace) -> Any:
    """The recipe (`--config` or the defaults) with the flags applied as overrides."""
    from moe_rl.cli import resolve_recipe
    from moe_rl.config import load_recipe

    overrides = [*args.overrides, f"run.init_checkpoint={args.checkpoint}", f"task.eval_data_path={args.data}",
                 f"run.eval_k={args.k}", f"run.eval_max_problems={args.max_problems}"]
    if not any(o.startswith("task.name=") for o in args.overrides):
        overrides += ["task.name=dataset", f"task.data_path={args.data}"]
    return resolve_recipe(*load_recipe(args.config, overrides))


def evaluate_checkpoint(args: argparse.Namespace) -> dict:
    from moe_rl.rollout import RolloutCollector
    from moe_rl.runtime.atomic import atomic_write_text

    check_inputs(args)
    cfg = eval_recipe(args)
    if args.check:
        print(f"eval OK: {args.checkpoint} on {args.data} (greedy + pass@{args.k}, {cfg.sampler.backend} sampler)")
        return {}
    collector = RolloutCollector(sampler=cfg.sampler, task=cfg.task, rl=cfg.rl, model=cfg.model,
                                 parallel=cfg.parallel, run=cfg.run)
    try:
        with tempfile.TemporaryDirectory(prefix="moe_rl_eval_") as work:
            collector.start_sampler(Path(work), Path(args.checkpoint))
            metrics = collector.evaluate(0)
    finally:
        collector.close()
    result = {"checkpoint": str(args.checkpoint), "data": str(args.data), **metrics,
              "examples": collector.last_eval_examples}
    text = json.dumps(result, indent=2)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return result


def main(argv: list[str] | None = None) -> None:
    cpu_environment()
    args = _args(argv)
    setup_logging(0)
    sys.exit(run_guarded(PROG, lambda: (evaluate_checkpoint(args), 0)[1], debug=args.debug))


if __name__ == "__main__":
    main()
