"""Measure the sampler-learner probability mismatch of a checkpoint and write a report.

    python tools/measure_mismatch.py                                  # shipped tiny model, vLLM fp32 vs learner fp32
    python tools/measure_mismatch.py --sweep --layout 1,ep2 --out runs/mm
    python tools/measure_mismatch.py --settings vllm:fp32 --top-p 1,0.9 --out runs/mm_top_p
    python tools/measure_mismatch.py --checkpoint runs/x/checkpoints/step_000050 \\
        --prompts my_prompts.jsonl --settings vllm:bf16/learner:fp32 vllm:fp8_emulated/learner:fp32@ep2

Each setting samples responses with a sampler (vLLM or transformers, in fp32, bf16 or
EMULATED fp8: weights rounded through float8_e4m3fn with a per-tensor scale, bf16 compute),
scores the same tokens with the megatron learner (fp32 or bf16, at a parallel layout), and
compares the two log-probabilities token by token with the metrics the trainer logs every
step (moe_rl.diagnostics.compute_mismatch). The output directory gets mismatch.json,
REPORT.md (summary table, buckets, how to read it) and plots/*.png; it is written
atomically and replaces an older report there, and nothing is written on any error.

Settings: BACKEND:PRECISION[/learner:PRECISION][@LAYOUT], e.g. vllm:bf16/learner:fp32@ep2.
Layouts: "1" (one process, the default) or tp2 / pp2 / ep2 / etp2 tokens joined by "-".
A multi-process layout runs the learner in torchrun workers that the tool launches itself
(run the tool as a plain process, not under torchrun); the samplers run once, in this
process, and every layout scores the very same rollouts.

Bad input (missing checkpoint, empty or malformed prompt file, unknown setting, a layout
that does not fit the model, a damaged checkpoint, an unwritable --out, a full disk) exits
with status 2 and one line naming the file and line; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings

from moe_rl.mismatch.settings import (
    LEARNER_PRECISIONS,
    SAMPLER_BACKENDS,
    SAMPLER_PRECISIONS,
    MeasureError,
    ScoringLayout,
    Setting,
    sweep_settings,
)
from moe_rl.mismatch.sources import SHIPPED_CHECKPOINT


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="measure_mismatch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("weights and prompts")
    src.add_argument("--checkpoint", default=str(SHIPPED_CHECKPOINT),
                     help="learner (megatron) checkpoint directory or Qwen3-MoE Hugging Face directory "
                          "(default: the shipped tiny model, moe_rl/assets/tiny_base)")
    src.add_argument("--out", default="runs/mismatch",
                     help="report directory: new, or an older report that is replaced (default: runs/mismatch)")
    which = src.add_mutually_exclusive_group()
    which.add_argument("--task", default="",
                       help="task to draw prompts from (default: the checkpoint's task, e.g. reverse)")
    which.add_argument("--prompts", default="", metavar="FILE.jsonl",
                       help='JSONL file, one {"prompt": ...} object per line ("answer" and other keys are '
                            "ignored); strict: a malformed line is an error naming the line")
    src.add_argument("--num-prompts", type=int, default=32,
                     help="prompts drawn from the task, or the first N of the file (default: 32)")
    src.add_argument("--tokenizer", default="",
                     help="tokenizer directory, tokenizer.json or SentencePiece .model (default: the checkpoint's own)")
    src.add_argument("--chat-template", default="auto",
                     help="auto (the tokenizer's template when it has one), none, or a .jinja file")

    samp = ap.add_argument_group("sampling")
    samp.add_argument("-n", "--samples-per-prompt", type=int, default=4,
                      help="responses per prompt and sampler (default: 4)")
    samp.add_argument("--max-new-tokens", type=int, default=None,
                      help="longest response (default: the recipe's sampler.max_new_tokens)")
    samp.add_argument("--temperature", type=float, default=None,
                      help="sampling and scoring temperature (default: the recipe's sampler.temperature)")
    samp.add_argument("--top-p", default="1", metavar="P[,P...]",
                      help="the sampler's top_p, comma-separated: every setting is measured at each (default: 1). "
                           "Below 1 the sampler's log-prob is the truncated distribution's while the learner "
                           "scores the full softmax: the bias RL training refuses top_p < 1 for")
    samp.add_argument("--seed", type=int, default=0,
                      help="seed of the task's prompts and of every sampler (default: 0)")

    sets = ap.add_argument_group("settings (the report's rows)")
    sets.add_argument("--backend", choices=SAMPLER_BACKENDS, default=None,
                      help="sampler backend; transformers also reports routing disagreement "
                           "(default: the recipe's sampler.backend, vllm for an HF directory)")
    sets.add_argument("--sampler-precision", choices=SAMPLER_PRECISIONS, default=None,
                      help="sampler precision; fp8_emulated is an emulation "
                           "(default: the recipe's sampler.precision)")
    sets.add_argument("--learner-precision", choices=LEARNER_PRECISIONS, default=None,
                      help="learner precision (default: the recipe's model.params_dtype)")
    sets.add_argument("--layout", default="1",
                      help="learner layout(s), comma-separated: 1 (one process), ep2, tp2, pp2, tp2-ep2, ... "
                           "(default: 1)")
    sets.add_argument("--sweep", action="store_true",
                      help="one row per sampler precision (fp32, bf16, fp8_emulated) against the learner "
                           "precision, for each --layout")
    sets.add_argument("--settings", nargs="+", default=None, metavar="SETTING",
                      help="explicit rows, e.g. vllm:bf16/learner:fp32 transformers:fp8_emulated@ep2; "
                           "a setting without @ is measured at each --layout, one without /learner: "
                           "uses --learner-precision (--backend and --sampler-precision are not used)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def settings_from_args(args: argparse.Namespace, recipe) -> tuple[Setting, ...]:
    """The report's rows from --settings, --sweep or the single-setting flags, each at every
    --top-p."""
    top_ps = parse_top_p(args.top_p)
    return tuple(dataclasses.replace(s, top_p=p) for s in _settings(args, recipe) for p in top_ps)


def parse_top_p(text: str) -> list[float]:
    """--top-p's comma-separated values, each in (0, 1]."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MeasureError(f"--top-p {text!r}: expected numbers in (0, 1], comma-separated, e.g. 1,0.9") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise MeasureError(f"--top-p {text!r}: every value must be in (0, 1], e.g. 1,0.9")
    return list(dict.fromkeys(values))


