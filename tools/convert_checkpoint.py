"""Convert between learner checkpoints and Hugging Face (Qwen3-MoE) directories.

    python tools/convert_checkpoint.py --to hf --src runs/x/checkpoints/step_000050 --dst runs/x/hf
    python tools/convert_checkpoint.py --to megatron --src Qwen3-MoE-dir --dst ckpt [--dtype fp32]
    python tools/convert_checkpoint.py --to hf --peft --src runs/x/checkpoints/step_000050 --dst runs/x/peft

A LoRA run's checkpoint converts --to hf merged (every adapted weight written as
W + (alpha / rank) B A); with --peft its attention adapters are written as a PEFT adapter
directory instead (expert adapters have no PEFT target: refused in one line).

--to hf streams tensor by tensor (peak memory ~ the largest tensor) from a checkpoint saved
at any TP/EP/PP layout; --to megatron builds a one-process learner and saves it (loadable
at any layout). The output is written under a temp name and renamed when complete; an
existing output is refused unless --force, and temp directories an interrupted conversion
left beside it (`<dst>.tmp-*`) are removed first.

Trust: a megatron checkpoint is read only when its manifest.json verifies (every file's
size and SHA-256; nothing is unpickled before); one without a manifest needs --trust
(docs/checkpoints.md). Hugging Face directories (safetensors) hold no code.

Bad input, a damaged checkpoint, an unwritable --dst or a full disk exits with status 2 and
one line naming the file and the fix; --debug shows the traceback instead.
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
from pathlib import Path

PROG = "convert_checkpoint"


def parse_size(text: str) -> int:
    """'2GB', '512MiB', '1e9' -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 2GB, 512MiB or 1000000")
    try:
        value = float(match.group(1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 2GB, 512MiB or 1000000") from None
    unit = (match.group(2) or "B").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** powers[unit[0]]
    if not 0 < value * scale < 2**62:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return int(value * scale)


def build_parser() -> argparse.ArgumentParser:
    from moe_rl.cli import add_debug_flag

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--to", choices=["hf", "megatron"], required=True, help="output format")
    ap.add_argument("--src", required=True, help="input directory")
    ap.add_argument("--dst", required=True, help="output directory (must not exist unless --force)")
    ap.add_argument("--shard-size", type=parse_size, default="2GiB", help="max safetensors shard size (--to hf)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                    help="output dtype (default: as stored / as config.json says)")
    ap.add_argument("--tokenizer", default=None,
                    help="SentencePiece model for the tokenizer files (--to hf; default: the checkpoint's)")
    ap.add_argument("--peft", action="store_true",
                    help="--to hf of a LoRA checkpoint: its attention adapters as a PEFT adapter directory "
                         "(instead of the merged model)")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    ap.add_argument("--trust", action="store_true",
                    help="read a megatron checkpoint that has no manifest.json (its pickles can run code: only "
                         "for files you trust)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(ap)
    return ap


def convert(args: argparse.Namespace) -> int:
    from moe_rl.checkpoints.temps import remove_temps
    from moe_rl.config import ConfigError

    dst = Path(args.dst)
    if dst.exists() and not args.force:  # checked here so the line names this tool's flag
        raise ConfigError(f"--dst {dst} already exists; pass --force to replace it, or choose another --dst")
    remove_temps(dst.parent, glob.escape(dst.name))  # what a killed conversion to this --dst left
    if args.peft and args.to != "hf":
        raise ConfigError("--peft exports a LoRA checkpoint's adapters: use it with --to hf")
    if args.peft:
        from moe_rl.convert import megatron_to_peft

        out = megatron_to_peft(args.src, args.dst, force=args.force, trust=args.trust)
    elif args.to == "hf":
        from moe_rl.convert import megatron_to_hf

        out = megatron_to_hf(args.src, args.dst, max_shard_bytes=args.shard_size, dtype=args.dtype,
                             force=args.force, tokenizer=args.tokenizer, progress=not args.no_progress,
                             trust=args.trust)
    else:
        from moe_rl.learner.hf_import import hf_to_megatron

        out = hf_to_megatron(args.src, args.dst, dtype=args.dtype, force=args.force)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from moe_rl.cli import cpu_environment, run_guarded

    cpu_environment()
    return run_guarded(PROG, lambda: convert(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
