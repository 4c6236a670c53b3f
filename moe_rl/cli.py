"""Command-line plumbing shared by the entry points (`moe_rl.train`, `moe_rl.sft`, tools).

    python -m moe_rl.train --config examples/tiny_rspo.yaml rl.objective=gspo run.steps=20
    python -m moe_rl.train --help-config        # every key, its type, default and docstring
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from moe_rl.config import Config, ConfigError, describe, load_config


def parse(argv: list[str] | None, prog: str, doc: str) -> tuple[argparse.Namespace, Config]:
    """`--config FILE` plus `section.key=value` overrides -> a validated Config. A bad
    recipe exits with status 2 and the ConfigError message, before anything is built."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe (sections: model, parallel, optimizer, rl, ...)")
    ap.add_argument("--help-config", action="store_true", help="list every config key and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = ap.parse_args(argv)
    if args.help_config:
        print(describe())
        sys.exit(0)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        sys.exit(2)
    return args, cfg


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings elsewhere; quiet megatron's and vLLM's chatter."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s r{rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("megatron", "megatron.core.rerun_state_machine", "vllm", "torch.distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cpu_environment() -> None:
    """Environment the CPU path needs before torch/megatron/vLLM start (idempotent), and
    silence for the import-time warnings third-party stacks print on every start (missing
    Apex/TE fallbacks, deprecations inside torch.distributed.checkpoint and vLLM): they are
    not actionable for a user of this package. Set MOE_RL_WARNINGS=1 to see them."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM's start-up warnings for an in-process engine without a tokenizer (chat-template
    # warm-up, thread binding, EOS from the tokenizer) are expected here; errors still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if os.environ.get("MOE_RL_WARNINGS") != "1":
        for module in ("megatron", "torch.distributed", "vllm", "transformers"):
            for category in (UserWarning, FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category, module=module)
