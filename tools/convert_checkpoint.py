"""Convert between learner checkpoints and Hugging Face (Qwen3-MoE) directories.

    python tools/convert_checkpoint.py --to hf --src runs/x/checkpoints/step_000050 --dst runs/x/hf
    python tools/convert_checkpoint.py --to megatron --src Qwen3-MoE-dir --dst ckpt [--dtype fp32]

--to hf streams tensor by tensor (peak memory ~ the largest tensor) from a checkpoint saved
at any TP/EP/PP layout; --to megatron builds a one-process learner and saves it (loadable
at any layout). The output is written under a temp name and renamed when complete; an
existing output is refused unless --force. Bad input exits with status 2 and one line
naming the problem.
"""

from __future__ import annotations

import argparse
import re
import sys


def parse_size(text: str) -> int:
    """'2GB', '512MiB', '1e9' -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 2GB, 512MiB or 1000000")
    value, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {"K": 1, "M": 2, "G": 3, "T": 4}
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** powers[unit[0]]
    return int(value * scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--to", choices=["hf", "megatron"], required=True, help="output format")
    ap.add_argument("--src", required=True, help="input directory")
    ap.add_argument("--dst", required=True, help="output directory (must not exist unless --force)")
    ap.add_argument("--shard-size", type=parse_size, default="2GiB", help="max safetensors shard size (--to hf)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                    help="output dtype (default: as stored / as config.json says)")
    ap.add_argument("--tokenizer", default=None,
                    help="SentencePiece model for the tokenizer files (--to hf; default: the checkpoint's)")
    ap.add_argument("--force", action="store_true", help="replace an existing output")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    from moe_rl.config import ConfigError
    from moe_rl.convert import ConvertError

    try:
        if args.to == "hf":
            from moe_rl.convert import megatron_to_hf

            out = megatron_to_hf(args.src, args.dst, max_shard_bytes=args.shard_size, dtype=args.dtype,
                                 force=args.force, tokenizer=args.tokenizer, progress=not args.no_progress)
        else:
            from moe_rl.learner.checkpoint import CheckpointError
            from moe_rl.learner.hf_import import hf_to_megatron

            try:
                out = hf_to_megatron(args.src, args.dst, dtype=args.dtype, force=args.force)
            except CheckpointError as e:
                raise ConvertError(str(e)) from e
    except (ConvertError, ConfigError, FileExistsError, FileNotFoundError, NotImplementedError, ValueError) as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