def _settings(args: argparse.Namespace, recipe) -> tuple[Setting, ...]:
    layouts = [ScoringLayout.parse(t) for t in args.layout.split(",")]
    backend = args.backend or recipe.sampler.backend
    learner = args.learner_precision or recipe.model.params_dtype
    if args.settings:
        if args.sweep:
            raise MeasureError("--settings and --sweep are exclusive: --settings lists the rows itself")
        items = [t.strip() for item in args.settings for t in item.split(",") if t.strip()]
        return tuple(Setting.parse(t, lay, learner) for t in items for lay in ([None] if "@" in t else layouts))
    if args.sweep:
        return tuple(sweep_settings(backend, learner, layouts))
    precision = args.sampler_precision or recipe.sampler.precision
    return tuple(Setting(backend, precision, learner, lay) for lay in layouts)


def quiet_libraries() -> None:
    """Keep the console to the progress bar: vLLM's engine start-up log, megatron's "Apex
    is not installed" and torch/vLLM deprecation warnings, and transformers' per-model
    loading bar say nothing a user of this tool can act on (errors still show)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    for module in (r"megatron\.", r"torch\.distributed\.checkpoint", r"vllm\."):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    logging.getLogger("torch._library").setLevel(logging.ERROR)  # "Triton not available"


def measure(args: argparse.Namespace) -> int:
    from moe_rl.mismatch.run import MeasureConfig, run
    from moe_rl.mismatch.sources import resolve_checkpoint

    try:
        recipe = resolve_checkpoint(args.checkpoint).cfg
        mc = MeasureConfig(
            checkpoint=args.checkpoint,
            settings=settings_from_args(args, recipe),
            prompts_file=args.prompts,
            task=args.task,
            num_prompts=args.num_prompts,
            samples_per_prompt=args.samples_per_prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            progress=not args.no_progress,
        )
        out = run(mc, args.out)
    except MeasureError as e:
        print(f"measure_mismatch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {out}/REPORT.md")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Any other error (a damaged checkpoint, an unwritable --out, a full disk) is one line
    and exit status 2 too; --debug shows the traceback."""
    ap = build_parser()
    from moe_rl.cli import add_debug_flag, cpu_environment, run_guarded

    add_debug_flag(ap)
    args = ap.parse_args(argv)
    cpu_environment()
    quiet_libraries()
    return run_guarded("measure_mismatch", lambda: measure(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
